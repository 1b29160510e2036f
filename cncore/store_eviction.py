"""The bounded-table verbs of `EmbeddingStore`: eviction (by the user's policy or predicate),
the callbacks that receive evicted rows, and the admission sketch's decay."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import ArrayLike

from cncore import _core
from cncore._interchange import as_count
from cncore.config import TTL, MinCount, StoreConfig
from cncore.rows import TableBatch


class EvictionVerbs:
    """`EmbeddingStore`'s verbs for bounded tables (``StoreConfig(max_rows=..., eviction=...)``),
    kept apart from the store's other verbs; they act on the store's core table."""

    _table: _core.Table
    _config: StoreConfig
    _evict_callbacks: list[Callable]

    if TYPE_CHECKING:  # EmbeddingStore's
        def iter_export(self, batch_size: int = ..., *, with_rows: bool = ...) -> Iterator[TableBatch]: ...

    def on_evict(self, callback: Callable[[TableBatch], object]) -> None:
        """Register `callback(batch)`: it receives a `TableBatch` of every eviction's rows
        (keys, rows, optimizer state, counts, last steps; lowest (score, key) first, or the
        export order for evict_if), called after the evicting call has released the store's lock, in the thread
        that made the call. Callbacks run in registration order, each with every evicted row;
        when one raises, the others still run, and the first error then propagates out of the
        call that evicted (the eviction has happened; later errors are attached to it as
        notes). Without callbacks evicted rows are dropped, and still counted.

        Args:
            callback (Callable[[TableBatch], object]): called with each eviction's rows.

        >>> import numpy as np, cncore
        >>> s = cncore.EmbeddingStore(dim=1, max_rows=2, eviction=cncore.LRU(), headroom=0)
        >>> sink = []
        >>> s.on_evict(sink.append)
        >>> _ = s.find_or_insert(np.array([5, 3])); _ = s.find_or_insert(np.array([9]))
        >>> sink[0].keys.tolist(), sorted(s.export().keys.tolist()), s.evicted_count
        ([3], [5, 9], 1)
        """
        if not callable(callback):
            raise TypeError(f"callback must be callable, got {type(callback).__name__}")
        self._evict_callbacks.append(callback)
        self._table.evict_sink = self._deliver

    def _deliver(self, keys, rows, state, counts, last_steps) -> None:
        batch = TableBatch(keys, rows, state, counts, last_steps, np.ones(len(keys), dtype=bool))
        errors = []
        for callback in list(self._evict_callbacks):
            try:
                callback(batch)
            except BaseException as e:  # the other callbacks still get the rows
                errors.append(e)
        if errors:
            _core.raise_first(errors)

    def decay_admission(self) -> None:
        """Halve every counter of the admission sketch (MinCount), so that old sightings fade."""
        if self._config.admission is None:
            raise TypeError("decay_admission: this store has no admission policy (StoreConfig.admission=None)")
        if not isinstance(self._config.admission, MinCount):
            raise TypeError(f"decay_admission: only MinCount admission counts sightings; this store's admission is "
                            f"{self._config.admission!r}")
        self._table.decay_admission()

    def _require_policy(self, verb: str):
        if self._config.eviction is None:
            raise TypeError(f"{verb}: this store has no eviction policy (StoreConfig.eviction=None)")

    def evict(self, n: int) -> int:
        """Evict the `n` lowest-scoring rows now (all of them if n >= len).

        Args:
            n (int): rows to evict.

        Returns:
            int: how many rows were evicted.

        >>> import numpy as np, cncore
        >>> s = cncore.EmbeddingStore(dim=1, eviction=cncore.LFU())
        >>> _ = s.find_or_insert(np.array([4, -2, 7]))
        >>> s.evict(2), s.export().keys.tolist()
        (2, [7])
        """
        self._require_policy("evict")
        return self._table.evict(as_count(n, "n", 0, 2**63))

    def evict_expired(self) -> int:
        """TTL: evict every row with ``step - last_step > ttl``.

        Returns:
            int: how many rows were evicted.

        >>> import cncore
        >>> s = cncore.EmbeddingStore(dim=1, eviction=cncore.TTL(2)); _ = s.find_or_insert([1])
        >>> s.step = 5; s.evict_expired(), len(s)
        (1, 0)
        """
        if not isinstance(self._config.eviction, TTL):
            raise TypeError("evict_expired: this store's eviction policy is not TTL(steps)")
        return self._table.evict_expired()

    def evict_if(self, predicate: Callable[[TableBatch], ArrayLike], *, batch_size: int = 65536) -> int:
        """Evict the rows `predicate` chooses: it is called with each `TableBatch` of an export
        (keys, rows, state, counts, last steps) and returns a bool mask over the batch; the
        chosen keys are then evicted (handed to the on_evict callbacks, counted). The export
        runs first and the eviction after it (HierarchicalKV's erase_if): call it between
        steps.

        Args:
            predicate (Callable[[TableBatch], ArrayLike]): gives a (len(batch.keys),) bool mask.
            batch_size (int): rows of each batch the predicate sees, at most.

        Returns:
            int: how many rows were evicted.

        >>> import numpy as np, cncore
        >>> s = cncore.EmbeddingStore(dim=1, eviction=cncore.LRU())
        >>> _ = s.find_or_insert(np.arange(6))
        >>> s.evict_if(lambda b: b.keys % 2 == 1), sorted(s.export().keys.tolist())
        (3, [0, 2, 4])
        """
        self._require_policy("evict_if")
        if not callable(predicate):
            raise TypeError(f"predicate must be callable, got {type(predicate).__name__}")
        chosen = []
        for batch in self.iter_export(batch_size):
            mask = np.asarray(predicate(batch))
            if mask.dtype != bool or mask.shape != batch.keys.shape:
                raise ValueError(f"predicate must return a bool mask of shape {batch.keys.shape}, got "
                                 f"{mask.dtype} {mask.shape}; nothing was evicted")
            chosen.append(batch.keys[mask])
        keys = np.concatenate(chosen) if chosen else np.empty(0, dtype=np.int64)
        return self._table.evict_keys(np.ascontiguousarray(keys, dtype=np.int64))

"""`EmbeddingStore`: a growable table from int64 keys to float32 rows with optimizer state.

Batch verbs (HierarchicalKV's vocabulary), all over 1-D key arrays:

========================  ===================================================================
``find(keys)``            ``(slots, found)``; slots are stable row addresses, -1 where absent
``contains(keys)``        ``found``
``find_or_insert(keys)``  ``(slots, found)``; absent keys get a new, initialised row
``insert_or_assign``      write rows for keys, inserting the absent ones
``assign``                write rows for keys that exist; others are left out
``erase(keys)``           remove keys; ``erased`` mask
``lookup(keys)``          rows (zeros where absent); inserts nothing
``read(keys)``            rows, optimizer state, access counts, last steps and ``found``
``export`` / ``iter_export``  everything, whole or in cursor batches
``load``                  import keys with rows, state and metadata (insert or overwrite)
``clear`` / ``reserve``   drop every row (keep memory) / allocate room up front
``evict(n)``              evict the n lowest-scoring rows (bounded tables: ``eviction=``)
``evict_expired()``       evict every row a ``TTL`` policy says has expired
``evict_if(predicate)``   evict the rows a vectorised predicate over their metadata chooses
``on_evict(callback)``    hand every evicted row to ``callback(TableBatch)``
========================  ===================================================================

Bounded tables (``StoreConfig(max_rows=..., eviction=LRU() | LFU() | TTL(steps))``): an insert
(training lookup, ``find_or_insert``, ``insert_or_assign``, ``load``) that would pass max_rows
first evicts the lowest-scoring rows the call does not use. Evicted rows are never dropped
silently: they are counted in ``evicted_count`` and handed, with their optimizer state and
metadata, to the ``on_evict`` callbacks after the call's lock is released. An eviction, like
an erase, refuses the backward of lookups made before it. ``erase`` is the caller's own
removal: it is not an eviction (not counted, not handed on).

Duplicate keys in one batch: ``find_or_insert`` inserts one row and returns its slot for
every occurrence (``found`` is False for all of them, as the key was absent before the call);
``insert_or_assign``, ``assign`` and ``load`` write in order, so the last occurrence wins.

Thread safety: any number of threads may read at once (``find``, ``contains``, ``lookup``,
``read``, ``export``, ``pooled_lookup(insert_missing=False)``); a call that writes
(inserts, erases, assigns, training lookups, gradient updates) waits for the readers and runs
alone. Every call is atomic with respect to the others; a sequence of calls is not.

>>> import numpy as np
>>> from cncore import EmbeddingStore, StoreConfig, Constant
>>> store = EmbeddingStore(StoreConfig(dim=2, initializer=Constant(0.5)))
>>> slots, found = store.find_or_insert(np.array([7, -1, 7]))
>>> found.tolist(), len(store)
([False, False, False], 2)
>>> store.lookup(np.array([7, 8])).tolist()
[[0.5, 0.5], [0.0, 0.0]]
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from cncore import _core
from cncore._interchange import as_count, as_floats, as_keys, as_uint32
from cncore.config import (
    LFU,
    ROW_DTYPES,
    TTL,
    MinCount,
    Optimizer,
    Probability,
    StoreConfig,
    config_with_optimizer,
    store_config_of,
    with_default_split,
)
from cncore.grouped import LookupContext, as_flag, grouped_apply_gradients, pooled_lookup_one, unique_gradients_one
from cncore.rows import TableBatch, initial_rows
from cncore.store_eviction import EvictionVerbs
from cncore.store_fallback import FallbackVerbs
from cncore.store_split import AutoSplitVerbs

__all__ = ["EmbeddingStore", "TableBatch", "initial_rows"]

_STORE_IDS = itertools.count()


def _restore(config, keys, rows, optimizer_state, counts, last_steps, step, kind=None, evicted_count=0,
             admission_counters=None, fallback=None):
    store = (kind or EmbeddingStore)(config)
    if fallback is not None:
        store.load_fallback(*fallback)
    store.reserve(len(keys))
    store.load(keys, rows, optimizer_state if config.state_floats else None, counts, last_steps)
    store.step = step
    if admission_counters is not None:
        store._table.admission_counters = admission_counters
    store.evicted_count = evicted_count
    return store


class EmbeddingStore(EvictionVerbs, FallbackVerbs, AutoSplitVerbs):
    """A growable embedding table in memory. See the module docstring for the verbs.

    It keeps its rows in memory only: a config with ``storage=`` is refused (TypeError);
    `cncore.make_store(config)` builds the store any config describes (a `cncore.tier.TieredStore`
    for ``storage=cncore.Tiered(...)``, which holds an EmbeddingStore as its cache).

    >>> import numpy as np
    >>> from cncore import EmbeddingStore
    >>> store = EmbeddingStore(dim=4, seed=1)
    >>> a = store.lookup(np.array([2**63 - 1]), insert_missing=True)
    >>> b = EmbeddingStore(dim=4, seed=1).lookup(np.array([2**63 - 1]), insert_missing=True)
    >>> bool((a == b).all()), len(store)
    (True, 1)

    Args:
        config (StoreConfig | None): the table's configuration; or give its fields as keywords.
        **config_fields: `StoreConfig` fields (``dim=`` at least) when `config` is None.
    """

    def __init__(self, config: StoreConfig | None = None, **config_fields: Any):
        config = store_config_of(config, config_fields)
        if config.storage is not None:  # refused before anything is made (a tier's directory included)
            cls = type(self)
            raise TypeError(f"storage={config.storage!r}: {cls.__module__}.{cls.__qualname__} keeps its rows in memory "
                            "and has no tiered form; build cncore.make_store(config), which gives a "
                            "cncore.tier.TieredStore for storage=cncore.Tiered(...); nothing was created")
        config = self._config = with_default_split(config)  # fallback_rows=None: "auto" where it can run
        opt = config.optimizer
        init = config.initializer
        ev = config.eviction
        ttl = ev.steps if isinstance(ev, TTL) else 0
        max_rows = config.max_rows or 0
        self._table = _core.Table(
            config.dim, opt.kind if opt is not None else 0, float(opt.initial_state) if opt is not None else 0.0,
            init.kind, config.seed, *init.params(), float(config.max_load_factor),
            min(config.capacity, max_rows) if max_rows else config.capacity,
            ev.kind if ev is not None else 0, max_rows, max_rows - (config.headroom or 0), ttl,
            *((adm.count, adm.width, adm.depth, adm.unadmitted == "initial") if isinstance(adm := config.admission,
                                                                                            MinCount)
              else (0, 0, 0, adm is not None and adm.unadmitted == "initial")), ROW_DTYPES[config.dtype],
            adm.threshold if isinstance(adm, Probability) else 0, config.seed,
            ev.halve_shift if isinstance(ev, LFU) else -1, config.fixed_fallback_rows, config.fallback_copy,
            config.fallback_mode == "residual")
        self._evict_callbacks: list[Callable] = []
        self._split_pending = config.fallback_rows == "auto"  # cncore.store_split
        # For incremental saves (cncore.tablefile): which store a checkpoint is of, and how many
        # calls wrote rows without recording a step (a delta cannot see those rows).
        self._uid, self._writes = next(_STORE_IDS), 0

    # --- sizes ---------------------------------------------------------------------------

    @property
    def config(self) -> StoreConfig:
        return self._config

    @property
    def dim(self) -> int:
        return self._config.dim

    def __len__(self) -> int:
        return self._table.size

    @property
    def capacity(self) -> int:
        """Rows the store holds before its index must grow."""
        return self._table.capacity

    @property
    def load_factor(self) -> float:
        """Keys / index buckets."""
        return self._table.size / self._table.n_buckets

    @property
    def nbytes(self) -> int:
        """Bytes this store has allocated (index, row pages, page table), all of them."""
        return self._table.nbytes

    @property
    def step(self) -> int:
        """Optimizer steps applied so far (Adam's t); training lookups record it as a row's last step.
        At most 2**32 - 1, the last step a row's 32-bit last step records: setting more, a
        training lookup at it, and a backward that would pass it are refused (ValueError), the
        table unchanged."""
        return self._table.step

    @step.setter
    def step(self, value: int) -> None:
        self._table.step = as_count(value, "step", 0, 2**63)

    @property
    def evicted_count(self) -> int:
        """Rows evicted so far (by the budget or the evict verbs; erase does not count). A 64-bit
        count; it stops at 2**63 - 1 rather than wrap."""
        return self._table.evicted_count

    @evicted_count.setter
    def evicted_count(self, value) -> None:
        # What a checkpoint restores (table files and torch state_dicts keep the count).
        self._table.evicted_count = as_count(value, "evicted_count", 0, 2**63)

    def __repr__(self) -> str:
        return f"EmbeddingStore(rows={len(self)}, capacity={self.capacity}, config={self._config})"

    def __reduce__(self):
        """Pickling (copy.deepcopy, torch.save of a model holding a store) carries the config,
        every row with its optimizer state and metadata, the step, the eviction count and the
        admission sketch's counters. The on_evict callbacks are the caller's code and stay
        behind: a copy that should hand its evicted rows on registers its own."""
        batch = self.export()
        return (_restore, (self._config, batch.keys, batch.rows, batch.optimizer_state, batch.counts,
                           batch.last_steps, self.step, type(self), self.evicted_count,
                           self._table.admission_counters, self.export_fallback() if self.fallback_rows else None))

    # --- key verbs -------------------------------------------------------------------------

    def find(self, keys: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
        """Slots of keys (-1 where absent) and the found mask. Inserts nothing.

        Args:
            keys (ArrayLike): (N,) int64 keys (any int64 value; a NumPy array, a DLPack tensor
                or a sequence of ints).

        Returns:
            tuple[np.ndarray, np.ndarray]: slots (N,) int64, stable row addresses (-1 where
            absent), and found (N,) bool.

        >>> import numpy as np
        >>> s = EmbeddingStore(dim=2); _ = s.find_or_insert(np.array([5]))
        >>> slots, found = s.find(np.array([5, 6]))
        >>> found.tolist(), int(slots[1])
        ([True, False], -1)
        """
        keys = as_keys(keys)
        slots = np.empty(len(keys), dtype=np.int64)
        self._table.find(keys, slots)
        return slots, slots >= 0

    def contains(self, keys: ArrayLike) -> np.ndarray:
        """Which keys are present.

        Args:
            keys (ArrayLike): (N,) int64 keys.

        Returns:
            np.ndarray: (N,) bool, True where the key has a row.

        >>> import numpy as np
        >>> s = EmbeddingStore(dim=2); _ = s.find_or_insert(np.array([5]))
        >>> s.contains([5, 6]).tolist()
        [True, False]
        """
        return self.find(keys)[1]

    def find_or_insert(self, keys: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
        """Slots of keys, inserting absent ones with their deterministic initial row.

        Args:
            keys (ArrayLike): (N,) int64 keys; duplicates get one row.

        Returns:
            tuple[np.ndarray, np.ndarray]: slots (N,) int64 and found (N,) bool, which keys
            were present before the call.

        >>> import numpy as np
        >>> s = EmbeddingStore(dim=2)
        >>> slots, found = s.find_or_insert(np.array([3, 3]))
        >>> found.tolist(), bool(slots[0] == slots[1]), len(s)
        ([False, False], True, 1)
        """
        keys = as_keys(keys)
        slots = np.empty(len(keys), dtype=np.int64)
        found = np.zeros(len(keys), dtype=np.uint8)
        self._table.find_or_insert(keys, slots, found)
        return slots, found.view(bool)

    def _upsert(self, keys, rows, optimizer_state, counts, last_steps, insert: bool) -> np.ndarray:
        keys = as_keys(keys)
        n = len(keys)
        rows = as_floats(rows, "rows", (n, self.dim))
        sf = self._config.state_floats
        if optimizer_state is not None:
            # Checked even when the store keeps no state: (n, 0) (what its export gives) is
            # accepted, anything else is a mismatch the caller should hear about, not lose.
            optimizer_state = as_floats(optimizer_state, "optimizer_state", (n, sf))
        counts = as_uint32(counts, "counts", n)
        last_steps = as_uint32(last_steps, "last_steps", n)
        found = np.zeros(n, dtype=np.uint8)
        self._writes += 1
        self._table.upsert(keys, rows, optimizer_state, counts, last_steps, found, insert)
        return found.view(bool)

    def insert_or_assign(self, keys: ArrayLike, rows: ArrayLike, optimizer_state: ArrayLike | None = None
                         ) -> np.ndarray:
        """Write rows for keys, inserting absent keys. Duplicates: the last one wins.

        Args:
            keys (ArrayLike): (N,) int64 keys.
            rows (ArrayLike): (N, dim) float32 rows.
            optimizer_state (ArrayLike | None): (N, state_floats) float32; without it,
                existing rows keep theirs and new rows start from the optimizer's initial state.

        Returns:
            np.ndarray: found (N,) bool, which keys were present before the call.

        >>> import numpy as np
        >>> s = EmbeddingStore(dim=1)
        >>> s.insert_or_assign([4], np.array([[2.0]], np.float32)).tolist(), s.lookup([4]).tolist()
        ([False], [[2.0]])
        """
        return self._upsert(keys, rows, optimizer_state, None, None, insert=True)

    def assign(self, keys: ArrayLike, rows: ArrayLike, optimizer_state: ArrayLike | None = None) -> np.ndarray:
        """Write rows for keys that are present; absent keys are left out.

        Args:
            keys (ArrayLike): (N,) int64 keys.
            rows (ArrayLike): (N, dim) float32 rows.
            optimizer_state (ArrayLike | None): (N, state_floats) float32, or None to keep theirs.

        Returns:
            np.ndarray: found (N,) bool; the rows of keys not found were not written.

        >>> import numpy as np
        >>> s = EmbeddingStore(dim=1); _ = s.find_or_insert([1])
        >>> s.assign([1, 2], np.ones((2, 1), np.float32)).tolist(), len(s)
        ([True, False], 1)
        """
        return self._upsert(keys, rows, optimizer_state, None, None, insert=False)

    def load(self, keys: ArrayLike, rows: ArrayLike, optimizer_state: ArrayLike | None = None,
             counts: ArrayLike | None = None, last_steps: ArrayLike | None = None) -> np.ndarray:
        """Import rows with their optimizer state and metadata (the inverse of `export`).

        Args:
            keys (ArrayLike): (N,) int64 keys; inserted or overwritten.
            rows (ArrayLike): (N, dim) float32 rows.
            optimizer_state (ArrayLike | None): (N, state_floats) float32, or None.
            counts (ArrayLike | None): (N,) access counts in [0, 2**32), or None.
            last_steps (ArrayLike | None): (N,) last steps in [0, 2**32), or None.

        Returns:
            np.ndarray: found (N,) bool, which keys were present before the call.

        >>> import numpy as np
        >>> a = EmbeddingStore(dim=1); _ = a.find_or_insert([8, 9])
        >>> b = EmbeddingStore(dim=1); e = a.export()
        >>> b.load(e.keys, e.rows, counts=e.counts, last_steps=e.last_steps).tolist(), len(b)
        ([False, False], 2)
        """
        return self._upsert(keys, rows, optimizer_state, counts, last_steps, insert=True)

    def erase(self, keys: ArrayLike) -> np.ndarray:
        """Remove keys (the caller's removal: not an eviction, not counted or handed on).

        Args:
            keys (ArrayLike): (N,) int64 keys.

        Returns:
            np.ndarray: erased (N,) bool, the keys this call removed.

        >>> s = EmbeddingStore(dim=1); _ = s.find_or_insert([1])
        >>> s.erase([1, 1, 2]).tolist(), len(s)
        ([True, False, False], 0)
        """
        keys = as_keys(keys)
        erased = np.zeros(len(keys), dtype=np.uint8)
        self._table.erase(keys, erased)
        return erased.view(bool)

    def clear(self) -> None:
        """Remove every key; allocated memory is kept for reuse."""
        self._table.clear()

    def reserve(self, n_rows: int) -> None:
        """Allocate room for `n_rows` rows in all, so that growing to it allocates nothing.

        Args:
            n_rows (int): rows the store should hold without growing.

        >>> s = EmbeddingStore(dim=1); s.reserve(1000); s.capacity >= 1000
        True
        """
        self._table.reserve(as_count(n_rows, "n_rows", 0, 2**63))

    def lookup(self, keys: ArrayLike, *, insert_missing: bool = False) -> np.ndarray:
        """Rows of keys. Does not count as a training access.

        Args:
            keys (ArrayLike): (N,) int64 keys.
            insert_missing (bool): insert absent keys first (with their initial rows);
                without it they read as zeros.

        Returns:
            np.ndarray: (N, dim) float32 rows.

        >>> from cncore import Constant
        >>> s = EmbeddingStore(dim=1, initializer=Constant(0.5))
        >>> s.lookup([1]).tolist(), s.lookup([1], insert_missing=True).tolist()
        ([[0.0]], [[0.5]])
        """
        if as_flag(insert_missing, "insert_missing"):
            self.find_or_insert(keys)
        return self.read(keys).rows

    def read(self, keys: ArrayLike) -> TableBatch:
        """Rows, optimizer state and metadata of keys (zeros where absent).

        Args:
            keys (ArrayLike): (N,) int64 keys.

        Returns:
            TableBatch: the keys' rows, optimizer state, counts, last steps and found mask.

        >>> s = EmbeddingStore(dim=1); _ = s.find_or_insert([2])
        >>> s.read([2, 3]).found.tolist()
        [True, False]
        """
        keys = as_keys(keys)
        n = len(keys)
        rows = np.empty((n, self.dim), dtype=np.float32)
        state = np.empty((n, self._config.state_floats), dtype=np.float32)
        counts = np.empty(n, dtype=np.uint32)
        last_steps = np.empty(n, dtype=np.uint32)
        found = np.zeros(n, dtype=np.uint8)
        self._table.read(keys, rows, state, counts, last_steps, found)
        return TableBatch(keys, rows, state, counts, last_steps, found.view(bool))

    # --- export ------------------------------------------------------------------------------

    def export(self, cursor: tuple | None = None, max_rows: int | None = None, *,
               with_rows: bool = True) -> TableBatch:
        """Every row (in index order), or up to `max_rows` from `cursor` on. With
        ``with_rows=False``, keys and metadata only (rows and optimizer_state are (N, 0)): a
        scan that does not copy the rows.

        Continue with ``export(batch.next_cursor, max_rows)`` until ``next_cursor`` is None.
        A store that gains or loses keys during a cursor walk raises RuntimeError at the
        next batch rather than skipping or repeating rows.

        Args:
            cursor (tuple | None): a previous batch's ``next_cursor``, or None to start.
            max_rows (int | None): rows in this batch at most (None: every row, at once).
            with_rows (bool): copy rows and optimizer state (False: keys and metadata only).

        Returns:
            TableBatch: the rows, with ``next_cursor`` None once the walk is finished.

        >>> import numpy as np
        >>> s = EmbeddingStore(dim=2); _ = s.find_or_insert(np.arange(5))
        >>> first = s.export(max_rows=3); rest = s.export(first.next_cursor, max_rows=3)
        >>> sorted(first.keys.tolist() + rest.keys.tolist()), rest.next_cursor
        ([0, 1, 2, 3, 4], None)
        """
        whole = max_rows is None and cursor is None  # every row, atomically (one batch)
        max_rows = max(len(self), 1) if max_rows is None else as_count(max_rows, "max_rows", 1, 2**63)
        if cursor is None:
            position, version = 0, 0
        else:
            if not (isinstance(cursor, tuple) and len(cursor) == 2):
                raise TypeError("cursor must be the next_cursor of a previous export (a tuple of two ints)")
            position = as_count(cursor[0], "cursor position", 0, 2**63)
            version = as_count(cursor[1], "cursor version", 0, 2**64)
        nxt, done, version, keys, rows, state, counts, steps = self._table.export(
            position, max_rows, version, as_flag(with_rows, "with_rows"), cursor is None, whole)
        return TableBatch(keys, rows, state, counts, steps, np.ones(len(keys), dtype=bool),
                          None if done else (nxt, version))

    def iter_export(self, batch_size: int = 65536, *, with_rows: bool = True) -> Iterator[TableBatch]:
        """Export in batches (a cursor walk, as `export` documents).

        Args:
            batch_size (int): rows a batch at most (checked now, not at the first batch).
            with_rows (bool): copy rows and optimizer state (False: keys and metadata only).

        Returns:
            Iterator[TableBatch]: the batches, every row once.

        >>> s = EmbeddingStore(dim=1); _ = s.find_or_insert(np.arange(5))
        >>> [len(b.keys) for b in s.iter_export(2)]
        [2, 2, 1]
        """
        batch_size = as_count(batch_size, "batch_size", 1, 2**63)

        def batches():
            batch = self.export(None, batch_size, with_rows=with_rows)
            yield batch
            while batch.next_cursor is not None:
                batch = self.export(batch.next_cursor, batch_size, with_rows=with_rows)
                yield batch
        return batches()

    # --- pooled lookup and training -----------------------------------------------------------

    def pooled_lookup(self, keys: ArrayLike, offsets: ArrayLike | None = None, *, lengths: ArrayLike | None = None,
                      mode: str = "sum", per_sample_weights: ArrayLike | None = None, insert_missing: bool = True,
                      out: np.ndarray | None = None) -> tuple[np.ndarray, LookupContext]:
        """Pool the rows of each bag.

        `apply_gradients` / `accumulate_gradients` take the context; they also record the
        accesses of a training lookup in the rows' metadata (count += occurrences, last step =
        the step of this lookup), once per distinct row rather than once per ID.

        Args:
            keys (ArrayLike): (N,) int64 keys of every bag, bag after bag.
            offsets (ArrayLike | None): (B + 1,) bag starts, the last one N (TorchRec's and
                ``include_last_offset=True`` convention; empty bags allowed); or give `lengths`.
            lengths (ArrayLike | None): (B,) keys per bag, instead of `offsets`.
            mode (str): "sum", "mean" or "max" (empty bags give zeros).
            per_sample_weights (ArrayLike | None): (N,) float32 scaling each row (sum and mean).
            insert_missing (bool): training (True) inserts unseen keys; evaluation (False)
                reads them as zero rows and changes nothing.
            out (np.ndarray | None): a (B, dim) float32 array to write into.

        Returns:
            tuple[np.ndarray, LookupContext]: the pooled rows (B, dim) float32, and what the
            backward needs.

        >>> import numpy as np
        >>> from cncore import EmbeddingStore, Constant
        >>> s = EmbeddingStore(dim=2, initializer=Constant(1.0))
        >>> out, ctx = s.pooled_lookup(np.array([1, 2, 3]), np.array([0, 2, 2, 3]))
        >>> out.tolist()
        [[2.0, 2.0], [0.0, 0.0], [1.0, 1.0]]
        """
        # grouped_pooled_lookup([self], ...) without its per-list checks: one feature's steps, called
        # directly (its Python steps cost ~1-5 us each once the caches are cold, as they are
        # after a model's dense layers).
        return pooled_lookup_one(self, keys, offsets, lengths, mode, per_sample_weights, insert_missing, out)

    def apply_gradients(self, ctx: LookupContext, grad_output: ArrayLike, *, lr: float | None = None) -> None:
        """Fused backward: update every row the lookup used, and its optimizer state, in
        place with the configured optimizer. Advances `step` by one.

        Args:
            ctx (LookupContext): what `pooled_lookup` returned.
            grad_output (ArrayLike): (B, dim) float32, d(loss)/d(out).
            lr (float | None): this step's learning rate (None: the optimizer's own).

        >>> import numpy as np, cncore
        >>> s = EmbeddingStore(dim=1, optimizer=cncore.SGD(lr=0.5), initializer=cncore.Constant(1.0))
        >>> _, ctx = s.pooled_lookup([7], lengths=[1])
        >>> s.apply_gradients(ctx, np.ones((1, 1), np.float32)); s.lookup([7]).tolist(), s.step
        ([[0.5]], 1)
        """
        grouped_apply_gradients([ctx], grad_output, lr=lr, stores=[self])

    def accumulate_gradients(self, ctx: LookupContext, grad_output: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
        """Non-fused backward, for callers that update rows themselves. Records a training
        lookup's accesses, as `apply_gradients` does.

        Args:
            ctx (LookupContext): what `pooled_lookup` returned.
            grad_output (ArrayLike): (B, dim) float32, d(loss)/d(out).

        Returns:
            tuple[np.ndarray, np.ndarray]: the distinct keys (U,) int64 in first-occurrence
            order, and their gradients (U, dim) float32.

        >>> import numpy as np
        >>> s = EmbeddingStore(dim=1)
        >>> _, ctx = s.pooled_lookup(np.array([4, 4, 9]), lengths=np.array([2, 1]))
        >>> k, g = s.accumulate_gradients(ctx, np.array([[1.0], [10.0]], dtype=np.float32))
        >>> k.tolist(), g.ravel().tolist()
        ([4, 9], [2.0, 10.0])
        """
        return unique_gradients_one(self, ctx, grad_output)

    def set_optimizer(self, optimizer: Optimizer) -> None:
        """Give a store built without an optimizer its fused optimizer (a cncore optimizer
        config). Rows, fallback rows, counts, last steps, the step, the eviction count, the
        admission sketch's counters and the on_evict callbacks stay; each row starts from the optimizer's
        initial state, as a row loaded without state does. For front ends that
        learn the optimizer after building the table (TorchRec's apply_optimizer_in_backward);
        call it between steps, never beside another call on the store.

        Args:
            optimizer (Optimizer): a cncore optimizer config (SGD, Adagrad, RowWiseAdagrad, Adam).

        >>> import numpy as np, cncore
        >>> s = cncore.EmbeddingStore(dim=2); _ = s.find_or_insert(np.array([7]))
        >>> s.set_optimizer(cncore.RowWiseAdagrad(lr=0.1))
        >>> s.config.optimizer, s.export().optimizer_state.shape
        (RowWiseAdagrad(lr=0.1, eps=1e-08, initial_accumulator_value=0.0), (1, 1))
        """
        config = config_with_optimizer(self._config, optimizer)
        rows = self.export()
        fresh = EmbeddingStore(config)
        fresh.reserve(len(rows.keys))
        fresh.load(rows.keys, rows.rows, None, rows.counts, rows.last_steps)
        if self.fallback_rows:  # their values; their state starts as the optimizer's, as the rows' does
            fresh.load_fallback(self.export_fallback()[0])
        fresh.step, fresh.evicted_count = self.step, self.evicted_count
        if self._table.admission_counters is not None:
            fresh._table.admission_counters = self._table.admission_counters
        self._config, self._table = config, fresh._table
        if self._evict_callbacks:
            self._table.evict_sink = self._deliver
        self._writes += 1

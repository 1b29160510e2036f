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

import dataclasses
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from cncore import _core
from cncore._interchange import as_floats, as_keys, to_numpy
from cncore.config import LFU, ROW_DTYPES, TTL, MinCount, Probability, StoreConfig, store_config_of
from cncore.grouped import as_flag, grouped_apply_gradients, pooled_lookup_one, unique_gradients_one

__all__ = ["EmbeddingStore", "TableBatch", "initial_rows"]

_STORE_IDS = itertools.count()


def config_with_optimizer(config: StoreConfig, optimizer) -> StoreConfig:
    """`config` with `optimizer`, for a table built without one (`set_optimizer` of every row
    storage); refused when it has one already (its rows' state would be lost) or for None."""
    if config.optimizer is not None:
        raise ValueError(f"optimizer: this table already has {config.optimizer!r}; its rows' optimizer state would "
                         "be lost (build a new table to change it)")
    if optimizer is None:
        raise TypeError("optimizer must be a cncore optimizer (SGD, Adagrad, RowWiseAdagrad, Adam), got None")
    return dataclasses.replace(config, optimizer=optimizer)  # checks the optimizer


def initial_rows(config: StoreConfig, keys) -> np.ndarray:
    """The rows a store with `config` gives `keys` when it inserts them, without a store: for
    front ends that keep rows elsewhere (accelerator memory) and the core's index only.

    >>> import numpy as np
    >>> from cncore import EmbeddingStore, StoreConfig, initial_rows
    >>> cfg = StoreConfig(dim=3, seed=5)
    >>> bool((initial_rows(cfg, np.array([9])) == EmbeddingStore(cfg).lookup(np.array([9]), insert_missing=True)).all())
    True
    """
    if not isinstance(config, StoreConfig):
        raise TypeError(f"config must be a cncore.StoreConfig, got {type(config).__name__}")
    keys = as_keys(keys)
    out = np.empty((len(keys), config.dim), dtype=np.float32)
    if len(keys):
        _core.init_rows(config.initializer.kind, config.seed, *config.initializer.params(), keys, out)
    return out


@dataclass(frozen=True)
class TableBatch:
    """Rows of a store with everything attached to them.

    keys (N,) int64; rows (N, dim) float32; optimizer_state (N, state_floats) float32;
    counts, last_steps (N,) uint32; found (N,) bool (all True in an export);
    next_cursor: where an export continues (None when it is finished).
    """
    keys: np.ndarray
    rows: np.ndarray
    optimizer_state: np.ndarray
    counts: np.ndarray
    last_steps: np.ndarray
    found: np.ndarray
    next_cursor: tuple | None = None


def _count(value, name: str, low: int, high: int) -> int:
    """An int argument in [low, high): Python or NumPy integers; bools and floats are refused."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or not low <= int(value) < high:
        raise ValueError(f"{name} must be an int in [{low}, {high}), got {value!r}")
    return int(value)


def _u32(obj, name: str, n: int) -> np.ndarray | None:
    if obj is None:
        return None
    arr = to_numpy(obj, name)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected an integer array, got {arr.dtype}")
    if arr.shape != (n,):
        raise ValueError(f"{name}: expected shape ({n},), got {arr.shape}")
    if arr.size and (arr.min() < 0 or arr.max() > 2**32 - 1):
        raise ValueError(f"{name}: values must be in [0, 2**32 - 1]")
    return np.ascontiguousarray(arr, dtype=np.uint32)


def _restore(config, keys, rows, optimizer_state, counts, last_steps, step, kind=None, evicted_count=0,
             admission_counters=None):
    store = (kind or EmbeddingStore)(config)
    store.reserve(len(keys))
    store.load(keys, rows, optimizer_state if config.state_floats else None, counts, last_steps)
    store.step = step
    if admission_counters is not None:
        store._table.admission_counters = admission_counters
    store.evicted_count = evicted_count
    return store


class EmbeddingStore:
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
    """

    def __init__(self, config: StoreConfig | None = None, **config_fields):
        config = store_config_of(config, config_fields)
        if config.storage is not None:  # refused before anything is made (a tier's directory included)
            cls = type(self)
            raise TypeError(f"storage={config.storage!r}: {cls.__module__}.{cls.__qualname__} keeps its rows in memory "
                            "and has no tiered form; build cncore.make_store(config), which gives a "
                            "cncore.tier.TieredStore for storage=cncore.Tiered(...); nothing was created")
        self._config = config
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
            ev.halve_shift if isinstance(ev, LFU) else -1)
        self._evict_callbacks: list[Callable] = []
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
        self._table.step = _count(value, "step", 0, 2**63)

    @property
    def evicted_count(self) -> int:
        """Rows evicted so far (by the budget or the evict verbs; erase does not count). A 64-bit
        count; it stops at 2**63 - 1 rather than wrap."""
        return self._table.evicted_count

    @evicted_count.setter
    def evicted_count(self, value) -> None:
        # What a checkpoint restores (table files and torch state_dicts keep the count).
        self._table.evicted_count = _count(value, "evicted_count", 0, 2**63)

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
                           self._table.admission_counters))

    # --- key verbs -------------------------------------------------------------------------

    def find(self, keys):
        """Slots of keys (-1 where absent) and the found mask. Inserts nothing.

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

    def contains(self, keys) -> np.ndarray:
        """Boolean mask: which keys are present."""
        return self.find(keys)[1]

    def find_or_insert(self, keys):
        """Slots of keys, inserting absent ones with their deterministic initial row.
        `found` says which keys were present before the call."""
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
        counts = _u32(counts, "counts", n)
        last_steps = _u32(last_steps, "last_steps", n)
        found = np.zeros(n, dtype=np.uint8)
        self._writes += 1
        self._table.upsert(keys, rows, optimizer_state, counts, last_steps, found, insert)
        return found.view(bool)

    def insert_or_assign(self, keys, rows, optimizer_state=None) -> np.ndarray:
        """Write `rows` (N, dim) for keys, inserting absent keys. Without `optimizer_state`,
        existing rows keep theirs and new rows start from the optimizer's initial state.
        Returns the found mask (present before the call). Duplicates: the last one wins."""
        return self._upsert(keys, rows, optimizer_state, None, None, insert=True)

    def assign(self, keys, rows, optimizer_state=None) -> np.ndarray:
        """Write rows for keys that are present; absent keys are left out (found is False)."""
        return self._upsert(keys, rows, optimizer_state, None, None, insert=False)

    def load(self, keys, rows, optimizer_state=None, counts=None, last_steps=None) -> np.ndarray:
        """Import rows with their optimizer state and metadata (the inverse of `export`).
        Inserts or overwrites; returns the found mask."""
        return self._upsert(keys, rows, optimizer_state, counts, last_steps, insert=True)

    def erase(self, keys) -> np.ndarray:
        """Remove keys; returns a mask of the keys this call removed."""
        keys = as_keys(keys)
        erased = np.zeros(len(keys), dtype=np.uint8)
        self._table.erase(keys, erased)
        return erased.view(bool)

    def clear(self) -> None:
        """Remove every key; allocated memory is kept for reuse."""
        self._table.clear()

    def reserve(self, n_rows: int) -> None:
        """Allocate room for `n_rows` rows in all, so that growing to it allocates nothing."""
        self._table.reserve(_count(n_rows, "n_rows", 0, 2**63))

    def lookup(self, keys, *, insert_missing: bool = False) -> np.ndarray:
        """Rows (N, dim) of keys; absent keys read as zeros, or are inserted first when
        `insert_missing`. Does not count as a training access."""
        if as_flag(insert_missing, "insert_missing"):
            self.find_or_insert(keys)
        return self.read(keys).rows

    def read(self, keys) -> TableBatch:
        """Rows, optimizer state and metadata of keys (zeros where absent)."""
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

        >>> import numpy as np
        >>> s = EmbeddingStore(dim=2); _ = s.find_or_insert(np.arange(5))
        >>> first = s.export(max_rows=3); rest = s.export(first.next_cursor, max_rows=3)
        >>> sorted(first.keys.tolist() + rest.keys.tolist()), rest.next_cursor
        ([0, 1, 2, 3, 4], None)
        """
        whole = max_rows is None and cursor is None  # every row, atomically (one batch)
        max_rows = max(len(self), 1) if max_rows is None else _count(max_rows, "max_rows", 1, 2**63)
        if cursor is None:
            position, version = 0, 0
        else:
            if not (isinstance(cursor, tuple) and len(cursor) == 2):
                raise TypeError("cursor must be the next_cursor of a previous export (a tuple of two ints)")
            position = _count(cursor[0], "cursor position", 0, 2**63)
            version = _count(cursor[1], "cursor version", 0, 2**64)
        nxt, done, version, keys, rows, state, counts, steps = self._table.export(
            position, max_rows, version, as_flag(with_rows, "with_rows"), cursor is None, whole)
        return TableBatch(keys, rows, state, counts, steps, np.ones(len(keys), dtype=bool),
                          None if done else (nxt, version))

    def iter_export(self, batch_size: int = 65536, *, with_rows: bool = True) -> Iterator[TableBatch]:
        """Export in batches of at most `batch_size` rows (checked now, not at the first batch)."""
        batch_size = _count(batch_size, "batch_size", 1, 2**63)

        def batches():
            batch = self.export(None, batch_size, with_rows=with_rows)
            yield batch
            while batch.next_cursor is not None:
                batch = self.export(batch.next_cursor, batch_size, with_rows=with_rows)
                yield batch
        return batches()

    # --- pooled lookup and training -----------------------------------------------------------

    def pooled_lookup(self, keys, offsets=None, *, lengths=None, mode: str = "sum", per_sample_weights=None,
                      insert_missing: bool = True, out=None):
        """Pool the rows of each bag: returns ``(out, ctx)``, out of shape (B, dim).

        Bags are given by `offsets` (B+1 entries, the last one len(keys): TorchRec's and
        ``include_last_offset=True`` convention; empty bags allowed) or by `lengths` (B).
        mode: "sum", "mean" or "max" (empty bags give zeros). per_sample_weights (N,) float32
        scale each row (sum and mean). Training (`insert_missing=True`) inserts unseen keys;
        evaluation (`False`) reads unseen keys as zero rows and changes nothing. `ctx` is what
        `apply_gradients` / `accumulate_gradients` need; they also record the accesses of a
        training lookup in the rows' metadata (count += occurrences, last step = the step of
        this lookup), once per distinct row rather than once per ID in the forward.

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

    def apply_gradients(self, ctx, grad_output, *, lr: float | None = None) -> None:
        """Fused backward: given d(loss)/d(out) (B, dim), update every row the lookup used
        (and its optimizer state) in place, with the configured optimizer (`lr` overrides
        its learning rate for this step). Advances `step` by one."""
        grouped_apply_gradients([ctx], grad_output, lr=lr, stores=[self])

    def accumulate_gradients(self, ctx, grad_output):
        """Non-fused backward: ``(unique_keys, grads)``, the gradient of each distinct row
        the lookup used (first-occurrence order), for callers that update rows themselves.
        Records a training lookup's accesses, as `apply_gradients` does.

        >>> import numpy as np
        >>> s = EmbeddingStore(dim=1)
        >>> _, ctx = s.pooled_lookup(np.array([4, 4, 9]), lengths=np.array([2, 1]))
        >>> k, g = s.accumulate_gradients(ctx, np.array([[1.0], [10.0]], dtype=np.float32))
        >>> k.tolist(), g.ravel().tolist()
        ([4, 9], [2.0, 10.0])
        """
        return unique_gradients_one(self, ctx, grad_output)

    def set_optimizer(self, optimizer) -> None:
        """Give a store built without an optimizer its fused optimizer (a cncore optimizer
        config). Rows, counts, last steps, the step, the eviction count, the admission
        sketch's counters and the on_evict callbacks stay; each row starts from the optimizer's
        initial state, as a row loaded without state does. For front ends that
        learn the optimizer after building the table (TorchRec's apply_optimizer_in_backward);
        call it between steps, never beside another call on the store.

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
        fresh.step, fresh.evicted_count = self.step, self.evicted_count
        if self._table.admission_counters is not None:
            fresh._table.admission_counters = self._table.admission_counters
        self._config, self._table = config, fresh._table
        if self._evict_callbacks:
            self._table.evict_sink = self._deliver
        self._writes += 1

    # --- bounded tables: eviction --------------------------------------------------------------

    def on_evict(self, callback) -> None:
        """Register `callback(batch)`: it receives a `TableBatch` of every eviction's rows
        (keys, rows, optimizer state, counts, last steps; lowest (score, key) first, or the
        export order for evict_if), called after the evicting call has released the store's lock, in the thread
        that made the call. Callbacks run in registration order, each with every evicted row;
        when one raises, the others still run, and the first error then propagates out of the
        call that evicted (the eviction has happened; later errors are attached to it as
        notes). Without callbacks evicted rows are dropped, and still counted.

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
        """Evict the `n` lowest-scoring rows now (all of them if n >= len); returns how many.

        >>> import numpy as np, cncore
        >>> s = cncore.EmbeddingStore(dim=1, eviction=cncore.LFU())
        >>> _ = s.find_or_insert(np.array([4, -2, 7]))
        >>> s.evict(2), s.export().keys.tolist()
        (2, [7])
        """
        self._require_policy("evict")
        return self._table.evict(_count(n, "n", 0, 2**63))

    def evict_expired(self) -> int:
        """TTL: evict every row with ``step - last_step > ttl``; returns how many."""
        if not isinstance(self._config.eviction, TTL):
            raise TypeError("evict_expired: this store's eviction policy is not TTL(steps)")
        return self._table.evict_expired()

    def evict_if(self, predicate, *, batch_size: int = 65536) -> int:
        """Evict the rows `predicate` chooses: it is called with each `TableBatch` of an export
        (keys, rows, state, counts, last steps) and returns a bool mask over the batch; the
        chosen keys are then evicted (handed to the on_evict callbacks, counted). The export
        runs first and the eviction after it (HierarchicalKV's erase_if): call it between
        steps. Returns how many rows were evicted.

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

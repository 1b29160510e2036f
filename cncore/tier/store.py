"""`TieredStore`: a table larger than memory, its hot rows in a bounded in-memory cache (see
`cncore.tier`)."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from cncore import _core
from cncore._interchange import as_floats, as_keys, as_uint32
from cncore.config import LRU, Optimizer, StoreConfig, Tiered, store_config_of
from cncore.grouped import LookupContext, as_flag, grouped_apply_gradients, pooled_lookup_one, unique_gradients_one
from cncore.rows import TableBatch
from cncore.store import EmbeddingStore
from cncore.tier import heap, records
from cncore.tier.background import _OPEN_STORES, _locked
from cncore.tier.directory import WriterLock, _open_rows, check_directory
from cncore.tier.durability import Durability
from cncore.tier.fault_in import _ERASE_BEHIND_AT, _FIND_ON_DISK_HERE, EraseBehind, FaultIn
from cncore.tier.prefetch import Prefetch, PrefetchState
from cncore.tier.records import (
    _cache_rows,
    _row_bytes,
    record_error,
    record_layout,
    record_offsets,
    rows_of,
    writer_layout,
)
from cncore.tier.slots import SlotAllocator
from cncore.tier.write_behind import SpillQueue, WriteBehind

_MIN_CACHE_ROWS = 16


class TieredStore(FaultIn, Prefetch, WriteBehind, Durability):
    """A table whose rows live on disk under a bounded memory cache, `cache` (an `EmbeddingStore`
    it holds), with the verbs of `cncore.storage.RowStorage` (see `cncore.tier`). Built by
    `cncore.make_store(config)` (or `TieredStore(config)`) when `config.storage` is a `Tiered`.

    Args:
        config (StoreConfig | None): the table's config, with ``storage=cncore.Tiered(path, cache_bytes)``.
        **config_fields: `StoreConfig` fields, when `config` is None.
    """

    def __init__(self, config: StoreConfig | None = None, **config_fields: Any):
        config = store_config_of(config, config_fields)
        storage = config.storage
        if not isinstance(storage, Tiered):
            raise TypeError(f"config.storage must be a cncore.Tiered, got {type(storage).__name__}")
        if config.max_rows is not None:
            raise ValueError("max_rows: a tiered table keeps every row (on disk); its memory is bounded by "
                             "Tiered.cache_bytes instead")
        self._tier_config = config
        self._cache_bytes = storage.cache_bytes
        self._lock = threading.RLock()  # the tiers' state: cache membership, disk index, slots, file
        # Why every verb is refused (closed, or inherited by a forked child), or None; set while
        # the store is being built, so that a half-built store refuses too.
        self._unusable: str | None = "the store is not open (its construction failed)"
        self._fd = None  # rows.dat
        self._writer_lock = None  # the directory's (WriterLock), from the open to close()
        self._prefetch = PrefetchState()  # the prefetch under way and what it left for the next call
        self._spare: np.ndarray | None = None  # a record buffer kept for the next read (_keep_spare)
        self._erases: EraseBehind  # disk-index erases left to the background thread (set with the disk index)
        self._erase_behind_at = _ERASE_BEHIND_AT  # (tests set it to 1)
        self._find_on_disk_here = _FIND_ON_DISK_HERE  # (tests set it to 0)
        self.cache_rows = _cache_rows(config, storage.cache_bytes)
        self._evict_chunk = max(records._IO_ROWS, self.cache_rows // 64)
        # Spilled bytes that make this store's share of a heap trim: 1/16 of the cache (_HeapTrim).
        self._trim_every = 4 * self._evict_chunk * _row_bytes(config)
        if self.cache_rows < _MIN_CACHE_ROWS:
            raise ValueError(f"Tiered.cache_bytes={storage.cache_bytes} holds {self.cache_rows} rows of this config "
                             f"({_row_bytes(config)} bytes each: the row, its optimizer state, metadata and index "
                             f"share); the cache needs at least {_MIN_CACHE_ROWS}: give cache_bytes >= "
                             f"{_MIN_CACHE_ROWS * _row_bytes(config)}")
        cache = dataclasses.replace(config, storage=None, max_rows=self.cache_rows,
                                    eviction=config.eviction or LRU(), headroom=None,
                                    capacity=min(config.capacity, self.cache_rows))
        self._dir = storage.path
        self._io_threads = storage.io_threads
        check_directory(self._dir)
        # The memory tier: a bounded core store, whose evictions go to disk (its evict_sink below).
        self.cache = EmbeddingStore(cache)
        self._version = records._VERSION  # of the directory's layout: a version 2 directory stays one
        self._layout()
        # Keys on disk -> slot (cn_slotindex.h: the core's hash index alone, 23-46 bytes a key).
        self._disk = _core.SlotIndex()
        self._erases = EraseBehind(self._disk)
        self._flushes = 0  # flush() calls over the directory's life (meta.json "flush")
        self._commits = 0  # index versions written (a compaction commits a second one)
        self.stats = {"hits": 0, "misses": 0, "new": 0, "rows_read": 0, "rows_written": 0, "bytes_read": 0,
                      "bytes_written": 0, "flushes": 0, "bytes_written_by_flush": 0, "bytes_written_by_compaction": 0,
                      "compactions": 0}
        os.makedirs(self._dir, exist_ok=True)  # its parent exists (check_directory)
        self._writer_lock = WriterLock(self._dir)
        try:
            flushed = self._last_flush()  # checked before anything in the directory is written
            self._fd = _open_rows(os.path.join(self._dir, "rows.dat"))
            if flushed is not None:
                self._reopen(*flushed)
            self._writer_lock.write_pid()
        except BaseException:
            self._writer_lock.release()
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            raise
        # StoreConfig.capacity, the rows the table is expected to hold, sizes the disk index now,
        # exactly (cn_slotindex.h): growing, a rehash holds the old and new buckets at once (16 +
        # 32 MiB at 1M disk rows, doubling), which set the peak RSS of a table 10x its cache.
        self._disk.reserve(max(0, self.disk_keys_at_most(config.capacity) - len(self._disk)))
        # The cache's evictions go to the writer in C (cn_tier.h): packed from the eviction's
        # buffer into records, written, indexed on disk; no NumPy copies, no callback.
        layout = writer_layout(self._tier_config, self._record, self._per_page)
        self._writer = _core.RecordWriter(self._fd, layout, self._disk, self._spill_slots, self._io_threads,
                                          records._IO_ROWS)
        self.cache._table.evict_sink = self._writer
        # Write-behind: the rows the cache evicts are written by the background thread, not by
        # the call that evicted them (RecordWriter.behind, SpillJob); see _write_behind.
        self._spills = SpillQueue(self._dir)  # the evicted rows waiting for the background thread
        self._writer.behind = self._write_behind
        heap._HEAP_TRIM.add(self)
        self._unusable = None
        _OPEN_STORES.add(self)

    @property
    def _io_rows(self) -> int:
        """Records the writer packs and writes at a time (its buffer; tests set it small)."""
        return self._writer.io_rows

    @_io_rows.setter
    def _io_rows(self, n: int) -> None:
        self._wait_writes()  # the queued writes use the writer's background buffer
        self._writer.io_rows = n

    # --- the layout of a record ------------------------------------------------------------------

    def _layout(self) -> None:
        """The record layout of the directory's version, and the slot allocator its pages make
        (built before anything is allocated: at the open, and again for an older directory)."""
        self._record, self._per_page = record_layout(self._tier_config, self._version)
        self._allocator = SlotAllocator(self._per_page)  # where spills and flushes write in rows.dat

    def _offsets(self, slots: np.ndarray) -> np.ndarray:
        return record_offsets(slots, self._record.itemsize, self._per_page)

    def _keep_spare(self, rec: np.ndarray) -> None:
        """Keep a record buffer for the next read (a new 400 KiB one faulted in its pages at
        every step of a Zipf run), if it is at most 1/32 of the cache."""
        base = rec if rec.base is None else rec.base
        if isinstance(base, np.ndarray) and base.dtype == self._record and base.ndim == 1 \
                and base.nbytes <= self._cache_bytes // 32:
            self._spare = base

    def _buffer(self, n: int) -> np.ndarray:
        """n records' room: the spare buffer of the last fault-in if large enough (every byte is
        then read from the file), else a new one."""
        spare, self._spare = self._spare, None
        if spare is not None and len(spare) >= n and spare.dtype == self._record:
            return spare[:n]
        return np.zeros(n, self._record)

    def _read(self, slots: np.ndarray) -> np.ndarray:
        self._wait_writes()  # a slot read may be one a queued spill has not written yet
        buf = self._buffer(len(slots))
        if len(slots):
            _core.block_io(self._fd, self._offsets(slots), buf.view(np.uint8).reshape(len(slots), -1), False,
                           self._io_threads)
            self.stats["rows_read"] += len(slots)
            self.stats["bytes_read"] += buf.nbytes
        return buf

    def _check_records(self, raw: np.ndarray, keys: np.ndarray, slots: np.ndarray) -> None:
        """Raise TableFormatError, naming the key and slot, unless every record read (raw: one a
        row, as bytes) holds keys[i] and, from directory version 4, matches its checksum."""
        bad = self._writer.check_keys(raw, keys)
        if bad >= 0:
            raise record_error(self._dir, raw[bad], int(keys[bad]), int(slots[bad]),
                               "the table is unchanged; restore the directory from a copy")

    def _write(self, slots: np.ndarray, batch: TableBatch) -> None:
        """Write a batch's rows as records at slots (the writer packs them in C, records._IO_ROWS at a
        time through one buffer: the records of a whole eviction, 16k rows in a step that
        inserts 16k keys, 4.4 MiB at dim 64, made a spill's peak memory the rows twice over)."""
        n = len(slots)
        if not n:
            return
        self._writer.write(np.ascontiguousarray(slots, dtype=np.int64), np.ascontiguousarray(batch.keys),
                           np.ascontiguousarray(batch.counts), np.ascontiguousarray(batch.last_steps),
                           np.ascontiguousarray(batch.rows), np.ascontiguousarray(batch.optimizer_state))
        self.stats["rows_written"] += n
        self.stats["bytes_written"] += n * self._record.itemsize

    @contextlib.contextmanager
    def faulted_in(self, keys: ArrayLike, insert: bool) -> Iterator[np.ndarray | None]:
        """A context in which `keys` are in the memory cache (with `insert`, absent keys get
        their initial rows) and no other thread moves rows between the tiers: run a core lookup
        of these keys inside it (what `grouped_pooled_lookup` and the torch modules do).

        Args:
            keys (ArrayLike): (N,) int64 keys.
            insert (bool): give absent keys their initial rows in the cache.

        Yields:
            np.ndarray | None: the cache slot of every key, or None (see _fault_in).
        """
        with self._lock:
            self._check_usable()
            yield self._fault_in(keys, insert)

    def _check_usable(self) -> None:
        """Refuse a verb of a closed store, or of a forked child's copy (ValueError)."""
        if self._unusable is not None:
            raise ValueError(self._unusable)

    def pooled_lookup(self, keys: ArrayLike, offsets: ArrayLike | None = None, *, lengths: ArrayLike | None = None,
                      mode: str = "sum", per_sample_weights: ArrayLike | None = None, insert_missing: bool = True,
                      out: np.ndarray | None = None) -> tuple[np.ndarray, LookupContext]:
        """As EmbeddingStore.pooled_lookup: its keys are faulted into the cache first, under the
        store's lock (`faulted_in`)."""
        return pooled_lookup_one(self, keys, offsets, lengths, mode, per_sample_weights, insert_missing, out)

    def apply_gradients(self, ctx: LookupContext, grad_output: ArrayLike, *, lr: float | None = None) -> None:
        """As EmbeddingStore.apply_gradients (the rows of a lookup are in the cache)."""
        self._check_usable()
        grouped_apply_gradients([ctx], grad_output, lr=lr, stores=[self])

    def accumulate_gradients(self, ctx: LookupContext, grad_output: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
        """As EmbeddingStore.accumulate_gradients."""
        self._check_usable()
        return unique_gradients_one(self, ctx, grad_output)

    def __repr__(self) -> str:
        if self._unusable is not None:
            return f"TieredStore(path={self._dir!r}, unusable: {self._unusable})"
        return (f"TieredStore(rows={len(self)}, path={self._dir!r}, cached={self.cached_rows}, "
                f"config={self.cache.config})")

    @_locked
    def evict(self, n: int) -> int:
        """As EmbeddingStore.evict: the `n` lowest-scoring cached rows go to disk now."""
        return self.cache.evict(n)

    @_locked
    def evict_expired(self) -> int:
        """As EmbeddingStore.evict_expired, over the cached rows (the expired rows go to disk)."""
        return self.cache.evict_expired()

    @_locked
    def evict_if(self, predicate: Callable[[TableBatch], ArrayLike], *, batch_size: int = 65536) -> int:
        """As EmbeddingStore.evict_if, over the cached rows (to disk), under the store's lock."""
        return self.cache.evict_if(predicate, batch_size=batch_size)

    @_locked
    def decay_admission(self) -> None:
        """As EmbeddingStore.decay_admission. The sketch counts keys with no row in memory or on
        disk; it lives in memory only: reopening the directory starts it over."""
        self.cache.decay_admission()

    def _check_fits(self, keys: np.ndarray) -> None:
        distinct = len(np.unique(keys))
        if distinct > self.cache_rows:
            raise ValueError(f"keys: this call uses {distinct} distinct keys, more than the cache's "
                             f"{self.cache_rows} rows (Tiered.cache_bytes={self._cache_bytes}); "
                             "give a larger cache_bytes or smaller batches. The table is unchanged")

    # --- the verbs of a store ------------------------------------------------------------------

    @property
    def config(self) -> StoreConfig:
        """The config the store was built with (its storage included)."""
        return self._tier_config

    @property
    def dim(self) -> int:
        return self._tier_config.dim

    @property
    def capacity(self) -> int:
        """Rows the cache holds before its index must grow."""
        return self.cache.capacity

    @property
    def load_factor(self) -> float:
        """The cache's keys / index buckets."""
        return self.cache.load_factor

    @property
    def nbytes(self) -> int:
        """Bytes the cache has allocated (the disk index apart: `disk_index_bytes`)."""
        return self.cache.nbytes

    @property
    def step(self) -> int:
        """Optimizer steps applied so far (see EmbeddingStore.step); flushed with the table."""
        return self.cache.step

    @step.setter
    def step(self, value: int) -> None:
        self.cache.step = value

    @property
    def evicted_count(self) -> int:
        """The cache's count of evicted rows (EmbeddingStore.evicted_count; each went to disk, none
        is lost); flushed with the table."""
        return self.cache.evicted_count

    @evicted_count.setter
    def evicted_count(self, value) -> None:
        self.cache.evicted_count = value

    @property
    def _table(self):
        """The core table the grouped lookups and backward compute on: the cache's (its keys are
        faulted in first, `faulted_in`)."""
        return self.cache._table

    @property
    def _uid(self) -> int:
        """Which store an incremental save's checkpoint is of (cncore.tablefile): the cache's."""
        return self.cache._uid

    @property
    def _writes(self) -> int:
        """Calls that wrote rows without recording a step (cncore.tablefile): the cache's count."""
        return self.cache._writes

    @property
    def record_bytes(self) -> int:
        """Bytes of one record in the file (key, count, last step, row, optimizer state)."""
        return self._record.itemsize

    def disk_keys_at_most(self, rows: int) -> int:
        """The most keys the disk index holds at once in a table of `rows` rows: all but the
        cache's low-water mark, plus a fault-in's round of loads (indexed on disk until they are
        loaded) and two rounds of erases the background thread may not have run yet (EraseBehind).

        Args:
            rows (int): rows in the table, memory and disk together.

        Returns:
            int: the bound on the disk index's keys.
        """
        low_water = self.cache_rows - (self.cache.config.headroom or 0)  # the cache's own config
        return max(0, int(rows) - low_water + 3 * self._evict_chunk)

    @property
    def disk_index_bytes(self) -> int:
        """Memory the index of the rows on disk takes (its buckets)."""
        return self._disk.nbytes

    @property
    def cached_rows(self) -> int:
        """Rows in memory now."""
        return len(self.cache)

    @_locked
    def __len__(self) -> int:
        self._erases.settle()
        return len(self.cache) + len(self._disk)

    def __reduce__(self):
        raise TypeError("a TieredStore does not pickle: flush() it and reopen the directory with its config")

    @_locked
    def find(self, keys: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
        """As EmbeddingStore.find: the keys on disk are faulted into the cache first."""
        self._fault_in(keys, insert=False)
        return self.cache.find(keys)

    @_locked
    def contains(self, keys: ArrayLike) -> np.ndarray:
        """As EmbeddingStore.contains, in memory or on disk (nothing moves)."""
        return self.cache.find(keys)[1] | (self._disk.find(as_keys(keys)) >= 0)

    @_locked
    def find_or_insert(self, keys: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
        """As EmbeddingStore.find_or_insert (`found`: in memory or on disk before the call)."""
        present = self.contains(keys)
        self._fault_in(keys, insert=True)
        slots, _ = self.cache.find_or_insert(keys)
        return slots, present

    @_locked
    def insert_or_assign(self, keys: ArrayLike, rows: ArrayLike, optimizer_state: ArrayLike | None = None
                         ) -> np.ndarray:
        """As EmbeddingStore.insert_or_assign."""
        self._fault_in(keys, insert=False)
        return self.cache.insert_or_assign(keys, rows, optimizer_state)

    @_locked
    def assign(self, keys: ArrayLike, rows: ArrayLike, optimizer_state: ArrayLike | None = None) -> np.ndarray:
        """As EmbeddingStore.assign."""
        self._fault_in(keys, insert=False)
        return self.cache.assign(keys, rows, optimizer_state)

    @_locked
    def load(self, keys: ArrayLike, rows: ArrayLike, optimizer_state: ArrayLike | None = None,
             counts: ArrayLike | None = None, last_steps: ArrayLike | None = None) -> np.ndarray:
        """As EmbeddingStore.load, in chunks of half the cache (restoring a table larger than the
        cache spills as it goes)."""
        keys = as_keys(keys)
        step = max(1, self.cache_rows // 2)
        if len(keys) <= step:
            self._fault_in(keys, insert=False)
            return self.cache.load(keys, rows, optimizer_state, counts, last_steps)
        # Every argument checked before the first chunk changes the table (as EmbeddingStore's
        # _upsert checks them).
        n = len(keys)
        rows = as_floats(rows, "rows", (n, self.dim))
        if optimizer_state is not None:
            optimizer_state = as_floats(optimizer_state, "optimizer_state", (n, self._tier_config.state_floats))
        counts, last_steps = as_uint32(counts, "counts", n), as_uint32(last_steps, "last_steps", n)
        # As in memory, `found` says which keys had a row before the call: a key given twice
        # (in two chunks) is not found the second time because the first chunk loaded it.
        found = self.contains(keys)
        for a in range(0, n, step):
            part = slice(a, a + step)
            self.load(keys[part], rows[part], None if optimizer_state is None else optimizer_state[part],
                      None if counts is None else counts[part], None if last_steps is None else last_steps[part])
        return found

    @_locked
    def erase(self, keys: ArrayLike) -> np.ndarray:
        """As EmbeddingStore.erase, in memory and on disk."""
        self._erases.settle()
        erased = self.cache.erase(keys)
        arr = as_keys(keys)
        on_disk = self._disk.find(arr) >= 0
        if on_disk.any():
            first = np.zeros(len(arr), bool)
            first[np.unique(arr, return_index=True)[1]] = True  # a repeated key is erased once
            erased = erased | (on_disk & first)
            gone = np.unique(arr[on_disk])
            self._allocator.release(self._disk.erase(gone))
        return erased

    @_locked
    def clear(self) -> None:
        """As EmbeddingStore.clear, in memory and on disk."""
        self._erases.settle()
        self.cache.clear()
        self._disk.clear()

    @_locked
    def reserve(self, n_rows: int) -> None:
        """As EmbeddingStore.reserve, for the cache (at most its rows)."""
        self.cache.reserve(min(int(n_rows), self.cache_rows))

    @_locked
    def lookup(self, keys: ArrayLike, *, insert_missing: bool = False) -> np.ndarray:
        """As EmbeddingStore.lookup; more keys than the cache holds go in chunks of half the
        cache (the rows are copies, so a later chunk may send an earlier one's rows to disk)."""
        insert = as_flag(insert_missing, "insert_missing")
        keys = as_keys(keys)
        step = max(1, self.cache_rows // 2)
        if len(keys) > step:
            return np.concatenate([self.lookup(keys[a:a + step], insert_missing=insert)
                                   for a in range(0, len(keys), step)]).reshape(len(keys), self.dim)
        self._fault_in(keys, insert=insert)
        if insert:
            self.cache.find_or_insert(keys)
        return self.cache.read(keys).rows

    @_locked
    def read(self, keys: ArrayLike) -> TableBatch:
        """As EmbeddingStore.read; more keys than the cache holds go in chunks of half the cache."""
        keys = as_keys(keys)
        step = max(1, self.cache_rows // 2)
        if len(keys) > step:
            parts = [self.read(keys[a:a + step]) for a in range(0, len(keys), step)]
            return TableBatch.concat(parts)
        self._fault_in(keys, insert=False)
        return self.cache.read(keys)

    def on_evict(self, callback: Callable[[TableBatch], object]) -> None:
        """As EmbeddingStore.on_evict, refused (TypeError): a tier's evicted rows go to its disk."""
        raise TypeError("on_evict: a tiered store's evicted rows go to its disk tier, not to callbacks")

    def set_optimizer(self, optimizer: Optimizer) -> None:
        """As EmbeddingStore.set_optimizer, refused (TypeError): a record has the optimizer's width."""
        raise TypeError("set_optimizer: not on a tiered store (its records have the optimizer's width)")

    @_locked
    def export(self, cursor: tuple | None = None, max_rows: int | None = None, *,
               with_rows: bool = True) -> TableBatch:
        """As EmbeddingStore.export, whole only: the cache's rows, then the disk's (iter_export
        walks both tiers in batches; a cursor or max_rows is refused)."""
        if cursor is not None or max_rows is not None:
            raise ValueError("cursor / max_rows: a tiered store exports whole or through iter_export()")
        parts = list(self.iter_export(1 << 18, with_rows=with_rows))
        if not parts:
            return self.cache.export(with_rows=with_rows)
        return TableBatch.concat(parts)

    def iter_export(self, batch_size: int = 65536, *, with_rows: bool = True) -> Iterator[TableBatch]:
        """As EmbeddingStore.iter_export: the cache's rows, then the disk's (each record checked)."""
        self._check_usable()
        return self._iter_export(batch_size, with_rows)

    def _iter_export(self, batch_size: int, with_rows: bool) -> Iterator[TableBatch]:
        yield from self._cache_batches(batch_size, with_rows)
        self._erases.settle()
        sf = self._tier_config.state_floats
        for disk_keys, disk_slots in self._disk.items(batch_size):
            rec = self._read(disk_slots)
            self._check_records(rec.view(np.uint8).reshape(len(rec), -1), disk_keys, disk_slots)
            dim = self.dim if with_rows else 0
            rows = rows_of(rec, self._tier_config.dtype) if with_rows else np.empty((len(rec), 0), np.float32)
            state = (rec["state"] if sf else np.empty((len(rec), 0), np.float32)) if with_rows \
                else np.empty((len(rec), 0), np.float32)
            assert rows.shape[1] == dim
            yield TableBatch(rec["key"].copy(), np.ascontiguousarray(rows), np.ascontiguousarray(state),
                             rec["count"].copy(), rec["last_step"].copy(), np.ones(len(rec), bool))

    def _holds_lock(self) -> bool:
        """Whether this store holds its directory's writer lock (also on a half-built store)."""
        lock = getattr(self, "_writer_lock", None)
        return lock is not None and lock.held

    def _disown(self) -> None:
        """In a forked child: this copy of the store is the parent's; refuse every verb, and close
        the copies of its descriptors without unlocking (WriterLock.disown)."""
        self._lock = threading.RLock()  # the parent's may have been held by a thread the child lacks
        lock = getattr(self, "_writer_lock", None)
        owner = lock.owner if lock is not None else "?"
        self._unusable = (f"this TieredStore of {self._dir} belongs to process {owner}, "
                          f"which forked this process ({os.getpid()}); a tier directory has one writer: use the "
                          "store in the parent only, or read its last flush here with cncore.tablefile.open_table")
        fd, self._fd = getattr(self, "_fd", None), None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
        if lock is not None:
            lock.disown()
        if getattr(self, "_writer", None) is not None:
            self._writer.fd = -1
        if getattr(self, "_spills", None) is not None:
            self._spills.forget()
        self._prefetch = PrefetchState()
        erases = getattr(self, "_erases", None)
        if erases is not None:
            erases.forget()

    def close(self) -> None:
        """Close the file (without flushing) and give the directory's writer lock back; every
        verb after it raises ValueError ("I/O operation on closed store"). Queued spills are
        written first (OSError if one cannot be: the file stays open, its rows in memory).
        A second close does nothing."""
        lock = getattr(self, "_lock", None)
        if lock is None:  # its construction failed before anything was opened
            return
        with lock:
            if getattr(self, "_fd", None) is None and not self._holds_lock():
                return  # closed, never opened, or a forked child's copy (_disown)
            if getattr(self, "_prefetch", None) is not None and self._prefetch.future is not None:
                self._wait_prefetch()
            erases = getattr(self, "_erases", None)
            if erases is not None and erases.outstanding:
                erases.settle()
            if getattr(self, "_spills", None) is not None and self._spills.pending:
                self._wait_writes()
            heap._HEAP_TRIM.discard(self)  # its share of the trigger (_HeapTrim) goes with it
            _OPEN_STORES.discard(self)
            self._unusable = (f"I/O operation on closed store: {self._dir} was closed (TieredStore.close()); open "
                              "the directory again with cncore.make_store(config) to use it")
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
                if getattr(self, "_writer", None) is not None:
                    self._writer.fd = -1  # a spill after close fails (EBADF), never writes to a reused descriptor
            if self._writer_lock is not None:
                self._writer_lock.release()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
        try:  # also when close failed (a queued write it could not make): the store is gone, and
            # its directory must not stay locked for the rest of the process
            if getattr(self, "_fd", None) is not None:
                os.close(self._fd)
                self._fd = None
            if self._holds_lock():
                self._writer_lock.release()
        except Exception:
            pass
        try:
            heap._HEAP_TRIM.discard(self)  # also when close failed: the store is gone
        except Exception:  # interpreter exit: the module's globals may be gone
            pass

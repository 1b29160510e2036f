"""Flush, reopen and compaction of a tier: what makes its directory hold the table, crash-safely."""
from __future__ import annotations

import json
import os
from collections.abc import Iterator

import numpy as np

from cncore import _core
from cncore.fileio import TableFormatError, fsync_dir
from cncore.rows import TableBatch
from cncore.tier import heap
from cncore.tier.background import _locked
from cncore.tier.directory import _CHUNK, _FORMAT, _config_record, _meta_digest, _sha256_file, read_flushed
from cncore.tier.records import records_end


class Durability:
    """Part of TieredStore: the last flush read back, flush, compaction and their commit."""

    def _last_flush(self):
        """(meta, keys, slots) of the directory's last flush, checked against this config and
        rows.dat; None for a new directory (or one never flushed: it holds no table yet). Reads
        only: a refusal leaves the directory as it was."""
        if not os.path.exists(os.path.join(self._dir, "meta.json")):
            return None
        meta, keys, slots = read_flushed(self._dir, TableFormatError, "Tiered.path: ")
        self._version = int(meta["version"])
        self._layout()
        if meta["config"] != _config_record(self._tier_config):
            raise ValueError(f"Tiered.path: {self._dir} holds a table of another config ({meta['config']}); "
                             "open it with the config it was flushed with")
        if meta.get("record_bytes") != self._record.itemsize:
            raise TableFormatError(f"Tiered.path: {self._dir}/meta.json holds records of "
                                   f"{meta.get('record_bytes')!r} bytes, this config's are {self._record.itemsize}; "
                                   "the directory is damaged or of another layout")
        if keys.dtype != np.int64 or slots.dtype != np.int64 or keys.shape != slots.shape or keys.ndim != 1 \
                or meta["rows"] != len(keys) or (len(slots) and slots.min() < 0):
            raise TableFormatError(f"Tiered.path: {self._dir}: meta.json (rows {meta['rows']}) does not match its "
                                   f"index ({keys.shape} keys, {slots.shape} slots); the tier is damaged")
        need = records_end(slots, self._record.itemsize, self._per_page)
        try:
            size = os.stat(os.path.join(self._dir, "rows.dat")).st_size
        except FileNotFoundError:
            size = None
        if need and (size is None or size < need):
            found = "is missing" if size is None else f"has {size} bytes"
            raise TableFormatError(f"Tiered.path: {self._dir}: rows.dat {found}, the index needs {need} (truncated); "
                                   "the directory is left as it is: restore it from a copy")
        return meta, keys, slots

    def _reopen(self, meta: dict, keys: np.ndarray, slots: np.ndarray) -> None:
        """Take the state of the directory's last flush (checked by _last_flush)."""
        self._disk.put(keys, slots)
        self._allocator.high_water = int(meta["high_water"])
        self._allocator.plan_free(slots)
        self.step = int(meta["step"])
        self.evicted_count = int(meta["evicted"])
        self._flushes, self._commits = int(meta["flush"]), int(meta["commit"])

    def _cache_batches(self, batch_size: int = _CHUNK, with_rows: bool = True) -> Iterator[TableBatch]:
        """The cached rows, batch_size at a time (the cache's export walk, empty batches left out)."""
        for b in self.cache.iter_export(batch_size, with_rows=with_rows):
            if len(b.keys):
                yield b

    @_locked
    def flush(self) -> None:
        """Make the directory hold this table as it is now, crash-safely (module docstring)."""
        keys, slots = self._flush()
        if self._allocator.high_water > self._tier_config.storage.compact_ratio * len(slots) + 4 * self._per_page:
            self._compact_flushed(keys, slots)
        del keys, slots
        heap._trim()  # the flush's scratch: the new index, 16 bytes a row

    def _flush(self):
        """flush() without its compaction; returns every row's key and slot (the new index).

        Scratch memory is the index (16 bytes a row) and one chunk of records: exporting the
        whole cache and writing it from one buffer made a flush's peak RSS 1.7x the steady
        state (130 MiB for a 32 MiB cache at 3x, asv_bench/scripts/tiered_bench.py)."""
        self._wait_prefetch()
        self._erases.settle()
        self._wait_writes()  # before the fsync: every spilled row in the file
        n = len(self.cache) + len(self._disk)
        keys, slots = np.empty(n, np.int64), np.empty(n, np.int64)
        at = 0
        for k, disk_slots in self._disk.items(_CHUNK):
            keys[at:at + len(k)], slots[at:at + len(k)] = k, disk_slots
            at += len(k)
        for b in self._cache_batches():
            taken = self._allocator.take(len(b.keys))
            self._write(taken, b)
            self.stats["bytes_written_by_flush"] += len(taken) * self._record.itemsize
            keys[at:at + len(b.keys)], slots[at:at + len(b.keys)] = b.keys, taken
            at += len(b.keys)
        assert at == n, (at, n)
        os.fsync(self._fd)
        self._flushes += 1
        self._commit(keys, slots)
        # The new snapshot: its slots stay untouched until the next flush; the rest is free.
        self._allocator.plan_free(slots)
        self.stats["flushes"] += 1
        return keys, slots

    @_locked
    def compact(self) -> int:
        """Flush, then move the records past the table's row count into the holes below it and
        truncate the file: afterwards it holds exactly one record per row. Crash-safe like a
        flush (records are copied into free slots, the new index is committed, then the file is
        cut). Returns the bytes the file gave back."""
        gave_back = self._compact_flushed(*self._flush())
        heap._trim()
        return gave_back

    def _compact_flushed(self, keys: np.ndarray, slots: np.ndarray) -> int:
        """compact() right after a flush (the state is on disk, nothing cached is newer): the
        records past the row count move into the holes below it, a chunk at a time."""
        n = len(slots)
        is_tail = slots >= n
        if is_tail.any():
            order = np.argsort(slots[is_tail])
            tail, tail_keys = slots[is_tail][order], keys[is_tail][order]
            del order
            low = np.zeros(n, bool)
            low[slots[~is_tail]] = True
            holes = np.flatnonzero(~low)  # as many as the tail records (n slots, n rows)
            del low
            for a in range(0, len(tail), _CHUNK):
                rec = self._read(tail[a:a + _CHUNK])
                buf = rec.view(np.uint8).reshape(len(rec), -1)
                self._check_records(buf, tail_keys[a:a + _CHUNK], tail[a:a + _CHUNK])
                _core.block_io(self._fd, self._offsets(holes[a:a + _CHUNK]), buf, True, self._io_threads)
                self.stats["rows_written"] += len(rec)
                self.stats["bytes_written"] += buf.nbytes
                self.stats["bytes_written_by_compaction"] += buf.nbytes
            os.fsync(self._fd)
            slots = slots.copy()
            slots[is_tail] = holes[np.searchsorted(tail, slots[is_tail])]
            self._commit(keys, slots)
            on_disk = self._disk.find(keys) >= 0
            self._disk.put(keys[on_disk], slots[on_disk])
        before = os.fstat(self._fd).st_size
        end = 0 if n == 0 else int(self._offsets(np.array([n - 1]))[0]) + self._record.itemsize
        os.ftruncate(self._fd, end)
        os.fsync(self._fd)
        self._allocator.truncated(n)
        self.stats["compactions"] += 1
        return before - end

    def _commit(self, keys: np.ndarray, all_slots: np.ndarray) -> None:
        """Write the index of every row's slot and make it the directory's state (atomic)."""
        self._commits += 1
        index_name = f"index-{self._commits:06d}.npz"
        index_path = os.path.join(self._dir, index_name)
        with open(index_path, "wb") as fh:  # straight to the file: no second copy of the index in memory
            np.savez(fh, keys=keys, slots=all_slots)
            fh.flush()
            os.fsync(fh.fileno())
        meta = {"format": _FORMAT, "version": self._version, "config": _config_record(self._tier_config),
                "flush": self._flushes, "commit": self._commits, "index": index_name,
                "rows": len(keys), "step": int(self.step), "evicted": int(self.evicted_count),
                "high_water": int(self._allocator.high_water), "record_bytes": int(self._record.itemsize),
                "index_sha256": _sha256_file(index_path)}
        if self._version >= 4:
            meta["meta_sha256"] = _meta_digest(meta)
        tmp_meta = os.path.join(self._dir, f".tmp-{os.getpid()}-meta.json")
        with open(tmp_meta, "wb") as fh:
            fh.write(json.dumps(meta, indent=1).encode())
            fh.flush()
            os.fsync(fh.fileno())
        fsync_dir(self._dir)
        os.replace(tmp_meta, os.path.join(self._dir, "meta.json"))  # the commit point
        fsync_dir(self._dir)
        for entry in os.listdir(self._dir):  # older indexes, and leftovers of killed flushes
            if (entry.startswith("index-") and entry != index_name) or entry.startswith(".tmp-"):
                os.remove(os.path.join(self._dir, entry))

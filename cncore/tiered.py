"""The SSD tier: a table larger than memory, its hot rows in a bounded in-memory cache.

    StoreConfig(dim=64, optimizer=..., storage=cncore.Tiered(path="users.tier", cache_bytes=2 << 30))

`EmbeddingStore(config)` with `storage=Tiered(...)` is a `TieredStore`: the same verbs, over two
tiers that never hold the same key at once:
- the cache: an ordinary bounded core store (the budget is cache_bytes over the bytes a row
  takes in memory; the config's eviction policy, LRU by default). Lookups, pooling and the
  fused backward run on it exactly as on any store;
- the disk: `path/rows.dat`, a slotted file of fixed-size records (key, count, last step,
  row, optimizer state; a record never straddles a 4 KiB page), and a key -> slot index in
  memory for the rows on disk (the core's hash index alone, cn_slotindex.h: 23-46 bytes a key).
Before a call touches keys, the keys found on disk are read in batched calls (several I/Os in
flight: cn_blockio.h) and loaded into the cache, a round (1/64 of the cache) at a time; making
room for them evicts the cache's lowest-scoring rows that the call does not use, and those are
written to free slots of the file in one batched call (the "spill"). Nothing is dropped: an
evicted row is on disk. Both directions run in C (cn_tier.h, `_core.RecordWriter` and
`Table.load_records`): the cache's eviction buffer is packed straight into records, and read
records go straight into the cache's rows, one nogil call a round; Python only finds which keys
are missing, allocates slots and keeps the counts.

Durability (`flush`): every cached row is written to free slots, the file is fsynced, then the
index of every row's slot is written to a new `index-NNNNNN.npz` (fsynced) and `meta.json`
(the config, the step, the index's name and checksum) replaces the previous one by an atomic
rename: that rename is the commit point; the older index is removed after it. Between flushes no write ever lands
on a slot the last flushed index refers to (a slot freed since the flush waits for the next
one), so a SIGKILL at any moment leaves the directory at the last flush; reopening the same
path (with the same config) reads only the index. No fsync in the training loop.

One writer: a store holds an exclusive lock (flock) on its directory from its open to close(); a
second store on the directory, in this process or another, is refused at once (BlockingIOError
naming the holder's pid, from the directory's `lock` file) and changes nothing. The lock is the
kernel's: a writer killed by SIGKILL leaves none behind. A forked child's copy of a store refuses
every verb (the parent's lock and file are not the child's to write). Readers (`TierFile`:
`open_table`, `load_store`, `cn-table`) take no lock: they read the flush they opened, and
refuse once the writer has flushed again. After close() every verb raises ValueError ("I/O
operation on closed store").

Checksums (directory format 4): every record's last 4 bytes hold a checksum of the rest
(cn_tier.h), written with it and checked by every read (a fault-in, export, compaction, and
`TierFile`), and meta.json holds a SHA-256 of its own fields, so a damaged byte is refused
(TableFormatError naming the key and slot) rather than read back. Reopening checks that rows.dat
is as long as the last flush's index needs. Format 2 and 3 directories open as before, without
checksums, and keep their layout.

Space: log-structured. A spill writes its records to whole free pages and then to the end of
the file, in runs (one pwritev per run); slots freed since the last flush are reused after the
next one, and a flush compacts (moves the records past the row count into the holes, then
truncates) when the file holds more than `Tiered.compact_ratio` (3 by default) records per row. So
after a flush the file is at most that many times the rows (plus a few pages), and between flushes it grows by the rows
spilled since. `compact()` brings it to exactly one record per row.

`prefetch(keys)` hands in the next batch's keys: a background thread (one for every tiered
store of the process) finds which are on disk and reads their records (at most 1/32 of the
cache's bytes of them), in one C call without the GIL, while the current step runs (TorchRec's
SSD TBE pipeline does the same); the next call takes them if still current (same slot, no
flush since), and reads the rest. A call of the same keys also takes the job's find of them
(`_own_plan`), and leaves the disk index's erase of the rows it loaded to the background thread
(`_erase_behind`).

Write-behind: the rows the cache evicts are written by that same background thread, after the
call that evicted them returned (their keys are indexed on disk at once; a read of one on the
training thread, a flush and close first wait for the queued writes, and a prefetch handed in
later reads after them: one thread, first in first out). See TieredStore._write_behind.

Threads: every verb holds the store's lock, and a lookup's fault-in and its core call are one
held section (`faulted_in`), so a thread's rows cannot go back to disk between them.

Memory: the cache's rows (cache_bytes), the disk index (16-byte buckets at a load factor of at
most 0.7; sized once and exactly from StoreConfig.capacity, the rows the table will hold, if
given: all of them but the cache's low-water mark, plus a fault-in's round, `disk_keys_at_most`;
else grown by 1.25x at least), per
call the records it moves (read and evicted in rounds of 1/64 of the cache at most, written
1,024 at a time through the writer's buffer; a read buffer of at most 1/32 of the cache is kept
for the next call, and prefetch reads at most that much ahead), and per flush the new index (16
bytes a row) and one chunk of records. Freed heap is
given back with malloc_trim (glibc) after flushes and whenever the process's tiered stores
have spilled 1/16 of their caches together (_HeapTrim). `stats`
counts hits and misses (IDs found in memory / read from disk), rows and bytes read and
written, and the bytes written by flushes and compactions apart.

Admission (`StoreConfig.admission=MinCount(...)`): a key a training lookup sees gets a row only
once admitted, as in memory; a key on disk has a row, so it is faulted in without asking. The
sketch lives in memory (not in the directory): reopening starts it over, as loading a table
file does.

16-bit rows (`StoreConfig(dtype="float16" | "bfloat16")`) are stored at their size in the records
(directory format 3; a format 2 directory, float32 records, still opens and keeps its layout).

Left for later (said here so nobody relies on them): records are read through the page cache
(no O_DIRECT), so on a machine with free memory the kernel caches the file too (outside the
process's RSS, given back under pressure).

>>> import numpy as np, tempfile, os, cncore
>>> path = os.path.join(tempfile.mkdtemp(), "t.tier")
>>> store = cncore.EmbeddingStore(cncore.StoreConfig(dim=4, optimizer=cncore.SGD(lr=0.1),
...                                                  storage=cncore.Tiered(path, cache_bytes=20_000)))
>>> for start in range(0, 1000, 100):
...     _, ctx = store.pooled_lookup(np.arange(start, start + 100), lengths=np.full(10, 10))
...     store.apply_gradients(ctx, np.ones((10, 4), np.float32))
>>> len(store), store.cached_rows < 1000, store.stats["rows_written"] > 0
(1000, True, True)
>>> before = store.lookup(np.array([5, 999]))
>>> store.flush(); store.close()          # a directory has one store at a time
>>> again = cncore.EmbeddingStore(store.config)
>>> bool((again.lookup(np.array([5, 999])) == before).all())
True
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import functools
import hashlib
import json
import os
import threading
import weakref
import zipfile
from typing import Iterator, Optional

import numpy as np

from cncore import _core
from cncore._interchange import as_floats, as_keys
from cncore.config import LRU, StoreConfig, Tiered
from cncore.row_codec import decode_rows
from cncore.store import EmbeddingStore, TableBatch

__all__ = ["TieredStore", "TierFile", "open_tier"]

_PAGE = 4096
_CHUNK = 1 << 13  # rows a flush or compaction moves at a time (its scratch: one chunk of records, 2.5 MiB at dim 64)
_IO_ROWS = 1024  # records a spill writes, or a fault-in loads, at a time (287 KiB at dim 64, row-wise Adagrad)
_FORMAT = "cn-tier"
_VERSION = 4  # 4: a checksum in every record; 3: 16-bit rows at their size; 2: records packed to 8 bytes
_READS = (2, 3, 4)  # versions this code opens (an older directory keeps its layout: no checksums, and
#                     in version 2 float32 rows)
_WRITER_PID = "lock"  # the writing process's pid, in the directory while a store holds it
_META_FIELDS = ("config", "flush", "commit", "index", "rows", "step", "evicted", "high_water", "record_bytes",
                "index_sha256")


_PREFETCHER = None  # the background thread of every tiered store's prefetch reads
_FIND_ON_DISK_HERE = 256  # prefetch: at most this many IDs missing from memory are found on disk by the caller
_ERASE_BEHIND_AT = 256  # a one-round fault-in of at least this many disk rows leaves their disk-index erase behind


def _prefetcher():
    global _PREFETCHER
    if _PREFETCHER is None:
        import concurrent.futures
        _PREFETCHER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="cncore-tier-prefetch")
        global _DRAIN_REGISTERED
        if not _DRAIN_REGISTERED:
            # Registered after concurrent.futures' own before-fork hook (it takes the lock that
            # submit() takes), so ours runs first: "before" hooks run in reverse order.
            os.register_at_fork(before=_drain_prefetcher)
            _DRAIN_REGISTERED = True
    return _PREFETCHER


_DRAIN_REGISTERED = False


def _drain_prefetcher() -> None:
    """Before a fork: let the prefetch thread finish what it was given. Its job holds a disk
    index's mutex in C (SlotIndex) for up to a few ms; a child forked meanwhile would inherit the
    mutex locked by a thread it does not have, and deadlock on its first use of that store.
    (One worker, first in first out: a no-op job's end means every earlier job's.)"""
    if _PREFETCHER is not None and not threading.current_thread().name.startswith("cncore-tier-prefetch"):
        try:
            _PREFETCHER.submit(int).result()
        except RuntimeError:  # the executor was shut down (interpreter exit): no job runs
            pass


def _run_spill(job) -> None:
    """A queued spill's write, on the background thread (tests wrap it: a crash mid-write)."""
    job.run()


def _submit_write(job):
    """Queue a spill's write on the background thread (the prefetch reads' thread: one worker,
    first in first out, so a prefetch handed in after a spill reads the file after its write)."""
    return _prefetcher().submit(_run_spill, job)


def _settle(entry) -> None:
    """Wait until a queued spill ([job, its Future or None]) has run on the background thread,
    and forget its Future. A write's error is the job's (job.err, job.written), not raised here;
    the Future's own (the executor's) is dropped the same way."""
    if entry[1] is not None:
        try:
            entry[1].result()
        except BaseException:
            pass
        entry[1] = None


def _forget_prefetcher() -> None:  # a forked child has no copy of the parent's thread
    global _PREFETCHER
    _PREFETCHER = None


os.register_at_fork(after_in_child=_forget_prefetcher)

_OPEN_STORES = weakref.WeakSet()  # the process's open tiered stores: a forked child disowns them


def _disown_open_stores() -> None:
    for store in list(_OPEN_STORES):
        store._disown()
    _OPEN_STORES.clear()


os.register_at_fork(after_in_child=_disown_open_stores)


def writer_of(directory: str) -> str:
    """Who holds a tier directory's writer lock, in words, from its pid file ("held by process
    1234"), for messages; the lock itself (flock on the directory) is what TieredStore checks."""
    try:
        with open(os.path.join(directory, _WRITER_PID)) as fh:
            pid = int(fh.read().strip())
    except (OSError, ValueError):
        return "held by another process"
    if pid == os.getpid():
        return f"held by this process, {pid}"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return f"last held by process {pid}, which has ended"
    except PermissionError:  # alive, another user's
        pass
    return f"held by process {pid}"


def _locked(method):
    """Run a verb under the store's lock: a verb's fault-in and its core call must not be
    split by another thread's, which could send the rows just faulted in back to disk (a
    lookup then read zeros, or a fresh initial row, for a key that was on its way to disk)."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self._lock:
            if self._unusable is not None:
                raise ValueError(self._unusable)
            return method(self, *args, **kwargs)
    return run


_MIN_CACHE_ROWS = 16


def _open_rows(path: str) -> int:
    """The tier's record file, read and written: with O_NOATIME where the kernel allows it (the
    file's owner), because every read of a page-cache file otherwise checks, and may update, its
    access time: `perf` put touch_atime, atime_needs_update and current_time at 1.7% of a 3x Zipf
    1.05 run's samples, ~7% of the background thread's read path. Without it (another owner's
    file: EPERM) the file opens as before."""
    flags = os.O_RDWR | os.O_CREAT
    try:
        return os.open(path, flags | getattr(os, "O_NOATIME", 0), 0o644)
    except PermissionError:
        return os.open(path, flags, 0o644)


def _row_bytes(config: StoreConfig) -> int:
    """Bytes a cached row takes: the row and its state, metadata and key (24 bytes), and the
    index's share (16-byte buckets at the 0.7 load factor, about 23 bytes)."""
    return config.dim * (4 if config.dtype == "float32" else 2) + 4 * config.state_floats + 24 + 23


def _cache_rows(config: StoreConfig, cache_bytes: int) -> int:
    """Rows that fit cache_bytes."""
    return cache_bytes // _row_bytes(config)


def _config_record(config: StoreConfig) -> dict:
    """What must match for a directory to reopen as this table (its storage aside)."""
    from cncore.tablefile import config_to_dict
    d = config_to_dict(dataclasses.replace(config, storage=None))
    d.pop("capacity", None)  # a hint, not part of the table
    return json.loads(json.dumps(d))  # as meta.json holds it (tuples as lists)


_TRIM = True  # malloc_trim after flushes and large spills (see _trim); off only to measure without


def _libc_trim():
    """glibc's malloc_trim, or None where there is none (musl, macOS)."""
    import ctypes
    try:
        return ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return None


_MALLOC_TRIM = _libc_trim()


def _trim() -> None:
    """Give the heap's free pages back to the system (glibc keeps freed blocks for reuse; after
    a large spill or a flush that is megabytes of eviction batches and scratch). 0.35-0.9 ms
    a call here (1.2-1.35 ms in cn-dlrm, whose heap holds torch's too), so not after every step:
    after a flush or compaction, and when the process's tiered stores have spilled 1/16 of their
    caches (_HeapTrim). Without it, a table 10x a 32 MiB cache under Zipf 1.05 IDs crept from 72
    to 84 MiB over 90 steps in some runs (freed eviction batches kept in the heap, fragmented).
    Rejected (round 4, 300-step runs): the eviction's row buffers mapped and unmapped directly
    instead (no trim needed for them): page faults 57k trimmed heap -> 67k mapped untrimmed,
    105k mapped and trimmed; and trimming 4x less often: no faster, the 3x store peak 41.3-42.0
    -> 42.4-42.6 MiB."""
    if _TRIM and _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
        _HEAP_TRIM.trimmed()


class _HeapTrim:
    """When the spills call malloc_trim: once the process's tiered stores together have spilled
    as many bytes as 1/16 of their caches together (each store's share, `_trim_every`: 4
    eviction rounds of its rows). The heap is the process's, so the trigger is too. Until round
    5 each store counted its own spills: cn-dlrm's 26 tables then trimmed 26x as often as one
    store of their total cache would (0.28 trims a step of 1.2-1.35 ms, ~10% of the job's
    samples/s), for the same freed bytes. A single store trims exactly as before.

    Plain counts under a reentrant lock: a store's __del__ (close, then `discard`) may run from
    a garbage collection inside any allocation, also one made while the lock is held.

    >>> h = _HeapTrim(); h.spilled(100); h.due()   # no store: never due
    False
    """

    def __init__(self):
        self._lock = threading.RLock()
        self._shares = {}  # id(store) -> its share (bytes), for the live stores
        self._every = 0    # their sum
        self._bytes = 0    # spilled by all of them since the last trim

    def add(self, store) -> None:
        with self._lock:
            self.discard(store)
            self._shares[id(store)] = store._trim_every
            self._every += store._trim_every

    def discard(self, store) -> None:
        with self._lock:
            self._every -= self._shares.pop(id(store), 0)

    def spilled(self, nbytes: int) -> None:
        with self._lock:
            self._bytes += nbytes

    def due(self) -> bool:
        """Whether to trim now (then the count starts over)."""
        with self._lock:
            if not self._shares or self._bytes <= self._every:
                return False
            self._bytes = 0
            return True

    def trimmed(self) -> None:
        """A flush or compaction trimmed: the count starts over."""
        with self._lock:
            self._bytes = 0


_HEAP_TRIM = _HeapTrim()


def record_layout(config: StoreConfig, version: int = _VERSION):
    """(record dtype, records per 4 KiB page) of a tier of `config` in directory format `version`.

    From version 3 a row is stored at its dtype's size (float16 as <f2, bfloat16 as the <u2 bit
    patterns, as table files store them: cncore.row_codec), so a 16-bit table's records are
    smaller: at dim 64 with row-wise Adagrad, 152 bytes instead of 280 (26 a page, not 14),
    and every spill, read and flush moves 46% fewer bytes.

    From version 4 a record's last 4 bytes ("check") hold the checksum of the bytes before them
    (cn_tier_sum, cn_tier.h), written with the record and checked at every read: where the
    fields leave 4 bytes of padding (dim 64 with row-wise Adagrad: 276 bytes of data in 280) it
    costs no space, else 8 bytes a record."""
    from cncore.row_codec import FILE_DTYPES
    row = FILE_DTYPES[config.dtype].str if version >= 3 else "<f4"
    fields = [("key", "<i8"), ("count", "<u4"), ("last_step", "<u4"), ("row", row, (config.dim,))]
    if config.state_floats:
        fields.append(("state", "<f4", (config.state_floats,)))
    packed = np.dtype(fields)
    # Records packed to 8 bytes (the key stays aligned), not to 64: at dim 64 with row-wise
    # Adagrad, 276 bytes of data took 320 bytes (12 a page) and now 280 (14 a page), so every
    # spill and flush writes 12% fewer bytes and the file is 12% smaller; a record is read
    # into a buffer, so its alignment in the file buys nothing.
    check = version >= 4
    rec = -(-(packed.itemsize + 4 * check) // 8) * 8
    if rec > _PAGE:
        rec = -(-rec // _PAGE) * _PAGE   # a record of its own pages
    names, formats = list(packed.names), [packed.fields[n][0] for n in packed.names]
    offsets = [packed.fields[n][1] for n in packed.names]
    if check:
        names, formats, offsets = names + ["check"], formats + ["<u4"], offsets + [rec - 4]
    record = np.dtype({"names": names, "formats": formats, "offsets": offsets, "itemsize": rec})
    return record, max(1, _PAGE // rec)


def check_offset(record: np.dtype) -> int:
    """Where a record of this layout holds its checksum (0: none, before version 4)."""
    return record.fields["check"][1] if "check" in record.names else 0


def rows_of(rec: np.ndarray, dtype: str) -> np.ndarray:
    """The rows of records as float32 (a new array), whatever width the records store."""
    if rec.dtype["row"].base == np.float32:
        return np.ascontiguousarray(rec["row"])
    return decode_rows(rec["row"], dtype)


def record_offsets(slots: np.ndarray, rec: int, per_page: int) -> np.ndarray:
    """File offsets of the records at `slots` (a record never straddles a page): the C
    formula the writer uses (cn_tier_offset, through _core.record_offsets), so that reads and
    writes cannot disagree."""
    return _core.record_offsets(slots, rec, per_page)


def records_end(slots: np.ndarray, rec: int, per_page: int) -> int:
    """Bytes rows.dat must have for the records at `slots` (0 for none)."""
    if not len(slots):
        return 0
    return int(record_offsets(np.array([np.max(slots)]), rec, per_page)[0]) + rec


def record_error(directory: str, raw: np.ndarray, key: int, slot: int, what_next: str):
    """The TableFormatError of a record (raw: its bytes) that check_records refused: another key
    in the slot, or a checksum that does not match."""
    from cncore.tablefile import TableFormatError
    held = int(np.ascontiguousarray(raw[:8]).view(np.int64)[0])
    if held != key:
        return TableFormatError(f"{directory}: rows.dat holds key {held} in slot {slot}, the index says {key}: "
                                f"the file is damaged or was written by another process; {what_next}")
    return TableFormatError(f"{directory}: rows.dat: the record of key {key} in slot {slot} fails its checksum "
                            f"(the file is damaged); {what_next}")


def _replaced(directory: str, meta_fd: int) -> bool:
    """Whether the directory's meta.json is no longer the file open at meta_fd: a flush replaced
    it (by a rename; the open descriptor keeps the old inode's number from being reused)."""
    try:
        now = os.stat(os.path.join(directory, "meta.json"))
    except FileNotFoundError:
        return True
    was = os.fstat(meta_fd)
    return (now.st_ino, now.st_dev) != (was.st_ino, was.st_dev)


def _close_fds(*fds) -> None:
    for fd in fds:
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass


_OPEN_TRIES = 20  # a TierFile's opens that a concurrent flush may restart


def _meta_digest(meta: dict) -> str:
    """The checksum meta.json carries of its other fields (from version 4): SHA-256 of them as
    canonical JSON (sorted keys), so that a changed count or step is refused, not taken."""
    fields = {k: v for k, v in meta.items() if k != "meta_sha256"}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def _sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def read_flushed(directory: str, error=ValueError, prefix: str = ""):
    """(meta, keys, slots) of the last flush of a tier directory: meta.json parsed and checked,
    the index checksummed. Raises `error` (its message starting with `prefix`) saying what is
    wrong: no meta.json (never flushed), damage, another format or version."""
    meta_path = os.path.join(directory, "meta.json")
    try:
        with open(meta_path) as fh:
            meta = json.load(fh)
    except FileNotFoundError:
        raise error(f"{prefix}{directory} holds no flushed table (no meta.json: the tier was never flushed, or its "
                    "first flush did not finish); TieredStore.flush() makes the directory a table") from None
    except (ValueError, UnicodeDecodeError) as exc:  # written whole by one rename: damage, not a crash
        raise error(f"{prefix}{meta_path} is not valid JSON ({exc}); the tier is damaged") from None
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT or meta.get("version") not in _READS:
        version = meta.get("version") if isinstance(meta, dict) else None
        raise error(f"{prefix}{meta_path} is not a {_FORMAT} directory of version {' or '.join(map(str, _READS))} "
                    f"(version {version!r}: export it with the version of cncore that wrote it)")
    missing = [k for k in _META_FIELDS + (("meta_sha256",) if meta["version"] >= 4 else ()) if k not in meta]
    if not missing and meta["version"] >= 4 and meta["meta_sha256"] != _meta_digest(meta):
        raise error(f"{prefix}{meta_path} fails its checksum (damaged)")
    if missing or not isinstance(meta["index"], str) or not isinstance(meta["config"], dict) \
            or not all(isinstance(meta[k], int) for k in _META_FIELDS if k not in ("config", "index", "index_sha256")):
        raise error(f"{prefix}{meta_path} lacks or mistypes fields ({missing or 'index, config or a count'}); "
                    "the tier is damaged")
    index_path = os.path.join(directory, meta["index"])
    try:
        with open(index_path, "rb") as fh:  # one descriptor: the bytes checked are the bytes loaded
            digest = hashlib.sha256()
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
            if digest.hexdigest() != meta.get("index_sha256"):
                raise error(f"{prefix}{index_path} fails its checksum (damaged)")
            fh.seek(0)
            with np.load(fh) as index:
                keys, slots = index["keys"], index["slots"]
    except FileNotFoundError:
        raise error(f"{prefix}{index_path} is missing (meta.json names it; the tier is damaged)") from None
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as exc:
        if isinstance(exc, error):
            raise
        raise error(f"{prefix}{index_path} cannot be read ({exc}); the tier is damaged") from None
    return meta, keys, slots


class TieredStore(EmbeddingStore):
    """An `EmbeddingStore` whose rows live on disk under a bounded memory cache (see the module
    docstring). Built by `EmbeddingStore(config)` when `config.storage` is a `Tiered`."""

    def __init__(self, config: Optional[StoreConfig] = None, **config_fields):
        if config is None:
            config = StoreConfig(**config_fields)
        storage = config.storage
        if not isinstance(storage, Tiered):
            raise TypeError(f"config.storage must be a cncore.Tiered, got {type(storage).__name__}")
        if config.max_rows is not None:
            raise ValueError("max_rows: a tiered table keeps every row (on disk); its memory is bounded by "
                             "Tiered.cache_bytes instead")
        self._tier_config = config
        self._lock = threading.RLock()  # the tiers' state: cache membership, disk index, slots, file
        # Why every verb is refused (closed, or inherited by a forked child), or None; set while
        # the store is being built, so that a half-built store refuses too.
        self._unusable = "the store is not open (its construction failed)"
        self._fd = self._dir_fd = None  # rows.dat, and the directory (its lock: _lock_directory)
        self._prefetching = None  # the Future of this store's prefetch read
        self._staged = None       # its result: (commit, sorted keys, slots, records)
        self._stage_job = None    # its shared reads (_core.StageJob)
        self._prefound = None     # the prefetch's find of its keys in the cache (_cache_find)
        self._job_is_this_calls = False  # in a fault-in whose keys are the running prefetch's (_spill_slots)
        self._unindexed = None  # (keys, slots) loaded into memory, still indexed on disk (_erase_behind)
        self._erasing = None    # the background task erasing the last batch handed over (its Future)
        self._erase_behind_at = _ERASE_BEHIND_AT  # (tests set it to 1)
        self._find_on_disk_here = _FIND_ON_DISK_HERE  # (tests set it to 0)
        self._job_has_all = False  # the running prefetch's job was handed every ID missing from memory
        self.cache_rows = _cache_rows(config, storage.cache_bytes)
        self._evict_chunk = max(_IO_ROWS, self.cache_rows // 64)
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
        self._check_directory()
        super().__init__(cache)
        self._version = _VERSION  # of the directory's layout: a version 2 directory stays one
        self._layout()
        # Keys on disk -> slot (cn_slotindex.h: the core's hash index alone, 23-46 bytes a key).
        self._disk = _core.SlotIndex()
        self._high_water = 0                       # slots ever used: the file's record count
        self._free_pages = np.empty(0, np.int64)   # whole free pages, their slots taken in order
        self._page_cursor = 0                      # slots taken from them so far
        self._flushes = 0  # flush() calls over the directory's life (meta.json "flush")
        self._commits = 0  # index versions written (a compaction commits a second one)
        self.stats = {"hits": 0, "misses": 0, "new": 0, "rows_read": 0, "rows_written": 0, "bytes_read": 0,
                      "bytes_written": 0, "flushes": 0, "bytes_written_by_flush": 0, "bytes_written_by_compaction": 0,
                      "compactions": 0}
        os.makedirs(self._dir, exist_ok=True)  # its parent exists (_check_directory)
        self._lock_directory()
        try:
            flushed = self._last_flush()  # checked before anything in the directory is written
            self._fd = _open_rows(os.path.join(self._dir, "rows.dat"))
            if flushed is not None:
                self._reopen(*flushed)
            self._write_pid()
        except BaseException:
            self._release_directory()
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
        self._writer = _core.RecordWriter(self._fd, self._layout_fields(), self._disk, self._spill_slots,
                                          self._io_threads, _IO_ROWS)
        self._table.evict_sink = self._writer
        # Write-behind: the rows the cache evicts are written by the background thread, not by
        # the call that evicted them (RecordWriter.behind, SpillJob); see _write_behind.
        self._pending = []  # queued spills, oldest first: [job, its Future or None]
        self._writer.behind = self._write_behind
        _HEAP_TRIM.add(self)
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

    def _rows_of(self, rec: np.ndarray) -> np.ndarray:
        return rows_of(rec, self._tier_config.dtype)

    def _layout(self) -> None:
        self._record, self._per_page = record_layout(self._tier_config, self._version)

    def _layout_fields(self) -> tuple:
        """The record layout as RecordWriter takes it (cn_tier_layout)."""
        from cncore.config import ROW_DTYPES
        r, f = self._record, self._record.fields
        row_code = 0 if r["row"].base == np.float32 else ROW_DTYPES[self._tier_config.dtype]
        return (r.itemsize, self._per_page, self.dim, self._tier_config.state_floats, row_code,
                f["count"][1], f["last_step"][1], f["row"][1], f["state"][1] if "state" in f else 0,
                check_offset(r))

    def _offsets(self, slots: np.ndarray) -> np.ndarray:
        return record_offsets(slots, self._record.itemsize, self._per_page)

    def _keep_spare(self, rec: np.ndarray) -> None:
        """Keep a record buffer for the next read (a new 400 KiB one faulted in its pages at
        every step of a Zipf run), if it is at most 1/32 of the cache."""
        base = rec if rec.base is None else rec.base
        if isinstance(base, np.ndarray) and base.dtype == self._record and base.ndim == 1 \
                and base.nbytes <= self._tier_config.storage.cache_bytes // 32:
            self._spare = base

    def _buffer(self, n: int) -> np.ndarray:
        """n records' room: the spare buffer of the last fault-in if large enough (every byte is
        then read from the file), else a new one."""
        spare, self._spare = getattr(self, "_spare", None), None
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
        """Write a batch's rows as records at slots (the writer packs them in C, _IO_ROWS at a
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

    # --- slots ---------------------------------------------------------------------------------

    # Log-structured: a spill's records go to whole free pages (in order) and then to the end of
    # the file, so that they form long runs, one pwritev each. Reusing single free slots scattered
    # over the file cost 10x per record (2,500 records of 320 bytes: 3.4 ms scattered, 0.3 ms in a
    # run, page cache, this machine). The holes that leaves (slots freed in pages still partly in
    # use) are closed by compaction, which flush() runs when the file exceeds compact_ratio x the rows it
    # holds, and compact() on demand.

    def _take_slots(self, n: int) -> np.ndarray:
        """n slots no live row and no row of the last flush uses, as contiguous as can be."""
        i = np.arange(self._page_cursor, min(self._page_cursor + n, len(self._free_pages) * self._per_page))
        got = self._free_pages[i // self._per_page] * self._per_page + i % self._per_page
        self._page_cursor += len(got)
        fresh = n - len(got)
        out = np.concatenate([got, np.arange(self._high_water, self._high_water + fresh, dtype=np.int64)])
        self._high_water += fresh
        return out

    def _release(self, slots: np.ndarray) -> None:
        """Slots of rows that left the disk: free for the allocation after the next flush (a
        slot the last flush refers to must not be written before the next one)."""

    def _plan_free(self, slots: np.ndarray) -> None:
        """After a flush (slots: every slot its index refers to): the whole pages below the high
        water that no row uses become the next spills' slots. Kept as pages (8 bytes a page):
        a list of free slots with its masks took 8-16 bytes a slot of the file, which made a
        flush's peak memory grow with the file rather than with the index."""
        full_pages = self._high_water // self._per_page
        used = np.bincount(slots // self._per_page, minlength=full_pages)[:full_pages]
        self._free_pages = np.flatnonzero(used == 0).astype(np.int64)
        self._page_cursor = 0

    # --- moving rows between the tiers ------------------------------------------------------------

    def _spill_slots(self, n: int) -> np.ndarray:
        """The writer's allocator: slots for the n rows the cache is evicting (the writer then
        writes them there and puts their keys in the disk index), counted as written."""
        if self._fd is None:  # closed: the writer's descriptor is -1 (never a reused number)
            raise OSError(errno.EBADF, f"writing evicted records: {os.strerror(errno.EBADF)} ({self._dir} was closed)")
        if self._prefetching is not None and not self._job_is_this_calls:
            # A prefetch's find must not see the keys this spill indexes (their records are
            # written behind, after it: _write_behind). Not needed while the running prefetch
            # is the current fault-in's own (_job_is_this_calls): its job looks up only keys of
            # this call that are not in memory (missing at its find, the cache's keys unchanged
            # since), and an eviction in this call takes only rows in memory that the call does
            # not use, so no key this spill indexes is one the job looks up.
            try:
                self._wait_prefetch()
            except RuntimeError:  # its read failed: nothing staged (the call reads, and reports, itself)
                self._staged = None
        _HEAP_TRIM.spilled(n * _row_bytes(self._tier_config))
        self.stats["rows_written"] += n
        self.stats["bytes_written"] += n * self._record.itemsize
        return self._take_slots(n)

    def _write_behind(self, job) -> None:
        """The writer's `behind`: queue a spill's write (a SpillJob, owning the evicted rows) on
        the background thread, once the writer has indexed its keys on disk. Called with the GIL
        and the store's lock held, from the eviction of a call. Never raises (the keys are
        indexed already): a job that cannot be queued is written by the next _wait_writes.

        Why: the training thread wrote every evicted record itself (pack, then pwritev into the
        page cache: 0.5-0.7 ms of a 3x Zipf 1.05 step's 1,440 records, asv_bench/scripts/
        tiered_bench.py), while the machine's other core idled. Safe because:
        - a read of the file on this thread waits for the queued writes first (_read);
        - a prefetch's read runs on the same background thread after the writes queued before
          it, and a prefetch still running is waited for before a spill indexes its keys
          (_spill_slots), so its find never sees a key whose record is queued after it;
        - a flush waits for them before its fsync, and a write lands only on a slot the last
          flush does not refer to (as before), so a crash with writes queued leaves the last
          flush; a fork first lets the background thread finish (_drain_prefetcher).
        Memory: at most two eviction rounds' rows wait (2 x (headroom + a fault-in round), 2.8
        MiB at a 32 MiB cache); more, and this waits for the oldest first."""
        self._reap_writes()
        bound = 2 * (self._config.headroom + self._evict_chunk)
        try:
            while self._pending and self._pending_rows + len(job) > bound:
                self._wait_oldest_write()
        except OSError:  # an older write failed again: this one waits behind it (raised by _wait_writes)
            pass
        try:
            future = _submit_write(job)
        except RuntimeError:  # the executor is shut down (interpreter exit): written by _wait_writes
            future = None
        self._pending.append([job, future])

    @property
    def _pending_rows(self) -> int:
        """Rows of the queued spills (at most a few jobs: derived, not kept)."""
        return sum(len(job) for job, _ in self._pending)

    def _reap_writes(self) -> None:
        """Forget the queued spills that the background thread has written."""
        while self._pending and self._pending[0][0].written:
            self._pending.pop(0)

    def _wait_oldest_write(self) -> None:
        """Wait for the oldest queued spill; a failed (or never queued) write is run again here.
        Raises OSError if it fails again; its rows stay queued (in memory) for the next try."""
        job = self._pending[0][0]
        _settle(self._pending[0])
        if not job.written:
            # Retried here, through the writer's buffer, which this store's later jobs on the
            # background thread use too: those end first.
            for entry in self._pending[1:]:
                _settle(entry)
            job.run()
        if not job.written:
            raise OSError(job.err, f"{self._dir}/rows.dat: writing {len(job)} evicted rows failed "
                                   f"({os.strerror(job.err)}); they are kept in memory and written by the next "
                                   "call that reads the file or flushes; the table is unchanged")
        self._pending.pop(0)

    def _wait_writes(self) -> None:
        """Wait until every queued spill is in the file (before a read on this thread, a flush,
        close). Raises OSError if one cannot be written (its rows stay in memory, queued)."""
        while self._pending:
            self._wait_oldest_write()

    def _fault_in(self, keys, insert: bool) -> Optional[np.ndarray]:
        """_fault_in_rows; whatever happens, the running prefetch is no longer the call's own
        after it (_job_is_this_calls: later spills wait for the job again). Then the heap is
        trimmed if the process's tiered stores have spilled enough since the last trim
        (_HeapTrim: every verb's spills count, and every verb faults in first)."""
        try:
            found = self._fault_in_rows(keys, insert)
        finally:
            self._job_is_this_calls = False
        if _HEAP_TRIM.due():
            _trim()
        return found

    def _fault_in_rows(self, keys, insert: bool) -> Optional[np.ndarray]:
        """Bring the keys on disk into the cache (and, with insert, give the absent ones their
        initial rows), evicting only rows the call does not use. Returns, when every key has a
        row in memory now, its find's slots (-1 for the keys it brought in): the call's lookup
        pools them without finding the cached keys again (_core.grouped_forward's found_slots;
        valid while the store's lock is held). Else None (keys the call's own lookup inserts, or
        not admitted).

        The common case, every key in memory, costs one batched find over the keys as given
        (duplicates and all): np.unique over a step's 16k IDs took 1.3 ms, more than the
        in-memory step's whole lookup, so only the keys missing from memory are made unique."""
        keys = as_keys(keys)
        if not len(keys):
            return None
        cache_slots, cached = self._cache_find(keys)
        n_cached = int(np.count_nonzero(cached))
        self.stats["hits"] += n_cached
        if n_cached == len(keys):
            return cache_slots
        n_disk = self._own_plan()
        if n_disk is None:
            disk_keys, slots, absent_new, misses = self._missing_rows(keys, cached)
            n_disk = len(disk_keys)
        else:  # every ID missing from memory is on disk, and this call's prefetch reads them
            disk_keys = slots = None  # its keys and slots, taken after its reads
            absent_new, misses = keys[:0], len(keys) - n_cached
        self.stats["misses"] += misses
        if insert:
            self.stats["new"] += len(absent_new)
            if len(keys) > self.cache_rows:
                self._check_fits(keys)
        # New keys take room too; with admission they may not be admitted (find_or_insert is
        # not gated, so making their rows here would give a row that admission may refuse): the
        # call's own training lookup counts them in the sketch, each once as in memory, and
        # makes room for those admitted.
        new_keys = absent_new if insert and self._tier_config.admission is None else absent_new[:0]
        if not n_disk and len(new_keys) <= self._evict_chunk:
            return None  # the call's own find_or_insert makes the new rows (one round)
        if n_cached + n_disk + len(new_keys) > self.cache_rows:  # (IDs, not keys: a cheap bound first)
            if disk_keys is None:
                disk_keys, slots, _, _ = self._missing_rows(keys, cached)
            self._check_fits(np.concatenate([keys[cached], disk_keys, new_keys]))
        # The disk rows go straight into the cache (RecordWriter / Table.load_records, one C call
        # a round: cn_tier.h), which makes their room as an insert does, evicting only rows the
        # call does not use (the call's cached rows and the rounds before are pinned, by the
        # slots found above, so no round finds the call's keys again). In rounds
        # of `_evict_chunk` rows: the core evicts what one call needs in one batch, so a step
        # bringing in 16k rows held 8.6 MiB of evicted rows at once at dim 64, most of a 32 MiB
        # cache's peak RSS overshoot; a round of 1/64 of the cache holds 3% of it. With room
        # for them (the cache evicts in rounds of `headroom` rows, so most steps find room)
        # nothing is pinned.
        step = self._evict_chunk
        if n_disk:
            room = EmbeddingStore.__len__(self) + n_disk <= self.cache_rows  # then nothing is evicted
            if not room and n_disk <= step and self._job_is_this_calls:
                # One round, and the running prefetch is this call's: its room is made now, before
                # waiting for the job's reads, which go on meanwhile (the spill needs not wait for
                # the job: _spill_slots). An eviction round is ~1.3 ms of the training thread's
                # (a 3x Zipf 1.05 step, one in ~3.5), during which the job read what the training
                # thread otherwise read beside it after the wait (_take_staged).
                self._table.make_room(n_disk, cache_slots[cached])
                room = True
            staged = self._take_staged()
            if disk_keys is None:  # the plan's: the keys the job read, in key order, and their slots
                if staged is not None and len(staged[0]) == n_disk:
                    disk_keys, slots = staged[0], staged[1]
                else:  # its records are no longer current (a flush since): found here
                    disk_keys, slots, _, _ = self._missing_rows(keys, cached)
            pin = cache_slots[:0] if room else cache_slots[cached]
            # Read and loaded a round at a time: a uniform step at 10x brings in 14.7k rows, and
            # its records read at once held 4 MiB beside the cache (half the store's peak over
            # cache + disk index). A round's keys leave the disk index once loaded, so that an
            # error in a later round leaves every row in one tier (a fault-in of one round leaves
            # that erase to the background thread: _erase_behind).
            for a in range(0, len(disk_keys), step):
                k, at = disk_keys[a:a + step], slots[a:a + step]
                rec = self._read_current(k, at, staged)
                if staged is not None and a + step < len(disk_keys) and k[-1] >= staged[0][-1]:
                    # Past the prefetch's keys (sorted, as the rounds are): its buffer serves the
                    # later rounds' reads (_buffer) rather than staying beside a new one.
                    self._keep_spare(staged[2])
                    staged = None
                raw = rec.view(np.uint8).reshape(len(rec), -1)
                self._check_records(raw, k, at)
                loaded = self._table.load_records(self._writer, raw, k, pin)
                if len(disk_keys) <= step and len(k) >= self._erase_behind_at:
                    self._erase_behind(k, at)
                else:
                    self._disk.erase(k)
                self._release(at)
                if a + step < len(disk_keys) and not room:
                    pin = np.concatenate([pin, loaded])
                if staged is None:
                    self._keep_spare(rec)
                del rec, raw
            if staged is not None:
                self._keep_spare(staged[2])
            del staged
            self._writes += 1
        # New keys (more than one round of them): their room in rounds too, by find_or_insert of
        # the call's cached keys, its disk rows and the new keys so far (their initial rows).
        if len(new_keys) > step and EmbeddingStore.__len__(self) + len(new_keys) > self.cache_rows:
            base = np.concatenate([keys[cached], disk_keys])
            for end in range(step, len(new_keys) + step, step):
                EmbeddingStore.find_or_insert(self, np.concatenate([base, new_keys[:end]]))
        if len(absent_new):
            return None  # keys with no row yet: the call's lookup finds (and makes) them
        # Every key has a row in memory now: the cached ones where the find above gave it (pinned,
        # or nothing was evicted); the loaded ones keep -1, which the core lookup finds (mapping
        # the loaded slots back to the IDs here took 0.13 ms a 3x Zipf 1.05 step).
        return cache_slots

    def _missing_rows(self, keys: np.ndarray, cached: np.ndarray):
        """Of the keys missing from memory (~cached): those on disk (distinct, in key order),
        their slots, the distinct others, and how many of the IDs are disk keys (with repeats)."""
        return self._disk.missing(keys, cached.view(np.uint8))

    def _own_plan(self) -> Optional[int]:
        """The rows on disk of a fault-in whose running prefetch is its own, from that prefetch's
        find, so that it does not find them itself (np.unique and the disk index's find of its
        ~1.5k missing IDs: 0.13-0.16 ms of a 3x Zipf 1.05 step). Only when the job was handed
        every ID missing from memory (more than _FIND_ON_DISK_HERE of them), has found them
        (StageJob.plan: never waits), found every distinct one on disk (no new keys), reads all
        of them (within its cap), and the disk index is unchanged since its find (its version:
        an erase, say, of a key it found; a spill since would have changed the cache's keys,
        and the find would not have matched). Else None."""
        job = self._stage_job
        if not (self._job_is_this_calls and self._job_has_all) or job is None:
            return None
        plan = job.plan()
        if plan is None:
            return None
        n_distinct, n_found, m, version = plan
        if n_found != n_distinct or m != n_found or version != self._disk.version:
            return None
        return m

    def _cache_find(self, keys: np.ndarray):
        """(slots, found) of keys in the cache: the prefetch's find of the same keys when the
        cache's keys have not changed since (the table's version: a fresh stamp at every insert,
        eviction, erase or rehash), else a find now. Taken once; kept across calls with other
        keys that leave the cache's keys as they are."""
        pre = self._prefound
        if pre is not None and pre[0] != self._table.version:
            pre = self._prefound = None
        if pre is not None and _core.same_int64(pre[1], keys):
            self._prefound = None
            self._job_is_this_calls = True  # (until the fault-in ends: _fault_in)
            return pre[2], pre[3]
        return EmbeddingStore.find(self, keys)

    def _erase_behind(self, keys: np.ndarray, slots: np.ndarray) -> None:
        """Leave the disk index's erase of keys just loaded into memory (from `slots`) to the
        background thread: the next prefetch hands it over after its read job, so it never
        delays the reads a call waits for (0.16-0.19 ms of the training thread's 3x Zipf 1.05
        step, 1.4k keys, each a cache miss in the disk index). Only a fault-in of one round.

        Until it runs, such a key is in memory and still indexed at its old slot. Nothing looks
        a key in memory up on disk except the verbs over the whole table (len, export, flush,
        erase, clear, close), which first wait for it (_settle_erase). A key evicted meanwhile is
        indexed anew at another slot (a slot is never reused before a flush), which erase_at
        leaves in place. At most two batches are outstanding (the last one handed over, and one
        not yet handed): the disk index's reservation allows for them (disk_keys_at_most)."""
        if self._unindexed is not None:  # no prefetch since the last batch: it goes here
            self._disk.erase_at(*self._unindexed)
        self._unindexed = (keys, slots)

    def _hand_erase(self) -> None:
        """Queue the batch of _erase_behind on the background thread (after the prefetch's read
        job, just handed in). The batch before it, handed over at the previous prefetch, ran
        after that prefetch's reads, which the call since waited for: waited for here (almost
        never still running), so that at most one batch is queued."""
        batch, self._unindexed = self._unindexed, None
        if batch is None:
            return
        if self._erasing is not None:
            self._erasing.result()
        try:
            self._erasing = _prefetcher().submit(self._disk.erase_at, *batch)
        except RuntimeError:  # the executor is shut down (interpreter exit): here, then
            self._erasing = None
            self._disk.erase_at(*batch)

    def _settle_erase(self) -> None:
        """Every erase of _erase_behind done (before a verb that reads the whole disk index)."""
        task, self._erasing = self._erasing, None
        if task is not None:
            task.result()
        batch, self._unindexed = self._unindexed, None
        if batch is not None:
            self._disk.erase_at(*batch)

    @contextlib.contextmanager
    def faulted_in(self, keys, insert: bool):
        """A context in which `keys` are in the memory cache (with `insert`, absent keys get
        their initial rows) and no other thread moves rows between the tiers: run a core lookup
        of these keys inside it (what `grouped_pooled_lookup` and the torch modules do). It
        gives the cache slot of every key, or None (see _fault_in)."""
        with self._lock:
            self._check_usable()
            yield self._fault_in(keys, insert)

    def _check_usable(self) -> None:
        """Refuse a verb of a closed store, or of a forked child's copy (ValueError)."""
        if self._unusable is not None:
            raise ValueError(self._unusable)

    def apply_gradients(self, ctx, grad_output, *, lr: Optional[float] = None) -> None:
        self._check_usable()
        super().apply_gradients(ctx, grad_output, lr=lr)

    def accumulate_gradients(self, ctx, grad_output):
        self._check_usable()
        return super().accumulate_gradients(ctx, grad_output)

    def __repr__(self) -> str:
        if self._unusable is not None:
            return f"TieredStore(path={self._dir!r}, unusable: {self._unusable})"
        return f"TieredStore(rows={len(self)}, path={self._dir!r}, cached={self.cached_rows}, config={self._config})"

    @_locked
    def evict(self, n: int) -> int:
        """Move the `n` lowest-scoring cached rows to disk now; returns how many."""
        return super().evict(n)

    @_locked
    def evict_expired(self) -> int:
        return super().evict_expired()

    @_locked
    def evict_if(self, predicate, *, batch_size: int = 65536) -> int:
        """As EmbeddingStore.evict_if, over the cached rows (the rows go to disk). Under the
        store's lock: the spill's writer has one buffer."""
        return super().evict_if(predicate, batch_size=batch_size)

    @_locked
    def decay_admission(self) -> None:
        """Halve every counter of the admission sketch (MinCount). The sketch counts the
        sightings of keys that have no row, in memory or on disk; it lives in memory only, so
        reopening a tier's directory starts it over (as loading a table file does)."""
        super().decay_admission()

    def _check_fits(self, keys: np.ndarray) -> None:
        distinct = len(np.unique(keys))
        if distinct > self.cache_rows:
            raise ValueError(f"keys: this call uses {distinct} distinct keys, more than the cache's "
                             f"{self.cache_rows} rows (Tiered.cache_bytes={self._tier_config.storage.cache_bytes}); "
                             "give a larger cache_bytes or smaller batches. The table is unchanged")

    # --- the verbs of a store ------------------------------------------------------------------

    @property
    def config(self) -> StoreConfig:
        """The config the store was built with (its storage included)."""
        return self._tier_config

    @property
    def record_bytes(self) -> int:
        """Bytes of one record in the file (key, count, last step, row, optimizer state)."""
        return self._record.itemsize

    def disk_keys_at_most(self, rows: int) -> int:
        """The most keys the disk index holds at once in a table of `rows` rows: all but the
        cache's low-water mark (eviction takes the cache down to max_rows - headroom), plus one
        round of a fault-in's loads (its keys leave the disk index after they are loaded, and
        the rows evicted to make their room are indexed on disk before that), plus two rounds
        whose erase is left to the background thread and may not have run yet (_erase_behind)."""
        low_water = self.cache_rows - self._config.headroom  # the cache's own config
        return max(0, int(rows) - low_water + 3 * self._evict_chunk)

    @property
    def disk_index_bytes(self) -> int:
        """Memory the index of the rows on disk takes (its buckets)."""
        return self._disk.nbytes

    @property
    def cached_rows(self) -> int:
        """Rows in memory now."""
        return EmbeddingStore.__len__(self)

    @_locked
    def __len__(self) -> int:
        self._settle_erase()
        return EmbeddingStore.__len__(self) + len(self._disk)

    def __reduce__(self):
        raise TypeError("a TieredStore does not pickle: flush() it and reopen the directory with its config")

    @_locked
    def find(self, keys):
        self._fault_in(keys, insert=False)
        return super().find(keys)

    @_locked
    def contains(self, keys) -> np.ndarray:
        return EmbeddingStore.find(self, keys)[1] | (self._disk.find(as_keys(keys)) >= 0)

    @_locked
    def find_or_insert(self, keys):
        present = self.contains(keys)
        self._fault_in(keys, insert=True)
        slots, _ = super().find_or_insert(keys)
        return slots, present

    @_locked
    def insert_or_assign(self, keys, rows, optimizer_state=None) -> np.ndarray:
        self._fault_in(keys, insert=False)
        return super().insert_or_assign(keys, rows, optimizer_state)

    @_locked
    def assign(self, keys, rows, optimizer_state=None) -> np.ndarray:
        self._fault_in(keys, insert=False)
        return super().assign(keys, rows, optimizer_state)

    @_locked
    def load(self, keys, rows, optimizer_state=None, counts=None, last_steps=None) -> np.ndarray:
        """As EmbeddingStore.load, in chunks of half the cache (restoring a table larger than the
        cache spills as it goes)."""
        keys = as_keys(keys)
        step = max(1, self.cache_rows // 2)
        if len(keys) <= step:
            self._fault_in(keys, insert=False)
            return super().load(keys, rows, optimizer_state, counts, last_steps)
        # Every argument checked before the first chunk changes the table (as EmbeddingStore's
        # _upsert checks them).
        from cncore.store import _u32
        n = len(keys)
        rows = as_floats(rows, "rows", (n, self.dim))
        if optimizer_state is not None:
            optimizer_state = as_floats(optimizer_state, "optimizer_state", (n, self._tier_config.state_floats))
        counts, last_steps = _u32(counts, "counts", n), _u32(last_steps, "last_steps", n)
        # As in memory, `found` says which keys had a row before the call: a key given twice
        # (in two chunks) is not found the second time because the first chunk loaded it.
        found = self.contains(keys)
        for a in range(0, n, step):
            part = slice(a, a + step)
            self.load(keys[part], rows[part], None if optimizer_state is None else optimizer_state[part],
                      None if counts is None else counts[part], None if last_steps is None else last_steps[part])
        return found

    @_locked
    def erase(self, keys) -> np.ndarray:
        self._settle_erase()
        erased = super().erase(keys)
        arr = as_keys(keys)
        on_disk = self._disk.find(arr) >= 0
        if on_disk.any():
            first = np.zeros(len(arr), bool)
            first[np.unique(arr, return_index=True)[1]] = True  # a repeated key is erased once
            erased = erased | (on_disk & first)
            gone = np.unique(arr[on_disk])
            self._release(self._disk.erase(gone))
        return erased

    @_locked
    def clear(self) -> None:
        self._settle_erase()
        super().clear()
        self._disk.clear()

    @_locked
    def reserve(self, n_rows: int) -> None:
        super().reserve(min(int(n_rows), self.cache_rows))

    @_locked
    def lookup(self, keys, *, insert_missing: bool = False) -> np.ndarray:
        """As EmbeddingStore.lookup; more keys than the cache holds go in chunks of half the
        cache (the rows are copies, so a later chunk may send an earlier one's rows to disk)."""
        from cncore.grouped import as_flag
        insert = as_flag(insert_missing, "insert_missing")
        keys = as_keys(keys)
        step = max(1, self.cache_rows // 2)
        if len(keys) > step:
            return np.concatenate([self.lookup(keys[a:a + step], insert_missing=insert)
                                   for a in range(0, len(keys), step)]).reshape(len(keys), self.dim)
        self._fault_in(keys, insert=insert)
        if insert:
            EmbeddingStore.find_or_insert(self, keys)
        return EmbeddingStore.read(self, keys).rows

    @_locked
    def read(self, keys) -> TableBatch:
        """As EmbeddingStore.read; more keys than the cache holds go in chunks of half the cache."""
        keys = as_keys(keys)
        step = max(1, self.cache_rows // 2)
        if len(keys) > step:
            parts = [self.read(keys[a:a + step]) for a in range(0, len(keys), step)]
            return TableBatch(*(np.concatenate([getattr(p, f) for p in parts]) for f in
                                ("keys", "rows", "optimizer_state", "counts", "last_steps", "found")))
        self._fault_in(keys, insert=False)
        return super().read(keys)

    @_locked
    def prefetch(self, keys) -> None:
        """Hand in the next batch's keys early: a background thread finds those on disk and reads
        their records (one C call without the GIL) while the current step runs, and the call that next needs
        them takes those records instead of reading, if they are still current: the key still in
        the slot read, and no flush since (a slot is rewritten only after a flush frees it). One
        prefetch at a time per store: a new one first waits for the previous one. The reads of
        every tiered store of the process run on one background thread (each read is itself a
        batch over Tiered.io_threads): a thread per call cost cn-dlrm (26 tables) 1 ms a step to
        start them and 5 ms a step waiting on them, against each other and the step, for GIL.

        >>> import numpy as np, tempfile, os, cncore
        >>> s = cncore.EmbeddingStore(cncore.StoreConfig(dim=2, storage=cncore.Tiered(
        ...     os.path.join(tempfile.mkdtemp(), "t"), cache_bytes=16 * 60)))
        >>> for start in range(0, 100, 10):                        # most rows spill to disk
        ...     _ = s.lookup(np.arange(start, start + 10), insert_missing=True)
        >>> s.prefetch(np.arange(10)); _ = s.lookup(np.arange(10))
        >>> s.stats["prefetched"] > 0
        True
        """
        try:
            self._prefetch_keys(keys)
        finally:
            self._hand_erase()  # after the read job: the last fault-in's disk-index erase (_erase_behind)

    def _prefetch_keys(self, keys) -> None:
        """prefetch(), but for the erase it hands over."""
        # A copy: the caller may reuse its array while the background job reads it.
        keys = np.array(as_keys(keys), dtype=np.int64, copy=True)
        self._wait_prefetch()
        self._prefound = None
        self._stage_job, self._job_has_all = None, False
        if not len(keys):
            return
        # The keys are found in the cache here, and only those missing go to the background job;
        # the call that looks these keys up takes this find instead of its own while the cache's
        # keys are unchanged (the backward between them changes rows, not keys: _cache_find).
        # The job then deduplicates and finds in the disk index ~1.5k IDs, not 16k (~6.2k keys,
        # each a cache miss in the disk index): 0.4 ms less of its ~2.3 ms a 3x Zipf 1.05 step.
        slots, found = EmbeddingStore.find(self, keys)
        self._prefound = (self._table.version, keys, slots, found)
        keys = keys[~found]
        has_all = len(keys) > self._find_on_disk_here
        if not has_all:
            # A few missing IDs (cn-dlrm: 512 IDs a table a step, tens missing, mostly new keys):
            # the disk index is asked here (a few us), and a background job is handed in only for
            # keys on disk. 26 tables' jobs that found nothing cost the step their submits and
            # the background thread's wake-ups.
            keys = keys[self._disk.find(keys) >= 0]
        if not len(keys):
            return
        # The rest runs on the background thread, in one C call without the GIL
        # (RecordWriter.stage, cn_tier.h): which keys are on disk (one batched find of the disk
        # index, under its mutex), the distinct ones in key order, their reads. What it finds
        # is checked where it is used (_read_current takes a record only for the same key in the
        # same slot, with no flush since `commit`; between flushes a slot is written once,
        # before its key is indexed). Done here, on the caller's thread (the code before), the
        # find and np.unique of a 16k-ID step cost 0.45-0.65 ms of the ~1.0 ms of reads they hid;
        # done in Python on the background thread, their GIL-holding parts slowed the training
        # thread's backward from 1.2-1.9 to 2.6-4.4 ms (3x zipf-1.05, tiered_bench).
        writer, record, commit = self._writer, self._record, self._commits
        # At most 1/32 of the cache read ahead (the rest is read by the call, a round at a time):
        # a uniform step at 10x prefetched 14.7k records, 4 MiB held beside the cache.
        cap = min(len(keys), max(_IO_ROWS, self._tier_config.storage.cache_bytes // 32 // record.itemsize))
        buf = self._buffer(cap)
        # The job reads on its own thread (1), not on Tiered.io_threads of the core's pool: its
        # point is the core the training thread leaves idle, and pool workers it wakes compete
        # with the training thread for the cores it computes on (and spin 200 us after each
        # batch). 3x Zipf 1.05 (tiered_bench's step, prefetch on, this 2-core machine, load
        # 1.0-1.1, three alternated pairs): 3.41-4.39 ms a step on 1 thread against 5.22-6.02 on
        # 4, the backward 0.90-1.29 against 1.49-1.89 ms (its CPU time 0.90-1.28 either way).
        # A call needing the records before they are read reads the rest beside it (StageJob).
        # (On a real SSD more reads in flight would pay: not measured here, page-cache files.)
        threads = 1
        # Shared with this thread: a call that needs the records before they are all read reads
        # the rest alongside the background thread (StageJob.help, cn_tier_share in cn_tier.h).
        job = self._stage_job = _core.StageJob()
        self._job_has_all = has_all

        def read():
            found_keys, slots = writer.stage(keys, cap, buf.view(np.uint8).reshape(cap, -1), threads, job)
            return commit, found_keys, slots, buf[:len(slots)]

        self._prefetching = _prefetcher().submit(read)

    def _wait_prefetch(self) -> None:
        """Take the result of this store's prefetch, if one is under way (into self._staged)."""
        job, self._prefetching = self._prefetching, None
        if job is not None:
            if not job.done():
                self._stage_job.help()  # read its unclaimed records here rather than wait for them
            try:
                self._staged = job.result()
            except BaseException as exc:
                raise RuntimeError("the background read of prefetch() failed") from exc

    def _take_staged(self):
        """The records this store's prefetch read, if still current (no flush since): (sorted
        keys, slots, records), or None. Taken once: the next prefetch reads anew."""
        self._wait_prefetch()
        staged, self._staged = self._staged, None
        if staged is None:
            return None
        if staged[0] != self._commits or not len(staged[1]):
            self._keep_spare(staged[3])  # its buffer serves the next read
            return None
        return staged[1:]

    def _read_current(self, keys: np.ndarray, slots: np.ndarray, staged) -> np.ndarray:
        """The records of disk keys (sorted) at slots: from `staged` (_take_staged) where still
        current (the same key in the same slot), the rest read now."""
        if staged is None:
            return self._read(slots)
        s_keys, s_slots, s_buf = staged
        if _core.same_int64(s_keys, keys) and _core.same_int64(s_slots, slots):
            # The call's own prefetch, which read exactly its disk rows (two memcmps; two
            # np.array_equal took 6 us for 1.4k keys, the match below 0.09-0.1 ms of a 3x Zipf
            # 1.05 step).
            out, n_hit = s_buf, len(keys)
        else:
            at = np.searchsorted(s_keys, keys).clip(max=len(s_keys) - 1)
            hit = (s_keys[at] == keys) & (s_slots[at] == slots)
            n_hit = int(np.count_nonzero(hit))
            if n_hit == len(keys) and at[-1] - at[0] == len(keys) - 1:  # a run of them (no copy)
                out = s_buf[at[0]:at[0] + len(keys)]
            elif n_hit == 0:
                out = self._read(slots)
            else:
                out = self._buffer(len(keys))
                out[hit] = s_buf[at[hit]]
                if n_hit < len(keys):
                    out[~hit] = self._read(slots[~hit])
        self.stats["prefetched"] = self.stats.get("prefetched", 0) + n_hit
        self.stats["rows_read"] += n_hit
        self.stats["bytes_read"] += n_hit * self._record.itemsize
        return out

    def on_evict(self, callback) -> None:
        raise TypeError("on_evict: a tiered store's evicted rows go to its disk tier, not to callbacks")

    def set_optimizer(self, optimizer) -> None:
        raise TypeError("set_optimizer: not on a tiered store (its records have the optimizer's width)")

    @_locked
    def export(self, cursor: Optional[tuple] = None, max_rows: Optional[int] = None, *,
               with_rows: bool = True) -> TableBatch:
        """Every row, the cache's then the disk's (no cursor: iter_export walks both tiers)."""
        if cursor is not None or max_rows is not None:
            raise ValueError("cursor / max_rows: a tiered store exports whole or through iter_export()")
        parts = list(self.iter_export(1 << 18, with_rows=with_rows))
        if not parts:
            return EmbeddingStore.export(self, with_rows=with_rows)
        return TableBatch(*(np.concatenate([getattr(p, f) for p in parts]) for f in
                            ("keys", "rows", "optimizer_state", "counts", "last_steps", "found")))

    def iter_export(self, batch_size: int = 65536, *, with_rows: bool = True) -> Iterator[TableBatch]:
        """Every row, a batch at a time: the cache's, then the disk's (each record checked)."""
        self._check_usable()
        return self._iter_export(batch_size, with_rows)

    def _iter_export(self, batch_size: int, with_rows: bool) -> Iterator[TableBatch]:
        cursor = None
        while True:  # the cache, with the base class's cursor walk
            b = EmbeddingStore.export(self, cursor, batch_size, with_rows=with_rows)
            if len(b.keys):
                yield b
            cursor = b.next_cursor
            if cursor is None:
                break
        self._settle_erase()
        sf = self._tier_config.state_floats
        for disk_keys, disk_slots in self._disk.items(batch_size):
            rec = self._read(disk_slots)
            self._check_records(rec.view(np.uint8).reshape(len(rec), -1), disk_keys, disk_slots)
            dim = self.dim if with_rows else 0
            rows = self._rows_of(rec) if with_rows else np.empty((len(rec), 0), np.float32)
            state = (rec["state"] if sf else np.empty((len(rec), 0), np.float32)) if with_rows \
                else np.empty((len(rec), 0), np.float32)
            assert rows.shape[1] == dim
            yield TableBatch(rec["key"].copy(), np.ascontiguousarray(rows), np.ascontiguousarray(state),
                             rec["count"].copy(), rec["last_step"].copy(), np.ones(len(rec), bool))

    # --- durability ----------------------------------------------------------------------------

    def _check_directory(self) -> None:
        """The path is new, empty, or a tier of this same table; anything else is refused."""
        if os.path.islink(self._dir) and not os.path.exists(self._dir):
            raise ValueError(f"Tiered.path: {self._dir} is a symbolic link to {os.readlink(self._dir)}, which does "
                             "not exist; create the directory it points to, or give another path")
        if not os.path.exists(self._dir):
            parent = os.path.dirname(os.path.abspath(self._dir))
            if not os.path.isdir(parent):  # a typo in the path would otherwise start an empty table
                raise ValueError(f"Tiered.path: the directory {parent} that should hold {self._dir} does not "
                                 "exist; create it first (the tier creates only its own directory)")
            return
        if not os.path.isdir(self._dir):
            raise ValueError(f"Tiered.path: {self._dir} exists and is not a directory")
        entries = set(os.listdir(self._dir)) - {"rows.dat", "meta.json", _WRITER_PID}
        if any(not (e.startswith(".tmp-") or (e.startswith("index-") and e.endswith(".npz"))) for e in entries):
            raise ValueError(f"Tiered.path: {self._dir} holds other files ({sorted(entries)[:3]}); give a new or "
                             "empty directory, or one a tiered table of this config flushed")

    # --- one writer a directory ------------------------------------------------------------------

    # A store holds an exclusive flock(2) on its directory from its open to close(): a second
    # store on the same directory (in this process or another) is refused at once and touches
    # nothing. The lock is the kernel's, so a writer killed by SIGKILL leaves none behind; the
    # pid in the directory's `lock` file (written once the lock is held, removed at close) only
    # names the holder in the refusal. Readers (TierFile) take no lock: they read the last
    # flush and refuse once the writer flushes again (TierFile._check_current).
    # A forked child inherits the descriptor, and with it the lock: it closes its copies at the
    # fork (never unlocking, which would release the parent's lock too) and refuses every verb.

    def _lock_directory(self) -> None:
        """Take the directory's writer lock, or refuse (BlockingIOError) naming its holder."""
        fd = os.open(self._dir, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise BlockingIOError(f"Tiered.path: {self._dir} is open in another TieredStore ({writer_of(self._dir)}); "
                                  "a tier directory has one writer at a time: close that store first, or read its "
                                  "last flush with cncore.tablefile.open_table") from None
        except OSError as exc:
            os.close(fd)
            raise OSError(exc.errno, f"Tiered.path: {self._dir} cannot be locked for one writer "
                                     f"({exc.strerror}); give a directory on a local file system") from None
        self._dir_fd, self._owner, self._pid_written = fd, os.getpid(), False

    def _write_pid(self) -> None:
        """Name this process in the directory's pid file (once the open has succeeded: a refused
        open leaves the directory as it was, a stale pid file of a killed writer included)."""
        with open(os.path.join(self._dir, _WRITER_PID), "w") as fh:
            fh.write(f"{os.getpid()}\n")
        self._pid_written = True

    def _release_directory(self) -> None:
        """Remove the pid file and give the writer lock back (the holder only)."""
        fd, self._dir_fd = self._dir_fd, None
        if fd is None:
            return
        try:
            if self._pid_written:
                os.remove(os.path.join(self._dir, _WRITER_PID))
        except OSError:  # removed by hand meanwhile: the lock is what counts
            pass
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def _disown(self) -> None:
        """In a forked child: this copy of the store is the parent's; refuse every verb, and close
        the copies of its descriptors without unlocking (see above)."""
        self._lock = threading.RLock()  # the parent's may have been held by a thread the child lacks
        self._unusable = (f"this TieredStore of {self._dir} belongs to process {getattr(self, '_owner', '?')}, "
                          f"which forked this process ({os.getpid()}); a tier directory has one writer: use the "
                          "store in the parent only, or read its last flush here with cncore.tablefile.open_table")
        for name in ("_fd", "_dir_fd"):
            fd = getattr(self, name, None)
            setattr(self, name, None)
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        if getattr(self, "_writer", None) is not None:
            self._writer.fd = -1
        self._pending, self._prefetching, self._erasing = [], None, None

    def _last_flush(self):
        """(meta, keys, slots) of the directory's last flush, checked against this config and
        rows.dat; None for a new directory (or one never flushed: it holds no table yet). Reads
        only: a refusal leaves the directory as it was."""
        from cncore.tablefile import TableFormatError
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
        self._high_water = int(meta["high_water"])
        self._plan_free(slots)
        self.step = int(meta["step"])
        self.evicted_count = int(meta["evicted"])
        self._flushes, self._commits = int(meta["flush"]), int(meta["commit"])

    def _cache_batches(self, batch_size: int = _CHUNK, with_rows: bool = True) -> Iterator[TableBatch]:
        """The cached rows, batch_size at a time (the base class's cursor walk)."""
        cursor = None
        while True:
            b = EmbeddingStore.export(self, cursor, batch_size, with_rows=with_rows)
            if len(b.keys):
                yield b
            cursor = b.next_cursor
            if cursor is None:
                return

    @_locked
    def flush(self) -> None:
        """Make the directory hold this table as it is now, crash-safely (module docstring)."""
        keys, slots = self._flush()
        if self._high_water > self._tier_config.storage.compact_ratio * len(slots) + 4 * self._per_page:
            self._compact_flushed(keys, slots)
        del keys, slots
        _trim()  # the flush's scratch: the new index, 16 bytes a row

    def _flush(self):
        """flush() without its compaction; returns every row's key and slot (the new index).

        Scratch memory is the index (16 bytes a row) and one chunk of records: exporting the
        whole cache and writing it from one buffer made a flush's peak RSS 1.7x the steady
        state (130 MiB for a 32 MiB cache at 3x, asv_bench/scripts/tiered_bench.py)."""
        self._wait_prefetch()
        self._settle_erase()
        self._wait_writes()  # before the fsync: every spilled row in the file
        n = EmbeddingStore.__len__(self) + len(self._disk)
        keys, slots = np.empty(n, np.int64), np.empty(n, np.int64)
        at = 0
        for k, disk_slots in self._disk.items(_CHUNK):
            keys[at:at + len(k)], slots[at:at + len(k)] = k, disk_slots
            at += len(k)
        for b in self._cache_batches():
            taken = self._take_slots(len(b.keys))
            self._write(taken, b)
            self.stats["bytes_written_by_flush"] += len(taken) * self._record.itemsize
            keys[at:at + len(b.keys)], slots[at:at + len(b.keys)] = b.keys, taken
            at += len(b.keys)
        assert at == n, (at, n)
        os.fsync(self._fd)
        self._flushes += 1
        self._commit(keys, slots)
        # The new snapshot: its slots stay untouched until the next flush; the rest is free.
        self._plan_free(slots)
        self.stats["flushes"] += 1
        return keys, slots

    @_locked
    def compact(self) -> int:
        """Flush, then move the records past the table's row count into the holes below it and
        truncate the file: afterwards it holds exactly one record per row. Crash-safe like a
        flush (records are copied into free slots, the new index is committed, then the file is
        cut). Returns the bytes the file gave back."""
        gave_back = self._compact_flushed(*self._flush())
        _trim()
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
        self._high_water = n
        self._free_pages, self._page_cursor = np.empty(0, np.int64), 0
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
                "rows": int(len(keys)), "step": int(self.step), "evicted": int(self.evicted_count),
                "high_water": int(self._high_water), "record_bytes": int(self._record.itemsize),
                "index_sha256": _sha256_file(index_path)}
        if self._version >= 4:
            meta["meta_sha256"] = _meta_digest(meta)
        tmp_meta = os.path.join(self._dir, f".tmp-{os.getpid()}-meta.json")
        with open(tmp_meta, "wb") as fh:
            fh.write(json.dumps(meta, indent=1).encode())
            fh.flush()
            os.fsync(fh.fileno())
        from cncore.tablefile import _fsync_dir
        _fsync_dir(self._dir)
        os.replace(tmp_meta, os.path.join(self._dir, "meta.json"))  # the commit point
        _fsync_dir(self._dir)
        for entry in os.listdir(self._dir):  # older indexes, and leftovers of killed flushes
            if (entry.startswith("index-") and entry != index_name) or entry.startswith(".tmp-"):
                os.remove(os.path.join(self._dir, entry))

    def close(self) -> None:
        """Close the file (without flushing) and give the directory's writer lock back; every
        verb after it raises ValueError ("I/O operation on closed store"). Queued spills are
        written first (OSError if one cannot be: the file stays open, its rows in memory).
        A second close does nothing."""
        lock = getattr(self, "_lock", None)
        if lock is None:  # its construction failed before anything was opened
            return
        with lock:
            if getattr(self, "_fd", None) is None and getattr(self, "_dir_fd", None) is None:
                return  # closed, never opened, or a forked child's copy (_disown)
            if getattr(self, "_prefetching", None) is not None:
                self._wait_prefetch()
            if getattr(self, "_erasing", None) is not None or getattr(self, "_unindexed", None) is not None:
                self._settle_erase()
            if getattr(self, "_pending", None):
                self._wait_writes()
            _HEAP_TRIM.discard(self)  # its share of the trigger (_HeapTrim) goes with it
            _OPEN_STORES.discard(self)
            self._unusable = (f"I/O operation on closed store: {self._dir} was closed (TieredStore.close()); open "
                              "the directory again with cncore.EmbeddingStore(config) to use it")
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
                if getattr(self, "_writer", None) is not None:
                    self._writer.fd = -1  # a spill after close fails (EBADF), never writes to a reused descriptor
            self._release_directory()

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
            if getattr(self, "_dir_fd", None) is not None:
                self._release_directory()
        except Exception:
            pass
        try:
            _HEAP_TRIM.discard(self)  # also when close failed: the store is gone
        except Exception:  # interpreter exit: the module's globals may be gone
            pass


# --- reading a flushed tier as a table file (cn-table, open_table, load_store) ----------------------

def is_tier_directory(path: str) -> bool:
    """Whether `path` is a tier's directory (meta.json or rows.dat, and no table file's CURRENT)."""
    return os.path.isdir(path) and not os.path.exists(os.path.join(path, "CURRENT")) and (
        os.path.exists(os.path.join(path, "meta.json")) or os.path.exists(os.path.join(path, "rows.dat")))


class TierFile:
    """A flushed tier directory read as a table file: what `open_table(path)` returns for one,
    with `TableFile`'s reading verbs (`len`, `config`, `step`, `evicted_count`, `nbytes`,
    `keys`, `read`, `take`, `batches`, `lookup`, `pooled_lookup`), so every `cn-table` command
    and `load_store` read it like any table.

    It holds the last flush's index in memory (16 bytes a row: the keys and their slots,
    ordered by slot so that a walk reads rows.dat front to back) and reads records on demand,
    a batch at a time: a tier far larger than memory walks in bounded memory. Rows come as
    float32 whatever the table's dtype. Every record read is checked to hold the key the index
    gives and, from directory version 4, to match its checksum (a mismatch: TableFormatError
    naming the key and slot).

    It takes no lock, so a store may train on the directory meanwhile: what it reads is the
    table as of the flush it opened, consistently. Rows the writer cached and has not flushed
    are not in it; once the writer flushes again (its flushes may reuse the slots this index
    names), every read refuses (TableFormatError naming the writer's pid): open it again. An
    open that races a flush starts over on the new one.

    >>> import numpy as np, tempfile, os, cncore
    >>> from cncore.tablefile import open_table
    >>> path = os.path.join(tempfile.mkdtemp(), "t.tier")
    >>> store = cncore.EmbeddingStore(cncore.StoreConfig(dim=2, storage=cncore.Tiered(path, cache_bytes=2000)))
    >>> for start in range(0, 100, 10):                  # most rows go to disk
    ...     _ = store.find_or_insert(np.arange(start, start + 10))
    >>> store.flush(); table = open_table(path)
    >>> len(table), bool((table.lookup([7, 500]) == store.lookup(np.array([7, 500]))).all())
    (100, True)
    """

    delta = None  # never a chain

    def __init__(self, path: str, verify: bool = True):
        from cncore.tablefile import TableFormatError
        self.path, self._fd, error = path, None, None
        for _ in range(_OPEN_TRIES):
            try:  # held open: while it is, its inode is meta.json's exactly when no flush replaced it
                meta_fd = os.open(os.path.join(path, "meta.json"), os.O_RDONLY)
            except OSError:
                meta_fd = None  # read_flushed says what is wrong (no meta.json: never flushed)
            try:
                self._open(path, verify)
                if meta_fd is not None and not _replaced(path, meta_fd):
                    self._meta_fd = meta_fd
                    weakref.finalize(self, _close_fds, self._fd, meta_fd)
                    return
            except (TableFormatError, OSError) as exc:
                if meta_fd is None or not _replaced(path, meta_fd):
                    _close_fds(self._fd, meta_fd)
                    if isinstance(exc, OSError):
                        raise TableFormatError(f"{path}: cannot be read ({exc.strerror or exc})") from None
                    raise
                error = exc
            _close_fds(self._fd, meta_fd)  # a flush replaced meta.json meanwhile: open the new one
            self._fd = None
        raise TableFormatError(f"{path}: the tier was flushed again during each of {_OPEN_TRIES} tries to open it "
                               f"({writer_of(path)}); open it once its writer is idle ({error})")

    def _check_current(self) -> None:
        """Refuse once the writer has flushed again since the open (its flushes may reuse the
        slots of the index this reads)."""
        from cncore.tablefile import TableFormatError
        if _replaced(self.path, self._meta_fd):
            raise TableFormatError(f"{self.path}: the tier was flushed again since it was opened "
                                   f"({writer_of(self.path)}), and the new flush may reuse the slots of the one "
                                   "opened: open the directory again")

    def _open(self, path: str, verify: bool) -> None:
        from cncore.tablefile import TableFormatError, config_from_dict
        meta, keys, slots = read_flushed(path, TableFormatError, "")
        config = meta.get("config")
        if isinstance(config, dict):
            config = {**config, "capacity": StoreConfig.__dataclass_fields__["capacity"].default}
        self.config = config_from_dict(config, f"{path}/meta.json")
        self.path, self.step, self.evicted_count = path, int(meta["step"]), int(meta["evicted"])
        self.version = str(meta["index"])
        self._record, self._per_page = record_layout(self.config, int(meta["version"]))
        if meta.get("record_bytes") != self._record.itemsize or meta.get("rows") != len(keys) \
                or keys.dtype != np.int64 or slots.dtype != np.int64 or keys.shape != slots.shape \
                or keys.ndim != 1:
            raise TableFormatError(f"{path}: meta.json (rows {meta.get('rows')!r}, record_bytes "
                                   f"{meta.get('record_bytes')!r}) does not match its index ({len(keys)} keys) or "
                                   f"its config (records of {self._record.itemsize} bytes); the tier is damaged")
        order = np.argsort(slots, kind="stable")
        self.keys, self._slots = keys[order], slots[order]
        del keys, slots, order
        if verify and len(self.keys):
            ordered = np.sort(self.keys)
            same = np.flatnonzero(ordered[1:] == ordered[:-1])
            if len(same):
                raise TableFormatError(f"{path}: the index holds duplicate keys ({len(same)}, e.g. "
                                       f"{int(ordered[same[0]])}); the tier is damaged")
            del ordered
        if len(self._slots) and (self._slots[0] < 0 or (np.diff(self._slots) == 0).any()):
            raise TableFormatError(f"{path}: the index gives a negative or repeated slot; the tier is damaged")
        try:
            self._fd = os.open(os.path.join(path, "rows.dat"), os.O_RDONLY)
        except FileNotFoundError:
            raise TableFormatError(f"{path}: rows.dat is missing (meta.json names {len(self.keys)} rows in it); "
                                   "the tier is damaged") from None
        end = records_end(self._slots, self._record.itemsize, self._per_page)
        size = os.fstat(self._fd).st_size
        if size < end:
            raise TableFormatError(f"{path}: rows.dat has {size} bytes, the index needs {end} (truncated)")

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def dim(self) -> int:
        return self.config.dim

    @property
    def record_bytes(self) -> int:
        """Bytes of one record in rows.dat."""
        return self._record.itemsize

    @property
    def nbytes(self) -> int:
        """Bytes of rows.dat and the index on disk."""
        self._check_current()
        try:
            return os.fstat(self._fd).st_size + os.path.getsize(os.path.join(self.path, self.version))
        except FileNotFoundError:  # removed by a flush after the check above
            self._check_current()
            raise

    def _records(self, at: np.ndarray) -> np.ndarray:
        """The records of row numbers `at`, checked against the index's keys."""
        from cncore.tablefile import TableFormatError
        slots = self._slots[at]
        buf = np.zeros(len(slots), self._record)
        if len(slots):
            raw = buf.view(np.uint8).reshape(len(slots), -1)
            try:
                _core.block_io(self._fd, record_offsets(slots, self._record.itemsize, self._per_page), raw, False, 4)
            except OSError as exc:
                self._check_current()
                raise TableFormatError(f"{self.path}: rows.dat cannot be read ({exc.strerror}): truncated or damaged "
                                       "since the tier was opened") from None
            self._check_current()  # else the records may be the new flush's
            keys = self.keys[at]
            bad = _core.check_records(raw, keys, check_offset(self._record))
            if bad >= 0:
                raise record_error(self.path, raw[bad], int(keys[bad]), int(slots[bad]), "the tier is damaged")
        return buf

    def _fields(self, rec: np.ndarray, names) -> dict:
        out = {}
        for name in names:
            if name == "keys":
                out[name] = rec["key"].copy()
            elif name == "rows":
                out[name] = rows_of(rec, self.config.dtype)
            elif name == "optimizer_state":
                out[name] = (np.ascontiguousarray(rec["state"]) if "state" in rec.dtype.names
                             else np.empty((len(rec), 0), np.float32))
            elif name == "counts":
                out[name] = rec["count"].copy()
            elif name == "last_steps":
                out[name] = rec["last_step"].copy()
            else:
                raise ValueError(f"name: expected one of keys, rows, optimizer_state, counts, last_steps, got {name!r}")
        return out

    def read(self, name: str, start: int, stop: int) -> np.ndarray:
        """Entries [start, stop) of one column (row numbers in the tier's slot order), a new array."""
        if name == "keys":
            return self.keys[start:stop].copy()
        return self._fields(self._records(np.arange(start, min(stop, len(self)))), (name,))[name]

    def take(self, name: str, rows: np.ndarray, chunk: int = 1 << 14) -> np.ndarray:
        """One column's entries at row numbers `rows` (any order, repeats allowed)."""
        rows = np.asarray(rows, dtype=np.int64)
        if len(rows) and (rows.min() < 0 or rows.max() >= len(self)):
            raise IndexError(f"rows: row numbers must be in [0, {len(self)})")
        if name == "keys":
            return self.keys[rows]
        parts = [self._fields(self._records(rows[a:a + chunk]), (name,))[name] for a in range(0, len(rows), chunk)]
        if parts:
            return np.concatenate(parts)
        return self._fields(np.zeros(0, self._record), (name,))[name]

    def batches(self, batch_rows: int = 1 << 18, names=("keys", "rows", "optimizer_state", "counts", "last_steps")):
        """(start, {name: rows [start, start + batch_rows)}) over the whole table, in slot
        order; each batch one batched read of rows.dat (none for keys alone)."""
        for start in range(0, len(self), batch_rows):
            stop = min(start + batch_rows, len(self))
            if all(n == "keys" for n in names):
                yield start, {n: self.keys[start:stop].copy() for n in names}
            else:
                yield start, self._fields(self._records(np.arange(start, stop)), names)

    def lookup(self, keys) -> np.ndarray:
        """Rows (N, dim) of keys, zeros where a key is not in the table (see TableFile.lookup)."""
        from cncore.tablefile_lookup import file_lookup
        return file_lookup(self, keys)

    def pooled_lookup(self, keys, offsets=None, *, lengths=None, mode: str = "sum",
                      per_sample_weights=None) -> np.ndarray:
        """Pooled rows (B, dim) of bags of keys, as TableFile.pooled_lookup."""
        from cncore.tablefile_lookup import file_pooled_lookup
        return file_pooled_lookup(self, keys, offsets, lengths, mode, per_sample_weights)


def open_tier(path: str, verify: bool = True) -> TierFile:
    """A flushed tier directory as a read-only table (TierFile); open_table(path) calls this
    for a tier's directory."""
    return TierFile(path, verify)

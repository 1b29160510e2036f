"""The SSD tier: a table larger than memory, its hot rows in a bounded in-memory cache.

    StoreConfig(dim=64, optimizer=..., storage=cncore.Tiered(path="users.tier", cache_bytes=2 << 30))

`cncore.make_store(config)` with `storage=Tiered(...)` builds a `TieredStore`: the verbs of
`cncore.storage.RowStorage`, over two tiers that never hold the same key at once:
- the cache: an ordinary bounded core store that the tiered store holds (`store.cache`, an
  `EmbeddingStore`) (the budget is cache_bytes over the bytes a row
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
(`fault_in.EraseBehind`).

Write-behind: the rows the cache evicts are written by that same background thread, after the
call that evicted them returned (their keys are indexed on disk at once; a read of one on the
training thread, a flush and close first wait for the queued writes, and a prefetch handed in
later reads after them: one thread, first in first out). See cncore.tier.write_behind.SpillQueue.

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

Modules, one job each: `store` (the `TieredStore` class and its verbs), `fault_in` (rows from
disk into the cache), `prefetch` (reads ahead on the background thread), `write_behind` (the
cache's evictions written on the background thread), `slots` (where records go in rows.dat),
`durability` (flush, reopen, compaction), `directory` (the directory's files, meta.json, the
writer lock), `records` (the record layout and checksums), `reader` (`TierFile`), `background`
(the background thread, fork handling), `heap` (when freed heap goes back to the system).

>>> import numpy as np, tempfile, os, cncore
>>> path = os.path.join(tempfile.mkdtemp(), "t.tier")
>>> store = cncore.make_store(cncore.StoreConfig(dim=4, optimizer=cncore.SGD(lr=0.1),
...                                              storage=cncore.Tiered(path, cache_bytes=20_000)))
>>> for start in range(0, 1000, 100):
...     _, ctx = store.pooled_lookup(np.arange(start, start + 100), lengths=np.full(10, 10))
...     store.apply_gradients(ctx, np.ones((10, 4), np.float32))
>>> len(store), store.cached_rows < 1000, store.stats["rows_written"] > 0
(1000, True, True)
>>> before = store.lookup(np.array([5, 999]))
>>> store.flush(); store.close()          # a directory has one store at a time
>>> again = cncore.make_store(store.config)
>>> bool((again.lookup(np.array([5, 999])) == before).all())
True
"""
from cncore.tier.directory import is_tier_directory, read_flushed, writer_of
from cncore.tier.reader import TierFile, open_tier
from cncore.tier.records import record_layout
from cncore.tier.store import TieredStore

__all__ = ["TieredStore", "TierFile", "open_tier", "is_tier_directory", "read_flushed", "writer_of", "record_layout"]

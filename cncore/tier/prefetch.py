"""Prefetch: the next call's disk rows read on the background thread while a step runs."""
from __future__ import annotations

import numpy as np

from cncore import _core
from cncore._interchange import as_keys
from cncore.tier import background, records
from cncore.tier.background import _locked


class PrefetchState:
    """What a store's prefetch has under way, and what it leaves for the call that needs its
    records (one prefetch at a time per store).

    Attributes:
        future: the Future of the background read, None when none is under way.
        staged: its result, (commit, sorted keys, slots, records), until a call takes it.
        job: its shared reads (_core.StageJob): a call that needs the records before they are
            all read reads the rest beside the background thread.
        prefound: its find of the keys in the cache, (cache version, keys, slots, found), which
            the call of the same keys takes while the cache's keys are unchanged (_cache_find).
        has_all: the job was handed every ID missing from memory (its find can serve the call).
        is_this_calls: set during a fault-in whose keys are the running prefetch's (its spills
            need not wait for the job: _spill_slots).
    """

    def __init__(self):
        self.future = None
        self.staged: tuple | None = None
        self.job = None
        self.prefound: tuple | None = None
        self.has_all = False
        self.is_this_calls = False


class Prefetch:
    """Part of TieredStore: prefetch() and the staged records a later call takes."""

    _prefetch: PrefetchState  # the prefetch under way and what it left for the next call

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
        >>> s = cncore.make_store(cncore.StoreConfig(dim=2, storage=cncore.Tiered(
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
            self._erases.hand_over()  # after the read job: the last fault-in's disk-index erase (EraseBehind)

    def _prefetch_keys(self, keys) -> None:
        """prefetch(), but for the erase it hands over."""
        # A copy: the caller may reuse its array while the background job reads it.
        keys = np.array(as_keys(keys), dtype=np.int64, copy=True)
        self._wait_prefetch()
        self._prefetch.prefound = None
        self._prefetch.job, self._prefetch.has_all = None, False
        if not len(keys):
            return
        # The keys are found in the cache here, and only those missing go to the background job;
        # the call that looks these keys up takes this find instead of its own while the cache's
        # keys are unchanged (the backward between them changes rows, not keys: _cache_find).
        # The job then deduplicates and finds in the disk index ~1.5k IDs, not 16k (~6.2k keys,
        # each a cache miss in the disk index): 0.4 ms less of its ~2.3 ms a 3x Zipf 1.05 step.
        slots, found = self.cache.find(keys)
        self._prefetch.prefound = (self.cache._table.version, keys, slots, found)
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
        cap = min(len(keys), max(records._IO_ROWS, self._tier_config.storage.cache_bytes // 32 // record.itemsize))
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
        job = self._prefetch.job = _core.StageJob()
        self._prefetch.has_all = has_all

        def read():
            found_keys, slots = writer.stage(keys, cap, buf.view(np.uint8).reshape(cap, -1), threads, job)
            return commit, found_keys, slots, buf[:len(slots)]

        self._prefetch.future = background._prefetcher().submit(read)

    def _wait_prefetch(self) -> None:
        """Take the result of this store's prefetch, if one is under way (into self._prefetch.staged)."""
        job, self._prefetch.future = self._prefetch.future, None
        if job is not None:
            if not job.done():
                self._prefetch.job.help()  # read its unclaimed records here rather than wait for them
            try:
                self._prefetch.staged = job.result()
            except BaseException as exc:
                raise RuntimeError("the background read of prefetch() failed") from exc

    def _take_staged(self):
        """The records this store's prefetch read, if still current (no flush since): (sorted
        keys, slots, records), or None. Taken once: the next prefetch reads anew."""
        self._wait_prefetch()
        staged, self._prefetch.staged = self._prefetch.staged, None
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

"""Write-behind: the rows a tier's cache evicts are written by the background thread."""
from __future__ import annotations

import errno
import os

import numpy as np

from cncore.tier import background, heap
from cncore.tier.background import _settle
from cncore.tier.records import _row_bytes


class WriteBehind:
    """Part of TieredStore: slots for the cache's evictions, and their writes handed to its
    SpillQueue (`_spills`)."""

    def _spill_slots(self, n: int) -> np.ndarray:
        """The writer's allocator: slots for the n rows the cache is evicting (the writer then
        writes them there and puts their keys in the disk index), counted as written."""
        if self._fd is None:  # closed: the writer's descriptor is -1 (never a reused number)
            raise OSError(errno.EBADF, f"writing evicted records: {os.strerror(errno.EBADF)} ({self._dir} was closed)")
        if self._prefetch.future is not None and not self._prefetch.is_this_calls:
            # A prefetch's find must not see the keys this spill indexes (their records are
            # written behind, after it: SpillQueue). Not needed while the running prefetch
            # is the current fault-in's own (_prefetch.is_this_calls): its job looks up only keys of
            # this call that are not in memory (missing at its find, the cache's keys unchanged
            # since), and an eviction in this call takes only rows in memory that the call does
            # not use, so no key this spill indexes is one the job looks up.
            try:
                self._wait_prefetch()
            except RuntimeError:  # its read failed: nothing staged (the call reads, and reports, itself)
                self._prefetch.staged = None
        heap._HEAP_TRIM.spilled(n * _row_bytes(self._tier_config))
        self.stats["rows_written"] += n
        self.stats["bytes_written"] += n * self._record.itemsize
        return self._allocator.take(n)

    def _write_behind(self, job) -> None:
        """The writer's `behind`: queue a spill's write on the background thread (SpillQueue.put),
        with at most two eviction rounds' rows waiting (2 x (headroom + a fault-in round))."""
        self._spills.put(job, 2 * (self.cache.config.headroom + self._evict_chunk))

    def _wait_writes(self) -> None:
        """Wait until every queued spill is in the file (before a read on this thread, a flush,
        close). Raises OSError if one cannot be written (its rows stay in memory, queued)."""
        self._spills.wait_all()


class SpillQueue:
    """The spills a tier's cache evicted that wait for the background thread to write them:
    `pending`, oldest first, each [job (a SpillJob, owning the evicted rows), its Future or
    None].

    Why: the training thread wrote every evicted record itself (pack, then pwritev into the
    page cache: 0.5-0.7 ms of a 3x Zipf 1.05 step's 1,440 records, asv_bench/scripts/
    tiered_bench.py), while the machine's other core idled. Safe because:
    - a read of the file on the training thread waits for the queued writes first
      (TieredStore._read);
    - a prefetch's read runs on the same background thread after the writes queued before
      it, and a prefetch still running is waited for before a spill indexes its keys
      (_spill_slots), so its find never sees a key whose record is queued after it;
    - a flush waits for them before its fsync, and a write lands only on a slot the last
      flush does not refer to, so a crash with writes queued leaves the last flush; a fork
      first lets the background thread finish (background._drain_prefetcher).
    Memory: at most two eviction rounds' rows wait (the bound `put` is given: 2.8 MiB at a
    32 MiB cache); more, and `put` waits for the oldest first.
    """

    def __init__(self, directory: str):
        self.directory = directory
        self.pending: list[list] = []

    @property
    def rows(self) -> int:
        """Rows of the queued spills (at most a few jobs: derived, not kept)."""
        return sum(len(job) for job, _ in self.pending)

    def put(self, job, bound: int) -> None:
        """Queue a spill's write on the background thread, once the writer has indexed its keys
        on disk; called with the GIL and the store's lock held, from the eviction of a call.
        Never raises (the keys are indexed already): a job that cannot be queued is written by
        the next `wait_all`. Waits for the oldest writes first while more than `bound` rows
        would wait."""
        self.reap()
        try:
            while self.pending and self.rows + len(job) > bound:
                self.wait_oldest()
        except OSError:  # an older write failed again: this one waits behind it (raised by wait_all)
            pass
        try:
            future = background._submit_write(job)
        except RuntimeError:  # the executor is shut down (interpreter exit): written by wait_all
            future = None
        self.pending.append([job, future])

    def reap(self) -> None:
        """Forget the queued spills that the background thread has written."""
        while self.pending and self.pending[0][0].written:
            self.pending.pop(0)

    def wait_oldest(self) -> None:
        """Wait for the oldest queued spill; a failed (or never queued) write is run again here.
        Raises OSError if it fails again; its rows stay queued (in memory) for the next try."""
        job = self.pending[0][0]
        _settle(self.pending[0])
        if not job.written:
            # Retried here, through the writer's buffer, which this store's later jobs on the
            # background thread use too: those end first.
            for entry in self.pending[1:]:
                _settle(entry)
            job.run()
        if not job.written:
            raise OSError(job.err, f"{self.directory}/rows.dat: writing {len(job)} evicted rows failed "
                                   f"({os.strerror(job.err)}); they are kept in memory and written by the next "
                                   "call that reads the file or flushes; the table is unchanged")
        self.pending.pop(0)

    def wait_all(self) -> None:
        """Wait until every queued spill is in the file. Raises OSError if one cannot be written
        (its rows stay in memory, queued)."""
        while self.pending:
            self.wait_oldest()

    def forget(self) -> None:
        """In a forked child: the queue is the parent's (its writes are the parent's to make)."""
        self.pending = []

"""The tier's background I/O thread (prefetch reads, write-behind spills, disk-index erases: one
worker for every tiered store of the process), fork handling, and the store lock around verbs."""
from __future__ import annotations

import functools
import os
import threading
import weakref
from typing import Any

_PREFETCHER = None  # the background thread of every tiered store's prefetch reads


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

# The process's open tiered stores: a forked child disowns them.
_OPEN_STORES: weakref.WeakSet[Any] = weakref.WeakSet()


def _disown_open_stores() -> None:
    for store in list(_OPEN_STORES):
        store._disown()
    _OPEN_STORES.clear()


os.register_at_fork(after_in_child=_disown_open_stores)


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

"""When the tier gives freed heap back to the system (malloc_trim after flushes and large spills)."""
from __future__ import annotations

import threading

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
    Rejected (300-step runs): the eviction's row buffers mapped and unmapped directly
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

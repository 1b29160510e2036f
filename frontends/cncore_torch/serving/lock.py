"""`ServingLock`: one version of the tables per request while deltas land.

Requests read (many at once); `apply_delta` writes (one at a time, briefly). A writer waits for
the requests in flight to finish and keeps new ones out until its swap is done, so a request
never sees half of a delta. `freeze` puts the read side around the frozen model's whole forward
with two hooks (`ReadHooks`), so a model holding several frozen collections reads all of them at
one version. A forward called from inside another (nested modules, the same thread) takes no
second read: a writer waiting between the two would otherwise deadlock against its own reader.
"""
from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["ServingLock", "ReadHooks"]


class ServingLock:
    """A readers-writer lock that prefers the writer (so a stream of requests cannot starve a
    delta). Picklable: a copy (torch.save, deepcopy) gets a fresh, unlocked lock.

    >>> lock = ServingLock()
    >>> lock.acquire_read(); lock.readers
    1
    >>> lock.release_read()
    >>> with lock.writing():
    ...     lock.readers
    0
    """

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._cond = threading.Condition()
        self._local = threading.local()
        self.readers = 0
        self._writer = False
        self._writers_waiting = 0
        self.version = 0  # deltas applied under this lock
        self._applying = threading.Lock()  # one delta at a time, prepared and swapped

    def __getstate__(self) -> dict:
        return {"version": self.version}

    def __setstate__(self, state: dict) -> None:
        self._reset()
        self.version = state.get("version", 0)

    def acquire_read(self) -> None:
        depth = getattr(self._local, "depth", 0)
        self._local.depth = depth + 1
        if depth:
            return
        with self._cond:
            while self._writer or self._writers_waiting:
                self._cond.wait()
            self.readers += 1

    def release_read(self) -> None:
        self._local.depth -= 1
        if self._local.depth:
            return
        with self._cond:
            self.readers -= 1
            if not self.readers:
                self._cond.notify_all()

    @contextmanager
    def applying(self) -> Iterator[None]:
        """Held by one delta from its preparation to its swap, so two deltas never prepare
        against the same old arrays."""
        with self._applying:
            yield

    @contextmanager
    def writing(self) -> Iterator[None]:
        """Hold the tables for a swap: no request is reading while the block runs."""
        if getattr(self._local, "depth", 0):
            raise RuntimeError("apply_delta was called from inside the frozen model's forward (this thread "
                               "holds a read of its tables); call it from outside a request")
        with self._cond:
            self._writers_waiting += 1
            while self._writer or self.readers:
                self._cond.wait()
            self._writers_waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self.version += 1
                self._cond.notify_all()


class ReadHooks:
    """The forward pre-hook and forward hook (`always_call=True`) that hold `lock`'s read side
    for one forward. A class, not closures, so a frozen model pickles."""

    def __init__(self, lock: ServingLock) -> None:
        self.lock = lock

    def before(self, module, args) -> None:
        self.lock.acquire_read()

    def after(self, module, args, output) -> None:
        self.lock.release_read()

    def install(self, module) -> None:
        module.register_forward_pre_hook(self.before)
        module.register_forward_hook(self.after, always_call=True)

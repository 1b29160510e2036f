"""Thread count of the core's parallel loops, decided in one place.

>>> import cncore
>>> previous = cncore.get_num_threads()
>>> cncore.set_num_threads(1); cncore.get_num_threads()
1
>>> cncore.set_num_threads(None)  # back to the default (OMP_NUM_THREADS or all cores)
"""
from cncore import _core

__all__ = ["set_num_threads", "get_num_threads", "has_openmp", "traced_bytes"]


def set_num_threads(n) -> None:
    """Use `n` threads in the core's parallel loops; None restores the default."""
    if n is None:
        _core.set_thread_setting(0)
        return
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= _core.MAX_THREADS:
        raise ValueError(f"n must be an int in [1, {_core.MAX_THREADS}] or None, got {n!r}")
    _core.set_thread_setting(n)


def get_num_threads() -> int:
    """Threads the next parallel loop will use (1 when built without OpenMP)."""
    return _core.max_threads()


def has_openmp() -> bool:
    """Whether the core was built with OpenMP."""
    return _core.has_openmp()


def traced_bytes() -> int:
    """Bytes held by all stores of this process, as counted by the core's allocator."""
    return _core.traced_bytes()

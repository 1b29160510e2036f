"""Thread count of the core's parallel loops, decided in one place.

The core runs its loops on a pool of its own (cython_src/include/cn_parallel.h says why not
OpenMP): the calling thread claims work alongside the workers and never waits for a worker that
has not started, and idle workers sleep after 50 us, so the core stays fast on a machine that
other processes keep busy. Default: CNCORE_NUM_THREADS, else OMP_NUM_THREADS, else the CPUs
this process may run on.

>>> import cncore
>>> previous = cncore.get_num_threads()
>>> cncore.set_num_threads(1); cncore.get_num_threads()
1
>>> cncore.set_num_threads(None)  # back to the default
"""
from cncore import _core

__all__ = ["set_num_threads", "get_num_threads", "traced_bytes"]


def set_num_threads(n: int | None) -> None:
    """Use `n` threads in the core's parallel loops.

    Args:
        n (int | None): threads in [1, MAX_THREADS], or None for the default.

    >>> import cncore
    >>> cncore.set_num_threads(1); cncore.get_num_threads()
    1
    >>> cncore.set_num_threads(None)
    """
    if n is None:
        _core.set_thread_setting(0)
        return
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= _core.MAX_THREADS:
        raise ValueError(f"n must be an int in [1, {_core.MAX_THREADS}] or None, got {n!r}")
    _core.set_thread_setting(n)


def get_num_threads() -> int:
    """Threads the next large parallel loop will use (small ones run on the calling thread).

    Returns:
        int: the thread count.
    """
    return _core.max_threads()


def traced_bytes() -> int:
    """Bytes held by all stores of this process, as counted by the core's allocator.

    Returns:
        int: the bytes.
    """
    return _core.traced_bytes()

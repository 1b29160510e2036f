"""What a benchmark must know about the machine it runs on, in one place: the last-level cache
(to size tables and the flush from it), a flush larger than that cache, the streaming read
bandwidth, a one-line description to print with every table, and a background load.

The asv suite (`common.py`) and the scripts (`asv_bench/scripts/`) both use these, so every
number we publish was taken under the same rules. Imports no framework (cncore only, to say which
of its kernels run).
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

import cncore
from cncore import _core

_CACHE_DIR = "/sys/devices/system/cpu/cpu0/cache"


def llc_bytes() -> int:
    """Size of the largest cache of cpu0 (the last-level cache), read from sysfs; 32 MiB when
    the machine does not say."""
    best = 0
    entries = sorted(os.listdir(_CACHE_DIR)) if os.path.isdir(_CACHE_DIR) else []
    for entry in entries:
        try:
            with open(f"{_CACHE_DIR}/{entry}/size") as fh:
                text = fh.read().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1], 1)
        best = max(best, int(text.rstrip("KMG")) * scale)
    return best or 32 << 20


def caches() -> str:
    """cpu0's caches as sysfs lists them, one per level and type: "L1d 48 KiB, L1i 64 KiB, L2 2
    MiB, L3 480 MiB" (each the size one core sees; shared caches are listed once); "" when the
    machine does not say."""
    found = []
    entries = sorted(os.listdir(_CACHE_DIR)) if os.path.isdir(_CACHE_DIR) else []
    for entry in entries:
        try:
            with open(f"{_CACHE_DIR}/{entry}/level") as fh:
                level = fh.read().strip()
            with open(f"{_CACHE_DIR}/{entry}/type") as fh:
                kind = {"Data": "d", "Instruction": "i"}.get(fh.read().strip(), "")
            with open(f"{_CACHE_DIR}/{entry}/size") as fh:
                text = fh.read().strip()
        except OSError:
            continue
        kib = int(text.rstrip("KMG")) * {"K": 1, "M": 1 << 10, "G": 1 << 20}.get(text[-1], 1)
        found.append(f"L{level}{kind} {kib >> 10} MiB" if kib >= 1024 else f"L{level}{kind} {kib} KiB")
    return ", ".join(found)


def cpu_count() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def available_memory() -> int:
    """Bytes the kernel says a new allocation can take without swapping (MemAvailable)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def load_average() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def kernels() -> str:
    """Which code of cncore runs: "cncore kernels v4 (CPU runs base, v3, v4), rest built for v3"
    (cncore.kernel_isa; the rest of the core runs the build's -march: v4 or v3 in a -march=native
    build on such a CPU, base in a portable one)."""
    if not hasattr(cncore, "kernel_isa"):  # a build from before the dispatch: one -march for all
        return "cncore kernels: no dispatch (the build's -march)"
    return (f"cncore kernels {cncore.kernel_isa()} (CPU runs {', '.join(cncore.runnable_isas())}), "
            f"rest built for {_core.build_isa()}")


def describe() -> str:
    """One line: CPU model, cores, last-level cache (and every cache level), memory, load
    average (1/5/15 min), and the instruction-set level of cncore's kernels (`kernels`)."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    levels = caches()
    return (f"{cpu_model()}, {cpu_count()} cores, LLC {llc_bytes() >> 20} MiB{f' ({levels})' if levels else ''}, "
            f"RAM {total / 2**30:.0f} GiB ({available_memory() / 2**30:.0f} GiB available), "
            f"load average {load_average()}; {kernels()}")


def openmp_wait() -> str:
    """How idle OpenMP threads wait in this process (the variables libgomp reads when it loads)."""
    told = [f"{k}={os.environ[k]}" for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in os.environ]
    return "OpenMP wait: " + (", ".join(told) if told else "libgomp's default spin")


class Flush:
    """A buffer `factor` times the last-level cache; calling it reads and writes every line, so
    the next timed call starts with none of the previous call's rows in any cache. `nbytes`, when
    given, sets the size instead: the scripts' smoke runs (--quick) use a small one, as they check
    that every cell prints, not what it measures."""

    def __init__(self, factor: int = 2, nbytes: int | None = None):
        self.buf = np.zeros((nbytes if nbytes is not None else factor * llc_bytes()) // 8, np.float64)

    def __call__(self) -> None:
        self.buf += 1.0


def read_bandwidth(nbytes: int | None = None, threads: int = 1, reps: int = 5) -> float:
    """Streaming read bandwidth in bytes/s: `threads` threads each summing its own slice of a
    buffer of nbytes (default 8x the last-level cache, at least 256 MiB), best of `reps`.
    NumPy's reduction releases the GIL, so the threads run in parallel."""
    nbytes = nbytes or max(8 * llc_bytes(), 256 << 20)
    buf = np.ones(nbytes // 8, np.float64)
    parts = np.array_split(buf, threads)
    best = 0.0
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(reps):
            t = time.perf_counter()
            list(pool.map(np.sum, parts))
            best = max(best, nbytes / (time.perf_counter() - t))
    return best


_SPIN = "while True:\n    pass\n"


@contextlib.contextmanager
def background_load(processes: int | None = None):
    """Keep every core busy while the block runs: one spinning Python process per CPU (a data
    loader, a second job or an evaluation process do the same to a training job). Yields the
    number started; the processes are ended, by their ids, when the block exits."""
    n = cpu_count() if processes is None else processes
    procs = [subprocess.Popen([sys.executable, "-c", _SPIN]) for _ in range(n)]
    try:
        time.sleep(0.2)  # let them start spinning before the first timing
        yield n
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()

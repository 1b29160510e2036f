"""A bounded OpenMP spin for torch, set before torch loads its OpenMP runtime.

torch runs its CPU kernels on GNU OpenMP (libgomp), whose idle threads spin for 300,000
iterations (about 8 ms here, at 26 ns per iteration) before they sleep, and whose parallel
regions end at a barrier that waits for every thread. On a machine that other processes keep
busy, that spin takes cores the job itself needs: `cn-dlrm` on 2 cores beside four busy
processes ran at 6.4-6.7 k samples/s with libgomp's default, 18-20 k with
GOMP_SPINCOUNT=10000 (about 0.26 ms) and 19-20 k with OMP_WAIT_POLICY=PASSIVE; on the same
machine without the extra load the three were within the run-to-run noise (45-67 k samples/s).
libgomp reads these settings once, from the environment, when it loads; so they can only be set
before torch is imported. The core itself does not use OpenMP (cn_parallel.h).

`bound_openmp_spin()` sets GOMP_SPINCOUNT=10000 when the user set neither OMP_WAIT_POLICY nor
GOMP_SPINCOUNT and no OpenMP runtime is loaded yet; otherwise it changes nothing. It returns
whether it set it (tests/test_worker_pool.py checks each case in a fresh interpreter).
"""
import os

__all__ = ["bound_openmp_spin", "SPINCOUNT"]

SPINCOUNT = "10000"


def _openmp_loaded() -> bool:
    try:
        with open("/proc/self/maps") as maps:
            return any("libgomp" in line or "libiomp" in line for line in maps)
    except OSError:  # not Linux: nothing to tell, so leave the environment alone
        return True


def bound_openmp_spin() -> bool:
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ or _openmp_loaded():
        return False
    os.environ["GOMP_SPINCOUNT"] = SPINCOUNT
    return True

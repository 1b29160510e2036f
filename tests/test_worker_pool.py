"""The core's worker pool (cn_parallel.h): results independent of threads and of concurrent
callers, a pool that survives fork(), the thread-count defaults read from the environment, and
the bounded OpenMP spin that cncore_torch sets for torch before torch loads."""
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
from reference import assert_same_table

import cncore

TIMEOUT = 120


def _run(code: str, **env_changes):
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "CNCORE_NUM_THREADS",
                                                             "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(env_changes)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _store(seed=0):
    store = cncore.EmbeddingStore(cncore.StoreConfig(dim=32, seed=seed, optimizer=cncore.Adagrad(lr=0.1)))
    return store


def _batch(rng, n_bags=3000, pooling=7):
    return rng.integers(-2**63, 2**63 - 1, n_bags * pooling, dtype=np.int64), np.full(n_bags, pooling, np.int64)


def _train(threads: int, seed: int, steps: int = 4):
    cncore.set_num_threads(threads)
    rng = np.random.default_rng(seed)
    store, outs = _store(seed), []
    for _ in range(steps):
        keys, lengths = _batch(rng)
        keys[::3] = keys[0]  # shared rows: the fused update groups them
        out, ctx = store.pooled_lookup(keys, lengths=lengths)
        store.apply_gradients(ctx, np.sin(out) + 1.0)
        outs.append(out)
    return outs, store.export()


@pytest.fixture
def restore_threads():
    yield
    cncore.set_num_threads(None)


def test_concurrent_callers_get_the_serial_results(restore_threads):
    """Four Python threads train four stores at once on 2 threads each: one of them holds the
    pool at a time and the others run their loops on their own thread; all equal a serial run."""
    expected = [_train(1, seed) for seed in range(4)]
    cncore.set_num_threads(2)
    results = [None] * 4

    def work(seed):
        results[seed] = _train(2, seed)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    for (outs, table), (ref_outs, ref_table) in zip(results, expected):
        for a, b in zip(outs, ref_outs):
            np.testing.assert_array_equal(a, b)
        assert_same_table(table, ref_table)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork only")
def test_a_forked_child_runs_parallel_loops():
    """The parent's workers do not exist in a child of fork(): the child's caller claims the
    chunks they never take and the child starts workers of its own (pthread_atfork), where a
    barrier over the parent's team would wait forever."""
    out = _run("""
import os, numpy as np, cncore
cncore.set_num_threads(2)
store = cncore.EmbeddingStore(cncore.StoreConfig(dim=16))
keys = np.arange(50000, dtype=np.int64)
parent, _ = store.pooled_lookup(keys, lengths=np.full(10000, 5))
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    child, _ = store.pooled_lookup(keys[::-1].copy(), lengths=np.full(10000, 5))
    # each bag's keys come in the other order: its sum may differ in the last bits (atol)
    os.write(w, b"1" if np.allclose(child[::-1], parent, rtol=1e-6, atol=1e-7) else b"0")
    os._exit(0)
os.waitpid(pid, 0)
print(os.read(r, 1).decode())
""")
    assert out == "1"


@pytest.mark.parametrize("env, expected", [({"CNCORE_NUM_THREADS": "3"}, "3"), ({"OMP_NUM_THREADS": "5"}, "5"),
                                           ({"CNCORE_NUM_THREADS": "3", "OMP_NUM_THREADS": "5"}, "3"),
                                           ({"CNCORE_NUM_THREADS": "zero"}, str(len(os.sched_getaffinity(0))))])
def test_default_thread_count_from_the_environment(env, expected):
    assert _run("import cncore; print(cncore.get_num_threads())", **env) == expected


@pytest.mark.slow
def test_cncore_torch_bounds_torchs_openmp_spin_only_when_it_can():
    pytest.importorskip("torch")
    show = "import os; {}; print(os.environ.get('GOMP_SPINCOUNT'))"
    assert _run(show.format("import cncore_torch")) == "10000"
    assert _run(show.format("import cncore_torch"), GOMP_SPINCOUNT="5") == "5"
    assert _run(show.format("import cncore_torch"), OMP_WAIT_POLICY="PASSIVE") == "None"
    # torch first: libgomp has read its environment already, so changing it would be a lie
    assert _run(show.format("import torch; import cncore_torch")) == "None"


@pytest.mark.parametrize("spin_us", ["0", "200"])
def test_pool_under_thread_sanitizer(tmp_path, spin_us):
    """The pool's own stress program, built with ThreadSanitizer: contended callers, loops of
    1-4 threads, workers that sleep at once (spin 0: every loop goes through the futex) or
    spin; every item processed exactly once, and no data race reported."""
    import shutil
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    here = os.path.dirname(__file__)
    exe = str(tmp_path / "pool_stress")
    build = subprocess.run([cc, "-O1", "-g", "-std=gnu11", "-fsanitize=thread", "-pthread",
                            "-I", os.path.join(here, "..", "cython_src", "include"),
                            os.path.join(here, "native", "pool_stress.c"),
                            os.path.join(here, "..", "cython_src", "src", "cn_globals.c"), "-o", exe],
                           capture_output=True, text=True)
    if build.returncode != 0 and "sanitize" in build.stderr:
        pytest.skip("the compiler cannot build with -fsanitize=thread")
    assert build.returncode == 0, build.stderr
    done = subprocess.run([exe], capture_output=True, text=True, timeout=TIMEOUT,
                          env={**os.environ, "CNCORE_SPIN_US": spin_us, "TSAN_OPTIONS": "halt_on_error=1"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("ok ") and "WARNING: ThreadSanitizer" not in done.stderr

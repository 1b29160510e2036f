"""Growth never loses or changes a row; results do not depend on thread count; concurrent
readers see consistent data; reported memory is what was allocated."""
import gc
import sys
import threading
import time

import numpy as np
import pytest
from reference import assert_same_table, run_isolated, uniform_row

import cncore


@pytest.fixture
def restore_threads():
    yield
    cncore.set_num_threads(None)


def test_growth_from_capacity_one_to_a_million_rows_changes_no_row():
    rng = np.random.default_rng(0)
    keys = rng.choice(2**62, 1_000_000, replace=False).astype(np.int64) - 2**61
    store = cncore.EmbeddingStore(dim=8, capacity=1, seed=9, optimizer=cncore.Adagrad())
    probe = keys[::997]
    first = None
    for chunk in np.array_split(keys, 40):  # 40 growth steps in between
        store.find_or_insert(chunk)
        if first is None:
            first = store.read(probe[:1])
    assert len(store) == 1_000_000
    got = store.read(keys)
    assert got.found.all()
    # Every row equals the one a fresh store gives that key alone: growth changed nothing.
    fresh = cncore.EmbeddingStore(dim=8, seed=9, optimizer=cncore.Adagrad())
    np.testing.assert_array_equal(got.rows, fresh.lookup(keys, insert_missing=True))
    np.testing.assert_array_equal(store.read(probe[:1]).rows, first.rows)
    for k in probe[:20].tolist():
        np.testing.assert_allclose(store.lookup(np.array([k]))[0], uniform_row(9, k, 8, -0.05, 0.05), atol=1e-8)


def test_initial_rows_independent_of_order_batching_and_threads(restore_threads):
    keys = np.random.default_rng(1).integers(-(2**63), 2**63 - 1, 50_000, dtype=np.int64)
    results = []
    for threads, order, batches in [(1, slice(None), 1), (2, slice(None, None, -1), 7), (2, slice(None), 1)]:
        cncore.set_num_threads(threads)
        store = cncore.EmbeddingStore(dim=16, seed=4, initializer=cncore.Normal(0, 0.1))
        for part in np.array_split(keys[order], batches):
            store.find_or_insert(part)
        results.append(store.lookup(keys))
    np.testing.assert_array_equal(results[0], results[1])
    np.testing.assert_array_equal(results[0], results[2])


def _train(threads, mode, optimizer):
    cncore.set_num_threads(threads)
    rng = np.random.default_rng(2)
    store = cncore.EmbeddingStore(dim=32, seed=3, optimizer=optimizer)
    outs = []
    for _ in range(3):
        keys = (rng.zipf(1.2, 40_000) % 5000).astype(np.int64)
        lengths = rng.multinomial(len(keys), np.ones(2000) / 2000)
        out, ctx = store.pooled_lookup(keys, lengths=lengths, mode=mode)
        store.apply_gradients(ctx, rng.standard_normal(out.shape).astype(np.float32))
        outs.append(out.copy())
    return outs, store.export()


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("optimizer", [cncore.SGD(lr=0.1), cncore.RowWiseAdagrad(lr=0.1), cncore.Adam()],
                         ids=["sgd", "rowwise", "adam"])
def test_training_identical_for_one_and_two_threads(mode, optimizer, restore_threads):
    outs1, exp1 = _train(1, mode, optimizer)
    outs2, exp2 = _train(2, mode, optimizer)
    for a, b in zip(outs1, outs2):
        np.testing.assert_array_equal(a, b)
    assert_same_table(exp1, exp2)


def _train_small_batches(threads, wake):
    """Steps of 4096 IDs (pooling 1 and 2), under the 16384 keys from which a lookup or a
    backward wakes sleeping workers (cn_table.h, cn_grad_threads). wake: a 40,000-key find just
    before each backward, so the workers are awake and the backward takes them; otherwise a 2 ms
    pause first (past the workers' 200 us spin), so it runs on the calling thread."""
    cncore.set_num_threads(threads)
    store = cncore.EmbeddingStore(dim=16, seed=3, optimizer=cncore.RowWiseAdagrad(lr=0.1))
    rng = np.random.default_rng(11)
    awake_keys = np.arange(40_000, dtype=np.int64)
    outs = []
    for step in range(6):
        keys = (rng.zipf(1.2, 4096) % 3000).astype(np.int64)
        out, ctx = store.pooled_lookup(keys, lengths=np.full(4096 // (1 + step % 2), 1 + step % 2))
        if wake:
            store.find(awake_keys)
        else:
            time.sleep(0.002)
        store.apply_gradients(ctx, rng.standard_normal(out.shape).astype(np.float32))
        outs.append(out.copy())
    return outs, store.export()


def test_small_backward_identical_with_workers_asleep_or_awake(restore_threads):
    """A backward of fewer than 16384 keys runs on the calling thread while the workers sleep
    and on all threads while they are awake: both give the one-thread rows bit for bit."""
    outs1, exp1 = _train_small_batches(1, wake=False)
    for wake in (False, True):
        outs2, exp2 = _train_small_batches(2, wake=wake)
        for a, b in zip(outs1, outs2):
            np.testing.assert_array_equal(a, b)
        assert_same_table(exp1, exp2)


def test_concurrent_readers_agree_with_a_serial_read():
    rng = np.random.default_rng(4)
    store = cncore.EmbeddingStore(dim=16, seed=1)
    store.find_or_insert(np.arange(100_000))
    queries = [rng.integers(0, 120_000, 50_000) for _ in range(8)]
    lengths = np.full(5000, 10)
    expected = [store.pooled_lookup(q, lengths=lengths, insert_missing=False)[0] for q in queries]
    found = [store.contains(q) for q in queries]
    errors = []

    def reader(i):
        try:
            for _ in range(5):
                out, _ = store.pooled_lookup(queries[i], lengths=lengths, insert_missing=False)
                np.testing.assert_array_equal(out, expected[i])
                np.testing.assert_array_equal(store.contains(queries[i]), found[i])
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(store) == 100_000


def test_small_finds_keep_the_gil_beside_writers_without_deadlock():
    """A find of fewer than 4,096 keys keeps the GIL while it takes the table's lock (_core.pyx,
    _NOGIL_FROM), which is safe only because no thread holds that lock while waiting for the
    GIL. Small finds in threads beside writers that grow and rehash the table: every find sees
    the slots the keys had before (growth appends pages, slots stay), and nothing hangs. In a
    child with a timeout, so that a deadlock fails the test instead of stopping the run."""
    code = """
        import json, threading, numpy as np, cncore
        store = cncore.EmbeddingStore(dim=8, capacity=1)
        old = np.arange(10_000)
        slots = store.find_or_insert(old)[0]
        errors = []
        def reader(seed):
            rng = np.random.default_rng(seed)
            try:
                for _ in range(2_000):
                    pick = rng.integers(0, len(old), int(rng.integers(1, 4_000)))
                    got, found = store.find(old[pick])
                    assert found.all() and (got == slots[pick]).all()
            except Exception as exc:
                errors.append(exc)
        def writer(part):
            for chunk in np.array_split(part, 20):
                store.find_or_insert(chunk)
        new = np.array_split(np.arange(10_000, 410_000), 2)
        threads = [threading.Thread(target=reader, args=(i,)) for i in range(3)]
        threads += [threading.Thread(target=writer, args=(p,)) for p in new]
        for t in threads: t.start()
        for t in threads: t.join()
        print(json.dumps([len(errors), len(store)]))
    """
    assert run_isolated(code, timeout=120) == [0, 410_000]


def test_concurrent_writers_are_serialised():
    store = cncore.EmbeddingStore(dim=4, capacity=1)
    parts = np.array_split(np.arange(200_000), 8)
    threads = [threading.Thread(target=store.find_or_insert, args=(p,)) for p in parts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(store) == 200_000
    assert store.contains(np.arange(200_000)).all()


def test_nbytes_is_what_the_allocator_traced():
    gc.collect()
    base = cncore.traced_bytes()
    store = cncore.EmbeddingStore(dim=64, capacity=10, optimizer=cncore.RowWiseAdagrad())
    assert cncore.traced_bytes() - base == store.nbytes > 0
    store.find_or_insert(np.arange(300_000))
    assert cncore.traced_bytes() - base == store.nbytes
    row_bytes = (64 + 1) * 4
    assert store.nbytes >= 300_000 * row_bytes
    store.erase(np.arange(100_000))
    store.clear()
    assert cncore.traced_bytes() - base == store.nbytes  # clear keeps capacity
    del store
    gc.collect()
    assert cncore.traced_bytes() == base


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc and mmap")
def test_large_blocks_are_mapped_on_their_own_not_taken_from_the_heap():
    """A table's blocks of 2 MiB and more (row pages, index buckets) are mapped by themselves,
    even after the process freed a large array (glibc then serves blocks up to that size from its
    heap), and unmapped when the table goes: none of them in the heap, between short-lived buffers
    whose holes stay resident. In a child: a clean allocator, and mallinfo2 (glibc 2.33+)."""
    code = """
        import ctypes, gc, json, numpy as np, cncore
        libc = ctypes.CDLL(None)
        if not hasattr(libc, "mallinfo2"):
            print(json.dumps("skip")); raise SystemExit
        class Info(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in
                        "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
        libc.mallinfo2.restype = Info
        big = np.ones(2 << 20)  # 16 MiB, mapped by malloc, then freed: glibc's threshold rises to it
        del big
        heap = libc.mallinfo2().arena
        store = cncore.EmbeddingStore(dim=64, capacity=200_000)
        store.find_or_insert(np.arange(200_000))
        grown = libc.mallinfo2().arena - heap
        rss = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096
        before = rss(); nbytes = store.nbytes
        del store; gc.collect()
        print(json.dumps([nbytes, grown, before - rss()]))
    """
    out = run_isolated(code, timeout=120)
    if out == "skip":
        pytest.skip("no mallinfo2 (glibc before 2.33)")
    nbytes, heap_grown, returned = out
    assert nbytes > 50 << 20
    # The blocks under 2 MiB (the growth steps' smaller indexes, the free-slot stack) and the
    # call's NumPy arrays still come from the heap: 6.5 MB here, against 111 MB before.
    assert heap_grown < nbytes // 4, f"the heap grew by {heap_grown} bytes for a table of {nbytes}"
    assert returned > nbytes - (4 << 20), f"{returned} of the table's {nbytes} bytes went back to the system"


def test_backward_scratch_is_not_left_in_pool_workers_malloc_arenas():
    """The fused backward's per-share scratch (key positions, the grouping map: ~1 MiB a share at
    16k IDs) is allocated by the calling thread. A pool worker's malloc comes from its own glibc
    arena, which after a large free (thresholds raised) keeps its freed bytes resident until
    malloc_trim: 0.8 MB in each of 3 workers' arenas here before, none now. In a child, reading
    glibc's malloc_info."""
    code = """
        import ctypes, json, os, re, tempfile, numpy as np, cncore
        libc = ctypes.CDLL(None)
        if not hasattr(libc, "malloc_info"):
            print(json.dumps("skip")); raise SystemExit
        cncore.set_num_threads(4)
        big = np.ones(2 << 20); del big  # 16 MiB mapped and freed: glibc's thresholds rise
        store = cncore.EmbeddingStore(dim=64, optimizer=cncore.RowWiseAdagrad(lr=0.1), capacity=200_000)
        rng = np.random.default_rng(0)
        for _ in range(20):
            _, ctx = store.pooled_lookup(rng.integers(0, 200_000, 16384), lengths=np.full(1024, 16))
            store.apply_gradients(ctx, np.ones((1024, 64), np.float32))
        fd, path = tempfile.mkstemp(); os.close(fd)
        libc.fopen.restype = ctypes.c_void_p; libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
        fp = libc.fopen(path.encode(), b"w"); libc.malloc_info(0, ctypes.c_void_p(fp)); libc.fclose(ctypes.c_void_p(fp))
        xml = open(path).read(); os.unlink(path)
        arenas = re.findall(r'<heap nr="(\\d+)">.*?<system type="current" size="(\\d+)"/>', xml, re.S)
        print(json.dumps([len(store), sum(int(size) for nr, size in arenas if nr != "0")]))
    """
    out = run_isolated(code, timeout=120)
    if out == "skip":
        pytest.skip("no malloc_info (not glibc)")
    rows, in_other_arenas = out
    assert rows > 150_000
    assert in_other_arenas < 128 << 10, f"{in_other_arenas} bytes held by the pool workers' malloc arenas"


def test_impossible_reservation_raises_memory_error_and_keeps_the_store():
    store = cncore.EmbeddingStore(dim=4)
    store.insert_or_assign(np.array([1, 2]), np.ones((2, 4), np.float32))
    before = store.export()
    with pytest.raises(MemoryError):
        store.reserve(2**55)
    after = store.export()
    np.testing.assert_array_equal(before.keys, after.keys)
    np.testing.assert_array_equal(before.rows, after.rows)
    store.find_or_insert(np.arange(10_000))  # still usable; keys 1 and 2 were already there
    assert len(store) == 10_000
    np.testing.assert_array_equal(store.lookup(np.array([1, 2])), before.rows[np.argsort(before.keys)])


def test_erased_slots_are_reused_without_touching_live_rows():
    store = cncore.EmbeddingStore(dim=3, seed=2)
    store.find_or_insert(np.arange(1000))
    live = store.lookup(np.arange(500, 1000))
    store.erase(np.arange(500))
    cap = store.nbytes
    store.find_or_insert(np.arange(2000, 2500))
    assert store.nbytes == cap  # freed slots reused, no new pages
    np.testing.assert_array_equal(store.lookup(np.arange(500, 1000)), live)
    fresh = cncore.EmbeddingStore(dim=3, seed=2).lookup(np.arange(2000, 2500), insert_missing=True)
    np.testing.assert_array_equal(store.lookup(np.arange(2000, 2500)), fresh)


@pytest.mark.parametrize("init,check", [
    (cncore.Uniform(-0.2, 0.3), lambda v: v.min() >= -0.2 and v.max() < 0.3 and abs(v.mean() - 0.05) < 2e-3
     and abs(v.std() - 0.5 / np.sqrt(12)) < 2e-3),
    (cncore.Normal(0.5, 2.0), lambda v: abs(v.mean() - 0.5) < 0.02 and abs(v.std() - 2.0) < 0.02
     and abs(np.mean(np.abs(v - 0.5) < 2.0) - 0.6827) < 0.005),
    (cncore.TruncatedNormal(0.0, 1.0, -1.0, 2.0), lambda v: v.min() >= -1.0 and v.max() <= 2.0
     and abs(v.mean() - 0.2296) < 0.01),
    (cncore.Constant(0.25), lambda v: (v == 0.25).all()),
])
def test_initializers_draw_the_requested_distribution(init, check):
    store = cncore.EmbeddingStore(dim=32, seed=8, initializer=init)
    values = store.lookup(np.arange(20_000), insert_missing=True).ravel().astype(np.float64)
    assert check(values)
    # columns are not correlated with each other (each column is its own draw)
    rows = values.reshape(20_000, 32)
    corr = np.corrcoef(rows[:, 0], rows[:, 1])[0, 1] if not isinstance(init, cncore.Constant) else 0.0
    assert abs(corr) < 0.05

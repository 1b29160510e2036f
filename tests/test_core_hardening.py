"""Regression tests for the core's hardening (issue 9): each failed (crash, hang, silent loss or
wrong value) on the code before it. Calls that could crash run in a subprocess, so a segfault
fails the test instead of killing the run.
"""
import dataclasses
import math

import numpy as np
import pytest
from reference import assert_unchanged, run_isolated, snapshot

import cncore

# --- 1. an erase racing a training step --------------------------------------------------------

def test_erase_racing_training_never_crashes_and_refuses_stale_updates():
    """The issue's reproducer: one thread trains on keys 0..999 (lookup + fused update), another
    erases random keys of the same range. Before, the stale-context check ran in Python before
    the core's lock and the forward read the epoch after releasing it: 11 of 12 runs crashed.
    Now every update either applies or raises the stale-context RuntimeError, and the table
    stays consistent."""
    result = run_isolated("""
        import json, threading, time
        import numpy as np, cncore
        store = cncore.EmbeddingStore(dim=16, optimizer=cncore.Adagrad(lr=0.1), capacity=64)
        stop = time.monotonic() + 3.0
        counts = {"applied": 0, "stale": 0, "erased": 0}
        errors = []
        def train():
            rng = np.random.default_rng(1)
            while time.monotonic() < stop:
                keys = rng.integers(0, 1000, 256)
                out, ctx = store.pooled_lookup(keys, lengths=np.full(32, 8))
                try:
                    store.apply_gradients(ctx, np.ones_like(out))
                    counts["applied"] += 1
                except RuntimeError as exc:
                    if "erased" not in str(exc):
                        errors.append(repr(exc))
                    counts["stale"] += 1
        def erase():
            rng = np.random.default_rng(2)
            while time.monotonic() < stop:
                counts["erased"] += int(store.erase(rng.integers(0, 1000, 16)).sum())
        threads = [threading.Thread(target=train), threading.Thread(target=erase)]
        [t.start() for t in threads]; [t.join() for t in threads]
        batch = store.export()
        keys = np.sort(batch.keys)
        print(json.dumps(dict(counts, errors=errors, n=len(store), unique=len(np.unique(keys)) == len(keys),
                              in_range=bool(((keys >= 0) & (keys < 1000)).all()),
                              finite=bool(np.isfinite(batch.rows).all() and np.isfinite(batch.optimizer_state).all()),
                              found=bool(store.contains(batch.keys).all()), exported=len(batch.keys))))
    """)
    assert result["errors"] == []
    assert result["applied"] > 0 and result["erased"] > 0
    assert result["unique"] and result["in_range"] and result["finite"] and result["found"]
    assert result["exported"] == result["n"]


def _stress_worker_code(seconds: float) -> str:
    return f"""
        import json, threading, time
        import numpy as np, cncore
        DIM = 8
        store = cncore.EmbeddingStore(dim=DIM, optimizer=cncore.SGD(lr=0.5), initializer=cncore.Uniform(-1, 1),
                                      seed=3, capacity=16)
        stop = time.monotonic() + {seconds}
        logs = {{"train": [], "insert": [], "erase": [], "export_restarts": 0, "exports": 0}}
        def train():       # keys [0, 5000): lookups + fused SGD; an update refused as stale is logged as such
            rng = np.random.default_rng(11)
            while time.monotonic() < stop:
                keys = rng.integers(0, 5000, 64)
                grad = rng.standard_normal((8, DIM)).astype(np.float32)
                out, ctx = store.pooled_lookup(keys, lengths=np.full(8, 8))
                try:
                    store.apply_gradients(ctx, grad)
                    applied = True
                except RuntimeError:
                    applied = False
                logs["train"].append((keys.tolist(), grad.tolist(), applied))
        def insert():      # keys [10**9, ...): insert_or_assign of fresh rows
            rng = np.random.default_rng(12)
            while time.monotonic() < stop:
                keys = 10**9 + rng.integers(0, 20000, 128)
                rows = rng.standard_normal((128, DIM)).astype(np.float32)
                store.insert_or_assign(keys, rows)
                logs["insert"].append((keys.tolist(), rows.tolist()))
        def erase():       # keys [-10**6, ...): inserts, then erases some (bumps the erase epoch)
            rng = np.random.default_rng(13)
            while time.monotonic() < stop:
                keys = -10**6 + rng.integers(0, 3000, 64)
                store.find_or_insert(keys)
                gone = rng.integers(0, 3000, 48) - 10**6
                store.erase(gone)
                logs["erase"].append((keys.tolist(), gone.tolist()))
        def export():      # cursor walks; a walk that meets a change restarts
            while time.monotonic() < stop:
                try:
                    cursor = None
                    while True:
                        batch = store.export(cursor, 997)
                        cursor = batch.next_cursor
                        if cursor is None:
                            break
                    logs["exports"] += 1
                except RuntimeError:
                    logs["export_restarts"] += 1
        def grow():        # reserve larger and larger (index rehash, new pages) while others run
            n = 1024
            while time.monotonic() < stop and n < 200000:
                store.reserve(n); n = int(n * 1.5); time.sleep(0.01)
        threads = [threading.Thread(target=f) for f in (train, insert, erase, export, grow)]
        [t.start() for t in threads]; [t.join() for t in threads]
        final = store.export()
        order = np.argsort(final.keys)
        print(json.dumps(dict(logs=logs, keys=final.keys[order].tolist(), rows=final.rows[order].tolist(),
                              step=store.step)))
    """


def test_threaded_stress_equals_a_serial_replay_of_each_thread():
    """Training steps, inserts, erases, cursor exports and growth on one store from five threads.
    Each thread owns a key range, so the final table is the union of the threads' own serial
    replays (the training replay applies exactly the updates the run applied; a stale refusal
    means no update, and the rows it inserted stay). Every row must equal its replay."""
    out = run_isolated(_stress_worker_code(2.5), timeout=120)
    logs = out["logs"]
    assert logs["train"] and logs["insert"] and logs["erase"] and logs["exports"] + logs["export_restarts"] > 0
    replay = cncore.EmbeddingStore(dim=8, optimizer=cncore.SGD(lr=0.5), initializer=cncore.Uniform(-1, 1), seed=3)
    applied = 0
    for keys, grad, ok in logs["train"]:
        _, ctx = replay.pooled_lookup(np.array(keys), lengths=np.full(8, 8))
        if ok:
            replay.apply_gradients(ctx, np.array(grad, dtype=np.float32))
            applied += 1
    for keys, rows in logs["insert"]:
        replay.insert_or_assign(np.array(keys), np.array(rows, dtype=np.float32))
    for keys, gone in logs["erase"]:
        replay.find_or_insert(np.array(keys))
        replay.erase(np.array(gone))
    want = replay.export()
    order = np.argsort(want.keys)
    np.testing.assert_array_equal(np.array(out["keys"]), want.keys[order])
    np.testing.assert_array_equal(np.array(out["rows"], dtype=np.float32), want.rows[order])
    assert out["step"] == applied


# --- 4. export cursors ------------------------------------------------------------------------------

@pytest.mark.parametrize("position", [-1, -(2**40), 2**40])
def test_export_cursor_outside_the_index_is_refused(position):
    result = run_isolated(f"""
        import json, numpy as np, cncore
        s = cncore.EmbeddingStore(dim=4); s.find_or_insert(np.arange(100))
        first = s.export(max_rows=10)
        try:
            s.export(({position}, first.next_cursor[1]), 10); print(json.dumps({{"error": None}}))
        except Exception as exc:
            print(json.dumps({{"error": type(exc).__name__, "msg": str(exc), "n": len(s)}}))
    """)
    assert result["error"] == "ValueError" and "cursor" in result["msg"] and result["n"] == 100


def test_export_cursor_of_another_store_is_refused_as_stale():
    a, b = cncore.EmbeddingStore(dim=2), cncore.EmbeddingStore(dim=2)
    a.find_or_insert(np.arange(50))
    b.find_or_insert(np.arange(50))
    cursor = a.export(max_rows=5).next_cursor
    with pytest.raises(RuntimeError, match="restart the export"):
        b.export(cursor, 5)


# --- 5. grouped backward: the gradient is checked against every context ------------------------------

@pytest.mark.parametrize("n_bags", [1000, 2_000_000])
def test_grouped_backward_checks_every_context_against_the_gradient(n_bags):
    result = run_isolated(f"""
        import json, numpy as np, cncore
        a = cncore.EmbeddingStore(dim=4, optimizer=cncore.SGD(lr=1.0))
        b = cncore.EmbeddingStore(dim=4, optimizer=cncore.SGD(lr=1.0))
        _, (ca,) = cncore.grouped_pooled_lookup([a], [np.array([1, 2])], lengths=[np.array([1, 1])])[0:2]
        _, (cb,) = cncore.grouped_pooled_lookup([b], [np.arange({n_bags})], lengths=[np.ones({n_bags}, np.int64)])
        before = b.export().rows.copy()
        try:
            cncore.grouped_apply_gradients([ca, cb], np.zeros((2, 4), np.float32)); err = None
        except Exception as exc:
            err = (type(exc).__name__, str(exc))
        print(json.dumps({{"err": err, "unchanged": bool((b.export().rows == before).all())}}))
    """, timeout=120)
    assert result["err"][0] == "ValueError" and "ctxs[1]" in result["err"][1]
    assert result["unchanged"]


# --- 6. contexts own their arrays; forged contexts are refused -----------------------------------------

def _trained_pair(mode="sum"):
    def make():
        return cncore.EmbeddingStore(dim=3, optimizer=cncore.Adagrad(lr=0.3), initializer=cncore.Uniform(-1, 1))
    return make(), make()


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_mutating_the_callers_arrays_after_the_lookup_changes_nothing(mode):
    mutated, clean = _trained_pair()
    keys = np.array([5, 7, 5, 9, 11], dtype=np.int64)
    offsets = np.array([0, 2, 5], dtype=np.int64)
    weights = np.array([0.5, 1.0, 2.0, -1.0, 3.0], dtype=np.float32)
    grad = np.arange(6, dtype=np.float32).reshape(2, 3)
    _, ctx = mutated.pooled_lookup(keys, offsets, per_sample_weights=weights, mode=mode)
    _, ref = clean.pooled_lookup(keys.copy(), offsets.copy(), per_sample_weights=weights.copy(), mode=mode)
    keys[:] = 123456
    offsets[:] = [0, 5, 2**40]
    weights[:] = 100.0
    got_keys, got_grads = mutated.accumulate_gradients(ctx, grad)
    want_keys, want_grads = clean.accumulate_gradients(ref, grad)
    assert got_keys.tolist() == want_keys.tolist() == [5, 7, 9, 11]
    np.testing.assert_array_equal(got_grads, want_grads)
    mutated.apply_gradients(ctx, grad)
    clean.apply_gradients(ref, grad)
    assert_unchanged(mutated, snapshot(clean))


@pytest.mark.parametrize("field, value", [
    ("slots", "np.full_like(ctx.slots, 10**12)"),
    ("slots", "np.full_like(ctx.slots, -5)"),
    ("slots", "ctx.slots[:1]"),
    ("offsets", "np.array([0, 2**40, 4])"),
    ("offsets", "np.array([0, 3, 1, 4])[:3]"),
    ("argmax", "np.zeros((1, 1), np.int64)"),
    ("weights", "np.ones(1, np.float32)"),
    ("mode", "7"),
    ("erase_epoch", "ctx.erase_epoch + 1"),
])
def test_a_forged_context_is_refused_with_the_table_unchanged(field, value):
    result = run_isolated(f"""
        import dataclasses, json, numpy as np, cncore
        s = cncore.EmbeddingStore(dim=4, optimizer=cncore.Adam(lr=0.1))
        _, ctx = s.pooled_lookup(np.array([1, 2, 3, 4]), np.array([0, 2, 4]), mode="max")
        ctx = dataclasses.replace(ctx, {field}={value})
        before = s.export()
        results = []
        for call in ("apply", "accumulate"):
            try:
                if call == "apply":
                    s.apply_gradients(ctx, np.ones((2, 4), np.float32))
                else:
                    s.accumulate_gradients(ctx, np.ones((2, 4), np.float32))
                results.append(None)
            except Exception as exc:
                results.append([type(exc).__name__, str(exc)])
        after = s.export()
        same = all(np.array_equal(getattr(before, f), getattr(after, f))
                   for f in ("keys", "rows", "optimizer_state", "counts", "last_steps"))
        print(json.dumps({{"results": results, "same": same, "step": s.step}}))
    """)
    for res in result["results"]:
        assert res is not None and res[0] in ("ValueError", "TypeError", "RuntimeError"), res
    assert result["same"] and result["step"] == 0


@pytest.mark.parametrize("how", ["erase", "clear"])
def test_a_stale_context_is_refused_with_the_table_unchanged(how):
    store = cncore.EmbeddingStore(dim=2, optimizer=cncore.SGD(lr=1.0))
    _, ctx = store.pooled_lookup(np.array([1, 2, 3]), lengths=np.array([3]))
    if how == "erase":
        store.erase(np.array([2]))
    else:
        store.clear()
    before = snapshot(store)
    with pytest.raises(RuntimeError, match="erased"):
        store.apply_gradients(ctx, np.ones((1, 2), np.float32))
    with pytest.raises(RuntimeError, match="erased"):
        store.accumulate_gradients(ctx, np.ones((1, 2), np.float32))
    assert_unchanged(store, before)


def test_a_context_is_opaque_copies_and_replacements_are_refused():
    """Epochs are unique per store (a store with the same history had the same epoch before, so
    a context moved to it passed, as a module moved between devices did); and a context cannot
    be rebuilt with other fields or arrays: only a lookup makes one."""
    import copy
    store = cncore.EmbeddingStore(dim=2, optimizer=cncore.SGD(lr=1.0))
    other = cncore.EmbeddingStore(dim=2, optimizer=cncore.SGD(lr=1.0))
    _, ctx = store.pooled_lookup(np.array([1, 2, 3]), lengths=np.array([3]))
    _, other_ctx = other.pooled_lookup(np.array([1, 2, 3]), lengths=np.array([3]))
    assert ctx.erase_epoch != other_ctx.erase_epoch
    # A lookup writes its context's fields straight into __dict__ (cncore.grouped._sealed): the
    # dataclass's fields, every one, and nothing else beside the seal.
    assert set(vars(ctx)) == {f.name for f in dataclasses.fields(ctx)} | {"_seal"}
    assert (ctx.store, ctx.mode, ctx.columns, ctx.n_new, ctx.training, ctx.step) == (store, 0, slice(0, 2), 3, True, 0)
    before = snapshot(other)
    grad = np.ones((1, 2), np.float32)
    with pytest.raises(ValueError, match="another store"):
        other.apply_gradients(ctx, grad)
    with pytest.raises(ValueError, match="not made by a lookup|another store"):
        other.apply_gradients(copy.deepcopy(other_ctx), grad)
    for forged in (dataclasses.replace(ctx, store=other), dataclasses.replace(other_ctx, mode=1)):
        with pytest.raises(ValueError, match="not made by a lookup"):
            other.apply_gradients(forged, grad)
        with pytest.raises(ValueError, match="not made by a lookup"):
            other.accumulate_gradients(forged, grad)
    for array in (other_ctx.keys, other_ctx.slots, other_ctx.offsets):
        with pytest.raises(ValueError, match="read-only"):
            array[0] = 5
    assert_unchanged(other, before)
    other.apply_gradients(other_ctx, grad)
    assert other.step == 1


# --- 7. sizes: overflow and what the machine can hold -------------------------------------------------

@pytest.mark.parametrize("n_rows", [2**62, int(0.7 * 2**62) + 1, int(0.7 * 2**60), int(0.7 * 2**59) + 1, 2**40])
def test_huge_reserve_is_refused_quickly_with_the_store_unchanged(n_rows):
    result = run_isolated(f"""
        import json, numpy as np, cncore
        s = cncore.EmbeddingStore(dim=8); s.find_or_insert(np.arange(10))
        cap, nbytes = s.capacity, s.nbytes
        try:
            s.reserve({n_rows}); err = None
        except MemoryError as exc:
            err = str(exc)
        print(json.dumps({{"err": err, "same": (s.capacity, s.nbytes, len(s)) == (cap, nbytes, 10),
                          "contains": s.contains(np.arange(12)).tolist()}}))
    """, timeout=30)
    assert result["err"] is not None and "n_rows" in result["err"] and "unchanged" in result["err"]
    assert result["same"]
    assert result["contains"] == [True] * 10 + [False] * 2


@pytest.mark.parametrize("capacity, error", [(2**62, "ValueError"), (2**56, "MemoryError"), (2**45, "MemoryError")])
def test_huge_capacity_is_refused_at_construction(capacity, error):
    """Past the index's bound, the config refuses it; below, what the machine cannot hold is
    refused before any allocation (with overcommit, the first memset of it killed the process)."""
    result = run_isolated(f"""
        import json, cncore
        try:
            cncore.EmbeddingStore(dim=8, capacity={capacity}); print(json.dumps(None))
        except (MemoryError, ValueError) as exc:
            print(json.dumps([type(exc).__name__, str(exc)]))
    """, timeout=30)
    assert result is not None and result[0] == error and "capacity" in result[1]


# --- 10. thread counts ---------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [0, -1, 1025, 32768, 65536, 1.5, True])
def test_set_num_threads_refuses_what_the_runtime_cannot_run(n):
    previous = cncore.get_num_threads()
    with pytest.raises(ValueError, match=r"n must be an int in \[1, 1024\]"):
        cncore.set_num_threads(n)
    assert cncore.get_num_threads() == previous


# --- 17. truncated normal in a tail --------------------------------------------------------------------

def _truncated_cdf(x, mean, std, low, high):
    phi = lambda z: 0.5 * math.erfc(-(z - mean) / std / math.sqrt(2))  # noqa: E731
    return (phi(x) - phi(low)) / (phi(high) - phi(low))


@pytest.mark.parametrize("mean, std, low, high", [(0.0, 1.0, 3.9, 3.96), (0.0, 1.0, -2.0, 2.0), (1.0, 0.5, -3.0, 0.2),
                                                  (0.0, 1.0, -9.0, -8.5)])
def test_truncated_normal_follows_its_distribution_in_the_tails(mean, std, low, high):
    """Kolmogorov-Smirnov distance of 64,000 draws to the exact truncated CDF. Rejection
    sampling pinned 98.9 % of the (3.9, 3.96) draws at `low` (distance ~0.99)."""
    init = cncore.TruncatedNormal(mean, std, low, high)
    rows = cncore.initial_rows(cncore.StoreConfig(dim=64, initializer=init, seed=5), np.arange(1000))
    x = np.sort(rows.ravel().astype(np.float64))
    assert x[0] >= np.float32(low) and x[-1] <= np.float32(high)
    cdf = np.array([_truncated_cdf(v, mean, std, low, high) for v in x])
    n = len(x)
    ks = max(np.max(np.arange(1, n + 1) / n - cdf), np.max(cdf - np.arange(n) / n))
    assert ks < 0.01, ks          # the 99.9 % critical value at n = 64,000 is 0.0077
    assert np.mean(x == np.float32(low)) < 0.001


# --- 21. validation of numbers and flags ------------------------------------------------------------------

@pytest.mark.parametrize("make", [
    lambda: cncore.SGD(lr=True), lambda: cncore.SGD(lr=1e39), lambda: cncore.Constant(1e39),
    lambda: cncore.Uniform(-1e39, 1e39), lambda: cncore.Uniform(-3e38, 3e38), lambda: cncore.Normal(0, 1e39),
    lambda: cncore.Normal(0, 1e38), lambda: cncore.Adagrad(eps=float("nan")), lambda: cncore.Adam(betas=(0.9,)),
])
def test_numbers_a_float32_row_cannot_hold_are_refused(make):
    with pytest.raises(ValueError, match="must be"):
        make()


def test_numpy_scalars_are_accepted_and_stored_as_python_floats():
    opt = cncore.SGD(lr=np.float32(0.25))
    assert opt.lr == 0.25 and type(opt.lr) is float
    assert cncore.Adam(betas=(np.float64(0.8), 0.9)).betas == (0.8, 0.9)


def test_an_lr_override_must_be_a_number_not_a_bool():
    store = cncore.EmbeddingStore(dim=2, optimizer=cncore.SGD(lr=0.1))
    _, ctx = store.pooled_lookup(np.array([1]), lengths=np.array([1]))
    before = snapshot(store)
    for bad in (True, 1e39, float("nan"), -1.0, "0.1"):
        with pytest.raises(ValueError, match="lr must be"):
            store.apply_gradients(ctx, np.ones((1, 2), np.float32), lr=bad)
    assert_unchanged(store, before)
    store.apply_gradients(ctx, np.ones((1, 2), np.float32), lr=np.float32(0.5))
    assert store.step == 1


def test_insert_missing_takes_only_bools():
    store = cncore.EmbeddingStore(dim=2)
    for bad in ("no", 0, None, 1.0):
        with pytest.raises(TypeError, match="insert_missing must be True or False"):
            store.lookup(np.array([1]), insert_missing=bad)
        with pytest.raises(TypeError, match="insert_missing must be True or False"):
            store.pooled_lookup(np.array([1]), lengths=np.array([1]), insert_missing=bad)
    assert len(store) == 0
    store.lookup(np.array([1]), insert_missing=np.bool_(True))
    assert len(store) == 1


def test_optimizer_state_for_a_stateless_store_must_be_empty():
    store = cncore.EmbeddingStore(dim=2, optimizer=cncore.SGD())
    with pytest.raises(ValueError, match="optimizer_state"):
        store.load(np.array([1]), np.ones((1, 2), np.float32), np.ones((1, 2), np.float32))
    assert len(store) == 0
    batch = cncore.EmbeddingStore(dim=2, optimizer=cncore.SGD()).export()
    store.load(batch.keys, batch.rows, batch.optimizer_state)   # (0, 0): what its own export gives


def test_steps_stop_at_uint32_max_where_a_rows_last_step_would_saturate():
    """A row's last step is 32 bits: a step past 2**32 - 1 is refused (a saturated last step
    dropped rows from delta saves and let TTL evict rows trained in the current step); the last
    training step records its step exactly."""
    store = cncore.EmbeddingStore(dim=2, optimizer=cncore.SGD(lr=0.0))
    with pytest.raises(ValueError, match=r"step: 4294967301 is outside \[0, 4294967295\]"):
        store.step = 2**32 + 5
    store.step = 2**32 - 2
    _, ctx = store.pooled_lookup(np.array([1]), lengths=np.array([1]))
    store.apply_gradients(ctx, np.ones((1, 2), np.float32))
    assert store.read(np.array([1])).last_steps.tolist() == [2**32 - 2] and store.step == 2**32 - 1


def test_lengths_that_do_not_add_up_to_the_keys_are_refused():
    store = cncore.EmbeddingStore(dim=2)
    with pytest.raises(ValueError, match=r"lengths\[0\]: must add up to len\(keys\[0\]\) = 3"):
        store.pooled_lookup(np.array([1, 2, 3]), lengths=np.array([1, 1]))
    assert len(store) == 0


def test_a_whole_export_is_atomic_while_another_thread_inserts():
    """`export()` (every row) sized its arrays and read the version outside the lock: with a
    writer inserting meanwhile it raised "changed since this export began" (a torch state_dict
    taken during training in another thread failed) or could return part of the table. Now it
    is one atomic snapshot: every exported key was present, and the count only grows."""
    import threading
    store = cncore.EmbeddingStore(dim=4, capacity=16)
    done = threading.Event()
    inserted = []

    def insert():  # at most 200 batches (51,200 keys): the exports stay cheap
        rng = np.random.default_rng(0)
        for _ in range(200):
            if done.is_set():
                break
            store.find_or_insert(rng.integers(0, 2**62, 256))
            inserted.append(1)

    writer = threading.Thread(target=insert)
    writer.start()
    sizes, errors = [], []
    try:
        while len(inserted) < 2:
            threading.Event().wait(0.001)
        while len(sizes) < 20 and writer.is_alive():
            try:
                batch = store.export()
            except RuntimeError as exc:
                errors.append(str(exc))
                break
            assert batch.next_cursor is None
            assert len(np.unique(batch.keys)) == len(batch.keys) == len(batch.rows)
            sizes.append(len(batch.keys))
    finally:
        done.set()
        writer.join()
    assert errors == []
    assert len(sizes) >= 1 and sizes == sorted(sizes) and sizes[0] > 0
    assert len(store.export().keys) == len(store)

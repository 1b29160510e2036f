"""cncore_jax against a dense jnp reference: the same rows in a dense array, pooled with
`jnp.take` + `jax.ops.segment_sum` / `segment_max`, differentiated by JAX itself, and updated
with the optimizers' formulas (cython_src/include/cn_optim.h) written out in NumPy."""
import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import cncore  # noqa: E402
import cncore_jax as cj  # noqa: E402

jax.config.update("jax_enable_x64", True)


from jax_routes import no_context_left_waiting, route  # noqa: E402,F401  (the fixtures)

DIM = 4
VOCAB = np.array([-(2**63), -7, 0, 3, 11, 2**40, 2**63 - 1], dtype=np.int64)
OPTIMIZERS = {
    "sgd": cncore.SGD(lr=0.3),
    "adagrad": cncore.Adagrad(lr=0.2, eps=1e-6, initial_accumulator_value=0.1),
    "rowwise": cncore.RowWiseAdagrad(lr=0.2, eps=1e-6, initial_accumulator_value=0.1),
    "adam": cncore.Adam(lr=0.05, betas=(0.8, 0.9), eps=1e-6),
}


def make_table(optimizer=None, seed=3):
    return cj.Table(dim=DIM, optimizer=optimizer, seed=seed, initializer=cncore.Uniform(-1.0, 1.0))


def batch(rng, n_bags=5, max_len=4, pad=2):
    """IDs drawn from VOCAB (duplicates within and across bags), some empty bags, `pad`
    padding IDs after the last bag; lengths and offsets of the same bags."""
    lengths = rng.integers(0, max_len + 1, n_bags)
    lengths[rng.integers(0, n_bags)] = 0
    idx = rng.integers(0, len(VOCAB), int(lengths.sum()) + pad)
    weights = rng.uniform(-1.0, 2.0, len(idx)).astype(np.float32)
    return idx, lengths, weights


def dense_pool(R, idx, lengths, mode, weights):
    n_bags = len(lengths)
    used = int(lengths.sum())
    seg = jnp.asarray(np.repeat(np.arange(n_bags), lengths))
    rows = jnp.take(R, jnp.asarray(idx[:used]), axis=0)
    if weights is not None:
        rows = rows * weights[:used, None]
    if mode == "max":
        m = jax.ops.segment_max(rows, seg, n_bags)
        return jnp.where(jnp.asarray(lengths)[:, None] > 0, m, 0.0)
    s = jax.ops.segment_sum(rows, seg, n_bags)
    if mode == "mean":
        s = s / jnp.maximum(jnp.asarray(lengths), 1)[:, None]
    return s


def initial_dense(table):
    return jnp.asarray(cncore.initial_rows(table.config, VOCAB))


CASES = [("sum", False), ("sum", True), ("mean", False), ("mean", True), ("max", False)]


@pytest.mark.parametrize("mode,weighted", CASES)
def test_forward_and_gradients_equal_the_dense_reference(route, mode, weighted):
    rng = np.random.default_rng(0)
    table = make_table()
    R = initial_dense(table)
    idx, lengths, w = batch(rng)
    ids = jnp.asarray(VOCAB[idx])
    w = jnp.asarray(w) if weighted else None
    G = jnp.asarray(rng.normal(size=(len(lengths), DIM)).astype(np.float32))

    def loss(weights, sink):
        out, ctx = cj.lookup(table, ids, jnp.asarray(lengths), mode=mode, weights=weights, sink=sink)
        return (out * G).sum(), (out, ctx)

    sink = jnp.zeros((len(lengths), DIM))
    (_, (out, ctx)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(w, sink)
    np.testing.assert_allclose(out, dense_pool(R, idx, lengths, mode, w), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(grads[1], G)  # the sink's cotangent: the gradient of the pooled rows

    ref_rows, ref_w = jax.grad(lambda R, w: (dense_pool(R, idx, lengths, mode, w) * G).sum(),
                               argnums=(0, 1) if weighted else (0,))(R, w)[0], None
    if weighted:
        ref_w = jax.grad(lambda w: (dense_pool(R, idx, lengths, mode, w) * G).sum())(w)
        np.testing.assert_allclose(grads[0], ref_w, rtol=1e-5, atol=1e-6)
        assert (np.asarray(grads[0])[lengths.sum():] == 0).all()  # padding has no gradient

    # the non-fused backward: each distinct row's gradient, first-occurrence order
    (sg,) = jax.jit(cj.accumulate_gradients)(ctx, grads[1])
    used = idx[:lengths.sum()]
    order = list(dict.fromkeys(used.tolist()))
    assert int(sg.count) == len(order)
    np.testing.assert_array_equal(sg.ids[:len(order)], VOCAB[order])
    np.testing.assert_allclose(sg.rows[:len(order)], np.asarray(ref_rows)[order], rtol=1e-5, atol=1e-6)
    assert (np.asarray(sg.rows)[len(order):] == 0).all()


def reference_update(name, opt, R, state, grad, touched, t):
    """One lazy step of cn_optim.h's formulas on the rows in `touched`."""
    R, g = np.array(R), np.asarray(grad)
    for i in touched:
        if name == "sgd":
            R[i] -= opt.lr * g[i]
        elif name == "adagrad":
            state[i] += g[i] * g[i]
            R[i] -= opt.lr * g[i] / (np.sqrt(state[i]) + opt.eps)
        elif name == "rowwise":
            state[i] += np.mean(g[i] * g[i])
            R[i] -= opt.lr / (np.sqrt(state[i][0]) + opt.eps) * g[i]
        else:
            b1, b2 = opt.betas
            m, v = state[i][:DIM], state[i][DIM:]
            m[:] = b1 * m + (1 - b1) * g[i]
            v[:] = b2 * v + (1 - b2) * g[i] * g[i]
            R[i] -= opt.lr / (1 - b1**t) * m / (np.sqrt(v) / np.sqrt(1 - b2**t) + opt.eps)
    return jnp.asarray(R)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("mode,weighted", CASES)
def test_k_fused_steps_equal_the_dense_reference(route, name, mode, weighted):
    opt = OPTIMIZERS[name]
    table = make_table(opt)
    R = initial_dense(table)
    floats = {"sgd": 0, "adagrad": DIM, "rowwise": 1, "adam": 2 * DIM}[name]
    state = np.full((len(VOCAB), floats), getattr(opt, "initial_state", 0.0), dtype=np.float64)
    rng = np.random.default_rng(1)

    @jax.jit
    def step(ids, lengths, weights, G):
        out, ctx = cj.lookup(table, ids, lengths, mode=mode, weights=weights)
        _, g = jax.value_and_grad(lambda o: (o * G).sum())(out)
        cj.apply_gradients(ctx, g)
        return out

    for t in range(1, 5):
        idx, lengths, w = batch(rng, pad=0)  # one shape per step count is fine: jit retraces
        w = jnp.asarray(w) if weighted else None
        G = jnp.asarray(rng.normal(size=(len(lengths), DIM)).astype(np.float32))
        out = step(jnp.asarray(VOCAB[idx]), jnp.asarray(lengths), w, G)
        np.testing.assert_allclose(out, dense_pool(R, idx, lengths, mode, w), rtol=1e-5, atol=1e-5)
        grad = jax.grad(lambda R: (dense_pool(R, idx, lengths, mode, w) * G).sum())(R)
        R = reference_update(name, opt, R, state, grad, sorted(set(idx[:lengths.sum()].tolist())), t)
    present = table.store.contains(VOCAB)
    got = table.store.lookup(VOCAB)
    np.testing.assert_allclose(got[present], np.asarray(R)[present], rtol=1e-5, atol=1e-5)
    assert table.store.step == 4


def test_offsets_equal_lengths_and_empty_batches(route):
    table = make_table(cncore.SGD(lr=0.1))
    ids = jnp.asarray(VOCAB[[1, 2, 2, 5]])
    a, _ = cj.lookup(table, ids, jnp.array([0, 3, 1]))
    b, _ = cj.lookup(table, ids, offsets=jnp.array([0, 0, 3, 4]))
    np.testing.assert_array_equal(a, b)
    empty, ctx = cj.lookup(table, jnp.zeros(0, jnp.int64), jnp.zeros(3, jnp.int64))
    assert empty.shape == (3, DIM) and not np.asarray(empty).any()
    cj.apply_gradients(ctx, jnp.ones((3, DIM)))


def test_int32_ids_are_widened_and_eval_inserts_nothing():
    table = make_table()
    out, _ = cj.lookup(table, jnp.array([5, 6], jnp.int32), jnp.array([2], jnp.int32), training=False)
    assert len(table) == 0 and not np.asarray(out).any()
    out, _ = cj.lookup(table, jnp.array([5, 6], jnp.int32), jnp.array([2], jnp.int32))
    assert sorted(table.store.export().keys.tolist()) == [5, 6]
    np.testing.assert_allclose(out[0], table.store.lookup(np.array([5, 6])).sum(0), rtol=1e-6)
    again, _ = cj.lookup(table, jnp.array([5, 6, 9], jnp.int32), jnp.array([3], jnp.int32), training=False)
    np.testing.assert_allclose(again, out, rtol=1e-6)  # 9 unseen: a zero row, not inserted
    assert len(table) == 2


def test_grouped_lookup_writes_each_table_in_its_columns(route):
    a, b = make_table(cncore.SGD(lr=1.0), seed=1), cj.Table(dim=2, optimizer=cncore.SGD(lr=1.0))
    out, ctx = cj.grouped_lookup([a, b], [jnp.array([1, 2]), jnp.array([3])], [jnp.array([2, 0]), jnp.array([0, 1])],
                                 modes=["sum", "mean"])
    assert out.shape == (2, DIM + 2)
    np.testing.assert_allclose(out[0, :DIM], a.store.lookup(np.array([1, 2])).sum(0), rtol=1e-6)
    np.testing.assert_allclose(out[1, DIM:], b.store.lookup(np.array([3]))[0], rtol=1e-6)
    before = b.store.lookup(np.array([3]))
    cj.apply_gradients(ctx, jnp.ones((2, DIM + 2)))
    np.testing.assert_allclose(b.store.lookup(np.array([3])), before - 1.0, rtol=1e-6)


def test_the_non_fused_path_feeds_optax_and_equals_the_fused_update():
    optax = pytest.importorskip("optax")
    fused, manual = make_table(cncore.SGD(lr=0.3)), make_table(None)
    tx = optax.sgd(0.3)
    rng = np.random.default_rng(4)
    for _ in range(3):
        idx, lengths, _ = batch(rng)
        ids, lens = jnp.asarray(VOCAB[idx]), jnp.asarray(lengths)
        G = jnp.asarray(rng.normal(size=(len(lengths), DIM)).astype(np.float32))
        out, ctx = cj.lookup(fused, ids, lens, mode="mean")
        cj.apply_gradients(ctx, G)
        out, ctx = cj.lookup(manual, ids, lens, mode="mean")
        (g,) = jax.jit(cj.accumulate_gradients)(ctx, G)
        n = int(g.count)
        keys = np.asarray(g.ids[:n])
        rows = jnp.asarray(manual.store.lookup(keys))
        updates, _ = tx.update(g.rows[:n], tx.init(rows), rows)
        manual.store.assign(keys, np.asarray(optax.apply_updates(rows, updates)))
    np.testing.assert_allclose(manual.store.lookup(VOCAB), fused.store.lookup(VOCAB), rtol=1e-6, atol=1e-6)
    assert manual.store.read(VOCAB).counts.tolist() == fused.store.read(VOCAB).counts.tolist()

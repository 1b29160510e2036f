"""The fused backward's grouping (a radix sort of each thread's keys by slot, cn_grad.h) on
batches with heavy repeats: every row gets the update a literal NumPy model computes from its
summed gradient, and the bits do not depend on the thread count (the rows are updated in slot
order, each row's keys summed in key order)."""
import numpy as np
import pytest

import cncore

DIM = 16
LR = 0.05


def zipf_batch(rng, vocab, n_keys, n_bags):
    """Keys with heavy repeats (Zipf 1.2 over `vocab` keys, scattered over int64) in bags of
    random lengths, some empty."""
    ids = (rng.zipf(1.2, n_keys) - 1) % vocab
    keys = ids.astype(np.int64) * np.int64(-7919) + np.int64(12345)
    cuts = np.sort(rng.integers(0, n_keys + 1, n_bags - 1))
    return keys, np.concatenate([[0], cuts, [n_keys]]).astype(np.int64)


def numpy_step(optimizer, rows, state, grads, step):
    """One fused step of `optimizer` in float64 on the rows (dict key -> row) that have a
    gradient (dict key -> summed gradient); state is a dict key -> state floats."""
    for k, g in grads.items():
        g = g.astype(np.float64)
        w, s = rows[k], state[k]
        if isinstance(optimizer, cncore.RowWiseAdagrad):
            s[0] += np.mean(g * g)
            w -= optimizer.lr / (np.sqrt(s[0]) + optimizer.eps) * g
        elif isinstance(optimizer, cncore.Adagrad):
            s += g * g
            w -= optimizer.lr * g / (np.sqrt(s) + optimizer.eps)
        else:  # Adam
            b1, b2 = optimizer.betas
            m, v = s[:DIM], s[DIM:]
            m[:] = b1 * m + (1 - b1) * g
            v[:] = b2 * v + (1 - b2) * g * g
            w -= optimizer.lr / (1 - b1**step) * m / (np.sqrt(v) / np.sqrt(1 - b2**step) + optimizer.eps)


OPTIMIZERS = {"rowwise-adagrad": lambda: cncore.RowWiseAdagrad(lr=LR, eps=1e-8),
              "adagrad": lambda: cncore.Adagrad(lr=LR, eps=1e-8),
              "adam": lambda: cncore.Adam(lr=LR, betas=(0.8, 0.95), eps=1e-8)}
MODES = [("sum", False), ("sum", True), ("mean", False), ("max", False)]


def train(optimizer, mode, weighted, threads, vocab, n_keys, n_bags, steps, reference=False):
    """A store trained for `steps` fused steps on seeded batches; with reference, also the
    NumPy model's rows and state, fed the per-row gradients of the non-fused path
    (accumulate_gradients, whose sums are in key order too)."""
    cncore.set_num_threads(threads)
    store = cncore.EmbeddingStore(dim=DIM, capacity=vocab, optimizer=optimizer, seed=5)
    rng = np.random.default_rng(11)
    rows, state = {}, {}
    for step in range(1, steps + 1):
        keys, offsets = zipf_batch(rng, vocab, n_keys, n_bags)
        w = rng.uniform(0.5, 2.0, n_keys).astype(np.float32) if weighted else None
        _, ctx = store.pooled_lookup(keys, offsets, mode=mode, per_sample_weights=w)
        grad = rng.standard_normal((n_bags, DIM)).astype(np.float32)
        if reference:
            ukeys, ugrads = store.accumulate_gradients(ctx, grad)
            found = store.read(ukeys)
            for k, r, s in zip(ukeys.tolist(), found.rows, found.optimizer_state):
                rows.setdefault(k, r.astype(np.float64))
                state.setdefault(k, s.astype(np.float64))
            numpy_step(optimizer, rows, state, dict(zip(ukeys.tolist(), ugrads)), step)
        store.apply_gradients(ctx, grad)
    return store, rows, state


def table_bits(store):
    batch = store.export()
    order = np.argsort(batch.keys)
    return (batch.keys[order], batch.rows[order].view(np.uint32), batch.optimizer_state[order].view(np.uint32),
            batch.counts[order], batch.last_steps[order])


@pytest.mark.parametrize("mode,weighted", MODES, ids=["sum", "weighted", "mean", "max"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_fused_step_matches_numpy_model_with_heavy_repeats(name, mode, weighted, restore_threads):
    """Two radix passes (20,000 rows: 15 slot bits), 2 threads (30,000 keys wake the pool),
    the hottest key in about a fifth of the positions."""
    optimizer = OPTIMIZERS[name]()
    store, rows, state = train(optimizer, mode, weighted, 2, 20_000, 30_000, 1_500, 3, reference=True)
    keys = np.array(sorted(rows), dtype=np.int64)
    found = store.read(keys)
    np.testing.assert_allclose(found.rows, np.array([rows[k] for k in keys]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(found.optimizer_state, np.array([state[k] for k in keys]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode,weighted", MODES, ids=["sum", "weighted", "mean", "max"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("vocab", [40, 20_000], ids=["one-pass", "two-passes"])
def test_fused_step_bits_do_not_depend_on_threads(name, mode, weighted, vocab, restore_threads):
    one = table_bits(train(OPTIMIZERS[name](), mode, weighted, 1, vocab, 24_000, 1_000, 2)[0])
    two = table_bits(train(OPTIMIZERS[name](), mode, weighted, 2, vocab, 24_000, 1_000, 2)[0])
    for a, b in zip(one, two):
        np.testing.assert_array_equal(a, b)

"""Per-row metadata (access count, last step, row-wise Adagrad's state) lies in chunks of its
own, one chunk covering several pages of rows on a large table (cn_arena.h). Every row keeps
its own metadata across chunk boundaries, as a store grows past its capacity hint, and after
erases refill the freed slots: checked against a dict of counts, last steps and a literal
row-wise Adagrad on float64."""
import numpy as np
import pytest

import cncore

DIM = 16
LR, EPS = 0.1, 1e-8


def train_and_check(capacity, n_keys, steps):
    """Train a store on keys spread over n_keys rows (more than a metadata chunk's 131,072 at
    dim 16 with row-wise Adagrad, and than `capacity`) and compare every row's metadata and
    state with a literal model."""
    store = cncore.EmbeddingStore(dim=DIM, capacity=capacity, optimizer=cncore.RowWiseAdagrad(lr=LR, eps=EPS),
                                  initializer=cncore.Constant(0.5))
    rng = np.random.default_rng(0)
    universe = np.arange(n_keys, dtype=np.int64) * 7 + 3
    counts, last, state, rows = {}, {}, {}, {}
    for step in range(steps):
        keys = rng.choice(universe, 30_000)
        offsets = np.arange(0, len(keys) + 1, 1, dtype=np.int64)  # one key a bag: its gradient is its bag's
        _, ctx = store.pooled_lookup(keys, offsets)
        grad = rng.standard_normal((len(keys), DIM)).astype(np.float32)
        summed = {}
        for k, g in zip(keys.tolist(), grad.astype(np.float64)):
            summed[k] = summed.get(k, 0.0) + g
            counts[k] = counts.get(k, 0) + 1
            last[k] = step
        for k, g in summed.items():
            s = state.get(k, 0.0) + np.mean(g * g)
            state[k] = s
            rows[k] = rows.get(k, np.full(DIM, 0.5)) - LR / (np.sqrt(s) + EPS) * g
        store.apply_gradients(ctx, grad)
    batch = store.export()
    assert sorted(batch.keys.tolist()) == sorted(counts)
    for i, k in enumerate(batch.keys.tolist()):
        assert batch.counts[i] == counts[k] and batch.last_steps[i] == last[k], k
    np.testing.assert_allclose(batch.optimizer_state[:, 0], [state[k] for k in batch.keys.tolist()], rtol=1e-4)
    np.testing.assert_allclose(batch.rows, np.array([rows[k] for k in batch.keys.tolist()]), rtol=1e-4, atol=1e-5)
    return store


@pytest.mark.slow
@pytest.mark.parametrize("capacity", [300_000, 1_000], ids=["hint-spans-chunks", "grows-past-hint"])
def test_metadata_follows_each_row_across_chunks(capacity):
    train_and_check(capacity, 300_000, 4)


def test_metadata_of_refilled_slots_after_erase():
    """Erased slots go back on the free stack; a new key in one starts from zero counts."""
    store = cncore.EmbeddingStore(dim=DIM, capacity=200_000, optimizer=cncore.RowWiseAdagrad(lr=LR, eps=EPS))
    keys = np.arange(200_000, dtype=np.int64)
    _, ctx = store.pooled_lookup(keys, np.arange(0, 200_001, 1000, dtype=np.int64))
    store.apply_gradients(ctx, np.ones((200, DIM), np.float32))
    store.erase(keys[::2])
    fresh = np.arange(10**9, 10**9 + 100_000, dtype=np.int64)
    store.insert_or_assign(fresh, np.zeros((100_000, DIM), np.float32))
    batch = store.export()
    is_fresh = batch.keys >= 10**9
    assert is_fresh.sum() == 100_000 and (~is_fresh).sum() == 100_000
    assert (batch.counts[is_fresh] == 0).all() and (batch.optimizer_state[is_fresh] == 0).all()
    assert (batch.counts[~is_fresh] == 1).all() and (batch.optimizer_state[~is_fresh] > 0).all()

"""The fused backward groups sum- and mean-pooled keys by bag, not by key position (cn_grad.h,
cn_grad_by_bag); weighted keys keep positions. A row's keys are summed in key order either way,
so an unweighted step gives the same bits as the weighted path fed weights that scale each key
the same: 1.0 for sum pooling, float32(1) / float32(bag length) for mean pooling (the core's own
scale)."""
import numpy as np
import pytest

import cncore

DIM = 16
OPTIMIZERS = {"rowwise-adagrad": lambda: cncore.RowWiseAdagrad(lr=0.05, eps=1e-8),
              "adagrad": lambda: cncore.Adagrad(lr=0.05, eps=1e-8),
              "adam": lambda: cncore.Adam(lr=0.05, betas=(0.8, 0.95), eps=1e-8)}


def batches(n_steps, vocab, n_keys, n_bags):
    """Seeded batches with heavy repeats (Zipf 1.2 over `vocab` keys), bags of random lengths
    (some empty, some holding one key twice), and their gradients."""
    rng = np.random.default_rng(3)
    out = []
    for _ in range(n_steps):
        keys = ((rng.zipf(1.2, n_keys) - 1) % vocab).astype(np.int64) * np.int64(-7919) + np.int64(12345)
        cuts = np.sort(rng.integers(0, n_keys + 1, n_bags - 1))
        offsets = np.concatenate([[0], cuts, [n_keys]]).astype(np.int64)
        out.append((keys, offsets, rng.standard_normal((n_bags, DIM)).astype(np.float32)))
    return out


def rows_after(name, mode, weights_of, threads, data):
    """The table's rows and state bits after a fused step per batch of `data`, pooled with
    `mode` and the per-key weights weights_of(offsets) (None: unweighted)."""
    cncore.set_num_threads(threads)
    store = cncore.EmbeddingStore(dim=DIM, capacity=20_000, optimizer=OPTIMIZERS[name](), seed=5)
    for keys, offsets, grad in data:
        w = weights_of(offsets)
        _, ctx = store.pooled_lookup(keys, offsets, mode=mode, per_sample_weights=w)
        store.apply_gradients(ctx, grad)
    batch = store.export()
    order = np.argsort(batch.keys)
    return batch.rows[order].view(np.uint32), batch.optimizer_state[order].view(np.uint32)


def ones(offsets):
    return np.ones(int(offsets[-1]), np.float32)


def inverse_lengths(offsets):
    lengths = np.diff(offsets)
    return np.repeat(np.float32(1) / np.maximum(lengths, 1).astype(np.float32), lengths)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_unweighted_sum_by_bag_matches_weighted_path_bit_for_bit(name, threads, restore_threads):
    data = batches(3, 20_000, 24_000, 1_000)
    by_bag = rows_after(name, "sum", lambda o: None, threads, data)
    by_position = rows_after(name, "sum", ones, threads, data)
    for a, b in zip(by_bag, by_position):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_mean_by_bag_matches_weighted_sum_of_inverse_lengths_bit_for_bit(name, restore_threads):
    """Mean pooling's backward scales a key by 1 / its bag's length: the same step, bit for bit,
    as a weighted sum whose weights are those scales (only the forwards differ)."""
    data = batches(2, 40, 6_000, 400)  # 40 keys: one radix pass, many keys a row in one bag
    mean = rows_after(name, "mean", lambda o: None, 2, data)
    weighted = rows_after(name, "sum", inverse_lengths, 2, data)
    for a, b in zip(mean, weighted):
        np.testing.assert_array_equal(a, b)

"""Backward and fused optimizer updates against torch.optim on a dense copy, FBGEMM's fused
table (row-wise Adagrad, SGD) and the row-wise formula written out in NumPy."""
import numpy as np
import pytest
import torch

import cncore

DIM = 8  # FBGEMM's tables need a multiple of 4
N_KEYS = 40
KEYS = np.array([0, -1, 2**63 - 1, -(2**63)] + list(range(100, 100 + N_KEYS - 4)), dtype=np.int64)


def random_batch(rng, n_bags, max_len, every_key=False):
    lengths = rng.integers(0, max_len + 1, n_bags)
    idx = rng.integers(0, N_KEYS, int(lengths.sum()))
    if every_key:  # every row gets a gradient (dense optimizers then move the same rows)
        idx = np.concatenate([np.arange(N_KEYS), idx])
        lengths[0] += N_KEYS
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return idx.astype(np.int64), offsets


def make_pair(optimizer, rng):
    store = cncore.EmbeddingStore(dim=DIM, optimizer=optimizer)
    init = rng.standard_normal((N_KEYS, DIM)).astype(np.float32)
    store.insert_or_assign(KEYS, init)
    return store, torch.nn.Parameter(torch.from_numpy(init.copy()))


def torch_optimizer(opt, param):
    if isinstance(opt, cncore.SGD):
        return torch.optim.SGD([param], lr=opt.lr)
    if isinstance(opt, cncore.Adagrad):
        return torch.optim.Adagrad([param], lr=opt.lr, eps=opt.eps,
                                   initial_accumulator_value=opt.initial_accumulator_value)
    if isinstance(opt, cncore.Adam):
        return torch.optim.Adam([param], lr=opt.lr, betas=opt.betas, eps=opt.eps)
    raise AssertionError(opt)


# torch.nn.EmbeddingBag takes per-sample weights with mode="sum" only
@pytest.mark.parametrize("mode,weighted", [("sum", False), ("mean", False), ("max", False), ("sum", True)])
@pytest.mark.parametrize("optimizer", [cncore.SGD(lr=0.05), cncore.Adagrad(lr=0.1, initial_accumulator_value=0.1),
                                       cncore.Adam(lr=0.01, betas=(0.8, 0.95))], ids=["sgd", "adagrad", "adam"])
def test_fused_update_matches_torch_optim(mode, weighted, optimizer):
    rng = np.random.default_rng(7)
    store, param = make_pair(optimizer, rng)
    opt = torch_optimizer(optimizer, param)
    for _step in range(5):
        # Adam on a dense copy moves every row each step; touch every row so lazy == dense.
        idx, offsets = random_batch(rng, 16, 6, every_key=isinstance(optimizer, cncore.Adam))
        w = rng.uniform(0.5, 2, len(idx)).astype(np.float32) if weighted else None
        out, ctx = store.pooled_lookup(KEYS[idx], offsets, mode=mode, per_sample_weights=w)
        ref = torch.nn.functional.embedding_bag(torch.from_numpy(idx), param, torch.from_numpy(offsets), mode=mode,
                                                per_sample_weights=None if w is None else torch.from_numpy(w),
                                                include_last_offset=True)
        np.testing.assert_allclose(out, ref.detach().numpy(), rtol=1e-5, atol=1e-5)
        grad = rng.standard_normal(out.shape).astype(np.float32)
        opt.zero_grad()
        ref.backward(torch.from_numpy(grad))
        opt.step()
        store.apply_gradients(ctx, grad)
        np.testing.assert_allclose(store.lookup(KEYS), param.detach().numpy(), rtol=1e-5, atol=1e-5)
    assert store.step == 5


def test_adam_is_lazy_for_rows_without_gradient():
    rng = np.random.default_rng(3)
    optimizer = cncore.Adam(lr=0.01)
    store, param = make_pair(optimizer, rng)
    before = store.lookup(KEYS[30:])
    for _ in range(3):
        idx, offsets = random_batch(rng, 8, 4)
        idx = idx % 30  # rows 30.. never looked up
        _, ctx = store.pooled_lookup(KEYS[idx], offsets)
        store.apply_gradients(ctx, np.ones((8, DIM), np.float32))
    np.testing.assert_array_equal(store.lookup(KEYS[30:]), before)


def rowwise_adagrad_reference(rows, state, grads_by_row, lr, eps):
    for r, g in grads_by_row.items():
        state[r] += np.mean(g.astype(np.float64) ** 2)
        rows[r] -= lr / (np.sqrt(state[r]) + eps) * g
    return rows, state


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_rowwise_adagrad_matches_formula_and_fbgemm(mode):
    pytest.importorskip("fbgemm_gpu")  # installed with the test extras; CI has it
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )
    rng = np.random.default_rng(11)
    optimizer = cncore.RowWiseAdagrad(lr=0.05, eps=1e-8)
    store, param = make_pair(optimizer, rng)
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(N_KEYS, DIM, EmbeddingLocation.HOST, ComputeDevice.CPU)], optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=0.05, eps=1e-8,
        pooling_mode=PoolingMode.SUM if mode == "sum" else PoolingMode.MEAN)
    with torch.no_grad():
        tbe.split_embedding_weights()[0].copy_(param)
    rows, state = param.detach().numpy().astype(np.float64), np.zeros(N_KEYS)
    for _ in range(4):
        idx, offsets = random_batch(rng, 12, 5)
        out, ctx = store.pooled_lookup(KEYS[idx], offsets, mode=mode)
        grad = rng.standard_normal(out.shape).astype(np.float32)
        # unique-row gradients from the non-fused path, then the formula by hand
        ukeys, ugrads = store.accumulate_gradients(ctx, grad)
        position = {k: i for i, k in enumerate(KEYS.tolist())}
        rows, state = rowwise_adagrad_reference(rows, state, {position[k]: g for k, g in zip(ukeys.tolist(), ugrads)},
                                                0.05, 1e-8)
        store.apply_gradients(ctx, grad)
        tbe_out = tbe(torch.from_numpy(idx), torch.from_numpy(offsets))
        np.testing.assert_allclose(out, tbe_out.detach().numpy(), rtol=1e-5, atol=1e-5)
        tbe_out.backward(torch.from_numpy(grad))
    np.testing.assert_allclose(store.lookup(KEYS), rows, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(store.read(KEYS).optimizer_state[:, 0], state, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(store.lookup(KEYS), tbe.split_embedding_weights()[0].numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(store.read(KEYS).optimizer_state[:, 0],
                               tbe.split_optimizer_states()[0][0].numpy(), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_accumulated_gradients_match_torch(mode):
    rng = np.random.default_rng(5)
    store, param = make_pair(None, rng)
    idx, offsets = random_batch(rng, 20, 7)
    w = rng.uniform(0.5, 2, len(idx)).astype(np.float32) if mode == "sum" else None
    out, ctx = store.pooled_lookup(KEYS[idx], offsets, mode=mode, per_sample_weights=w)
    ref = torch.nn.functional.embedding_bag(torch.from_numpy(idx), param, torch.from_numpy(offsets), mode=mode,
                                            per_sample_weights=None if w is None else torch.from_numpy(w),
                                            include_last_offset=True)
    grad = rng.standard_normal(out.shape).astype(np.float32)
    ref.backward(torch.from_numpy(grad))
    ukeys, ugrads = store.accumulate_gradients(ctx, grad)
    first_seen = list(dict.fromkeys(KEYS[idx].tolist()))
    assert ukeys.tolist() == first_seen
    position = {k: i for i, k in enumerate(KEYS.tolist())}
    dense = param.grad.numpy()
    np.testing.assert_allclose(ugrads, dense[[position[k] for k in first_seen]], rtol=1e-5, atol=1e-6)
    untouched = sorted(set(range(N_KEYS)) - {position[k] for k in first_seen})
    assert not dense[untouched].any()


def test_shared_store_gets_one_update_per_row_with_summed_gradient():
    """Two features on one table: the row seen by both gets a single Adagrad step with the sum
    of both gradients (what a fused TBE does), not two steps."""
    opt = cncore.Adagrad(lr=0.5)
    store = cncore.EmbeddingStore(dim=2, initializer=cncore.Constant(1.0), optimizer=opt)
    out, ctxs = cncore.grouped_pooled_lookup([store, store], [np.array([7]), np.array([7])],
                                             lengths=[np.array([1]), np.array([1])], modes=["sum", "mean"])
    cncore.grouped_apply_gradients(ctxs, np.array([[1.0, 1.0, 2.0, 2.0]], dtype=np.float32))
    g = 3.0
    expected = 1.0 - 0.5 * g / (np.sqrt(g * g) + 1e-10)
    np.testing.assert_allclose(store.lookup(np.array([7])), [[expected, expected]], rtol=1e-6)
    assert store.step == 1


def test_learning_rate_override_and_no_optimizer():
    store = cncore.EmbeddingStore(dim=1, initializer=cncore.Constant(0.0), optimizer=cncore.SGD(lr=1.0))
    _, ctx = store.pooled_lookup(np.array([1]), lengths=np.array([1]))
    store.apply_gradients(ctx, np.ones((1, 1), np.float32), lr=0.25)
    assert store.lookup(np.array([1])).item() == -0.25
    plain = cncore.EmbeddingStore(dim=1)
    _, ctx = plain.pooled_lookup(np.array([1]), lengths=np.array([1]))
    with pytest.raises(TypeError, match="no optimizer"):
        plain.apply_gradients(ctx, np.ones((1, 1), np.float32))


def test_gradient_after_erase_is_refused():
    store = cncore.EmbeddingStore(dim=2, optimizer=cncore.SGD())
    _, ctx = store.pooled_lookup(np.array([1, 2]), lengths=np.array([2]))
    store.erase(np.array([2]))
    with pytest.raises(RuntimeError, match="erased"):
        store.apply_gradients(ctx, np.ones((1, 2), np.float32))

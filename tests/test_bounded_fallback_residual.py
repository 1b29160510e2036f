"""Residual fallback rows (``StoreConfig(fallback_rows=N, fallback_mode="residual")``,
cn_table_core.h "Fallback Rows"): every key of a pooled lookup reads its own row (zeros while it
has none) plus the shared row mix64(key) % N, and the fused update trains both, each with its own
optimizer state. The reference is a dense torch model of the same layout (an own-row parameter
masked by "has a row", a hashed (N, dim) parameter) trained by torch.optim.Adagrad; the literal
model's state machine (test_bounded_fallback.py) covers eviction, admission and clear."""
import numpy as np
import pytest
import torch
from reference import _mix64

import cncore

DIM, N = 3, 4


def fallback_of(key: int, n: int = N) -> int:
    return _mix64(key % 2**64) % n


def residual_store(**kw) -> cncore.EmbeddingStore:
    kw.setdefault("optimizer", cncore.Adagrad(lr=0.3))
    return cncore.EmbeddingStore(dim=DIM, seed=5, initializer=cncore.Uniform(-1, 1), fallback_rows=N,
                                 fallback_mode="residual", **kw)


class DenseResidual:
    """The same model, dense: own rows for keys 0..K-1 (used only where the store has a row),
    fallback rows as a hashed table, each a torch parameter under torch.optim.Adagrad."""

    def __init__(self, store: cncore.EmbeddingStore, n_keys: int, lr: float):
        self.own = torch.zeros(n_keys, DIM, dtype=torch.float64, requires_grad=True)
        self.fb = torch.tensor(store.export_fallback()[0], dtype=torch.float64, requires_grad=True)
        self.opt = torch.optim.Adagrad([self.own, self.fb], lr=lr, eps=1e-10)

    def forward(self, keys, offsets, mode, weights, has_row):
        k = torch.as_tensor(keys)
        value = self.own[k] * torch.as_tensor(has_row, dtype=torch.float64)[:, None] + \
            self.fb[torch.tensor([fallback_of(int(x)) for x in keys])]
        w = None if weights is None else torch.as_tensor(weights, dtype=torch.float64)
        return torch.nn.functional.embedding_bag(torch.arange(len(keys)), value, torch.as_tensor(offsets[:-1]),
                                                 mode=mode, per_sample_weights=w)

    def step(self, out, grad):
        self.opt.zero_grad()
        out.backward(torch.as_tensor(grad, dtype=torch.float64))
        self.opt.step()


@pytest.mark.parametrize("mode,weighted", [("sum", False), ("sum", True), ("mean", False)])
def test_residual_rows_read_and_train_like_a_dense_head_plus_hashed_model(mode, weighted):
    """MinCount(2) admits a key at its second sighting, so keys with and without rows of their
    own mix in each batch; values and per-value Adagrad match the dense model at every step."""
    s = residual_store(admission=cncore.MinCount(2))
    ref = DenseResidual(s, 12, 0.3)
    rng = np.random.default_rng(0)
    for _ in range(6):
        keys = rng.integers(0, 12, 7).astype(np.int64)
        offsets = np.array([0, 3, 3, 7], np.int64)  # an empty bag too
        weights = rng.choice([0.5, 2.0], 7).astype(np.float32) if weighted else None
        out, ctx = s.pooled_lookup(keys, offsets, mode=mode, per_sample_weights=weights)
        has_row = s.contains(keys)
        want = ref.forward(keys, offsets, mode, weights, has_row)
        np.testing.assert_allclose(out, want.detach().numpy(), rtol=1e-5, atol=1e-6)
        grad = rng.standard_normal(out.shape).astype(np.float32)
        s.apply_gradients(ctx, grad)
        ref.step(want, grad)
    assert 0 < len(s) < 12
    batch = s.export()
    np.testing.assert_allclose(batch.rows, ref.own.detach().numpy()[batch.keys], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(s.export_fallback()[0], ref.fb.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(s.export_fallback()[1], ref.opt.state[ref.fb]["sum"].numpy(), rtol=1e-5, atol=1e-7)


def test_features_sharing_a_residual_table_get_one_update_a_row():
    """Two features of one store in one grouped lookup (mean and weighted sum): one fused update
    with each row's summed gradient, as the dense model gives."""
    s = residual_store()
    ref = DenseResidual(s, 10, 0.3)
    k1, o1 = np.array([1, 2, 3, 1], np.int64), np.array([0, 2, 4], np.int64)
    k2, o2 = np.array([3, 4, 9], np.int64), np.array([0, 1, 3], np.int64)
    w2 = np.array([0.5, 2.0, 1.0], np.float32)
    for _ in range(3):
        out, ctxs = cncore.grouped_pooled_lookup([s, s], [k1, k2], offsets=[o1, o2], modes=["mean", "sum"],
                                                 per_sample_weights=[None, w2])
        a = ref.forward(k1, o1, "mean", None, s.contains(k1))
        b = ref.forward(k2, o2, "sum", w2, s.contains(k2))
        np.testing.assert_allclose(out, torch.cat([a, b], 1).detach().numpy(), rtol=1e-5, atol=1e-6)
        grad = np.arange(12, dtype=np.float32).reshape(2, 6) / 10
        cncore.grouped_apply_gradients(ctxs, grad)
        ref.step(torch.cat([a, b], 1), grad)
    np.testing.assert_allclose(s.export_fallback()[0], ref.fb.detach().numpy(), rtol=1e-5, atol=1e-6)
    batch = s.export()
    np.testing.assert_allclose(batch.rows, ref.own.detach().numpy()[batch.keys], rtol=1e-5, atol=1e-6)


def test_a_residual_table_beside_other_tables_in_one_grouped_lookup_pools_as_alone():
    """A residual table first, then a plain one and a miss-mode one, in one grouped lookup with
    bags enough for the pool's threads: each feature's block equals that table's lookup alone."""
    def tables():
        return [residual_store(), cncore.EmbeddingStore(dim=DIM, seed=1),
                cncore.EmbeddingStore(dim=DIM, seed=2, fallback_rows=N, max_rows=5)]
    rng = np.random.default_rng(3)
    lens = [rng.integers(0, 4, 512) for _ in range(3)]
    keys = [rng.integers(0, 900, ln.sum()).astype(np.int64) for ln in lens]
    grouped, alone = tables(), tables()
    for _ in range(3):
        out, _ = cncore.grouped_pooled_lookup(grouped, keys, lengths=lens)
        for f, s in enumerate(alone):
            want, _ = s.pooled_lookup(keys[f], lengths=lens[f])
            np.testing.assert_array_equal(out[:, f * DIM:(f + 1) * DIM], want)


def test_a_new_row_starts_at_zero_so_admission_leaves_the_keys_value_unchanged():
    s = residual_store(optimizer=cncore.SGD(lr=1.0), admission=cncore.MinCount(2))
    _, ctx = s.pooled_lookup(np.array([11]), lengths=np.array([1]))
    s.apply_gradients(ctx, np.ones((1, DIM), np.float32))  # trains the fallback row only
    fb = s.export_fallback()[0][fallback_of(11)]
    out, _ = s.pooled_lookup(np.array([11]), lengths=np.array([1]))  # second sighting: admitted
    assert len(s) == 1
    np.testing.assert_array_equal(s.lookup(np.array([11]))[0], np.zeros(DIM, np.float32))
    np.testing.assert_array_equal(out[0], fb)


def test_an_evicted_key_keeps_reading_its_trained_fallback_row():
    s = residual_store(optimizer=cncore.SGD(lr=1.0), max_rows=1, headroom=0, eviction=cncore.LRU())
    _, ctx = s.pooled_lookup(np.array([1]), lengths=np.array([1]))
    s.apply_gradients(ctx, np.ones((1, DIM), np.float32))
    s.pooled_lookup(np.array([2]), lengths=np.array([1]))  # evicts 1
    assert s.export().keys.tolist() == [2]
    out, _ = s.pooled_lookup(np.array([1]), lengths=np.array([1]), insert_missing=False)
    np.testing.assert_array_equal(out[0], s.export_fallback()[0][fallback_of(1)])


def test_residual_refusals_name_what_works():
    with pytest.raises(ValueError, match=r"fallback_mode must be one of \('miss', 'residual'\), got 'sum'"):
        cncore.StoreConfig(dim=2, fallback_rows=2, fallback_mode="sum")
    with pytest.raises(ValueError, match=r"fallback_mode='residual' adds a shared fallback row .* set fallback_rows"):
        cncore.StoreConfig(dim=2, fallback_mode="residual")
    with pytest.raises(ValueError, match=r"fallback_copy=False with fallback_mode='residual'"):
        cncore.StoreConfig(dim=2, fallback_rows=2, fallback_mode="residual", fallback_copy=False)
    s = residual_store()
    before = s.export_fallback()[0]
    with pytest.raises(ValueError, match=r"modes\[0\]: 'max' pooling of a table with fallback_mode='residual'"):
        s.pooled_lookup(np.array([1, 2]), lengths=np.array([2]), mode="max")
    assert len(s) == 0
    np.testing.assert_array_equal(s.export_fallback()[0], before)
    _, ctx = s.pooled_lookup(np.array([1, 2]), lengths=np.array([2]))
    with pytest.raises(ValueError, match=r"accumulate_gradients: a table with fallback_mode='residual'"):
        s.accumulate_gradients(ctx, np.ones((1, DIM), np.float32))
    with pytest.raises(ValueError, match=r"offsets\[0\]: must start at 0, .* keys \(2\); position 1"):
        s.pooled_lookup(np.array([1, 2]), np.array([0, 3]))


def test_a_residual_table_round_trips_through_a_table_file_and_a_pickle(tmp_path):
    import pickle

    from cncore.tablefile import load_store, save_table
    s = residual_store(max_rows=2)
    keys = np.array([1, 2, 3, 4, 5], np.int64)
    _, ctx = s.pooled_lookup(keys, lengths=np.array([2, 3]))
    s.apply_gradients(ctx, np.ones((2, DIM), np.float32))
    want, _ = s.pooled_lookup(keys, lengths=np.array([2, 3]), insert_missing=False)
    save_table(s, str(tmp_path / "t.cnt"))
    for back in (load_store(str(tmp_path / "t.cnt")), pickle.loads(pickle.dumps(s))):
        assert back.config == s.config and back.config.fallback_mode == "residual"
        got, _ = back.pooled_lookup(keys, lengths=np.array([2, 3]), insert_missing=False)
        np.testing.assert_array_equal(got, want)
        for x, y in zip(back.export_fallback(), s.export_fallback()):
            np.testing.assert_array_equal(x, y)


@pytest.mark.slow  # (imports torchrec)
def test_torch_modules_and_collections_take_fallback_mode_and_state_dicts_carry_the_rows():
    """CNEmbeddingBag(fallback_mode="residual") pools own + fallback; its state_dict loads into
    another module, which then pools the same; a collection passes the option per table."""
    from torchrec import EmbeddingBagConfig

    from cncore_torch import CNEmbeddingBag
    from cncore_torch.collection import CNEmbeddingBagCollection
    kw = {"mode": "mean", "optimizer": cncore.Adagrad(lr=0.5), "fallback_rows": N, "fallback_mode": "residual",
              "max_rows": 2}
    bag, other = CNEmbeddingBag(100, DIM, **kw), CNEmbeddingBag(100, DIM, **kw)
    ids = torch.tensor([[1, 2, 3], [4, 1, 5]])
    bag(ids).sum().backward()
    assert bag.store.config.fallback_mode == "residual" and len(bag.store) == 2
    other.load_state_dict(bag.state_dict())
    bag.eval()
    other.eval()
    torch.testing.assert_close(other(ids), bag(ids), rtol=0, atol=0)
    own = {int(k): r for k, r in zip(*(lambda b: (b.keys, b.rows))(bag.store.export()))}
    fb = bag.store.export_fallback()[0]
    want = np.mean([[own.get(k, np.zeros(DIM)) + fb[fallback_of(k)] for k in row] for row in ids.tolist()], 1)
    np.testing.assert_allclose(bag(ids).detach().numpy(), want, rtol=1e-5, atol=1e-6)
    hooked = CNEmbeddingBag(100, DIM, mode="sum", fallback_rows=N, fallback_mode="residual")  # no fused optimizer
    with pytest.raises(ValueError, match=r"fallback_mode='residual' trains two rows a key .* fused optimizer in torch"):
        hooked(ids).sum().backward()
    tables = [EmbeddingBagConfig(name=n, embedding_dim=DIM, num_embeddings=10, feature_names=[n]) for n in "ab"]
    ebc = CNEmbeddingBagCollection(tables=tables, optimizer=cncore.SGD(lr=0.1), fallback_rows=N,
                                   fallback_mode={"a": "residual"})
    assert [ebc.stores[n].config.fallback_mode for n in "ab"] == ["residual", "miss"]

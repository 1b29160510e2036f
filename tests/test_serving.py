"""cncore_torch.serving.freeze: frozen outputs equal the live model's in eval mode, bit for bit,
on seen IDs and unseen ones (the zero row), checked against a dict of NumPy rows and against
TorchRec's own EmbeddingBagCollection holding the same rows; the exported file runs in a fresh
process that cannot import cncore."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from reference import run_isolated
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingConfig, KeyedJaggedTensor, PoolingType

import cncore
from cncore_torch import CNEmbedding, CNEmbeddingBag, CNEmbeddingBagCollection, CNEmbeddingCollection
from cncore_torch.base import TableModule
from cncore_torch.serving import (
    FrozenEmbedding,
    FrozenEmbeddingBag,
    FrozenEmbeddingBagCollection,
    FrozenEmbeddingCollection,
    freeze,
)
from cncore_torch.serving.export import export_program
from cncore_torch.serving.freeze import serving_lock

FEATURES = ["f", "g", "h"]


def trained_ebc(pooling=PoolingType.SUM, weighted=False, row_dtype="float32", seed=0):
    """A two-table collection (one shared by two features) trained for a few steps."""
    ebc = CNEmbeddingBagCollection(
        [EmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=10, feature_names=["f", "g"], pooling=pooling),
         EmbeddingBagConfig(name="b", embedding_dim=3, num_embeddings=10, feature_names=["h"], pooling=pooling)],
        is_weighted=weighted, optimizer=cncore.SGD(lr=0.1), row_dtype=row_dtype, seed=seed)
    rng = np.random.default_rng(seed)
    for _ in range(3):
        ebc(batch(rng, 40, weighted)).values().sum().backward()
    return ebc.eval()


def batch(rng, high, weighted, n_bags=4):
    lengths = rng.integers(0, 5, len(FEATURES) * n_bags)
    ids = rng.integers(-high, high, int(lengths.sum())) * (2**40 + 1)  # large and negative IDs too
    return KeyedJaggedTensor.from_lengths_sync(FEATURES, torch.from_numpy(ids), torch.from_numpy(lengths),
                                               weights=torch.rand(int(lengths.sum())) if weighted else None)


def rows_by_id(store) -> dict[int, np.ndarray]:
    e = store.export()
    return {int(k): r for k, r in zip(e.keys, e.rows)}


def zero_reader(store):
    """id -> its exported row, zeros for an ID the table lacks (what eval mode answers)."""
    rows, zero = rows_by_id(store), np.zeros(store.dim, np.float32)
    return lambda i: rows.get(i, zero)


def reference_pooled(ebc, kjt, reader=zero_reader) -> np.ndarray:
    """The pooled rows from each table's NumPy rows (`reader(store)`: id -> row; unseen IDs
    zero rows by default), mean the (weighted) sum times 1/length."""
    tables = {f: (reader(ebc.stores[c.name]), c) for c in ebc.embedding_bag_configs() for f in c.feature_names}
    out = []
    for f, jt in kjt.to_dict().items():
        read, config = tables[f]
        ids, offsets = jt.values().tolist(), jt.offsets().tolist()
        w = jt.weights().numpy() if ebc.is_weighted() else np.ones(len(ids), np.float32)
        pooled = np.zeros((len(offsets) - 1, config.embedding_dim), np.float32)
        for b in range(len(offsets) - 1):
            for i in range(offsets[b], offsets[b + 1]):
                pooled[b] += np.float32(w[i]) * read(ids[i])
            if config.pooling == PoolingType.MEAN and offsets[b + 1] > offsets[b]:
                pooled[b] *= np.float32(1.0) / np.float32(offsets[b + 1] - offsets[b])
        out.append(pooled)
    return np.concatenate(out, axis=1)


@pytest.mark.parametrize("row_dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("pooling", [PoolingType.SUM, PoolingType.MEAN])
def test_frozen_pooled_collection_equals_live_model_and_numpy_rows(pooling, weighted, row_dtype):
    ebc = trained_ebc(pooling, weighted, row_dtype)
    frozen = freeze(ebc)
    assert isinstance(frozen, FrozenEmbeddingBagCollection)
    rng = np.random.default_rng(1)
    for _ in range(3):
        kjt = batch(rng, 60, weighted)  # IDs in [-60, 60) * (2^40 + 1): about a third unseen
        with torch.no_grad():
            live = ebc(kjt)
        out = frozen(kjt)
        assert out.keys() == live.keys() == FEATURES and out.length_per_key() == live.length_per_key()
        assert torch.equal(out.values(), live.values())
        # (the reference rounds w * row before adding; the core fuses the multiply-add)
        np.testing.assert_allclose(out.values().numpy(), reference_pooled(ebc, kjt), rtol=1e-6, atol=1e-8)
    assert ebc.table_rows() == {n: len(rows_by_id(s)) for n, s in ebc.stores.items()}  # freeze inserted nothing


def test_frozen_collection_matches_torchrec_ebc_on_the_same_rows():
    """TorchRec's own EmbeddingBagCollection, its rows set to the trained ones at positions of a
    remap done in NumPy (unseen IDs -> a zero row), gives what the frozen collection gives."""
    ebc = trained_ebc(PoolingType.SUM, weighted=True)
    frozen = freeze(ebc)
    ids = {c.name: np.sort(ebc.stores[c.name].export().keys) for c in ebc.embedding_bag_configs()}
    configs = [EmbeddingBagConfig(name=c.name, embedding_dim=c.embedding_dim, num_embeddings=len(ids[c.name]) + 1,
                                  feature_names=c.feature_names) for c in ebc.embedding_bag_configs()]
    theirs = EmbeddingBagCollection(tables=configs, is_weighted=True)
    with torch.no_grad():
        for name, bag in theirs.embedding_bags.items():
            bag.weight.zero_()
            bag.weight[:-1] = torch.from_numpy(ebc.stores[name].lookup(ids[name]))
    table_of = {f: c.name for c in configs for f in c.feature_names}
    kjt = batch(np.random.default_rng(2), 60, True)
    remapped = []
    for f, jt in kjt.to_dict().items():
        known, v = ids[table_of[f]], jt.values().numpy()
        pos = np.searchsorted(known, v).clip(max=len(known) - 1)
        remapped.append(np.where(known[pos] == v, pos, len(known)))
    theirs_kjt = KeyedJaggedTensor.from_lengths_sync(FEATURES, torch.from_numpy(np.concatenate(remapped)),
                                                     kjt.lengths(), weights=kjt.weights())
    assert torch.equal(frozen(kjt).values(), theirs(theirs_kjt).values())


@pytest.mark.parametrize("need_indices", [False, True])
def test_frozen_unpooled_collection_equals_live_model(need_indices):
    ec = CNEmbeddingCollection([EmbeddingConfig(name="a", embedding_dim=4, num_embeddings=10, feature_names=["f", "g"]),
                                EmbeddingConfig(name="b", embedding_dim=4, num_embeddings=10, feature_names=["h"])],
                               need_indices=need_indices, optimizer=cncore.SGD(lr=0.1), row_dtype="float16")
    rng = np.random.default_rng(3)
    for _ in range(2):
        out = ec(batch(rng, 30, False))
        sum(jt.values().sum() for jt in out.values()).backward()
    ec.eval()
    frozen = freeze(ec)
    assert isinstance(frozen, FrozenEmbeddingCollection)
    kjt = batch(rng, 50, False)
    with torch.no_grad():
        live = ec(kjt)
    out = frozen(kjt)
    assert list(out) == list(live) == FEATURES
    rows = {f: rows_by_id(ec.stores[t]) for t, fs in (("a", ("f", "g")), ("b", ("h",))) for f in fs}
    for f, jt in kjt.to_dict().items():
        assert torch.equal(out[f].values(), live[f].values())
        assert torch.equal(out[f].lengths(), jt.lengths())
        expected = [rows[f].get(int(i), np.zeros(4, np.float32)) for i in jt.values()]
        np.testing.assert_array_equal(out[f].values().numpy(), np.array(expected).reshape(-1, 4))
        if need_indices:
            assert torch.equal(out[f].weights(), jt.values())


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_frozen_embedding_bag_equals_live_module_and_nn_embedding_bag(mode):
    live = CNEmbeddingBag(10, 3, mode=mode, optimizer=cncore.SGD(lr=0.1), padding_idx=7)
    live(torch.tensor([[1, 2, 3], [4, 5, 7]])).sum().backward()
    live.eval()
    frozen = freeze(live)
    assert isinstance(frozen, FrozenEmbeddingBag)
    ids = torch.tensor([1, 2, 99, 7, 4, 5, 3, -8, 7, 7])   # 99, -8 unseen; 7 the padding ID
    offsets = torch.tensor([0, 3, 4, 6, 6])
    rows = rows_by_id(live.store)
    dense = torch.zeros(5, 3)      # nn.EmbeddingBag over a remapped copy: unseen -> row 3, padding -> row 4
    known = {1: 0, 2: 1, 3: 2, 7: 4}
    for k, r in ((1, 0), (2, 1), (3, 2)):
        dense[r] = torch.from_numpy(rows[k])
    with torch.no_grad():
        for args in ((ids, offsets), (ids.view(5, 2),)):
            assert torch.equal(frozen(*args), live(*args))
        sub = torch.tensor([1, 2, 99, 7, 3])
        remapped = torch.tensor([known.get(int(i), 3) for i in sub])
        reference = torch.nn.EmbeddingBag(5, 3, mode=mode, padding_idx=4, _weight=dense)
        torch.testing.assert_close(frozen(sub, torch.tensor([0, 2])), reference(remapped, torch.tensor([0, 2])))
        if mode != "max":
            w = torch.rand(len(ids))
            assert torch.equal(frozen(ids, offsets, per_sample_weights=w), live(ids, offsets, per_sample_weights=w))


def test_frozen_embedding_equals_live_module():
    live = CNEmbedding(10, 3, optimizer=cncore.SGD(lr=0.1), padding_idx=0, row_dtype="bfloat16")
    live(torch.tensor([[1, 2], [3, 0]])).sum().backward()
    live.eval()
    frozen = freeze(live)
    assert isinstance(frozen, FrozenEmbedding)
    ids = torch.tensor([[1, 2, 0], [3, 77, 1]])
    with torch.no_grad():
        assert torch.equal(frozen(ids), live(ids))
    assert torch.equal(frozen(ids)[1, 1], torch.zeros(3)) and torch.equal(frozen(ids)[0, 2], torch.zeros(3))


def test_freeze_copies_a_model_and_leaves_the_original_training():
    ebc = trained_ebc()
    model = torch.nn.Sequential(ebc, torch.nn.Identity())
    model.train()
    frozen = freeze(model)
    kjt = batch(np.random.default_rng(4), 40, False)
    before = frozen(kjt).values().clone()
    assert frozen[0] is not ebc and not frozen.training and not any(p.requires_grad for p in frozen.parameters())
    assert not [n for n, m in frozen.named_modules() if isinstance(m, TableModule)]  # no live table left inside
    ebc(kjt).values().sum().backward()   # the original keeps training: the frozen copy does not move
    assert model.training and torch.equal(frozen(kjt).values(), before)


def test_freeze_refuses_what_it_cannot_read():
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module, got int"):
        freeze(3)
    meta = CNEmbeddingBagCollection([EmbeddingBagConfig(name="t", embedding_dim=2, num_embeddings=4,
                                                        feature_names=["f"])], device="meta")
    with pytest.raises(ValueError, match="model: 0 is on the meta device and holds no rows"):
        freeze(torch.nn.Sequential(meta))
    # fallback rows freeze (tests/test_serving_fallback.py); residual ones (every key reads its
    # own row plus its fallback row) do not yet
    bag = CNEmbeddingBag(4, 2, mode="sum", fallback_rows=3)
    bag.storage = cncore.make_store(cncore.StoreConfig(dim=2, fallback_rows=3, fallback_mode="residual"))
    with pytest.raises(ValueError, match=r"model: 1 has fallback_mode='residual': every key reads its own row plus "
                                         r"its fallback row, which freeze does not build; freeze tables with "
                                         r"fallback_mode='miss' \(or fallback_rows=0\), or serve the live module"):
        freeze(torch.nn.Sequential(torch.nn.Linear(2, 2), bag))
    residual = CNEmbeddingBagCollection([EmbeddingBagConfig(name="t", embedding_dim=2, num_embeddings=4,
                                                            feature_names=["f"])], fallback_rows=2,
                                        fallback_mode="residual")
    with pytest.raises(ValueError, match=r"model: 0, table 't', has fallback_mode='residual': every key reads"):
        freeze(torch.nn.Sequential(residual))


CHILD = """
import sys, json
sys.modules["cncore"] = None          # any import of cncore (or of our front end) now fails
sys.modules["cncore_torch"] = None
import torch, torchrec
out = {}
for name in ("pooled", "unpooled", "bag", "fallback", "fallback_bag", "embedding", "weighted_bag", "tbe"):
    inputs, expected = torch.load(f"{DIR}/{name}.io", weights_only=False)
    got = torch.export.load(f"{DIR}/{name}.pt2").module()(*inputs)
    if name in ("pooled", "fallback", "tbe"):
        got, expected = got.values(), expected.values()
    elif name == "unpooled":
        got = torch.cat([got[k].values() for k in sorted(got)])
        expected = torch.cat([expected[k].values() for k in sorted(expected)])
    out[name] = bool(torch.equal(got, expected))
out["cncore_loaded"] = any(m.startswith("cncore") and sys.modules[m] is not None for m in sys.modules)
print(json.dumps(out))
"""


@pytest.mark.slow
def test_exported_files_run_without_cncore_in_a_fresh_process(tmp_path):
    """One .pt2 per kind (pooled weighted mean on 16-bit rows, unpooled, a module, and both with
    fallback rows: unseen IDs read them through the mixer in-graph; the unpooled module on
    16-bit rows with a padding ID, a weighted mean module with offsets; the pooled one with its
    float32 rows in FBGEMM's inference TBE, quantize_embeddings(dtype=torch.float32)), exported with one batch and
    run on another, of other sizes, in a process where importing cncore fails."""
    ebc = trained_ebc(PoolingType.MEAN, weighted=True, row_dtype="float16")
    ec = CNEmbeddingCollection([EmbeddingConfig(name="a", embedding_dim=4, num_embeddings=10,
                                                feature_names=FEATURES)], optimizer=cncore.SGD(lr=0.1))
    ec(batch(np.random.default_rng(5), 20, False))["f"].values().sum().backward()
    bag = CNEmbeddingBag(10, 3, mode="sum", optimizer=cncore.SGD(lr=0.1))
    bag(torch.tensor([[1, 2], [3, 4]])).sum().backward()
    emb = CNEmbedding(10, 3, optimizer=cncore.SGD(lr=0.1), padding_idx=0, row_dtype="bfloat16")
    emb(torch.tensor([[1, 2], [-1, 0]])).sum().backward()
    mean = CNEmbeddingBag(10, 3, mode="mean", optimizer=cncore.SGD(lr=0.1), row_dtype="float16")
    mean(torch.tensor([1, 2, 3, -1]), torch.tensor([0, 1]), per_sample_weights=torch.rand(4)).sum().backward()
    shared = CNEmbeddingBagCollection(  # a 6-row budget: most IDs read fallback rows (5 and 3 of them)
        [EmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=10, feature_names=["f", "g"],
                            pooling=PoolingType.MEAN),
         EmbeddingBagConfig(name="b", embedding_dim=3, num_embeddings=10, feature_names=["h"],
                            pooling=PoolingType.MEAN)],
        is_weighted=True, optimizer=cncore.SGD(lr=0.1), row_dtype="float16", max_rows=6, fallback_rows={"a": 5, "b": 3})
    shared_bag = CNEmbeddingBag(10, 3, mode="max", optimizer=cncore.SGD(lr=0.1), max_rows=3, fallback_rows=7)
    rng = np.random.default_rng(6)
    for _ in range(2):
        shared(batch(rng, 40, True)).values().sum().backward()
        shared_bag(torch.from_numpy(rng.integers(-9, 9, (4, 3)))).sum().backward()
    kjt = lambda w, n: batch(rng, 40, w, n)  # noqa: E731
    edge = torch.tensor([[0, -1, 2**62], [-2**63, 2**63 - 1, 5], [7, 1, -2**62]])
    cases = {"pooled": (ebc.eval(), kjt(True, 3), (kjt(True, 7),)),
             "unpooled": (ec.eval(), kjt(False, 3), (kjt(False, 5),)),
             "bag": (bag.eval(), torch.tensor([[1, 9], [3, 4]]), (torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]]),)),
             "fallback": (shared.eval(), kjt(True, 3), (kjt(True, 7),)),
             "fallback_bag": (shared_bag.eval(), torch.tensor([[1, 9], [3, 4]]), (edge,)),
             "embedding": (emb.eval(), torch.tensor([[1, 9], [3, 0]]),
                           (torch.tensor([[2, 0, -1, 5], [1, 1, 0, 2**62]]),)),
             "weighted_bag": (mean.eval(), (torch.tensor([1, 2, 9]), torch.tensor([0, 1]), torch.rand(3)),
                              (torch.tensor([3, -1, 2, 8, 1]), torch.tensor([0, 2, 2]), torch.rand(5)))}
    from torchrec.inference.modules import quantize_embeddings
    cases["tbe"] = (ebc, kjt(True, 3), (kjt(True, 6),))   # float32 rows in FBGEMM's inference TBE: the same outputs
    for name, (live, example, inputs) in cases.items():
        frozen = freeze(live)
        if name == "tbe":
            frozen = quantize_embeddings(frozen, dtype=torch.float32, inplace=False)
        export_program(frozen, example if isinstance(example, tuple) else (example,), tmp_path / f"{name}.pt2")
        with torch.no_grad():
            torch.save((inputs, live(*inputs)), tmp_path / f"{name}.io")
    got = run_isolated(CHILD.replace("{DIR}", str(tmp_path)), timeout=120)
    assert got == {"pooled": True, "unpooled": True, "bag": True, "fallback": True, "fallback_bag": True,
                   "embedding": True, "weighted_bag": True, "tbe": True, "cncore_loaded": False}


def test_the_cn_dlrm_model_freezes_to_its_exact_outputs():
    """The main job's DLRM (26 tables, dense and over arches), prefilled: the frozen copy gives
    the live model's outputs exactly, for batches with IDs the tables hold and IDs they do not."""
    from cn_dlrm.data import SyntheticCriteo
    from cn_dlrm.train import build_dlrm, prefill_tables, table_configs

    gen = SyntheticCriteo(seed=0, batch_size=16, scale=1e-4)
    ebc = CNEmbeddingBagCollection(tables=table_configs(4, gen.cardinalities))
    prefill_tables(ebc, gen, 2)      # the first two batches' IDs; later batches reach unseen ones
    live = build_dlrm(ebc, 4).eval()
    frozen = freeze(live)
    held = np.concatenate([s.export().keys for s in ebc.stores.values()])
    for index in (0, 1, 50):
        batch = gen.batch(index)
        assert np.isin(batch.sparse.values().numpy(), held).all() == (index < 2)
        with torch.no_grad():
            assert torch.equal(frozen(batch.dense, batch.sparse), live(batch.dense, batch.sparse))


def test_a_kjt_with_a_batch_size_per_feature_is_refused():
    frozen = freeze(trained_ebc())
    vbe = KeyedJaggedTensor(keys=FEATURES, values=torch.tensor([1, 2, 3, 4]), lengths=torch.tensor([1, 1, 1, 1]),
                            stride_per_key_per_rank=[[2], [1], [1]])
    with pytest.raises(ValueError, match=r"features: a KJT with a batch size per feature \(VBE"):
        frozen(vbe)
    assert serving_lock(frozen).readers == 0

"""Frozen tables with fallback rows: an ID the frozen table lacks reads its fallback row
`cn_hash_key(id) % N` computed in-graph, as the live table does in eval mode. Checked bit for
bit against the live modules, against a dict of NumPy rows with the mixer written in Python
integers, and (hypothesis) against the core's own slot choice read through one-hot fallback
rows; deltas carry the fallback rows; TorchRec's quantizer keeps them within the bound."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import _mix64
from test_serving import reference_pooled as serving_reference_pooled
from torchrec import EmbeddingBagConfig, EmbeddingConfig, KeyedJaggedTensor, PoolingType
from torchrec.inference.modules import quantize_embeddings

import cncore
from cncore.tablefile import save_table
from cncore_torch import CNEmbedding, CNEmbeddingBag, CNEmbeddingBagCollection, CNEmbeddingCollection
from cncore_torch.serving import TableDelta, apply_delta, freeze
from cncore_torch.serving.export import export_program
from cncore_torch.serving.fallback import fallback_slot, mix64
from cncore_torch.serving.quantize import row_error_bound

FEATURES = ["f", "g", "h"]
EDGE_IDS = [0, 1, -1, 2, 2**62, -2**62, 2**63 - 1, -2**63, -2**63 + 1, 2**63 - 2, 2**32, -2**31, 2**40 + 1]
_M = 2**64 - 1


def mix_reference(key: int) -> int:
    """The core's cn_mix64 of the ID as uint64, in Python integers (cython_src/include/cn_mix.h)."""
    return _mix64(key & _M)


def trained_ebc(fallback_rows, pooling=PoolingType.SUM, weighted=False, row_dtype="float32", dim_b=3):
    """Two tables (one shared by two features) over a budget of 6 rows each, so that training
    also reads and trains the fallback rows."""
    ebc = CNEmbeddingBagCollection(
        [EmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=10, feature_names=["f", "g"], pooling=pooling),
         EmbeddingBagConfig(name="b", embedding_dim=dim_b, num_embeddings=10, feature_names=["h"], pooling=pooling)],
        is_weighted=weighted, optimizer=cncore.SGD(lr=0.1), row_dtype=row_dtype, max_rows=6,
        fallback_rows=fallback_rows)
    rng = np.random.default_rng(0)
    for _ in range(3):
        ebc(batch(rng, weighted)).values().sum().backward()
    return ebc.eval()


def batch(rng, weighted=False, n_bags=4):
    lengths = rng.integers(0, 5, len(FEATURES) * n_bags)
    ids = rng.choice(np.array(EDGE_IDS + list(range(-30, 30)), dtype=np.int64), int(lengths.sum()))
    return KeyedJaggedTensor.from_lengths_sync(FEATURES, torch.from_numpy(ids), torch.from_numpy(lengths),
                                               weights=torch.rand(int(lengths.sum())) if weighted else None)


def row_reader(store):
    """id -> the row the live table answers in eval mode, from its exported rows and fallback rows."""
    e = store.export()
    rows = {int(k): r for k, r in zip(e.keys, e.rows)}
    shared = store.export_fallback()[0] if store.fallback_rows else None
    zero = np.zeros(store.dim, np.float32)
    return lambda i: rows.get(i, zero if shared is None else shared[mix_reference(i) % len(shared)])


def reference_pooled(ebc, kjt) -> np.ndarray:
    """test_serving's pooled reference, with each table's rows read as the live table answers."""
    return serving_reference_pooled(ebc, kjt, row_reader)


def test_torch_mixer_equals_the_python_integer_mixer_on_edge_ids():
    ids = torch.tensor(EDGE_IDS)
    assert [v & _M for v in mix64(ids).tolist()] == [mix_reference(i) for i in EDGE_IDS]
    for n in (1, 2, 3, 5, 8, 1000003, 2**40 + 3, 2**61 - 1, 2**62):
        assert fallback_slot(ids, n).tolist() == [mix_reference(i) % n for i in EDGE_IDS], n
        per_id = torch.full_like(ids, n)
        assert fallback_slot(ids, per_id, torch.full_like(ids, 2**64 % n)).tolist() == \
            [mix_reference(i) % n for i in EDGE_IDS], n


_ONE_HOT: dict[int, CNEmbeddingBag] = {}


def one_hot_bag(n: int) -> CNEmbeddingBag:
    """A live table of no keyed rows whose fallback row j is the one-hot row j: the argmax of an
    ID's output is the slot the core chose for it."""
    if n not in _ONE_HOT:
        bag = CNEmbeddingBag(10, n, mode="sum", fallback_rows=n)
        bag.store.load_fallback(np.eye(n, dtype=np.float32))
        _ONE_HOT[n] = bag.eval()
    return _ONE_HOT[n]


@settings(max_examples=60, deadline=None)
@given(n=st.sampled_from([1, 2, 3, 5, 7, 8, 13, 64, 97]),
       ids=st.lists(st.one_of(st.integers(-2**63, 2**63 - 1), st.sampled_from(EDGE_IDS)), min_size=1, max_size=20))
def test_torch_fallback_slot_is_the_cores_choice(n, ids):
    x = torch.tensor(ids, dtype=torch.int64)
    with torch.no_grad():
        chosen = one_hot_bag(n)(x.unsqueeze(1))
    assert torch.equal(chosen.sum(1), torch.ones(len(ids)))          # exactly one fallback row each
    assert chosen.argmax(1).tolist() == fallback_slot(x, n).tolist()


@pytest.mark.parametrize("row_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("pooling", "weighted"), [(PoolingType.SUM, False), (PoolingType.MEAN, True),
                                                   (PoolingType.SUM, True)])
@pytest.mark.parametrize("fallback_rows", [{"a": 5, "b": 3}, 4, {"a": 3, "b": 0}])
def test_frozen_pooled_collection_reads_fallback_rows_as_the_live_one(fallback_rows, pooling, weighted, row_dtype):
    ebc = trained_ebc(fallback_rows, pooling, weighted, row_dtype)
    frozen = freeze(ebc)
    rng = np.random.default_rng(3)
    for _ in range(3):
        kjt = batch(rng, weighted)
        with torch.no_grad():
            live = ebc(kjt).values()
        got = frozen(kjt).values()
        assert torch.equal(got, live)
        if weighted:   # (the core may fuse the weight's multiply into the sum: one rounding less)
            np.testing.assert_allclose(got.numpy(), reference_pooled(ebc, kjt), rtol=1e-6, atol=1e-7)
        else:
            np.testing.assert_array_equal(got.numpy(), reference_pooled(ebc, kjt))
        # keys in another order read the same rows (the remap's key-by-key path)
        shuffled = KeyedJaggedTensor.from_jt_dict({k: kjt.to_dict()[k] for k in ["h", "f", "g"]})
        with torch.no_grad():
            assert torch.equal(frozen(shuffled).values(), ebc(shuffled).values())


def test_a_table_without_fallback_rows_adds_no_operation_to_the_graph():
    """N = 0 exports today's graph (the remap and TorchRec's lookup); N > 0 adds the mixer, the
    unsigned modulo and one select."""
    kjt = batch(np.random.default_rng(1))
    plain, shared = (export_program(freeze(trained_ebc(n)), (kjt,)).graph for n in (0, 5))
    ops = [{str(node.target) for node in g.nodes if node.op == "call_function"} for g in (plain, shared)]
    mixer = {"aten.__rshift__.Scalar", "aten.__and__.Scalar", "aten.__xor__.Tensor", "aten.mul.Tensor",
             "aten.add.Tensor", "aten.remainder.Scalar", "aten.where.self"}
    assert ops[0] < ops[1] and mixer <= ops[1] and not mixer & ops[0]


@pytest.mark.parametrize("need_indices", [False, True])
def test_frozen_unpooled_collection_reads_fallback_rows(need_indices):
    ec = CNEmbeddingCollection([EmbeddingConfig(name="a", embedding_dim=4, num_embeddings=10, feature_names=["f", "g"]),
                                EmbeddingConfig(name="b", embedding_dim=4, num_embeddings=10, feature_names=["h"])],
                               need_indices=need_indices, optimizer=cncore.SGD(lr=0.1), max_rows=6,
                               fallback_rows={"a": 3, "b": 7}, row_dtype="float16")
    rng = np.random.default_rng(2)
    for _ in range(3):
        out = ec(batch(rng))
        sum(jt.values().sum() for jt in out.values()).backward()
    ec.eval()
    frozen = freeze(ec)
    reader = {"f": row_reader(ec.stores["a"]), "g": row_reader(ec.stores["a"]), "h": row_reader(ec.stores["b"])}
    kjt = batch(rng)
    with torch.no_grad():
        live = ec(kjt)
    got = frozen(kjt)
    for f in FEATURES:
        assert torch.equal(got[f].values(), live[f].values())
        expected = [reader[f](i) for i in kjt[f].values().tolist()]
        np.testing.assert_array_equal(got[f].values().numpy(), np.array(expected).reshape(-1, 4))
        if need_indices:
            assert torch.equal(got[f].weights(), live[f].weights())


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_frozen_modules_read_fallback_rows(mode):
    bag = CNEmbeddingBag(10, 3, mode=mode, optimizer=cncore.SGD(lr=0.1), max_rows=4, fallback_rows=5,
                         padding_idx=7, row_dtype="bfloat16")
    rng = np.random.default_rng(4)
    for _ in range(3):
        bag(torch.from_numpy(rng.integers(-20, 20, (6, 3)))).sum().backward()
    bag.eval()
    frozen = freeze(bag)
    ids = torch.tensor([[7, 0, -1], [2**62, -2**63, 2**63 - 1], [1, 2, 3], [7, 7, 11]])
    with torch.no_grad():
        assert torch.equal(frozen(ids), bag(ids))
        if mode != "max":
            flat, offsets, w = ids.reshape(-1), torch.tensor([0, 2, 5, 9]), torch.rand(12)
            assert torch.equal(frozen(flat, offsets, per_sample_weights=w), bag(flat, offsets, per_sample_weights=w))
    read = row_reader(bag.store)
    if mode == "sum":   # padding ID 7 reads zeros, not its fallback row
        expected = [sum((read(i) if i != 7 else np.zeros(3, np.float32)) for i in row) for row in ids.tolist()]
        np.testing.assert_array_equal(frozen(ids).numpy(), np.array(expected, np.float32))
    emb = CNEmbedding(10, 2, max_rows=2, fallback_rows=3)
    emb(torch.tensor([1, 2, 3, 4])).sum().backward()
    emb.eval()
    x = torch.tensor([[1, 4, 5], [2**62, -1, 0]])
    with torch.no_grad():
        assert torch.equal(freeze(emb)(x), emb(x))


def test_deltas_carry_the_fallback_rows(tmp_path):
    """A chain of a table with fallback rows brings the frozen copy to the live one, fallback
    rows included; a delta whose fallback rows do not match the frozen table's is refused."""
    ebc = trained_ebc({"a": 5, "b": 3})
    frozen = freeze(ebc)
    paths = {name: str(tmp_path / f"{name}.cnt") for name in ebc.stores}
    base = {name: save_table(store, paths[name]) for name, store in ebc.stores.items()}
    ebc.train()
    rng = np.random.default_rng(9)
    for _ in range(2):
        ebc(batch(rng)).values().sum().backward()
    ebc.eval()
    heads = {name: save_table(store, paths[name], since=base[name]).version for name, store in ebc.stores.items()}
    deltas = {name: TableDelta.from_chain(paths[name], base[name].version, heads[name]) for name in ebc.stores}
    assert np.array_equal(deltas["a"].fallback, ebc.stores["a"].export_fallback()[0])
    kjt = batch(rng)
    with torch.no_grad():
        live = ebc(kjt).values()
    assert not torch.equal(frozen(kjt).values(), live)   # the fallback rows and keyed rows trained since
    apply_delta(frozen, deltas)
    assert torch.equal(frozen(kjt).values(), live)
    np.testing.assert_array_equal(frozen(kjt).values().numpy(), reference_pooled(ebc, kjt))
    wrong = TableDelta(np.empty(0, np.int64), np.empty((0, 3), np.float32), np.empty(0, np.int64),
                       fallback=np.zeros((4, 3), np.float32))
    before = frozen(kjt).values().clone()
    with pytest.raises(ValueError, match=r"deltas\['b'\]: 4 fallback rows, but the frozen table holds 3; freeze "
                                         r"the model again"):
        apply_delta(frozen, {"b": wrong})
    assert torch.equal(frozen(kjt).values(), before)


def test_quantized_fallback_rows_stay_within_the_bound():
    ebc = trained_ebc({"a": 5, "b": 3}, dim_b=4)   # (FBGEMM's 8-bit rows take an even dim)
    frozen = freeze(ebc)
    kjt = batch(np.random.default_rng(5))
    exact = frozen(kjt).values()
    quantized = quantize_embeddings(frozen, dtype=torch.qint8, inplace=False)
    got = quantized(kjt).values()
    limits = []   # per bag and column: the bag's rows' bounds summed (sum pooling, no weights)
    for config in ebc.embedding_bag_configs():
        weight = frozen.embedding_bag_collection.embedding_bags[config.name].weight
        bound = row_error_bound(weight, torch.qint8)
        slots = frozen.remap.tables[config.name]
        first, n = slots.first_fallback, slots.fallback_rows
        for f in config.feature_names:
            jt = kjt[f]
            ids = jt.values()
            own = torch.searchsorted(slots.ids, ids).clamp(max=max(slots.ids.numel() - 1, 0))
            hit = slots.ids[own] == ids if slots.ids.numel() else torch.zeros_like(ids, dtype=torch.bool)
            row = torch.where(hit, slots.slots[own] if slots.ids.numel() else ids, first + fallback_slot(ids, n))
            per_id = bound[row] + 2.0**-22 * weight[row].abs().amax(1)
            offsets = jt.offsets().tolist()
            col = torch.tensor([float(per_id[offsets[b]:offsets[b + 1]].sum()) for b in range(len(offsets) - 1)])
            limits.append(col.unsqueeze(1).expand(-1, config.embedding_dim))
    assert ((got - exact).abs() <= torch.cat(limits, 1)).all()
    assert not torch.equal(got, exact)   # int8 rows, really

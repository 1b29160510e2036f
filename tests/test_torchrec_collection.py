"""CNEmbeddingBagCollection against TorchRec's EmbeddingBagCollection on the same rows."""
import io

import numpy as np
import pytest
import torch

pytest.importorskip("torchrec")
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
from torchrec.models.dlrm import DLRM

import cncore
from cncore_torch import CNEmbeddingBagCollection

ROWS = 40


def configs(dim_a=4, dim_b=8, mean=True):
    # TorchRec's own EmbeddingBagCollection takes weights with SUM pooling only.
    return [
        EmbeddingBagConfig(name="t_shared", embedding_dim=dim_a, num_embeddings=ROWS, feature_names=["f1", "f2"]),
        EmbeddingBagConfig(name="t_mean", embedding_dim=dim_b, num_embeddings=ROWS, feature_names=["f3"],
                           pooling=PoolingType.MEAN if mean else PoolingType.SUM),
    ]


def twins(is_weighted, optimizer=None, **kw):
    torch.manual_seed(0)
    ref = EmbeddingBagCollection(tables=configs(**kw), is_weighted=is_weighted)
    ours = CNEmbeddingBagCollection(tables=configs(**kw), is_weighted=is_weighted, optimizer=optimizer)
    for name, store in ours.stores.items():
        store.insert_or_assign(np.arange(ROWS), ref.embedding_bags[name].weight.detach().numpy())
    return ours, ref


def random_kjt(rng, keys=("f1", "f2", "f3"), batch=5, weighted=False):
    lengths = torch.from_numpy(rng.integers(0, 4, len(keys) * batch))
    values = torch.from_numpy(rng.integers(0, ROWS, int(lengths.sum())))
    weights = torch.rand(len(values)) if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(keys=list(keys), values=values, lengths=lengths, weights=weights)


def rows_of(ours, ref):
    for name in ref.embedding_bags:
        yield (torch.from_numpy(ours.stores[name].lookup(np.arange(ROWS))),
               ref.embedding_bags[name].weight.detach())


@pytest.mark.parametrize("weighted", [False, True])
def test_same_keyed_tensor_as_torchrec(weighted):
    rng = np.random.default_rng(1)
    ours, ref = twins(weighted, mean=not weighted)
    for _ in range(5):
        kjt = random_kjt(rng, weighted=weighted)
        with torch.no_grad():  # forward only: without an optimizer a training forward is refused
            a, b = ours(kjt), ref(kjt)
        assert a.keys() == b.keys() and a.length_per_key() == b.length_per_key()
        torch.testing.assert_close(a.values(), b.values())
    assert ours.embedding_bag_configs() is not None and ours.is_weighted() == weighted


@pytest.mark.parametrize("optimizer", [cncore.SGD(lr=0.1), cncore.Adagrad(lr=0.1)], ids=["sgd", "adagrad"])
def test_same_rows_after_fused_steps(optimizer):
    rng = np.random.default_rng(2)
    ours, ref = twins(False, optimizer)
    dense = (torch.optim.SGD(ref.parameters(), lr=0.1) if isinstance(optimizer, cncore.SGD)
             else torch.optim.Adagrad(ref.parameters(), lr=0.1, eps=optimizer.eps))
    for _ in range(4):
        kjt = random_kjt(rng)
        g = torch.randn(5, 16)
        dense.zero_grad()
        ref(kjt).values().backward(g)
        dense.step()
        ours(kjt).values().backward(g)
    for a, b in rows_of(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_plain_kjt_path_trains_exactly_as_the_general_one(monkeypatch):
    """int64 KJTs take `plain_arrays` (offsets from the lengths, no JaggedTensor per key), int32
    ones the general path (features_by_key): the same outputs and rows, bit for bit, with empty
    bags, a table under two features, mean pooling, keys in another order and a key not read."""
    from cncore_torch import collection as coll
    taken = []
    plain = coll.plain_arrays
    monkeypatch.setattr(coll, "plain_arrays", lambda c, f: taken.append(plain(c, f) is not None) or plain(c, f))
    a = CNEmbeddingBagCollection(tables=configs(), optimizer=cncore.RowWiseAdagrad(lr=0.1), seed=3)
    b = CNEmbeddingBagCollection(tables=configs(), optimizer=cncore.RowWiseAdagrad(lr=0.1), seed=3)
    rng = np.random.default_rng(6)
    for _ in range(4):
        kjt = random_kjt(rng, keys=("f3", "x", "f1", "f2"))
        narrow = KeyedJaggedTensor.from_lengths_sync(keys=kjt.keys(), values=kjt.values().to(torch.int32),
                                                     lengths=kjt.lengths())
        g = torch.randn(5, 16)
        out_a, out_b = a(kjt).values(), b(narrow).values()
        assert torch.equal(out_a, out_b)
        out_a.backward(g)
        out_b.backward(g)
    assert taken == [True, False] * 4
    for name in a.stores:
        rows_a, rows_b = a.stores[name].export(), b.stores[name].export()
        order_a, order_b = np.argsort(rows_a.keys), np.argsort(rows_b.keys)
        assert np.array_equal(rows_a.keys[order_a], rows_b.keys[order_b])
        for field in ("rows", "optimizer_state", "counts", "last_steps"):
            assert np.array_equal(getattr(rows_a, field)[order_a], getattr(rows_b, field)[order_b]), field


def test_ids_changed_in_place_before_the_backward_are_refused():
    """The plain path hands the core views of the KJT's values: changed in place between the
    passes, the backward refuses (as autograd does for a saved tensor), every row unchanged."""
    ours, _ = twins(False, cncore.SGD(lr=0.1))
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f1", "f2", "f3"], values=torch.tensor([1, 2, 3, 4]),
                                              lengths=torch.tensor([1, 1, 1, 1, 0, 0]))
    out = ours(kjt).values()
    before = {name: s.lookup(np.arange(ROWS)) for name, s in ours.stores.items()}
    kjt.values()[0] = 7
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
    for name, s in ours.stores.items():
        assert np.array_equal(s.lookup(np.arange(ROWS)), before[name])


def test_raw_ids_beyond_num_embeddings_grow_the_tables():
    ours, _ = twins(False, cncore.SGD(lr=0.1))
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f1", "f2", "f3"], values=torch.tensor([2**62, -5, 10**15]),
                                              lengths=torch.tensor([1, 1, 1]))
    ours(kjt).values().sum().backward()
    assert len(ours.stores["t_shared"]) == ROWS + 2 and len(ours.stores["t_mean"]) == ROWS + 1


def test_torchrec_dlrm_accepts_it_and_learns():
    torch.manual_seed(3)
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=100, feature_names=[f"c{i}"])
              for i in range(3)]
    ebc = CNEmbeddingBagCollection(tables=tables, optimizer=cncore.RowWiseAdagrad(lr=0.1))
    model = DLRM(embedding_bag_collection=ebc, dense_in_features=4, dense_arch_layer_sizes=[16, 8],
                 over_arch_layer_sizes=[16, 1])
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    rng = np.random.default_rng(4)
    losses = []
    for _ in range(60):
        ids = rng.integers(0, 50, (32, 3))
        y = torch.from_numpy((ids[:, 0] < 25).astype(np.float32))  # learnable from table c0's rows
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=["c0", "c1", "c2"],
                                                  values=torch.from_numpy(ids.T.reshape(-1) * 7919 + 2**40),
                                                  lengths=torch.ones(96, dtype=torch.int64))
        logits = model(torch.randn(32, 4), kjt).squeeze(1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert np.mean(losses[-10:]) < 0.7 * np.mean(losses[:10])


@pytest.mark.parametrize("bad,exc", [
    (dict(tables=[]), ValueError),
    (dict(tables=[EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=5, feature_names=["f"],
                                     pooling=PoolingType.NONE)]), ValueError),
    (dict(tables=[EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=5, feature_names=["f"],
                                     init_fn=lambda w: w)]), ValueError),
    (dict(tables=configs(), initializers={"nope": cncore.Constant(0.0)}), ValueError),
    (dict(tables=configs(), device="cuda"), ValueError),
])
def test_bad_construction_is_refused(bad, exc):
    with pytest.raises(exc):
        CNEmbeddingBagCollection(**bad)


def test_missing_feature_is_a_clear_error():
    ours, _ = twins(False)
    kjt = random_kjt(np.random.default_rng(5), keys=("f1", "f2"))
    with pytest.raises(ValueError, match="f3"):
        ours(kjt)


def test_fused_optimizer_in_torchrec_combined_optimizer_saves_and_restores_training_exactly():
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper

    def build():
        torch.manual_seed(7)
        ebc = CNEmbeddingBagCollection(tables=configs(dim_a=8, dim_b=8), optimizer=cncore.RowWiseAdagrad(lr=0.1))
        model = DLRM(embedding_bag_collection=ebc, dense_in_features=3, dense_arch_layer_sizes=[8],
                     over_arch_layer_sizes=[8, 1])
        dense = {n: p for n, p in model.named_parameters() if "_anchor" not in n}
        opt = CombinedOptimizer([("dense", KeyedOptimizerWrapper(dense, lambda ps: torch.optim.Adagrad(ps, lr=0.05))),
                                 ("sparse", ebc.fused_optimizer)])
        opt.save_param_groups(True)  # TorchRec's switch: learning rates travel with the state
        return model, opt

    def steps(model, opt, start, n):
        rng = np.random.default_rng(start)
        for _ in range(n):
            kjt = random_kjt(rng)
            loss = model(torch.randn(5, 3, generator=torch.Generator().manual_seed(start)), kjt).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            start += 1
        return model

    model, opt = build()
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)
    steps(model, opt, 0, 3)
    sched.step()  # after opt.step(), as torch wants
    assert model.sparse_arch.embedding_bag_collection.fused_optimizer.lr == pytest.approx(0.05)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)  # a checkpoint, as on disk
    steps(model, opt, 3, 2)
    expected = model.state_dict()

    fresh, fresh_opt = build()
    torch.optim.lr_scheduler.ExponentialLR(fresh_opt, gamma=0.5)  # as the saved run had (adds initial_lr)
    buffer.seek(0)
    saved = torch.load(buffer)
    fresh.load_state_dict(saved["model"])
    fresh_opt.load_state_dict(saved["opt"])
    assert fresh.sparse_arch.embedding_bag_collection.fused_optimizer.lr == pytest.approx(0.05)
    steps(fresh, fresh_opt, 3, 2)
    got = fresh.state_dict()
    assert got.keys() == expected.keys()
    for name in expected:
        if ".tables." in name:
            continue  # table rows are compared by key below (an export's row order may differ)
        torch.testing.assert_close(got[name], expected[name])
    for table in ("t_shared", "t_mean"):
        sa = model.sparse_arch.embedding_bag_collection.stores[table]
        sb = fresh.sparse_arch.embedding_bag_collection.stores[table]
        keys = sa.export().keys
        ra, rb = sa.read(keys), sb.read(keys)
        assert rb.found.all()
        np.testing.assert_array_equal(ra.rows, rb.rows)
        np.testing.assert_array_equal(ra.optimizer_state, rb.optimizer_state)
        np.testing.assert_array_equal(ra.counts, rb.counts)
        assert sa.step == sb.step == 5


def test_convert_a_torchrec_model_to_dynamic_tables_and_back_for_serving():
    from cncore_torch.convert import remap_to_fixed, to_dynamic, to_fixed
    torch.manual_seed(9)
    model = DLRM(embedding_bag_collection=EmbeddingBagCollection(tables=configs(dim_a=8, dim_b=8, mean=False)),
                 dense_in_features=3, dense_arch_layer_sizes=[8], over_arch_layer_sizes=[8, 1])
    kjt = random_kjt(np.random.default_rng(10))
    dense = torch.randn(5, 3)
    before = model(dense, kjt)
    to_dynamic(model, optimizer=cncore.SGD(lr=0.1))
    ebc = model.sparse_arch.embedding_bag_collection
    assert isinstance(ebc, CNEmbeddingBagCollection)
    torch.testing.assert_close(model(dense, kjt), before)  # every row carried over as the row of its ID
    # train on raw, unbounded IDs, then serve with fixed tables
    raw = KeyedJaggedTensor.from_lengths_sync(keys=["f1", "f2", "f3"], values=torch.tensor([2**50, 3, 2**50]),
                                              lengths=torch.tensor([1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0]))
    model(dense, raw).sum().backward()
    model.eval()
    with torch.no_grad():
        served_dynamic = model(dense, raw)
    fixed, id_maps = to_fixed(ebc)
    model.sparse_arch.embedding_bag_collection = fixed
    with torch.no_grad():
        served_fixed = model(dense, remap_to_fixed(raw, ebc.embedding_bag_configs(), id_maps))
    torch.testing.assert_close(served_fixed, served_dynamic)


def test_embedding_collection_matches_torchrec_and_trains_the_same():
    from torchrec import EmbeddingCollection, EmbeddingConfig

    from cncore_torch import CNEmbeddingCollection
    from cncore_torch.convert import to_dynamic

    def ec_configs():
        return [EmbeddingConfig(name="t_shared", embedding_dim=4, num_embeddings=ROWS, feature_names=["f1", "f2"]),
                EmbeddingConfig(name="t_other", embedding_dim=4, num_embeddings=ROWS, feature_names=["f3"])]

    torch.manual_seed(11)
    ref = EmbeddingCollection(tables=ec_configs())
    ours = to_dynamic(torch.nn.Sequential(EmbeddingCollection(tables=ec_configs())),
                      optimizer=cncore.Adagrad(lr=0.1))[0]
    assert isinstance(ours, CNEmbeddingCollection)
    for name, store in ours.stores.items():
        store.insert_or_assign(np.arange(ROWS), ref.embeddings[name].weight.detach().numpy())
    dense = torch.optim.Adagrad(ref.parameters(), lr=0.1, eps=cncore.Adagrad().eps)
    rng = np.random.default_rng(12)
    for _ in range(3):
        kjt = random_kjt(rng)
        a, b = ours(kjt), ref(kjt)
        assert a.keys() == b.keys()
        for key in b:
            torch.testing.assert_close(a[key].values(), b[key].values())
            assert a[key].lengths().tolist() == b[key].lengths().tolist()
        grads = {key: torch.randn_like(b[key].values()) for key in b}
        dense.zero_grad()
        sum((b[k].values() * g).sum() for k, g in grads.items()).backward()
        dense.step()
        sum((a[k].values() * g).sum() for k, g in grads.items()).backward()
    for name, store in ours.stores.items():
        torch.testing.assert_close(torch.from_numpy(store.lookup(np.arange(ROWS))),
                                   ref.embeddings[name].weight.detach(), rtol=1e-5, atol=1e-6)


def collection_state(ebc):
    """Every table's entries sorted by key, as bytes, and each step."""
    state = ebc.state_dict()
    out = {}
    for name in ebc.stores:
        p = f"tables.{name}."
        order = torch.argsort(state[p + "keys"])
        out |= {p + f: state[p + f][order].numpy().tobytes() for f in ("keys", "rows", "optimizer_state", "counts",
                                                                        "last_steps")}
        out[p + "step"] = int(state[p + "step"])
    return out


def trained_collection(seed):
    ebc = CNEmbeddingBagCollection(tables=configs(), optimizer=cncore.Adam(lr=0.1))
    ebc(random_kjt(np.random.default_rng(seed))).values().sum().backward()
    return ebc


def test_a_broken_second_table_leaves_every_table_as_it_was():
    ebc, other = trained_collection(1), trained_collection(2)
    before = collection_state(ebc)
    state = other.state_dict()
    state["tables.t_mean.counts"] = state["tables.t_mean.counts"].float()
    with pytest.raises(RuntimeError, match=r"^Error\(s\) in loading state_dict for CNEmbeddingBagCollection:\n\t"
                                           r"tables\.t_mean\.counts: expected dtype"):
        ebc.load_state_dict(state)
    assert collection_state(ebc) == before
    del state["tables.t_mean.counts"]
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "tables\.t_mean\.counts"'):
        ebc.load_state_dict(state)  # strict: refused after loading, so nothing may load
    assert collection_state(ebc) == before


def test_non_strict_load_replaces_the_complete_tables_and_keeps_the_others():
    ebc, other = trained_collection(1), trained_collection(2)
    before, want = collection_state(ebc), collection_state(other)
    state = other.state_dict()
    del state["tables.t_mean.rows"]
    assert ebc.load_state_dict(state, strict=False).missing_keys == ["tables.t_mean.rows"]
    got = collection_state(ebc)
    for key in got:
        assert got[key] == (before[key] if key.startswith("tables.t_mean.") else want[key]), key

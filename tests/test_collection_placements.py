"""The TorchRec collections on accelerator rows (device="cncard"; CNCORE_CNCARD=cpu maps it onto
the CPU so CI runs that code path) through the one bridge the modules use (cncore_torch._ops),
against the same collection with its rows in the core: outputs, rows, optimizer state and
metadata after fused steps (to fp32 reassociation noise: PyTorch's embedding_bag and the core
add in different orders), shared tables, weights, mean pooling, bounded tables, state_dict,
apply_optimizer_in_backward, torch.fx, and placements that cannot be reached."""
import warnings

import numpy as np
import pytest
import torch
from torchrec import EmbeddingBagConfig, EmbeddingConfig, KeyedJaggedTensor, PoolingType
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

import cncore
from cncore_torch import CNEmbeddingBagCollection, CNEmbeddingCollection

OPTIMIZERS = [cncore.SGD(lr=0.1), cncore.Adagrad(lr=0.1), cncore.RowWiseAdagrad(lr=0.1), cncore.Adam(lr=0.01)]


@pytest.fixture(autouse=True)
def on_cncard(cncard):
    pass


def bag_configs():
    return [EmbeddingBagConfig(name="t_user", embedding_dim=4, num_embeddings=50, feature_names=["user", "friend"]),
            EmbeddingBagConfig(name="t_item", embedding_dim=8, num_embeddings=50, feature_names=["item"],
                               pooling=PoolingType.MEAN)]


def kjt(rng, keys=("user", "friend", "item"), batch=5, weighted=False):
    lengths = torch.from_numpy(rng.integers(0, 4, len(keys) * batch))
    values = torch.from_numpy(rng.integers(0, 40, int(lengths.sum())))
    weights = torch.rand(len(values)) if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(list(keys), values, lengths, weights=weights)


def exported(store):
    e = store.export()
    e = e if isinstance(e, dict) else {k: torch.from_numpy(np.asarray(getattr(e, k), dtype=np.int64)
                                                           if k in ("counts", "last_steps") else getattr(e, k))
                                       for k in ("keys", "rows", "optimizer_state", "counts", "last_steps")}
    e = {k: v.cpu() for k, v in e.items()}  # the card's tables export on their device
    order = torch.argsort(e["keys"])
    return {k: v[order] for k, v in e.items()}


def assert_same_tables(card, core):
    for name in core.stores:
        a, b = exported(core.stores[name]), exported(card.stores[name])
        assert torch.equal(a["keys"], b["keys"]), name
        for field in ("counts", "last_steps"):
            assert torch.equal(a[field], b[field]), (name, field)
        for field in ("rows", "optimizer_state"):
            torch.testing.assert_close(b[field], a[field], rtol=1e-5, atol=1e-6)
        assert card.stores[name].step == core.stores[name].step


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=["sgd", "adagrad", "rowwise", "adam"])
def test_pooled_collection_on_cncard_trains_like_the_core(weighted, optimizer):
    core = CNEmbeddingBagCollection(bag_configs(), is_weighted=weighted, optimizer=optimizer, seed=3)
    card = CNEmbeddingBagCollection(bag_configs(), is_weighted=weighted, optimizer=optimizer, seed=3,
                                    device="cncard")
    assert card._placement.kind == "device" and type(card.stores["t_user"]).__name__ == "DeviceRows"
    rng = np.random.default_rng(0)
    for _ in range(4):
        features = kjt(rng, weighted=weighted)
        a, b = core(features), card(features)
        assert b.keys() == a.keys() and b.length_per_key() == a.length_per_key()
        torch.testing.assert_close(b.values().cpu(), a.values(), rtol=1e-5, atol=1e-6)
        grad = torch.randn_like(a.values())
        a.values().backward(grad)
        b.values().backward(grad.to(b.values().device))
    assert_same_tables(card, core)
    card.eval()
    core.eval()
    with torch.no_grad():  # evaluation: unseen keys read as not stored, nothing inserted
        features = KeyedJaggedTensor.from_lengths_sync(["user", "friend", "item"], torch.tensor([2**50, 1, 3]),
                                                       torch.tensor([1, 1, 1]),
                                                       weights=torch.tensor([0.5, 1.0, 2.0]) if weighted else None)
        torch.testing.assert_close(card(features).values().cpu(), core(features).values(), rtol=1e-5, atol=1e-6)
    assert card.table_rows() == core.table_rows()


@pytest.mark.parametrize("need_indices", [False, True])
def test_unpooled_collection_on_cncard_trains_like_the_core(need_indices):
    configs = [EmbeddingConfig(name="t_a", embedding_dim=4, num_embeddings=50, feature_names=["f1", "f2"]),
               EmbeddingConfig(name="t_b", embedding_dim=4, num_embeddings=50, feature_names=["f3"])]
    core = CNEmbeddingCollection(configs, need_indices=need_indices, optimizer=cncore.Adam(lr=0.01), seed=1)
    card = CNEmbeddingCollection(configs, need_indices=need_indices, optimizer=cncore.Adam(lr=0.01), seed=1,
                                 device="cncard")
    rng = np.random.default_rng(2)
    for _ in range(3):
        features = kjt(rng, keys=("f1", "f2", "f3"))
        a, b = core(features), card(features)
        assert a.keys() == b.keys()
        loss_a = loss_b = 0
        for name in a:
            torch.testing.assert_close(b[name].values().cpu(), a[name].values(), rtol=1e-5, atol=1e-6)
            assert torch.equal(b[name].lengths().cpu(), a[name].lengths())
            if need_indices:
                assert torch.equal(b[name].weights().cpu(), a[name].weights())
            loss_a = loss_a + (a[name].values() ** 2).sum()
            loss_b = loss_b + (b[name].values() ** 2).sum()
        loss_a.backward()
        loss_b.backward()
    assert_same_tables(card, core)


def test_bounded_collection_on_cncard_evicts_the_same_keys_as_the_core():
    configs = [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=8, feature_names=["f"])]
    kw = dict(optimizer=cncore.RowWiseAdagrad(lr=0.1), max_rows="num_embeddings", eviction=cncore.LRU(), headroom=0,
              fallback_rows=0)  # a row per key on both (the core's default would split, the card's cannot)
    core = CNEmbeddingBagCollection(configs, **kw)
    card = CNEmbeddingBagCollection(configs, device="cncard", **kw)
    sinks = {"core": [], "card": []}
    core.stores["t"].on_evict(lambda batch: sinks["core"].extend(batch.keys.tolist()))
    card.stores["t"].on_evict(lambda batch: sinks["card"].extend(batch.keys.tolist()))
    rng = np.random.default_rng(4)
    for _ in range(6):
        features = kjt(rng, keys=("f",), batch=3)
        core(features).values().sum().backward()
        card(features).values().sum().backward()
    assert sinks["card"] == sinks["core"] and len(sinks["core"]) > 0
    assert card.stores["t"].evicted_count == core.stores["t"].evicted_count
    assert_same_tables(card, core)


def test_cncard_state_dict_loads_into_the_core_and_back():
    rng = np.random.default_rng(5)
    card = CNEmbeddingBagCollection(bag_configs(), optimizer=cncore.Adagrad(lr=0.1), device="cncard")
    for _ in range(2):
        card(kjt(rng)).values().sum().backward()
    core = CNEmbeddingBagCollection(bag_configs(), optimizer=cncore.Adagrad(lr=0.1))
    core.load_state_dict(card.state_dict())
    assert_same_tables(card, core)
    again = CNEmbeddingBagCollection(bag_configs(), optimizer=cncore.Adagrad(lr=0.1), device="cncard")
    again.load_state_dict(core.state_dict())
    assert_same_tables(again, core)


def test_cncard_collection_honours_apply_optimizer_in_backward():
    core = CNEmbeddingBagCollection(bag_configs(), seed=2)
    card = CNEmbeddingBagCollection(bag_configs(), seed=2, device="cncard")
    features = kjt(np.random.default_rng(6))
    out = card(features)  # the forward runs; the gradient says what is missing
    with pytest.raises(RuntimeError, match="has no optimizer.*apply_optimizer_in_backward"):
        out.values().sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for module in (core, card):
            apply_optimizer_in_backward(torch.optim.Adagrad, module.parameters(), {"lr": 0.5})
    core(features).values().sum().backward()
    card(features).values().sum().backward()
    assert card.stores["t_user"].config.optimizer == cncore.Adagrad(lr=0.5)
    assert_same_tables(card, core)


def test_cncard_collection_traces_with_fx_to_the_same_output():
    card = CNEmbeddingBagCollection(bag_configs(), optimizer=cncore.SGD(lr=0.1), device="cncard")
    features = kjt(np.random.default_rng(7))
    expected = card(features).values()
    traced = torch.fx.symbolic_trace(card)
    assert torch.equal(traced(features).values().cpu(), expected.cpu())


def test_unreachable_placements_are_refused_naming_the_device(tmp_path):
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device='cuda'"):
            CNEmbeddingBagCollection(bag_configs(), device="cuda")
    card = CNEmbeddingBagCollection(bag_configs(), optimizer=cncore.SGD(lr=0.1), device="cncard")
    card(kjt(np.random.default_rng(8))).values().sum().backward()
    with pytest.raises(ValueError, match="drop its rows"):
        card.to("meta")
    assert sum(card.table_rows().values()) > 0
    with pytest.raises(ValueError, match="tiered table"):
        CNEmbeddingBagCollection(bag_configs(), device="cncard",
                                 storage=cncore.Tiered(str(tmp_path / "tier"), cache_bytes=1 << 20))

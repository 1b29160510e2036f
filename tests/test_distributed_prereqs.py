"""What DMP needs of CNEmbeddingBagCollection on one process: device="meta" (no storage until
`to_empty`) and a forward that `torch.fx.symbolic_trace` keeps as one node, each checked
against TorchRec's own EmbeddingBagCollection doing the same."""
import numpy as np
import pytest
import torch

pytest.importorskip("torchrec")
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType

import cncore
from cncore_torch import CNEmbeddingBagCollection
from cncore_torch.collection import CNEmbeddingCollection


def configs():
    return [EmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=50, feature_names=["f1", "f2"]),
            EmbeddingBagConfig(name="b", embedding_dim=3, num_embeddings=50, feature_names=["f3"],
                               pooling=PoolingType.MEAN)]


def kjt(seed, batch=4, weighted=False, high=2**62):
    rng = np.random.default_rng(seed)
    lengths = torch.from_numpy(rng.integers(0, 4, 3 * batch))
    values = torch.from_numpy(rng.integers(-high if high > 50 else 0, high, int(lengths.sum())))
    weights = torch.rand(len(values), generator=torch.Generator().manual_seed(seed)) if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(keys=["f1", "f2", "f3"], values=values, lengths=lengths,
                                               weights=weights)


def test_meta_has_no_storage_and_infers_torchrecs_shapes():
    ours = CNEmbeddingBagCollection(configs(), device="meta", optimizer=cncore.SGD(lr=0.1))
    ref = EmbeddingBagCollection(configs(), device=torch.device("meta"))
    assert ours.is_meta and ours.stores == {} and ours.fused_optimizer is None
    a, b = ours(kjt(0)), ref(kjt(0))
    assert a.values().is_meta and a.values().shape == b.values().shape
    assert a.keys() == b.keys() and a.length_per_key() == b.length_per_key()


def test_to_empty_materialises_empty_tables_that_train_like_a_cpu_collection():
    lazy = CNEmbeddingBagCollection(configs(), device="meta", optimizer=cncore.SGD(lr=0.1), seed=3)
    lazy.to_empty(device="cpu")
    eager = CNEmbeddingBagCollection(configs(), optimizer=cncore.SGD(lr=0.1), seed=3)
    assert not lazy.is_meta and sorted(lazy.stores) == ["a", "b"] and all(len(s) == 0 for s in lazy.stores.values())
    for step in range(3):
        for m in (lazy, eager):
            m(kjt(step)).values().square().sum().backward()
    for name in eager.stores:
        keys = np.sort(eager.stores[name].export().keys)
        np.testing.assert_array_equal(np.sort(lazy.stores[name].export().keys), keys)
        np.testing.assert_array_equal(lazy.stores[name].lookup(keys), eager.stores[name].lookup(keys))


def test_moving_rows_to_meta_is_refused_and_cuda_is_refused_at_construction():
    m = CNEmbeddingBagCollection(configs(), optimizer=cncore.SGD(lr=0.1))
    m(kjt(1))
    with pytest.raises(ValueError, match="would drop its rows"):
        m.to("meta")
    with pytest.raises(ValueError, match="runs on 'cpu', 'meta' or 'cncard'"):
        CNEmbeddingBagCollection(configs(), device="cuda")


def test_unpooled_collection_on_meta():
    from torchrec import EmbeddingConfig
    tables = [EmbeddingConfig(name="t", embedding_dim=4, num_embeddings=10, feature_names=["f1", "f2", "f3"])]
    ec = CNEmbeddingCollection(tables, device="meta", optimizer=cncore.SGD(lr=0.1))
    out = ec(kjt(2))
    assert out["f1"].values().is_meta and out["f1"].values().shape[1] == 4
    ec.to_empty(device="cpu")
    assert ec(kjt(2))["f1"].values().shape == out["f1"].values().shape


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("training", [False, True])
def test_fx_trace_is_one_node_and_equals_eager(weighted, training):
    traced_model = CNEmbeddingBagCollection(configs(), is_weighted=weighted, optimizer=cncore.Adagrad(lr=0.1), seed=1)
    eager = CNEmbeddingBagCollection(configs(), is_weighted=weighted, optimizer=cncore.Adagrad(lr=0.1), seed=1)
    traced_model.train(training), eager.train(training)
    gm = torch.fx.symbolic_trace(traced_model)
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert len(calls) == 1 and "pooled_collection_lookup" in calls[0].name
    for step in range(3):
        a, b = gm(kjt(step, weighted=weighted)), eager(kjt(step, weighted=weighted))
        assert a.keys() == b.keys()
        torch.testing.assert_close(a.values(), b.values(), rtol=0, atol=0)
        if training:
            a.values().sum().backward(), b.values().sum().backward()
    for name in eager.stores:
        keys = np.sort(eager.stores[name].export().keys)
        np.testing.assert_array_equal(traced_model.stores[name].lookup(keys), eager.stores[name].lookup(keys))


def test_torchrecs_own_ebc_traces_too():
    """The same call on TorchRec's EBC, for comparison: its trace runs and equals eager."""
    ref = EmbeddingBagCollection(configs())
    gm = torch.fx.symbolic_trace(ref)
    torch.testing.assert_close(gm(kjt(0, high=50)).values(), ref(kjt(0, high=50)).values())

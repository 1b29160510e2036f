"""CNEmbeddingBagCollection against TorchRec's EmbeddingBagCollection on the same rows."""
import numpy as np
import pytest
import torch

pytest.importorskip("torchrec")
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType  # noqa: E402
from torchrec.models.dlrm import DLRM  # noqa: E402

import cncore  # noqa: E402
from cncore_torch import CNEmbeddingBagCollection  # noqa: E402

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
    (dict(tables=configs(), device="meta"), ValueError),
])
def test_bad_construction_is_refused(bad, exc):
    with pytest.raises(exc):
        CNEmbeddingBagCollection(**bad)


def test_missing_feature_is_a_clear_error():
    ours, _ = twins(False)
    kjt = random_kjt(np.random.default_rng(5), keys=("f1", "f2"))
    with pytest.raises(ValueError, match="f3"):
        ours(kjt)

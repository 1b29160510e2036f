"""The collections' forward and backward as TorchRec's own modules run them, on the same rows:
per-sample weights get their gradient (FeatureProcessedEmbeddingBagCollection +
PositionWeightedModule learn), KJTs with a batch size per key (VBE) pool and expand as
TorchRec's EmbeddingBagCollection does, the forward runs without an optimizer (a gradient
reaching the rows says how to give one), a frozen collection trains nothing, and a lookup
under torch.no_grad() never inserts."""
import numpy as np
import pytest
import torch
from reference import assert_unchanged, snapshot

pytest.importorskip("torchrec")
from torchrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
    PoolingType,
)
from torchrec.modules.feature_processor_ import PositionWeightedModule
from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

import cncore
from cncore_torch import CNEmbedding, CNEmbeddingBag, CNEmbeddingBagCollection, CNEmbeddingCollection

ROWS = 30
SGD = cncore.SGD(lr=1.0)  # a row moves by minus its gradient
NO_OPTIMIZER = r"has no optimizer.*optimizer=cncore\.RowWiseAdagrad.*apply_optimizer_in_backward"


def bag_configs(mean=False):
    # TorchRec's EmbeddingBagCollection takes per-sample weights with SUM pooling only.
    return [EmbeddingBagConfig(name="t_shared", embedding_dim=4, num_embeddings=ROWS, feature_names=["f1", "f2"]),
            EmbeddingBagConfig(name="t_one", embedding_dim=3, num_embeddings=ROWS, feature_names=["f3"],
                               pooling=PoolingType.MEAN if mean else PoolingType.SUM)]


def unpooled_configs():
    return [EmbeddingConfig(name="t_shared", embedding_dim=4, num_embeddings=ROWS, feature_names=["f1", "f2"]),
            EmbeddingConfig(name="t_one", embedding_dim=4, num_embeddings=ROWS, feature_names=["f3"])]


def bag_twins(weighted=False, mean=False, optimizer=SGD):
    """Ours (SGD lr=1: a row moves by minus its gradient) and TorchRec's EBC holding our rows."""
    ours = CNEmbeddingBagCollection(bag_configs(mean), is_weighted=weighted, optimizer=optimizer, seed=3)
    ref = EmbeddingBagCollection(bag_configs(mean), is_weighted=weighted)
    copy_rows(ours, ref.embedding_bags)
    return ours, ref


def unpooled_twins(optimizer=SGD):
    ours = CNEmbeddingCollection(unpooled_configs(), optimizer=optimizer, seed=3)
    ref = EmbeddingCollection(unpooled_configs())
    copy_rows(ours, ref.embeddings)
    return ours, ref


def copy_rows(ours, ref_modules):
    """Our rows of IDs 0..ROWS-1 (inserted here from the initializer) into TorchRec's weights."""
    with torch.no_grad():
        for name, store in ours.stores.items():
            ref_modules[name].weight.copy_(torch.from_numpy(store.lookup(np.arange(ROWS), insert_missing=True)))


def assert_rows_moved_as_sgd(ours, ref_modules):
    """Our rows after SGD(lr=1) are TorchRec's rows minus TorchRec's dense gradient."""
    for name, module in ref_modules.items():
        expected = module.weight.detach() - (0 if module.weight.grad is None else module.weight.grad)
        torch.testing.assert_close(torch.from_numpy(ours.stores[name].lookup(np.arange(ROWS))), expected)


def kjt(rng, batch=4, weighted=False, ids=ROWS):
    keys = ["f3", "other", "f1", "f2"]  # shuffled, with a key no table reads
    lengths = torch.from_numpy(rng.integers(0, 4, len(keys) * batch))
    values = torch.from_numpy(rng.integers(0, ids, int(lengths.sum())))
    weights = torch.from_numpy(rng.random(len(values)).astype(np.float32)).requires_grad_() if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(keys, values, lengths, weights=weights)


def variable_batch_kjt(rng, weighted=False, inverse=True):
    """A KJT with a batch size per key (3, 1, 2, 3 bags) expanded to a batch of 4 samples."""
    keys, strides = ["f3", "other", "f1", "f2"], [3, 1, 2, 3]
    lengths = torch.from_numpy(rng.integers(0, 4, sum(strides)))
    values = torch.from_numpy(rng.integers(0, ROWS, int(lengths.sum())))
    weights = torch.from_numpy(rng.random(len(values)).astype(np.float32)).requires_grad_() if weighted else None
    index = torch.stack([torch.from_numpy(rng.integers(0, s, 4)) for s in strides])
    return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, weights=weights,
                             stride_per_key_per_rank=[[s] for s in strides],
                             inverse_indices=(keys, index) if inverse else None)


def compiled(module, mode):
    """The module under torch.compile with no graph break (fullgraph) in "compiled" mode. Dynamo's
    caches are emptied first: each new module is a recompilation, and past the limit fullgraph raises."""
    if mode != "compiled":
        return module
    torch._dynamo.reset()
    return torch.compile(module, backend="aot_eager", fullgraph=True)


MODES = ["eager", "compiled"]


# --- per-sample weights -----------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["eager", pytest.param("compiled", marks=pytest.mark.slow)])
def test_per_sample_weights_get_torchrecs_gradient_and_rows_its_update(mode):
    ours, ref = bag_twins(weighted=True)
    run = compiled(ours, mode)
    rng = np.random.default_rng(0)
    for _ in range(2):
        features = kjt(rng, weighted=True)
        weights = features.weights()
        a, b = run(features), ref(features)
        torch.testing.assert_close(a.values(), b.values())
        grad = torch.from_numpy(rng.standard_normal(tuple(a.values().shape)).astype(np.float32))
        (a.values() * grad).sum().backward()
        ours_grad, weights.grad = weights.grad.clone(), None
        (b.values() * grad).sum().backward()
        torch.testing.assert_close(ours_grad, weights.grad)
        assert bool((weights.grad != 0).any())  # (a test that can fail: TorchRec's gradient is not all zeros)
        assert_rows_moved_as_sgd(ours, ref.embedding_bags)
        ref.zero_grad()
        copy_rows(ours, ref.embedding_bags)


def position_weighted(ebc):
    module = FeatureProcessedEmbeddingBagCollection(
        ebc, {f: PositionWeightedModule(4) for f in ("f1", "f2", "f3")})
    with torch.no_grad():
        for i, p in enumerate(module._feature_processors.parameters()):
            p.copy_(torch.linspace(0.5, 2.0, p.numel()) + i)
    return module


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("frozen", [False, True], ids=["training", "frozen"])
def test_position_weights_learn_as_with_torchrecs_collection(mode, frozen):
    """FeatureProcessedEmbeddingBagCollection + PositionWeightedModule over ours: the position
    weights get TorchRec's gradient; a frozen collection's rows stay as they were."""
    ours_ebc, ref_ebc = bag_twins(weighted=True)
    ours, ref = position_weighted(ours_ebc), position_weighted(ref_ebc)
    if frozen:
        ours_ebc.requires_grad_(False)
        ref_ebc.requires_grad_(False)
    before = {name: snapshot(s) for name, s in ours_ebc.stores.items()}
    run = compiled(ours, mode)
    features = kjt(np.random.default_rng(1))
    a, b = run(features), ref(features)
    torch.testing.assert_close(a.values(), b.values())
    a.values().square().sum().backward()
    b.values().square().sum().backward()
    for p, q in zip(ours._feature_processors.parameters(), ref._feature_processors.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    assert any(bool((q.grad != 0).any()) for q in ref._feature_processors.parameters())
    if frozen:
        for name, store in ours_ebc.stores.items():
            assert_unchanged(store, before[name])
    else:
        assert_rows_moved_as_sgd(ours_ebc, ref_ebc.embedding_bags)


# --- a batch size per key (VBE) ------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_variable_batch_kjt_pools_and_expands_as_torchrecs_collection(mode, weighted):
    ours, ref = bag_twins(weighted=weighted, mean=not weighted)
    run = compiled(ours, mode)
    rng = np.random.default_rng(2)
    features = variable_batch_kjt(rng, weighted)
    ours.eval()
    before = {name: snapshot(s) for name, s in ours.stores.items()}
    torch.testing.assert_close(run(features).values(), ref(features).values())
    for name, store in ours.stores.items():
        assert_unchanged(store, before[name])
    ours.train()
    a, b = run(features), ref(features)
    assert a.keys() == b.keys() and a.values().shape == (4, 11)
    torch.testing.assert_close(a.values(), b.values())
    grad = torch.from_numpy(rng.standard_normal((4, 11)).astype(np.float32))
    (a.values() * grad).sum().backward()
    if weighted:
        ours_grad, features.weights().grad = features.weights().grad.clone(), None
    (b.values() * grad).sum().backward()
    assert_rows_moved_as_sgd(ours, ref.embedding_bags)
    if weighted:
        torch.testing.assert_close(ours_grad, features.weights().grad)


def test_variable_batch_weighted_on_accelerator_rows_as_in_the_core(cncard):
    """device="cncard" (PyTorch ops on device rows): the same output, weight gradient and update."""
    card = CNEmbeddingBagCollection(bag_configs(), is_weighted=True, optimizer=SGD, seed=3, device="cncard")
    core = CNEmbeddingBagCollection(bag_configs(), is_weighted=True, optimizer=SGD, seed=3)
    rng = np.random.default_rng(7)
    features = variable_batch_kjt(rng, weighted=True)
    twin = KeyedJaggedTensor(keys=features.keys(), values=features.values(), lengths=features.lengths(),
                             weights=features.weights().detach().clone().requires_grad_(),
                             stride_per_key_per_rank=features.stride_per_key_per_rank(),
                             inverse_indices=features.inverse_indices())
    a, b = card(features), core(twin)
    torch.testing.assert_close(a.values().cpu(), b.values())
    grad = torch.from_numpy(rng.standard_normal(tuple(a.values().shape)).astype(np.float32))
    (a.values() * grad.to(a.values().device)).sum().backward()
    (b.values() * grad).sum().backward()
    torch.testing.assert_close(features.weights().grad, twin.weights().grad)
    for name in core.stores:
        ours, theirs = snapshot(card.stores[name]), snapshot(core.stores[name])
        np.testing.assert_array_equal(ours[1], theirs[1])
        np.testing.assert_allclose(ours[2], theirs[2], rtol=1e-6, atol=1e-6)


def test_variable_batch_kjt_without_inverse_indices_is_refused():
    ours, _ = bag_twins()
    before = {name: snapshot(s) for name, s in ours.stores.items()}
    with pytest.raises(ValueError, match=r"features: the KJT has a batch size per key \(stride_per_key_per_rank="
                                         r"\[\[3\], \[1\], \[2\], \[3\]\]\) but no inverse_indices; "
                                         r"CNEmbeddingBagCollection pools .* build the KJT with inverse_indices="):
        ours(variable_batch_kjt(np.random.default_rng(0), inverse=False))
    for name, store in ours.stores.items():
        assert_unchanged(store, before[name])


def test_variable_batch_inverse_index_past_a_features_bags_is_refused():
    ours, _ = bag_twins()
    features = variable_batch_kjt(np.random.default_rng(0))
    features.inverse_indices()[1][2, 1] = 2  # f1 has 2 bags
    before = {name: snapshot(s) for name, s in ours.stores.items()}
    for run in (ours, compiled(ours, "compiled")):
        with pytest.raises(ValueError, match=r"features: inverse_indices of feature 'f1' hold 0\.\.2, but it has 2 "
                                             r"bags \(expected 0\.\.1\)"):
            run(features)
    for name, store in ours.stores.items():
        assert_unchanged(store, before[name])


@pytest.mark.parametrize("mode", MODES)
def test_variable_batch_kjt_in_the_unpooled_collection_as_torchrecs(mode):
    """TorchRec's EmbeddingCollection keeps each feature's own bags (no expansion): so do we."""
    ours, ref = unpooled_twins()
    run = compiled(ours, mode)
    rng = np.random.default_rng(3)
    features = variable_batch_kjt(rng, inverse=False)
    a, b = run(features), ref(features)
    assert sorted(a) == sorted(b)
    loss_a, loss_b = 0, 0
    for key in b:
        torch.testing.assert_close(a[key].values(), b[key].values())
        assert a[key].lengths().tolist() == b[key].lengths().tolist()
        scale = torch.from_numpy(rng.standard_normal(tuple(b[key].values().shape)).astype(np.float32))
        loss_a, loss_b = loss_a + (a[key].values() * scale).sum(), loss_b + (b[key].values() * scale).sum()
    loss_a.backward()
    loss_b.backward()
    assert_rows_moved_as_sgd(ours, ref.embeddings)


# --- the forward always runs -------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("pooled", [True, False], ids=["bags", "unpooled"])
def test_training_forward_without_optimizer_runs_and_its_gradient_names_both_ways(mode, pooled):
    ours, ref = bag_twins(optimizer=None) if pooled else unpooled_twins(optimizer=None)
    run = compiled(ours, mode)
    features = kjt(np.random.default_rng(4))
    a, b = run(features), ref(features)
    if pooled:
        torch.testing.assert_close(a.values(), b.values())
        loss = a.values().sum()
    else:
        for key in b:
            torch.testing.assert_close(a[key].values(), b[key].values())
        loss = sum(jt.values().sum() for jt in a.values())
    before = {name: snapshot(s) for name, s in ours.stores.items()}
    with pytest.raises(RuntimeError, match=NO_OPTIMIZER):
        loss.backward()
    for name, store in ours.stores.items():
        assert_unchanged(store, before[name])
    apply_optimizer_in_backward(torch.optim.SGD, ours.parameters(), {"lr": 1.0})  # the TorchRec way, then trains
    a, b = run(features), ref(features)
    if pooled:
        a.values().sum().backward()
        b.values().sum().backward()
    else:
        sum(jt.values().sum() for jt in a.values()).backward()
        sum(jt.values().sum() for jt in b.values()).backward()
    assert_rows_moved_as_sgd(ours, ref.embedding_bags if pooled else ref.embeddings)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("pooled", [True, False], ids=["bags", "unpooled"])
def test_frozen_collection_trains_nothing_and_says_nothing(mode, pooled):
    """Fine-tuning the dense part: a frozen collection (no optimizer) runs in training mode, the
    dense layer gets TorchRec's gradient, and the tables neither change nor grow (an unseen ID
    reads as in eval mode: a zero row)."""
    ours, ref = bag_twins(optimizer=None) if pooled else unpooled_twins(optimizer=None)
    ours.requires_grad_(False)
    ref.requires_grad_(False)
    before = {name: snapshot(s) for name, s in ours.stores.items()}
    dense = torch.nn.Linear(4, 1)
    run = compiled(ours, mode)
    features = kjt(np.random.default_rng(5), ids=ROWS + 5)  # IDs 30..34 are in no table
    unseen = bool((features.values() >= ROWS).any())
    with torch.no_grad():
        for name in ref.embedding_bags if pooled else ref.embeddings:  # TorchRec's rows of the unseen IDs: zeros
            module = (ref.embedding_bags if pooled else ref.embeddings)[name]
            grown = torch.nn.Parameter(torch.cat([module.weight, torch.zeros(5, module.weight.shape[1])]),
                                       requires_grad=False)
            module.weight = grown
    a, b = run(features), ref(features)
    grads = []
    for out in (a, b):
        dense.zero_grad()
        x = out.values()[:, :4] if pooled else out["f1"].values()
        dense(x).square().sum().backward()
        grads.append(dense.weight.grad.clone())
    torch.testing.assert_close(grads[0], grads[1])
    assert unseen
    for name, store in ours.stores.items():
        assert_unchanged(store, before[name])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["bags", "unpooled", "CNEmbeddingBag", "CNEmbeddingBag weighted", "CNEmbedding"])
def test_lookup_under_no_grad_never_inserts_and_reads_as_eval(mode, kind):
    """A validation loop that forgot .eval(): the output is the eval output (unseen IDs: zero
    rows), and the tables hold exactly what they held."""
    rng = np.random.default_rng(6)
    if kind == "bags":
        module, _ = bag_twins()
        features = (kjt(rng, ids=ROWS + 10),)
    elif kind == "unpooled":
        module, _ = unpooled_twins()
        features = (kjt(rng, ids=ROWS + 10),)
    else:
        module = (CNEmbedding(ROWS, 4) if kind == "CNEmbedding"
                  else CNEmbeddingBag(ROWS, 4, mode="sum", optimizer=cncore.SGD(lr=0.1)))
        module.storage.lookup(np.arange(ROWS), insert_missing=True)
        ids = torch.from_numpy(rng.integers(0, ROWS + 10, (4, 3)))
        features = (ids, None, torch.rand(4, 3)) if kind.endswith("weighted") else (ids,)
    stores = module.stores if hasattr(module, "stores") else {"t": module.storage}
    before = {name: snapshot(s) for name, s in stores.items()}
    run = compiled(module, mode)
    with torch.no_grad():
        train_out = run(*features)
    module.eval()
    with torch.no_grad():
        eval_out = run(*features)
    for name, store in stores.items():
        assert_unchanged(store, before[name])
    if kind == "bags":
        torch.testing.assert_close(train_out.values(), eval_out.values(), rtol=0, atol=0)
    elif kind == "unpooled":
        for key in eval_out:
            torch.testing.assert_close(train_out[key].values(), eval_out[key].values(), rtol=0, atol=0)
        ids, rows = features[0]["f1"].values(), train_out["f1"].values()
        assert bool((ids >= ROWS).any()) and bool((rows[ids >= ROWS] == 0).all())
    else:
        torch.testing.assert_close(train_out, eval_out, rtol=0, atol=0)
        if kind == "CNEmbedding":
            assert bool((train_out[features[0] >= ROWS] == 0).all())

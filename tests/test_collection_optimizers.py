"""The collections' optimizer the way TorchRec users set it: `torchrec.optim.apply_optimizer_in_backward`
on the parameters, against TorchRec's own EmbeddingBagCollection given the same call.

- Each optimizer it maps (torch.optim.SGD / Adagrad / Adam, torchrec.optim.RowWiseAdagrad) trains
  our rows as it trains TorchRec's dense weights: every batch touches every row, so TorchRec's
  dense update and our per-row fused update do the same arithmetic (Adam included, whose lazy
  form differs only on rows without a gradient); rows equal after k steps to fp32 rounding.
- Options without a fused form (momentum, weight decay, ...) and optimizers without one (RMSprop)
  are refused by name at the first forward, the collection unchanged.
- Neither optimizer= nor apply_optimizer_in_backward: a training forward says both ways
  (a plain torch.optim over model.parameters() cannot move the rows); no_grad / eval need neither.
- torch.save of a whole collection loads into one that trains on identically.
- Under DMP (2 gloo processes) the sharder reads the tag as TorchRec's own sharders do.
"""
import io

import numpy as np
import pytest
import torch

pytest.importorskip("torchrec")
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor  # noqa: E402
from torchrec.optim import RowWiseAdagrad as TorchRecRowWiseAdagrad  # noqa: E402
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward  # noqa: E402
from torchrec.optim.keyed import KeyedOptimizer  # noqa: E402

import cncore  # noqa: E402
from cncore_torch import CNEmbeddingBagCollection, CNEmbeddingCollection  # noqa: E402
from reference import assert_unchanged, snapshot  # noqa: E402

ROWS = 12
pytestmark = pytest.mark.filterwarnings("ignore:This API is deprecated:DeprecationWarning")


def configs():
    return [EmbeddingBagConfig(name="t_a", embedding_dim=4, num_embeddings=ROWS, feature_names=["f1", "f2"]),
            EmbeddingBagConfig(name="t_b", embedding_dim=3, num_embeddings=ROWS, feature_names=["f3"])]


def batch(rng, bags=6):
    """Every ID of every table in some bag (so every row gets a gradient every step), plus random ones."""
    values, lengths = [], []
    for _ in range(3):  # f1, f2, f3
        ids = np.concatenate([rng.permutation(ROWS), rng.integers(0, ROWS, 8)])
        cuts = np.sort(rng.integers(0, len(ids), bags - 1))
        lengths.append(np.diff(np.concatenate([[0], cuts, [len(ids)]])))
        values.append(ids)
    return KeyedJaggedTensor.from_lengths_sync(["f1", "f2", "f3"], torch.from_numpy(np.concatenate(values)),
                                               torch.from_numpy(np.concatenate(lengths)))


def twins():
    """TorchRec's EBC and ours, no optimizer given, ours holding TorchRec's initial rows."""
    torch.manual_seed(0)
    ref = EmbeddingBagCollection(tables=configs())
    ours = CNEmbeddingBagCollection(tables=configs())
    for name, store in ours.stores.items():
        store.insert_or_assign(np.arange(ROWS), ref.embedding_bags[name].weight.detach().numpy())
    return ours, ref


def train(model, kjt, targets):
    (model(kjt).values() * targets).sum().backward()


CASES = [
    (torch.optim.SGD, {"lr": 0.1}, cncore.SGD(lr=0.1)),
    (torch.optim.Adagrad, {"lr": 0.1, "eps": 1e-8}, cncore.Adagrad(lr=0.1, eps=1e-8)),
    (TorchRecRowWiseAdagrad, {"lr": 0.1}, cncore.RowWiseAdagrad(lr=0.1, eps=1e-10)),
    (torch.optim.Adam, {"lr": 0.01, "betas": (0.8, 0.99)}, cncore.Adam(lr=0.01, betas=(0.8, 0.99))),
]


@pytest.mark.parametrize("optimizer_class, kwargs, expected", CASES, ids=lambda c: getattr(c, "__name__", ""))
def test_apply_optimizer_in_backward_trains_as_torchrec_does(optimizer_class, kwargs, expected):
    ours, ref = twins()
    apply_optimizer_in_backward(optimizer_class, ours.parameters(), kwargs)
    apply_optimizer_in_backward(optimizer_class, ref.parameters(), kwargs)
    rng = np.random.default_rng(1)
    for step in range(4):
        kjt = batch(rng)
        targets = torch.from_numpy(rng.standard_normal((6, 11)).astype(np.float32))
        train(ours, kjt, targets)
        train(ref, kjt, targets)
        for name, store in ours.stores.items():
            torch.testing.assert_close(torch.from_numpy(store.lookup(np.arange(ROWS))),
                                       ref.embedding_bags[name].weight.detach(), rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"step {step}, table {name}: {m}")
    assert {s.config.optimizer for s in ours.stores.values()} == {expected}
    assert isinstance(ours.fused_optimizer, KeyedOptimizer) and ours.fused_optimizer.lr == kwargs["lr"]
    assert all(s.step == 4 for s in ours.stores.values())


def test_the_unpooled_collection_takes_it_too():
    ec = CNEmbeddingCollection([EmbeddingConfig_(name="t", embedding_dim=2, num_embeddings=5, feature_names=["f"])])
    apply_optimizer_in_backward(torch.optim.SGD, ec.parameters(), {"lr": 0.5})
    kjt = KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor([3, 3]), torch.tensor([2]))
    before = torch.from_numpy(ec(kjt)["f"].values().detach().numpy()[0].copy())
    ec(kjt)["f"].values().sum().backward()
    after = torch.from_numpy(ec.stores["t"].lookup(np.array([3]))[0])
    torch.testing.assert_close(after, before - 0.5 * 2 * torch.ones(2))  # one update, the summed gradient


def EmbeddingConfig_(**kw):
    from torchrec import EmbeddingConfig
    return EmbeddingConfig(**kw)


@pytest.mark.parametrize("optimizer_class, kwargs, match", [
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, r"SGD with momentum=0\.9 has no fused form"),
    (torch.optim.Adagrad, {"lr": 0.1, "weight_decay": 0.01}, r"Adagrad with weight_decay=0\.01"),
    (torch.optim.Adam, {"lr": 0.1, "amsgrad": True}, r"Adam with amsgrad=True"),
    (torch.optim.RMSprop, {"lr": 0.1}, r"'RMSprop' cannot run fused on dynamic tables; use one of .*SGD"),
])
def test_options_without_a_fused_form_are_refused_naming_them(optimizer_class, kwargs, match):
    ours, _ = twins()
    apply_optimizer_in_backward(optimizer_class, ours.parameters(), kwargs)
    before = {name: snapshot(store) for name, store in ours.stores.items()}
    with pytest.raises(ValueError, match=match):
        ours(batch(np.random.default_rng(0)))
    for name, store in ours.stores.items():
        assert_unchanged(store, before[name])
        assert store.config.optimizer is None


def test_neither_optimizer_says_both_ways_at_the_first_forward():
    ours, _ = twins()
    model = torch.nn.Sequential()
    model.add_module("ebc", ours)
    torch.optim.SGD(list(model.parameters()), lr=0.1)  # what a user of plain torch would write
    kjt = batch(np.random.default_rng(0))
    with pytest.raises(RuntimeError, match=r"has no optimizer.*optimizer=cncore\.RowWiseAdagrad.*"
                                           r"apply_optimizer_in_backward"):
        ours(kjt)
    with torch.no_grad():
        ours(kjt)  # inference needs no optimizer
    ours.eval()
    ours(kjt)
    assert {name: len(s) for name, s in ours.stores.items()} == {"t_a": ROWS, "t_b": ROWS}


def test_torch_save_of_a_whole_collection_trains_on_identically():
    ours = CNEmbeddingBagCollection(tables=configs(), optimizer=cncore.RowWiseAdagrad(lr=0.1))
    rng = np.random.default_rng(2)
    targets = torch.ones(6, 11)
    train(ours, batch(rng), targets)
    buf = io.BytesIO()
    torch.save(ours, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=False)
    for name in ours.stores:
        a, b = ours.stores[name].export(), back.stores[name].export()
        ia, ib = np.argsort(a.keys), np.argsort(b.keys)  # (a reloaded index may order keys otherwise)
        for field in ("keys", "rows", "optimizer_state", "counts", "last_steps"):
            np.testing.assert_array_equal(getattr(a, field)[ia], getattr(b, field)[ib])
    kjt = batch(rng)
    train(ours, kjt, targets)
    train(back, kjt, targets)
    for name in ours.stores:
        np.testing.assert_array_equal(ours.stores[name].lookup(np.arange(ROWS)), back.stores[name].lookup(np.arange(ROWS)))
    assert back.fused_optimizer.lr == 0.1 and back.fused_optimizer._stores[0] is back.stores["t_a"]


def _sharded_with_tag(rank, world_size):
    from torchrec.distributed.model_parallel import DistributedModelParallel

    from cncore_torch.distributed import CNEmbeddingBagCollectionSharder
    model = CNEmbeddingBagCollection(tables=configs(), device="meta", seed=3)
    apply_optimizer_in_backward(TorchRecRowWiseAdagrad, model.parameters(), {"lr": 0.2})
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), sharders=[CNEmbeddingBagCollectionSharder()])
    ref = CNEmbeddingBagCollection(tables=configs(), seed=3, optimizer=cncore.RowWiseAdagrad(lr=0.2, eps=1e-10))
    rng = np.random.default_rng(5)
    for _ in range(2):
        kjt = batch(rng)  # every rank feeds the same batch: the single process sees it world_size times
        both = KeyedJaggedTensor.from_lengths_sync(
            kjt.keys(), torch.cat([kjt[k].values() for k in kjt.keys() for _ in range(world_size)]),
            torch.cat([kjt[k].lengths() for k in kjt.keys() for _ in range(world_size)]))
        dmp(kjt).values().sum().backward()
        ref(both).values().sum().backward()
    for name, store in dmp.module.stores.items():
        assert store.config.optimizer == cncore.RowWiseAdagrad(lr=0.2, eps=1e-10)
        b = store.export()
        assert len(b.keys) > 0
        want = ref.stores[name].read(b.keys)
        torch.testing.assert_close(torch.from_numpy(b.rows), torch.from_numpy(want.rows), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(torch.from_numpy(b.optimizer_state), torch.from_numpy(want.optimizer_state),
                                   rtol=1e-6, atol=1e-6)


def test_dmp_shards_honour_the_tag():
    from cncore_torch.distributed.launch import spawn
    spawn(_sharded_with_tag, 2, timeout=80.0)


def test_store_set_optimizer_keeps_rows_metadata_and_sinks_and_refuses_a_second():
    s = cncore.EmbeddingStore(dim=2, max_rows=3, eviction=cncore.LRU(), headroom=0)
    sink = []
    s.on_evict(sink.append)
    _, ctx = s.pooled_lookup(np.array([1, 2, 2]), lengths=np.array([3]), insert_missing=True)
    before = s.read(np.array([1, 2]))
    s.step, s.evicted_count = 5, 4
    s.set_optimizer(cncore.Adagrad(lr=0.1, initial_accumulator_value=0.5))
    after = s.read(np.array([1, 2]))
    for field in ("rows", "counts", "last_steps"):
        np.testing.assert_array_equal(getattr(after, field), getattr(before, field))
    np.testing.assert_array_equal(after.optimizer_state, np.full((2, 2), 0.5, np.float32))
    assert (s.step, s.evicted_count) == (5, 4)
    s.find_or_insert(np.array([3, 4]))  # past the budget: the sink registered before still hears it
    assert [b.keys.tolist() for b in sink] == [[1]] and s.evicted_count == 5
    with pytest.raises(ValueError, match="already has Adagrad"):
        s.set_optimizer(cncore.SGD())


def test_a_state_dict_saved_with_the_old_one_dimensional_anchor_loads():
    ours = CNEmbeddingBagCollection(tables=configs(), optimizer=cncore.SGD(lr=0.1))
    state = ours.state_dict()
    assert tuple(state["_anchor"].shape) == (0, 1)
    state["_anchor"] = torch.empty(0)  # as collections saved it before
    again = CNEmbeddingBagCollection(tables=configs(), optimizer=cncore.SGD(lr=0.1))
    again.load_state_dict(state)
    assert again.table_rows() == ours.table_rows()

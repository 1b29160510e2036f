"""The collections' optimizer the way TorchRec users set it: `torchrec.optim.apply_optimizer_in_backward`
on the parameters, against TorchRec's own EmbeddingBagCollection given the same call.

- Each optimizer it maps (torch.optim.SGD / Adagrad / Adam, torchrec.optim.RowWiseAdagrad) trains
  our rows as it trains TorchRec's dense weights, pooled (EmbeddingBagCollection) and unpooled
  (EmbeddingCollection): every batch touches every row, so TorchRec's dense update and our
  per-row fused update do the same arithmetic (Adam included, whose lazy form differs only on
  rows without a gradient); rows equal after k steps to fp32 rounding.
- One optimizer per collection: optimizer= and a tag that disagree, a second
  apply_optimizer_in_backward (before or after the tables adopted the first) are refused, the
  tables unchanged; TorchRec's placeholder optimizers are read only when sharded.
- Options without a fused form (momentum, weight decay, ...) and optimizers without one (RMSprop)
  are refused by name at the first forward, the collection unchanged.
- Neither optimizer= nor apply_optimizer_in_backward: a training forward says both ways
  (a plain torch.optim over model.parameters() cannot move the rows); no_grad / eval need neither.
- torch.save of a whole collection (pooled, unpooled, tagged) loads into one that trains on
  identically.
- Under DMP (2 gloo processes) the sharders read the tag and their FBGEMM-style fused_params as
  TorchRec's own sharders do (rows and optimizer state equal the single process's); fused_params
  they cannot honour are refused by name.
- torch.compile(collection, fullgraph=True) (no graph break: the lookups are operators) trains
  both collections bit for bit as eager, with the tag too, and keeps nothing for a forward
  whose backward never runs.
"""
import io

import numpy as np
import pytest
import torch

pytest.importorskip("torchrec")
from reference import assert_unchanged, snapshot
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, KeyedTensor
from torchrec.optim import RowWiseAdagrad as TorchRecRowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import KeyedOptimizer

import cncore
from cncore_torch import CNEmbeddingBagCollection, CNEmbeddingCollection, ops

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


def test_neither_optimizer_says_both_ways_at_the_first_backward():
    ours, _ = twins()
    model = torch.nn.Sequential()
    model.add_module("ebc", ours)
    torch.optim.SGD(list(model.parameters()), lr=0.1)  # what a user of plain torch would write
    kjt = batch(np.random.default_rng(0))
    out = ours(kjt)  # the forward runs (and inserts, as a training forward does)
    with pytest.raises(RuntimeError, match=r"has no optimizer.*optimizer=cncore\.RowWiseAdagrad.*"
                                           r"apply_optimizer_in_backward"):
        out.values().sum().backward()
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
        np.testing.assert_array_equal(ours.stores[name].lookup(np.arange(ROWS)),
                                      back.stores[name].lookup(np.arange(ROWS)))
    assert back.fused_optimizer.lr == 0.1 and back.fused_optimizer._stores[0] is back.stores["t_a"]


def _sharded_with_tag(rank, world_size):
    from torchrec.distributed.model_parallel import DistributedModelParallel

    from cncore_torch.distributed import CNEmbeddingBagCollectionSharder
    model = CNEmbeddingBagCollection(tables=configs(), device="meta", seed=3)
    apply_optimizer_in_backward(TorchRecRowWiseAdagrad, model.parameters(), {"lr": 0.2})
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), sharders=[CNEmbeddingBagCollectionSharder()])
    ref = CNEmbeddingBagCollection(tables=configs(), seed=3, optimizer=cncore.RowWiseAdagrad(lr=0.2, eps=1e-10),
                                   per_rank_tables=True)  # each rank's own one-process reference
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


@pytest.mark.slow
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


# --- more than one place sets the optimizer ----------------------------------------------------------

def test_optimizer_and_a_disagreeing_tag_are_refused_naming_both_tables_unchanged():
    ours = CNEmbeddingBagCollection(tables=configs(), optimizer=cncore.SGD(lr=0.1))
    train(ours, batch(np.random.default_rng(0)), torch.ones(6, 11))
    apply_optimizer_in_backward(torch.optim.Adam, ours.parameters(), {"lr": 0.1})
    before = {name: snapshot(store) for name, store in ours.stores.items()}
    with pytest.raises(ValueError, match=r"optimizer= sets SGD\(lr=0\.1\) but apply_optimizer_in_backward sets "
                                         r"Adam\(lr=0\.1.*Nothing was changed"):
        ours(batch(np.random.default_rng(1)))
    for name, store in ours.stores.items():
        assert_unchanged(store, before[name])
        assert store.config.optimizer == cncore.SGD(lr=0.1)


def test_optimizer_and_the_same_tag_train_as_optimizer_alone():
    tagged = CNEmbeddingBagCollection(tables=configs(), optimizer=cncore.Adagrad(lr=0.1, eps=1e-10))
    plain = CNEmbeddingBagCollection(tables=configs(), optimizer=cncore.Adagrad(lr=0.1, eps=1e-10))
    apply_optimizer_in_backward(torch.optim.Adagrad, tagged.parameters(), {"lr": 0.1})  # torch's eps: 1e-10
    rng = np.random.default_rng(3)
    for _ in range(2):
        kjt = batch(rng)
        train(tagged, kjt, torch.ones(6, 11))
        train(plain, kjt, torch.ones(6, 11))
    for name in plain.stores:
        np.testing.assert_array_equal(snapshot(tagged.stores[name])[2], snapshot(plain.stores[name])[2])
        np.testing.assert_array_equal(snapshot(tagged.stores[name])[3], snapshot(plain.stores[name])[3])


def test_a_second_apply_optimizer_in_backward_after_adoption_is_refused_tables_unchanged():
    ours, _ = twins()
    apply_optimizer_in_backward(torch.optim.Adagrad, ours.parameters(), {"lr": 0.1})
    train(ours, batch(np.random.default_rng(0)), torch.ones(6, 11))
    apply_optimizer_in_backward(torch.optim.SGD, ours.parameters(), {"lr": 0.5})
    before = {name: snapshot(store) for name, store in ours.stores.items()}
    with pytest.raises(ValueError, match=r"already train with Adagrad\(lr=0\.1.*tagged its parameters with "
                                         r"Adagrad, SGD.*cannot change.*The tables are unchanged"):
        ours(batch(np.random.default_rng(1)))
    with pytest.raises(ValueError, match=r"already train with Adagrad"):
        _ = ours.fused_optimizer
    for name, store in ours.stores.items():
        assert_unchanged(store, before[name])
        assert store.config.optimizer == cncore.Adagrad(lr=0.1, eps=1e-10)


def test_two_apply_optimizer_in_backward_calls_before_training_are_refused():
    ours, _ = twins()
    apply_optimizer_in_backward(torch.optim.SGD, ours.parameters(), {"lr": 0.1})
    apply_optimizer_in_backward(torch.optim.SGD, ours.parameters(), {"lr": 0.2})
    before = {name: snapshot(store) for name, store in ours.stores.items()}
    with pytest.raises(ValueError, match=r"apply_optimizer_in_backward was called 2 times on its parameters "
                                         r"\(SGD, SGD\); dynamic tables take one optimizer"):
        ours(batch(np.random.default_rng(0)))
    for name, store in ours.stores.items():
        assert_unchanged(store, before[name])
        assert store.config.optimizer is None


def test_torchrec_placeholder_optimizers_read_as_its_sharders_read_them():
    """torchrec.optim.Adam and friends carry FBGEMM's names and defaults (eps 1e-8, lr renamed)."""
    import torchrec.optim as trec_optim

    from cncore_torch.optim import optimizer_from_torch
    assert optimizer_from_torch(trec_optim.Adam, {"lr": 0.02, "beta2": 0.99}) == \
        cncore.Adam(lr=0.02, betas=(0.9, 0.99), eps=1e-8)
    assert optimizer_from_torch(trec_optim.Adagrad, {"learning_rate": 0.3}) == cncore.Adagrad(lr=0.3, eps=1e-8)
    assert optimizer_from_torch(trec_optim.SGD, {"lr": 0.3}) == cncore.SGD(lr=0.3)
    with pytest.raises(ValueError, match=r"torchrec\.optim\.SGD: 'momentum' has no meaning for dynamic tables"):
        optimizer_from_torch(trec_optim.SGD, {"lr": 0.3, "momentum": 0.9})
    ours, _ = twins()  # in one process torch's hook would call the placeholder's step, which raises
    apply_optimizer_in_backward(trec_optim.SGD, ours.parameters(), {"lr": 0.5})
    with pytest.raises(ValueError, match=r"torchrec\.optim\.SGD is a placeholder only sharded tables take.*"
                                         r"use torch\.optim\.SGD here, or shard the collection with DMP"):
        ours(batch(np.random.default_rng(0)))
    assert {s.config.optimizer for s in ours.stores.values()} == {None}


# --- the unpooled collection against TorchRec's EmbeddingCollection --------------------------------

def ec_configs():
    from torchrec import EmbeddingConfig
    return [EmbeddingConfig(name="t_a", embedding_dim=3, num_embeddings=ROWS, feature_names=["f1", "f2"]),
            EmbeddingConfig(name="t_b", embedding_dim=3, num_embeddings=ROWS, feature_names=["f3"])]


@pytest.mark.parametrize("optimizer_class, kwargs, expected", CASES, ids=lambda c: getattr(c, "__name__", ""))
def test_the_unpooled_collection_trains_as_torchrecs_embedding_collection(optimizer_class, kwargs, expected):
    from torchrec import EmbeddingCollection
    torch.manual_seed(0)
    ref = EmbeddingCollection(tables=ec_configs())
    ours = CNEmbeddingCollection(tables=ec_configs())
    for name, store in ours.stores.items():
        store.insert_or_assign(np.arange(ROWS), ref.embeddings[name].weight.detach().numpy())
    apply_optimizer_in_backward(optimizer_class, ours.parameters(), kwargs)
    apply_optimizer_in_backward(optimizer_class, ref.parameters(), kwargs)
    rng = np.random.default_rng(4)
    for step in range(3):
        kjt = batch(rng)
        targets = {f: torch.from_numpy(rng.standard_normal((len(kjt[f].values()), 3)).astype(np.float32))
                   for f in kjt.keys()}
        for model in (ours, ref):
            out = model(kjt)
            sum((out[f].values() * targets[f]).sum() for f in targets).backward()
        for name, store in ours.stores.items():
            torch.testing.assert_close(torch.from_numpy(store.lookup(np.arange(ROWS))),
                                       ref.embeddings[name].weight.detach(), rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"step {step}, table {name}: {m}")
    assert {s.config.optimizer for s in ours.stores.values()} == {expected}


# --- torch.save, beyond the pooled collection with optimizer= -----------------------------------

def roundtrip(module):
    buf = io.BytesIO()
    torch.save(module, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def test_torch_save_of_a_tagged_collection_and_of_the_unpooled_one_train_on_identically():
    tagged, _ = twins()
    apply_optimizer_in_backward(torch.optim.Adam, tagged.parameters(), {"lr": 0.01})
    unpooled = CNEmbeddingCollection(tables=ec_configs(), optimizer=cncore.Adagrad(lr=0.1))
    rng = np.random.default_rng(6)
    kjt = batch(rng)

    def step(model):
        out = model(kjt)
        (out.values().sum() if isinstance(out, KeyedTensor) else sum(jt.values().sum() for jt in out.values())
         ).backward()

    for model in (tagged, unpooled):
        step(model)
        back = roundtrip(model)
        for name in model.stores:
            assert_unchanged(back.stores[name], snapshot(model.stores[name]))
        assert back.fused_optimizer.lr == model.fused_optimizer.lr
        step(model)
        step(back)
        for name in model.stores:
            assert_unchanged(back.stores[name], snapshot(model.stores[name]))
            assert back.stores[name].step == 2


# --- sharded: the sharder's fused_params, and the unpooled collection's tag ----------------------

def _sharded_fused_params_and_unpooled_tag(rank, world_size):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    from cncore_torch.distributed import CNEmbeddingBagCollectionSharder, CNEmbeddingCollectionSharder, plan_for

    model = CNEmbeddingBagCollection(tables=configs(), device="meta", seed=3)
    sharder = CNEmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.ADAM, "learning_rate": 0.05,
                                                            "beta1": 0.8})
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), sharders=[sharder])  # TorchRec's planner
    assert not dict(in_backward_optimizer_filter(dmp.named_parameters()))  # no dense parameter left
    ref = CNEmbeddingBagCollection(tables=configs(), seed=3, per_rank_tables=True,  # each rank's own reference
                                   optimizer=cncore.Adam(lr=0.05, betas=(0.8, 0.999), eps=1e-8))
    unpooled = CNEmbeddingCollection(tables=ec_configs(), device="meta", seed=4)
    apply_optimizer_in_backward(torch.optim.Adagrad, unpooled.parameters(), {"lr": 0.2})
    dmp_ec = DistributedModelParallel(unpooled, device=torch.device("cpu"), sharders=[CNEmbeddingCollectionSharder()],
                                      plan=plan_for(unpooled, world_size))
    ref_ec = CNEmbeddingCollection(tables=ec_configs(), seed=4, optimizer=cncore.Adagrad(lr=0.2, eps=1e-10),
                                   per_rank_tables=True)
    rng = np.random.default_rng(5)
    for _ in range(2):
        kjt = batch(rng)  # every rank feeds the same batch: the single process sees it world_size times
        both = KeyedJaggedTensor.from_lengths_sync(
            kjt.keys(), torch.cat([kjt[k].values() for k in kjt.keys() for _ in range(world_size)]),
            torch.cat([kjt[k].lengths() for k in kjt.keys() for _ in range(world_size)]))
        dmp(kjt).values().sum().backward()
        ref(both).values().sum().backward()
        sum(jt.values().sum() for jt in dmp_ec(kjt).values()).backward()
        sum(jt.values().sum() for jt in ref_ec(both).values()).backward()
    for sharded, single, want in ((dmp.module, ref, cncore.Adam(lr=0.05, betas=(0.8, 0.999), eps=1e-8)),
                                  (dmp_ec.module, ref_ec, cncore.Adagrad(lr=0.2, eps=1e-10))):
        for name, store in sharded.stores.items():
            assert store.config.optimizer == want
            b = store.export()
            assert len(b.keys) > 0
            expected = single.stores[name].read(b.keys)
            torch.testing.assert_close(torch.from_numpy(b.rows), torch.from_numpy(expected.rows), rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(torch.from_numpy(b.optimizer_state), torch.from_numpy(expected.optimizer_state),
                                       rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_dmp_reads_the_sharders_fused_params_and_the_unpooled_tag():
    from cncore_torch.distributed.launch import spawn
    spawn(_sharded_fused_params_and_unpooled_tag, 2, timeout=100.0)


@pytest.mark.parametrize("fused_params, tag, error, match", [
    ({"optimizer": "adam", "cache_load_factor": 0.2}, None, ValueError,
     r"fused_params: 'cache_load_factor' has no meaning for dynamic tables"),
    ({"optimizer": "lamb"}, None, ValueError, r"optimizer <EmbOptimType\.LAMB: 'lamb'> cannot run fused"),
    ({"optimizer": "exact_sgd", "learning_rate": 0.1}, (torch.optim.SGD, {"lr": 0.2}), ValueError,
     r"apply_optimizer_in_backward sets SGD\(lr=0\.2\) but the sharder's fused_params sets SGD\(lr=0\.1\)"),
    (None, None, RuntimeError, r"has no optimizer.*apply_optimizer_in_backward"),
])
def test_the_sharded_collection_refuses_fused_params_it_cannot_honour(fused_params, tag, error, match):
    """Refused in the sharded module's constructor, before any store or collective (world size 1,
    no process group needed)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.types import ShardingEnv

    from cncore_torch.distributed import ShardedCNEmbeddingBagCollection, plan_for
    model = CNEmbeddingBagCollection(tables=configs(), device="meta")
    if tag is not None:
        apply_optimizer_in_backward(tag[0], model.parameters(), tag[1])
    if fused_params is not None:
        fused_params = {**fused_params, "optimizer": EmbOptimType(fused_params["optimizer"])}
    plan = plan_for(model, 1).plan[""]
    with pytest.raises(error, match=match):
        ShardedCNEmbeddingBagCollection(model, plan, ShardingEnv(world_size=1, rank=0, pg=None), fused_params)


# --- torch.compile: the collection's lookup as operators (one node each way, no graph break) -------

def compile_configs():
    from torchrec import PoolingType
    return [EmbeddingBagConfig(name="t_a", embedding_dim=4, num_embeddings=ROWS, feature_names=["f1", "f2"]),
            EmbeddingBagConfig(name="t_b", embedding_dim=3, num_embeddings=ROWS, feature_names=["f3"],
                               pooling=PoolingType.MEAN)]


def random_kjt(rng, bags, weighted=False):
    """f1..f3 in shuffled key order with an extra key no table reads, empty bags included."""
    keys = ["f3", "other", "f1", "f2"]
    lengths = rng.integers(0, 4, (len(keys), bags))
    values = rng.integers(-3, 40, int(lengths.sum()))
    weights = torch.from_numpy(rng.random(len(values)).astype(np.float32)) if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(keys, torch.from_numpy(values), torch.from_numpy(lengths.ravel()),
                                               weights=weights)


def assert_same_tables(a, b):
    for name in a.stores:
        assert_unchanged(b.stores[name], snapshot(a.stores[name]))


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_compiled_collection_trains_exactly_as_eager(weighted):
    make = lambda: CNEmbeddingBagCollection(tables=compile_configs(), is_weighted=weighted,  # noqa: E731
                                            optimizer=cncore.Adam(lr=0.01))
    eager, compiled = make(), make()
    run = torch.compile(compiled, fullgraph=True)  # fullgraph: no graph break, or it raises
    rng = np.random.default_rng(7)
    for bags in (5, 3, 5, 4):  # batch sizes vary (the last batch of an epoch)
        kjt = random_kjt(rng, bags, weighted)
        a, b = eager(kjt), run(kjt)
        assert b.keys() == a.keys() and b.length_per_key() == a.length_per_key()
        torch.testing.assert_close(b.values(), a.values(), rtol=0, atol=0)
        grad = torch.from_numpy(rng.standard_normal(tuple(a.values().shape)).astype(np.float32))
        (a.values() * grad).sum().backward()
        (b.values() * grad).sum().backward()
        assert_same_tables(eager, compiled)
    assert all(s.step == 4 for s in compiled.stores.values())
    assert ops._PENDING == {}  # every lookup's contexts left with its backward


def test_compiled_collection_honours_apply_optimizer_in_backward_and_says_when_there_is_none():
    ours, _ = twins()
    ref, _ = twins()
    run = torch.compile(ours, backend="aot_eager", fullgraph=True)
    kjt = batch(np.random.default_rng(0))
    out = run(kjt)
    with pytest.raises(RuntimeError, match=r"has no optimizer.*apply_optimizer_in_backward"):
        out.values().sum().backward()
    for model in (ours, ref):
        apply_optimizer_in_backward(TorchRecRowWiseAdagrad, model.parameters(), {"lr": 0.1})
    rng = np.random.default_rng(1)
    for _ in range(3):
        kjt = batch(rng)
        targets = torch.from_numpy(rng.standard_normal((6, 11)).astype(np.float32))
        train(run, kjt, targets)
        train(ref, kjt, targets)
    assert {s.config.optimizer for s in ours.stores.values()} == {cncore.RowWiseAdagrad(lr=0.1, eps=1e-10)}
    assert_same_tables(ref, ours)


def test_compiled_forward_without_backward_keeps_nothing_and_bad_batches_raise_the_eager_message():
    import gc

    ours = CNEmbeddingBagCollection(tables=compile_configs(), optimizer=cncore.SGD(lr=0.1))
    run = torch.compile(ours, backend="aot_eager", fullgraph=True)
    rng = np.random.default_rng(3)
    out = run(random_kjt(rng, 4))  # a training forward whose loss is never used
    with torch.no_grad():
        run(random_kjt(rng, 4))
    del out
    gc.collect()
    assert ops._PENDING == {}
    bad = KeyedJaggedTensor(keys=["f1", "f2", "f3"], values=torch.tensor([1, 2, 3]),
                            lengths=torch.tensor([2, -1, 1, 0, 1, 0]))
    before = {name: snapshot(store) for name, store in ours.stores.items()}
    with pytest.raises(ValueError, match=r"features: lengths must be >= 0, got -1"):
        run(bad)
    for name, store in ours.stores.items():
        assert_unchanged(store, before[name])


def unpooled_twins(need_indices=False):
    from torchrec import EmbeddingConfig
    make = lambda: CNEmbeddingCollection(  # noqa: E731
        tables=[EmbeddingConfig(name="t_a", embedding_dim=3, num_embeddings=ROWS, feature_names=["f1", "f2"]),
                EmbeddingConfig(name="t_b", embedding_dim=3, num_embeddings=ROWS, feature_names=["f3"])],
        need_indices=need_indices, optimizer=cncore.Adagrad(lr=0.1))
    return make(), make()


@pytest.mark.parametrize("need_indices", [False, True], ids=["rows", "rows_and_indices"])
def test_compiled_unpooled_collection_trains_exactly_as_eager(need_indices):
    eager, compiled = unpooled_twins(need_indices)
    run = torch.compile(compiled, fullgraph=True)
    rng = np.random.default_rng(8)
    for bags in (5, 3, 5):
        kjt = random_kjt(rng, bags)
        a, b = eager(kjt), run(kjt)
        assert list(b) == list(a) == ["f1", "f2", "f3"]
        for name in a:
            torch.testing.assert_close(b[name].values(), a[name].values(), rtol=0, atol=0)
            assert b[name].lengths().tolist() == a[name].lengths().tolist()
            if need_indices:
                assert b[name].weights().tolist() == a[name].weights().tolist() == kjt[name].values().tolist()
        # f2's rows left out of the loss: its part of t_a's gradient is zero, in both
        scale = {"f1": 1.0, "f3": -2.0}
        for out in (a, b):
            sum((out[f].values() * s).sum() for f, s in scale.items()).backward()
        assert_same_tables(eager, compiled)
    assert ops._PENDING == {}

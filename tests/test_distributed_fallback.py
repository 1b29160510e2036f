"""Fallback rows on tables sharded over 2 gloo processes by DMP with our sharders.

A table with ``fallback_rows=5`` gives each rank's shard ceil(5 / 2) = 3 fallback rows; an
``"auto"`` one (the default) lets each shard choose its split when it fills, from what it
measured. The stream is built so the ranks choose differently: the auto table's keys owned by
rank 0 churn (a new key each time), those owned by rank 1 are three keys looked up again and
again, so rank 0's shard splits and rank 1's never fills.

The reference is a plain `cncore.EmbeddingStore` per rank with that rank's shard config (what
`shard_store_configs` gives it), fed the keys that rank owns in the order its shard receives
them (rank 0's bags, then rank 1's), each call's gradient a matrix of ones (the loss is the sum
of the outputs): every rank's shard equals its reference row for row, fallback row for fallback
row, with the optimizer state, and the model's outputs equal the references' pools added up.

Then each rank saves (DCP, its own state_dict, its shard table files) and a fresh DMP loads each
at the same world size exactly. At world size 1 (a plain collection, `merge_shards`,
`load_shard_tables`, `cn-table reshard`) the trained fallback rows cannot be placed (a key reads
the fallback row of its shard): refused by name with the table unchanged, and after
`drop_fallback_rows` the keyed rows load."""
import os

import numpy as np
import pytest
import torch

pytest.importorskip("torchrec")

TIMEOUT = 150.0
STEPS = 6
FIELDS = ("keys", "rows", "optimizer_state", "counts", "last_steps")
BATCH = 4  # samples per rank


def _configs():
    from torchrec import EmbeddingBagConfig
    return [EmbeddingBagConfig(name="fixed", embedding_dim=3, num_embeddings=8, feature_names=["fa"]),
            EmbeddingBagConfig(name="auto", embedding_dim=2, num_embeddings=10, feature_names=["fb"])]


def _model(device):
    import cncore
    from cncore_torch import CNEmbeddingBagCollection
    return CNEmbeddingBagCollection(_configs(), device=device, optimizer=cncore.Adagrad(lr=0.3),
                                    max_rows="num_embeddings", fallback_rows={"fixed": 5, "auto": None}, seed=4)


def _owned_keys(rank, count, start=0):
    """`count` keys from `start` up that rank `rank` of 2 owns."""
    from cncore.routing import owner_of
    candidates = np.arange(start, start + 40 * count + 100, dtype=np.int64)
    return candidates[owner_of(candidates, 2) == rank][:count]


def _batch(step, rank):
    """Rank `rank`'s KJT of step `step`: 4 samples, 2 IDs each per feature. fa: IDs of a wide range
    (both tables' shards overflow, so keys go to their fallback rows); fb: two fresh keys owned
    by rank 0 and repeated keys owned by rank 1 in every sample."""
    from torchrec import KeyedJaggedTensor
    rng = np.random.default_rng(100 * step + rank)
    fa = rng.integers(0, 60, 2 * BATCH)
    fresh = _owned_keys(0, 2 * BATCH * 2 * 60, start=1000)
    at = (2 * step + rank) * 2 * BATCH
    fb = np.stack([fresh[at:at + 2 * BATCH:2], np.resize(_owned_keys(1, 3, start=5000), BATCH)], axis=1).reshape(-1)
    return KeyedJaggedTensor.from_lengths_sync(["fa", "fb"], torch.from_numpy(np.concatenate([fa, fb])),
                                               torch.full((2 * BATCH,), 2, dtype=torch.int64))


def _references():
    """{rank: {table: a plain store with that rank's shard config}} (sharded as DMP shards)."""
    import cncore
    from cncore_torch.distributed.embedding_sharding import shard_store_configs
    whole = {name: store.config for name, store in _model("cpu").stores.items()}
    return {r: {name: cncore.EmbeddingStore(config) for name, config in shard_store_configs(whole, 2, r).items()}
            for r in range(2)}


def _train_references(references, step):
    """One step of every reference: each rank's store looks up the keys it owns of both ranks'
    bags (rank 0's, then rank 1's, as its shard receives them) and takes a gradient of ones.
    Returns the global (2 x BATCH, 5) output: the ranks' pools added up."""
    from cncore.routing import owner_of
    kjts = [_batch(step, r) for r in range(2)]
    out = np.zeros((2, 2 * BATCH, 5), np.float32)
    for owner, stores in references.items():
        for column, (feature, name) in zip((slice(0, 3), slice(3, 5)), (("fa", "fixed"), ("fb", "auto"))):
            bags = [k for kjt in kjts for k in torch.split(kjt[feature].values(), 2)]
            keys = [b.numpy()[owner_of(b.numpy(), 2) == owner] for b in bags]
            pooled, ctx = stores[name].pooled_lookup(np.concatenate(keys), lengths=[len(k) for k in keys])
            stores[name].apply_gradients(ctx, np.ones_like(pooled))
            out[owner, :, column] = pooled
    return out[0] + out[1]


def _state(store):
    e = store.export()
    order = np.argsort(e.keys)
    state = {f: np.asarray(getattr(e, f))[order] for f in FIELDS}
    state["fallback"] = store.export_fallback() if store.fallback_rows else None
    state["step"], state["evicted"] = store.step, int(store.evicted_count)
    return state


def _assert_same(got, want, where):
    for f in FIELDS:
        np.testing.assert_array_equal(got[f], want[f], err_msg=f"{where}: {f}")
    assert (got["step"], got["evicted"]) == (want["step"], want["evicted"]), where
    assert (got["fallback"] is None) == (want["fallback"] is None), where
    if want["fallback"] is not None:
        for part in range(2):
            np.testing.assert_array_equal(got["fallback"][part], want["fallback"][part], err_msg=f"{where}: fallback")


def _dmp():
    from torchrec.distributed.model_parallel import DistributedModelParallel

    from cncore_torch.distributed import CNEmbeddingBagCollectionSharder
    return DistributedModelParallel(_model("meta"), device=torch.device("cpu"),
                                    sharders=[CNEmbeddingBagCollectionSharder()])


def _ranks(rank, world_size, directory):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from cncore_torch.dcp import CNLoadPlanner
    from cncore_torch.distributed import load_shard_tables, save_shard_tables
    dmp = _dmp()
    stores = dmp.module.stores
    assert {n: (s.config.max_rows, s.config.fallback_rows) for n, s in stores.items()} == \
        {"fixed": (4, 3), "auto": (5, "auto")}
    references = _references()
    for step in range(STEPS):
        out = dmp(_batch(step, rank)).wait().values()
        out.sum().backward()
        want = _train_references(references, step)[rank * BATCH:(rank + 1) * BATCH]
        torch.testing.assert_close(out.detach(), torch.from_numpy(want), rtol=0, atol=0)
    saved = {name: _state(store) for name, store in stores.items()}
    for name in stores:
        _assert_same(saved[name], _state(references[rank][name]), f"rank {rank} {name} against its reference")
    # the ranks chose differently: rank 0's auto shard split, rank 1's never filled
    assert (stores["auto"].fallback_rows > 0) == (rank == 0) and stores["fixed"].fallback_rows == 3
    assert stores["fixed"].evicted_count > 0
    dmp.eval()
    probe = dmp(_batch(50, rank)).wait().values().detach()  # unseen keys read fallback rows
    dmp.train()

    dcp.save({"model": dmp.state_dict()}, checkpoint_id=os.path.join(directory, "ckpt"))
    torch.save(dmp.state_dict(), os.path.join(directory, f"state{rank}.pt"))
    save_shard_tables(dmp.module, os.path.join(directory, "files"))
    torch.save(saved, os.path.join(directory, f"saved{rank}.pt"))
    dist.barrier()

    def check(fresh, how):
        for name, store in fresh.module.stores.items():
            _assert_same(_state(store), saved[name], f"rank {rank} {name} after {how}")
        fresh.eval()
        torch.testing.assert_close(fresh(_batch(50, rank)).wait().values().detach(), probe, rtol=0, atol=0)

    fresh = _dmp()
    state = {"model": fresh.state_dict()}
    dcp.load(state, checkpoint_id=os.path.join(directory, "ckpt"), planner=CNLoadPlanner())
    fresh.load_state_dict(state["model"])
    check(fresh, "a DCP load at the saved world size")
    fresh = _dmp()
    fresh.load_state_dict(torch.load(os.path.join(directory, f"state{rank}.pt"), weights_only=False))
    check(fresh, "its own state_dict")
    fresh = _dmp()
    load_shard_tables(fresh.module, os.path.join(directory, "files"))
    check(fresh, "load_shard_tables at the saved world size")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from cncore_torch.distributed.launch import spawn
    directory = str(tmp_path_factory.mktemp("fallback"))
    spawn(_ranks, 2, directory, timeout=TIMEOUT)
    return directory


@pytest.mark.slow
def test_sharded_fallback_rows_train_as_each_ranks_reference_and_load_back_exactly(saved):
    """(The checks run in the ranks: a failure there fails the spawn.)"""
    shards = [torch.load(os.path.join(saved, f"saved{r}.pt"), weights_only=False) for r in range(2)]
    assert [len(s["auto"]["fallback"][0]) if s["auto"]["fallback"] else 0 for s in shards][1] == 0
    assert shards[0]["auto"]["fallback"] is not None


def _loaded_plain():
    """A plain (one-process) collection that has trained a step, and its state."""
    ebc = _model("cpu")
    ebc(_batch(0, 0)).values().sum().backward()
    return ebc, {name: _state(store) for name, store in ebc.stores.items()}


@pytest.mark.slow
def test_a_dcp_load_at_world_size_1_is_refused_by_name_and_the_table_is_unchanged(saved):
    import torch.distributed.checkpoint as dcp

    from cncore_torch.dcp import CNLoadPlanner
    from cncore_torch.state import drop_fallback_rows
    ebc, before = _loaded_plain()
    state = {"model": ebc.state_dict()}
    dcp.load(state, checkpoint_id=os.path.join(saved, "ckpt"), planner=CNLoadPlanner(), no_dist=True)
    with pytest.raises(RuntimeError, match=r"fallback_rows: the checkpoint holds \d+ trained fallback rows of the "
                                           r"shards of a table split over 2 ranks, and this table is a whole table"
                                           r".*Load the checkpoint on 2 ranks"):
        ebc.load_state_dict(state["model"])
    for name, store in ebc.stores.items():
        _assert_same(_state(store), before[name], f"{name} after the refused load")
    # without the fallback rows, the keyed rows of the "auto" table load (the fixed one needs them)
    result = ebc.load_state_dict(drop_fallback_rows(state["model"]), strict=False)
    assert sorted(result.missing_keys) == ["tables.fixed.fallback_optimizer_state", "tables.fixed.fallback_rows"]
    shards = [torch.load(os.path.join(saved, f"saved{r}.pt"), weights_only=False) for r in range(2)]
    np.testing.assert_array_equal(_state(ebc.stores["auto"])["keys"],
                                  np.sort(np.concatenate([s["auto"]["keys"] for s in shards])))
    assert ebc.stores["auto"].fallback_rows == 0 and ebc.stores["auto"].config.fallback_rows == "auto"
    _assert_same(_state(ebc.stores["fixed"]), before["fixed"], "fixed after the load without its fallback rows")


@pytest.mark.slow
def test_merge_shards_refuses_trained_fallback_rows_and_merges_the_keyed_rows_without_them(saved):
    from cncore_torch.distributed import merge_shards
    from cncore_torch.state import drop_fallback_rows
    shards = [torch.load(os.path.join(saved, f"state{r}.pt"), weights_only=False) for r in range(2)]
    with pytest.raises(ValueError, match=r"tables.auto.fallback_rows: the shards hold \d+ trained fallback rows .*"
                                         r"Load each rank's state_dict on 2 ranks .*drop_fallback_rows"):
        merge_shards(shards)
    # a state_dict of rank 1 alone, whose auto shard never split, has nothing to refuse in "auto"
    merged = merge_shards([drop_fallback_rows(sd) for sd in shards])
    assert not any("fallback" in k for k in merged)
    whole = _model("cpu")  # "fixed" needs its fallback rows: reported missing, left as it is
    result = whole.load_state_dict(merged, strict=False)
    assert sorted(result.missing_keys) == ["tables.fixed.fallback_optimizer_state", "tables.fixed.fallback_rows"]
    saved_keys = np.concatenate([s["tables.auto.keys"].numpy() for s in shards])
    assert sorted(whole.stores["auto"].export().keys.tolist()) == sorted(saved_keys.tolist())
    assert len(whole.stores["fixed"]) == 0


@pytest.mark.slow
def test_shard_files_at_another_world_size_are_refused_by_name(saved):
    from cncore.tablefile import open_table
    from cncore_numpy.tools import reshard
    from cncore_torch.distributed import load_shard_tables
    ebc, before = _loaded_plain()
    with pytest.raises(ValueError, match=r"files/fixed: the 2 shard files hold 6 trained fallback rows, and this "
                                         r"table is split over 1 rank; .*Load them on 2 ranks"):
        load_shard_tables(ebc, os.path.join(saved, "files"))
    for name, store in ebc.stores.items():
        _assert_same(_state(store), before[name], f"{name} after the refused load")
    paths = [os.path.join(saved, "files", "fixed", f"shard-{r}-of-2") for r in range(2)]
    out = os.path.join(saved, "resharded")
    with pytest.raises(ValueError, match=r"fallback_rows: the shard tables hold 6 trained fallback rows .*, and they "
                                         r"are to be split over 3 shards; a key reads the fallback row of the shard "
                                         r"that owns it, .*Load the shards on 2 ranks .*; nothing was written"):
        reshard(paths, [open_table(p) for p in paths], out, 3)
    assert not os.path.exists(out)


def test_a_shard_of_one_rank_loads_elsewhere_only_as_its_own_shard():
    """The placement rule on its own: fallback rows saved by rank r of W are this table's only
    as rank r of W; a whole table's only as a whole table (one process, no ranks needed)."""
    from cncore_torch.dcp import fallback_in_place
    assert fallback_in_place((1, 2, 7), (1, 2)) and not fallback_in_place((1, 2, 7), (0, 2))
    assert not fallback_in_place((0, 2, 7), (0, 1)) and not fallback_in_place((0, 1, 7), (0, 2))
    assert fallback_in_place(None, (0, 1)) and not fallback_in_place(None, (0, 2))


def test_sharding_a_trained_whole_table_with_fallback_rows_is_refused_and_leaves_both_as_they_were():
    """keep_owned_rows (what DMP runs on an already-trained unsharded module): a whole table's
    trained fallback rows are no shard's, so it refuses before any rank's store is written."""
    import cncore
    from cncore_torch.distributed.embedding_sharding import keep_owned_rows
    trained = cncore.EmbeddingStore(dim=2, optimizer=cncore.SGD(lr=0.5), max_rows=4, fallback_rows=2, seed=3)
    keys = np.arange(9, dtype=np.int64)
    trained.pooled_lookup(keys[:4], np.arange(5, dtype=np.int64))  # keys 0-3 get rows: the table is used
    before = (trained.export().keys.copy(), trained.export_fallback()[0].copy())
    target = cncore.EmbeddingStore(dim=2, optimizer=cncore.SGD(lr=0.5), max_rows=2, fallback_rows=1, seed=3)
    with pytest.raises(ValueError, match=r"table 't': it holds 2 trained fallback rows of a whole table, and it is "
                                         r"to be split over 2 ranks; a key reads the fallback row of the shard that "
                                         r"owns it, .*Shard the module before it trains .*drop_fallback_rows; "
                                         r"nothing was sharded"):
        keep_owned_rows({"t": target}, {"t": trained}, world_size=2, rank=0)
    assert len(target) == 0
    np.testing.assert_array_equal(trained.export().keys, before[0])
    np.testing.assert_array_equal(trained.export_fallback()[0], before[1])


def _unpooled_dmp():
    from torchrec import EmbeddingConfig
    from torchrec.distributed.model_parallel import DistributedModelParallel

    import cncore
    from cncore_torch import CNEmbeddingCollection
    from cncore_torch.distributed import CNEmbeddingCollectionSharder
    model = CNEmbeddingCollection([EmbeddingConfig(name="u", embedding_dim=2, num_embeddings=6, feature_names=["fu"])],
                                  device="meta", optimizer=cncore.SGD(lr=0.5), max_rows="num_embeddings",
                                  fallback_rows=3, seed=9)
    return DistributedModelParallel(model, device=torch.device("cpu"), sharders=[CNEmbeddingCollectionSharder()])


def _unpooled_kjt(step, rank):
    from torchrec import KeyedJaggedTensor
    ids = np.random.default_rng(10 * step + rank).integers(0, 40, 6)
    return KeyedJaggedTensor.from_lengths_sync(["fu"], torch.from_numpy(ids), torch.full((3,), 2, dtype=torch.int64))


def _unpooled_ranks(rank, world_size, directory):
    import torch.distributed.checkpoint as dcp

    from cncore_torch.dcp import CNLoadPlanner
    dmp = _unpooled_dmp()
    store = dmp.module.stores["u"]
    initial = store.export_fallback()[0].copy()
    for step in range(4):
        dmp(_unpooled_kjt(step, rank)).wait()["fu"].values().sum().backward()
    assert store.fallback_rows == 2 and not np.array_equal(store.export_fallback()[0], initial)  # trained
    saved = _state(store)
    dcp.save({"model": dmp.state_dict()}, checkpoint_id=directory)
    fresh = _unpooled_dmp()
    state = {"model": fresh.state_dict()}
    dcp.load(state, checkpoint_id=directory, planner=CNLoadPlanner())
    fresh.load_state_dict(state["model"])
    _assert_same(_state(fresh.module.stores["u"]), saved, f"rank {rank}: the unpooled table after a DCP load")
    dmp.eval(), fresh.eval()
    torch.testing.assert_close(fresh(_unpooled_kjt(9, rank)).wait()["fu"].values(),
                               dmp(_unpooled_kjt(9, rank)).wait()["fu"].values(), rtol=0, atol=0)


def _roomy_model(device):
    """An "auto" table whose shards never fill (so none splits)."""
    from torchrec import EmbeddingBagConfig

    import cncore
    from cncore_torch import CNEmbeddingBagCollection
    return CNEmbeddingBagCollection([EmbeddingBagConfig(name="roomy", embedding_dim=2, num_embeddings=1000,
                                                        feature_names=["fu"])],
                                    device=device, optimizer=cncore.SGD(lr=0.5), max_rows="num_embeddings", seed=2)


def _roomy_ranks(rank, world_size, directory):
    import torch.distributed.checkpoint as dcp
    from torchrec.distributed.model_parallel import DistributedModelParallel

    from cncore_torch.distributed import CNEmbeddingBagCollectionSharder
    dmp = DistributedModelParallel(_roomy_model("meta"), device=torch.device("cpu"),
                                   sharders=[CNEmbeddingBagCollectionSharder()])
    for step in range(2):
        dmp(_unpooled_kjt(step, rank)).wait().values().sum().backward()
    store = dmp.module.stores["roomy"]
    assert store.config.fallback_rows == "auto" and store.fallback_rows == 0 and len(store) > 0
    dcp.save({"model": dmp.state_dict()}, checkpoint_id=directory)
    torch.save(_state(store), directory + f"_rank{rank}.pt")


@pytest.mark.slow
def test_an_unpooled_sharded_table_trains_its_fallback_rows_and_a_dcp_load_gives_them_back(tmp_path):
    from cncore_torch.distributed.launch import spawn
    spawn(_unpooled_ranks, 2, str(tmp_path / "ckpt"), timeout=TIMEOUT)


@pytest.mark.slow
def test_undecided_auto_shards_hold_no_fallback_rows_and_load_at_another_world_size(tmp_path):
    """Every rank writes its (empty) fallback entries, and with none held the checkpoint loads
    into one process as any checkpoint of keyed rows does."""
    import torch.distributed.checkpoint as dcp

    from cncore_torch.dcp import CNLoadPlanner
    from cncore_torch.distributed.launch import spawn
    path = str(tmp_path / "ckpt")
    spawn(_roomy_ranks, 2, path, timeout=TIMEOUT)
    one = _roomy_model("cpu")
    state = {"model": one.state_dict()}
    dcp.load(state, checkpoint_id=path, planner=CNLoadPlanner(), no_dist=True)
    assert state["model"]["tables.roomy.fallback_count"].tolist() == [0, 0]
    one.load_state_dict(state["model"])
    shards = [torch.load(path + f"_rank{r}.pt", weights_only=False) for r in range(2)]
    got = _state(one.stores["roomy"])
    order = np.argsort(np.concatenate([s["keys"] for s in shards]))
    for f in FIELDS:
        np.testing.assert_array_equal(got[f], np.concatenate([s[f] for s in shards])[order], err_msg=f)
    assert one.stores["roomy"].fallback_rows == 0 and one.stores["roomy"].config.fallback_rows == "auto"

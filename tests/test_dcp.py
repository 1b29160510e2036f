"""torch.distributed.checkpoint (DCP) of dynamic tables: a DMP model's sharded tables (pooled and
unpooled, plain, bounded with LRU eviction, on the SSD tier) are saved from every rank with
`dcp.save({"model": dmp.state_dict()})` and loaded with `CNLoadPlanner` at the same world size
and at another one (2 -> 2, 2 -> 1, 1 -> 2). The reference is each rank's own `export()` of its
stores taken when it saved (never read back through DCP): after the load, every rank holds
exactly the saved rows it owns at its world size (`owner_of`), with their optimizer state,
counts, last steps, step and evicted count, and the model's outputs on a probe batch equal the
saved model's. A checkpoint with a rank's chunks gone is refused with the table unchanged."""
import os
import pickle

import numpy as np
import pytest
import torch

pytest.importorskip("torchrec")

from torch.distributed.checkpoint.api import CheckpointException

TIMEOUT = 150.0
FIELDS = ("keys", "rows", "optimizer_state", "counts", "last_steps")
BATCH = {1: [7], 2: [3, 4]}  # unequal batches per rank; the global batch is the same
BUDGET = 24
STEPS = 4


def _bag_configs(prefix):
    from torchrec import EmbeddingBagConfig
    return [EmbeddingBagConfig(name=f"{prefix}_a", embedding_dim=4, num_embeddings=200, feature_names=["f1", "f2"]),
            EmbeddingBagConfig(name=f"{prefix}_b", embedding_dim=2, num_embeddings=200, feature_names=["f3"])]


class Net(torch.nn.Module):
    """Every kind of table DCP must carry, and a dense layer (a replicated parameter)."""

    def __init__(self, device, tier):
        super().__init__()
        from torchrec import EmbeddingConfig

        import cncore
        from cncore_torch import CNEmbeddingBagCollection, CNEmbeddingCollection
        self.plain = CNEmbeddingBagCollection(_bag_configs("p"), device=device, optimizer=cncore.Adam(lr=0.05),
                                              seed=5)
        # a row per key (fallback_rows=0): this checkpoint loads at other world sizes, where a
        # shard's trained fallback rows are refused (test_distributed_fallback.py)
        self.bounded = CNEmbeddingBagCollection(_bag_configs("b"), device=device, optimizer=cncore.Adagrad(lr=0.1),
                                                max_rows=BUDGET, eviction=cncore.LRU(), headroom=2, seed=6,
                                                fallback_rows=0)
        self.tiered = CNEmbeddingBagCollection(_bag_configs("t"), device=device,
                                               optimizer=cncore.RowWiseAdagrad(lr=0.1), seed=7,
                                               storage=cncore.Tiered(tier, cache_bytes=1 << 12))
        self.unpooled = CNEmbeddingCollection(
            [EmbeddingConfig(name="u", embedding_dim=4, num_embeddings=200, feature_names=["f1"])],
            device=device, optimizer=cncore.SGD(lr=0.1), seed=8)
        self.dense = torch.nn.Linear(4, 1)

    def forward(self, kjt):
        """(the pooled tables' outputs and the dense layer's, (B, 31); the unpooled rows, (IDs, 4))."""
        pooled = [m(kjt).values() for m in (self.plain, self.bounded, self.tiered)]
        return torch.cat(pooled + [self.dense(pooled[0][:, :4])], dim=1), self.unpooled(kjt)["f1"].values()


BOUNDED_COLUMNS = slice(10, 20)


def _loss(outputs):
    return outputs[0].sum() + outputs[1].sum()


def _kjt(step, world_size, rank):
    """Rank `rank`'s part of global batch `step` (7 samples, split by BATCH[world_size])."""
    from torchrec import KeyedJaggedTensor
    rng = np.random.default_rng(step)
    lengths = rng.integers(0, 4, (3, 7))
    values = [rng.integers(0, 90, int(n)) for n in lengths.reshape(-1)]
    lo = sum(BATCH[world_size][:rank])
    hi = lo + BATCH[world_size][rank]
    mine = [values[f * 7 + s] for f in range(3) for s in range(lo, hi)]
    return KeyedJaggedTensor.from_lengths_sync(
        keys=["f1", "f2", "f3"], values=torch.from_numpy(np.concatenate(mine).astype(np.int64)),
        lengths=torch.from_numpy(lengths[:, lo:hi].reshape(-1)))


def _dmp(root, rank):
    from torchrec.distributed.model_parallel import DistributedModelParallel

    from cncore_torch.distributed import CNEmbeddingBagCollectionSharder, CNEmbeddingCollectionSharder
    torch.manual_seed(0)  # the dense layer starts alike in every process
    return DistributedModelParallel(Net("meta", root), device=torch.device("cpu"),
                                    sharders=[CNEmbeddingBagCollectionSharder(), CNEmbeddingCollectionSharder()])


def _collections(dmp):
    return {name: getattr(dmp.module, name) for name in ("plain", "bounded", "tiered", "unpooled")}


def _exports(dmp):
    """{table: {field: array, step, evicted}} of this rank's stores, straight from the stores."""
    out = {}
    for module in _collections(dmp).values():
        for name, store in module.stores.items():
            e = store.export()
            out[name] = {f: np.asarray(getattr(e, f)).copy() for f in FIELDS}
            out[name]["step"] = store.step
            out[name]["evicted"] = int(store.evicted_count)
    return out


def _save(rank, world_size, directory):
    import torch.distributed.checkpoint as dcp
    dmp = _dmp(os.path.join(directory, f"tier_save{world_size}"), rank)
    for step in range(STEPS):
        _loss(dmp(_kjt(step, world_size, rank))).backward()
        with torch.no_grad():
            dmp.module.dense.weight -= 0.01  # a dense update, so the dense layer is not the initial one
    assert dmp.module.bounded.stores["b_a"].evicted_count > 0 or world_size == 1
    dcp.save({"model": dmp.state_dict()}, checkpoint_id=os.path.join(directory, f"ckpt{world_size}"))
    saved = _exports(dmp)
    probe = [t.detach() for t in dmp(_kjt(100, world_size, rank))]
    torch.save({"tables": saved, "probe": probe, "dense": dmp.module.dense.weight.detach().clone()},
               os.path.join(directory, f"saved{world_size}_rank{rank}.pt"))


def _load(rank, world_size, directory, saved_world):
    import torch.distributed.checkpoint as dcp

    from cncore_torch.dcp import CNLoadPlanner
    from cncore_torch.distributed import owner_of
    dmp = _dmp(os.path.join(directory, f"tier_load{saved_world}to{world_size}"), rank)
    state = {"model": dmp.state_dict()}
    dcp.load(state, checkpoint_id=os.path.join(directory, f"ckpt{saved_world}"), planner=CNLoadPlanner())
    dmp.load_state_dict(state["model"])
    saved = [torch.load(os.path.join(directory, f"saved{saved_world}_rank{r}.pt"), weights_only=False)
             for r in range(saved_world)]
    torch.testing.assert_close(dmp.module.dense.weight, saved[0]["dense"], rtol=0, atol=0)
    got = _exports(dmp)
    for name, mine in got.items():
        whole = {f: np.concatenate([s["tables"][name][f] for s in saved]) for f in FIELDS}
        keep = (owner_of(torch.from_numpy(whole["keys"]), world_size) == rank).numpy()
        order, want = np.argsort(mine["keys"]), np.argsort(whole["keys"][keep])
        for f in FIELDS:
            np.testing.assert_array_equal(mine[f][order], whole[f][keep][want], err_msg=f"{name}.{f}")
        assert mine["step"] == saved[0]["tables"][name]["step"] == STEPS
        evicted = [s["tables"][name]["evicted"] for s in saved]
        want_evicted = evicted[rank] if saved_world == world_size else (sum(evicted) if rank == 0 else 0)
        assert mine["evicted"] == want_evicted, name
    pooled, unpooled = (t.detach() for t in dmp(_kjt(100, world_size, rank)))
    lo, hi = sum(BATCH[world_size][:rank]), sum(BATCH[world_size][:rank + 1])
    saved_pooled = torch.cat([s["probe"][0] for s in saved])[lo:hi]
    saved_unpooled = torch.cat([s["probe"][1] for s in saved])
    ids = _kjt(100, 1, 0)["f1"].lengths()  # the unpooled rows of this rank's samples, among all samples'
    first = int(ids[:lo].sum())
    torch.testing.assert_close(unpooled, saved_unpooled[first:first + int(ids[lo:hi].sum())], rtol=0, atol=0)
    if saved_world == world_size:
        torch.testing.assert_close(pooled, saved_pooled, rtol=0, atol=0)
        return
    # Another split of ranks: a bag's partial pools add in another order (fp32 reassociation), and
    # a bounded table's shares evict by themselves, so the probe's new keys evict other victims.
    keep = torch.ones(pooled.shape[1], dtype=torch.bool)
    keep[BOUNDED_COLUMNS] = False
    torch.testing.assert_close(pooled[:, keep], saved_pooled[:, keep], rtol=1e-6, atol=1e-6)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from cncore_torch.distributed.launch import spawn
    directory = str(tmp_path_factory.mktemp("dcp"))
    spawn(_save, 2, directory, timeout=TIMEOUT)
    return directory


@pytest.mark.slow
def test_two_ranks_save_every_shard_and_load_back_at_two(saved):
    from torch.distributed.checkpoint import FileSystemReader

    from cncore_torch.distributed.launch import spawn
    # every rank's rows are in the checkpoint: each table entry's chunks add up to both ranks' rows
    metadata = FileSystemReader(os.path.join(saved, "ckpt2")).read_metadata()
    shards = [torch.load(os.path.join(saved, f"saved2_rank{r}.pt"), weights_only=False) for r in range(2)]
    for name in shards[0]["tables"]:
        n = [len(s["tables"][name]["keys"]) for s in shards]
        assert min(n) > 0
        fqn = next(k for k in metadata.state_dict_metadata if k.endswith(f".tables.{name}.keys"))
        md = metadata.state_dict_metadata[fqn]
        assert md.size == torch.Size([sum(n)]) and sorted(c.sizes[0] for c in md.chunks) == sorted(n)
    spawn(_load, 2, saved, 2, timeout=TIMEOUT)


def _load_then_save(rank, world_size, directory, saved_world):
    _load(rank, world_size, directory, saved_world)
    _save(rank, world_size, directory)


@pytest.mark.slow
def test_two_ranks_checkpoint_loads_into_one_and_one_rank_checkpoint_into_two(saved):
    from cncore_torch.distributed.launch import spawn
    spawn(_load_then_save, 1, saved, 2, timeout=TIMEOUT)  # 2 -> 1, then one rank trains and saves
    spawn(_load, 2, saved, 1, timeout=TIMEOUT)  # 1 -> 2


@pytest.mark.slow
def test_a_checkpoint_missing_a_shard_is_refused_and_nothing_changes(saved, tmp_path):
    import shutil

    import torch.distributed.checkpoint as dcp

    from cncore_torch.dcp import CNLoadPlanner
    damaged = str(tmp_path / "ckpt")
    shutil.copytree(os.path.join(saved, "ckpt2"), damaged)
    with open(os.path.join(damaged, ".metadata"), "rb") as f:
        metadata = pickle.load(f)
    fqn = "model.plain.tables.p_a.rows"
    md = metadata.state_dict_metadata[fqn]
    first = min(md.chunks, key=lambda c: c.offsets[0])
    md.chunks[:] = [c for c in md.chunks if c is not first]  # rank 0's rows of one table are gone
    with open(os.path.join(damaged, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)
    model = Net("cpu", str(tmp_path / "tier"))
    state = {"model": model.state_dict()}
    with pytest.raises(CheckpointException, match=rf"{fqn}: the checkpoint holds \d+ rows but no chunk covers rows "
                                        rf"\[0, {first.sizes[0]}\): a rank's shard is missing from it"):
        dcp.load(state, checkpoint_id=damaged, planner=CNLoadPlanner(), no_dist=True)
    assert all(len(s) == 0 for m in (model.plain, model.bounded, model.tiered, model.unpooled)
               for s in m.stores.values())


@pytest.mark.slow
def test_a_rank_that_is_not_in_the_checkpoint_is_refused(saved, tmp_path):
    """The shard entries name every saved rank: a state_dict holding one rank's stacked entries
    (a checkpoint that lost a rank's per-rank rows) is refused by load_state_dict, naming them."""
    import torch.distributed.checkpoint as dcp

    from cncore_torch.dcp import CNLoadPlanner
    model = Net("cpu", str(tmp_path / "tier"))
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=os.path.join(saved, "ckpt2"), planner=CNLoadPlanner(), no_dist=True)
    entries = dict(state["model"])
    entries["plain.tables.p_a.shard"] = entries["plain.tables.p_a.shard"][:1]
    with pytest.raises(RuntimeError, match=r"plain.tables.p_a.shard: expected \(rank, 1, run id\) for ranks 0..0 "
                                           r"of one save, got \[\(0, 2, "):
        model.load_state_dict(entries)
    assert len(model.plain.stores["p_a"]) == 0
    # the whole checkpoint loads into one process (2 -> 1 without DMP): every saved row
    model.load_state_dict(state["model"])
    shards = [torch.load(os.path.join(saved, f"saved2_rank{r}.pt"), weights_only=False) for r in range(2)]
    for name, store in {**model.plain.stores, **model.unpooled.stores}.items():
        keys = np.sort(np.concatenate([s["tables"][name]["keys"] for s in shards]))
        np.testing.assert_array_equal(np.sort(store.export().keys), keys)


def test_unsharded_collections_round_trip_in_one_process(tmp_path):
    """CNEmbeddingBagCollection and CNEmbeddingCollection beside TorchRec's own EBC, one process."""
    import torch.distributed.checkpoint as dcp
    from torchrec import EmbeddingBagCollection, EmbeddingConfig, KeyedJaggedTensor

    import cncore
    from cncore_torch import CNEmbeddingBagCollection, CNEmbeddingCollection
    from cncore_torch.dcp import CNLoadPlanner

    def make():
        torch.manual_seed(1)
        return torch.nn.ModuleDict({
            "ours": CNEmbeddingBagCollection(_bag_configs("o"), optimizer=cncore.Adagrad(lr=0.1), max_rows=50,
                                             eviction=cncore.LFU(), seed=2),
            "unpooled": CNEmbeddingCollection([EmbeddingConfig(name="u", embedding_dim=4, num_embeddings=99,
                                                               feature_names=["f1"])],
                                              optimizer=cncore.SGD(lr=0.1), seed=3),
            "torchrec": EmbeddingBagCollection(_bag_configs("r"))})

    model = make()
    kjt = KeyedJaggedTensor.from_lengths_sync(["f1", "f2", "f3"], torch.arange(36) * 7, torch.tensor([4] * 9))
    for _ in range(2):
        (model["ours"](kjt).values().sum() + model["unpooled"](kjt)["f1"].values().sum()).backward()
    with torch.no_grad():
        for p in model["torchrec"].parameters():
            p.add_(1.0)
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path), no_dist=True)
    fresh = make()
    state = {"model": fresh.state_dict()}
    dcp.load(state, checkpoint_id=str(tmp_path), planner=CNLoadPlanner(), no_dist=True)
    fresh.load_state_dict(state["model"])
    for name in ("ours", "unpooled"):
        for table, store in model[name].stores.items():
            a, b = store.export(), fresh[name].stores[table].export()
            for f in FIELDS:
                np.testing.assert_array_equal(getattr(a, f), getattr(b, f), err_msg=f"{table}.{f}")
            assert store.step == fresh[name].stores[table].step and store.evicted_count == \
                fresh[name].stores[table].evicted_count
    for key, value in model["torchrec"].state_dict().items():
        torch.testing.assert_close(fresh["torchrec"].state_dict()[key], value, rtol=0, atol=0)
    torch.testing.assert_close(fresh["ours"](kjt).values(), model["ours"](kjt).values(), rtol=0, atol=0)


def test_single_modules_round_trip_in_one_process(tmp_path):
    """CNEmbeddingBag and CNEmbedding (a bounded one evicting) beside nn.Linear, one process: every
    row, optimizer state, count, last step, step and evicted count back exactly, outputs equal."""
    import torch.distributed.checkpoint as dcp

    import cncore
    from cncore_torch import CNEmbedding, CNEmbeddingBag
    from cncore_torch.dcp import CNLoadPlanner, TableEntry

    def make():
        torch.manual_seed(1)
        return torch.nn.ModuleDict({
            "bag": CNEmbeddingBag(99, 4, mode="sum", optimizer=cncore.Adagrad(lr=0.1), seed=2),
            "emb": CNEmbedding(99, 3, optimizer=cncore.RowWiseAdagrad(lr=0.1), max_rows=12,
                               eviction=cncore.LRU(), seed=3),
            "dense": torch.nn.Linear(4, 1)})

    model = make()
    ids, offsets = torch.arange(30) * 5, torch.arange(0, 30, 3)
    for step in range(3):
        (model["bag"](ids + step, offsets).sum() + model["emb"](ids[:10] + 3 * step).sum()).backward()
    with torch.no_grad():
        model["dense"].weight.add_(1.0)
    saved = model.state_dict()
    assert isinstance(saved["bag.rows"], TableEntry) and isinstance(saved["emb.keys"], TableEntry)
    dcp.save({"model": saved}, checkpoint_id=str(tmp_path), no_dist=True)
    fresh = make()
    state = {"model": fresh.state_dict()}
    dcp.load(state, checkpoint_id=str(tmp_path), planner=CNLoadPlanner(), no_dist=True)
    fresh.load_state_dict(state["model"])
    for name in ("bag", "emb"):
        a, b = model[name].storage, fresh[name].storage
        ea, eb = a.export(), b.export()
        oa, ob = np.argsort(ea.keys), np.argsort(eb.keys)  # (the table's own order may differ)
        for f in FIELDS:
            np.testing.assert_array_equal(getattr(ea, f)[oa], getattr(eb, f)[ob], err_msg=f"{name}.{f}")
        assert len(a) and a.step == b.step == 3 and a.evicted_count == b.evicted_count
    assert model["emb"].storage.evicted_count > 0
    torch.testing.assert_close(fresh["dense"].weight, model["dense"].weight, rtol=0, atol=0)
    model.eval(), fresh.eval()
    torch.testing.assert_close(fresh["bag"](ids, offsets), model["bag"](ids, offsets), rtol=0, atol=0)
    torch.testing.assert_close(fresh["emb"](ids[:10]), model["emb"](ids[:10]), rtol=0, atol=0)


def test_table_entries_are_plain_tensors_to_everything_but_dcp(tmp_path):
    """torch.save, weights_only torch.load, deepcopy and arithmetic see plain tensors."""
    import copy

    import cncore
    from cncore_torch import CNEmbeddingBagCollection
    from cncore_torch.dcp import TableEntry
    model = CNEmbeddingBagCollection(_bag_configs("o"), optimizer=cncore.Adam(lr=0.1))
    model.stores["o_a"].find_or_insert(np.array([4, 9]))
    sd = model.state_dict()
    assert isinstance(sd["tables.o_a.rows"], TableEntry)
    torch.save(sd, tmp_path / "sd.pt")
    back = torch.load(tmp_path / "sd.pt")  # weights_only: only plain tensors pass
    assert type(back["tables.o_a.rows"]) is torch.Tensor
    torch.testing.assert_close(back["tables.o_a.rows"], sd["tables.o_a.rows"].as_subclass(torch.Tensor))
    assert type(sd["tables.o_a.rows"] * 2) is torch.Tensor
    assert type(torch.cat([sd["tables.o_a.keys"], sd["tables.o_a.keys"]])) is torch.Tensor
    twin = copy.deepcopy(sd)
    assert torch.equal(twin["tables.o_a.keys"], sd["tables.o_a.keys"])


def _plain_into_ranks(rank, world_size, path, saved):
    import torch.distributed.checkpoint as dcp
    from torchrec.distributed.model_parallel import DistributedModelParallel

    from cncore_torch.dcp import CNLoadPlanner
    from cncore_torch.distributed import CNEmbeddingBagCollectionSharder, owner_of
    dmp = DistributedModelParallel(_plain_collection("meta"), device=torch.device("cpu"),
                                   sharders=[CNEmbeddingBagCollectionSharder()])
    state = {"model": dmp.state_dict()}
    dcp.load(state, checkpoint_id=path, planner=CNLoadPlanner())
    dmp.load_state_dict(state["model"])
    for name, whole in saved.items():
        mine = dmp.module.stores[name].export()
        keep = (owner_of(torch.from_numpy(whole["keys"]), world_size) == rank).numpy()
        order, want = np.argsort(mine.keys), np.argsort(whole["keys"][keep])
        for f in FIELDS:
            np.testing.assert_array_equal(np.asarray(getattr(mine, f))[order], whole[f][keep][want], err_msg=name)
        assert dmp.module.stores[name].step == whole["step"]


def _plain_collection(device):
    import cncore
    from cncore_torch import CNEmbeddingBagCollection
    return CNEmbeddingBagCollection(_bag_configs("o"), device=device, optimizer=cncore.Adagrad(lr=0.1), seed=4)


@pytest.mark.slow
def test_a_plain_collections_checkpoint_loads_into_two_ranks(tmp_path):
    """Trained in one process without DMP, then sharded: each rank keeps the saved rows it owns."""
    import torch.distributed.checkpoint as dcp
    from torchrec import KeyedJaggedTensor

    from cncore_torch.distributed.launch import spawn
    model = _plain_collection("cpu")
    kjt = KeyedJaggedTensor.from_lengths_sync(["f1", "f2", "f3"], torch.arange(45) * 5, torch.tensor([5] * 9))
    for _ in range(2):
        model(kjt).values().sum().backward()
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    saved = {}
    for name, store in model.stores.items():
        e = store.export()
        saved[name] = {f: np.asarray(getattr(e, f)).copy() for f in FIELDS}
        saved[name]["step"] = store.step
    assert min(len(s["keys"]) for s in saved.values()) > 0
    spawn(_plain_into_ranks, 2, str(tmp_path / "ckpt"), saved, timeout=TIMEOUT)


class _Mixed(torch.nn.Module):
    """Our collection beside TorchRec's own EBC (sharded by TorchRec's sharder, ShardedTensor state)."""

    def __init__(self):
        super().__init__()
        from torchrec import EmbeddingBagCollection
        self.ours = _plain_collection("meta")
        self.torchrec = EmbeddingBagCollection(_bag_configs("r"), device=torch.device("meta"))

    def forward(self, kjt):
        return torch.cat([self.ours(kjt).values(), self.torchrec(kjt).values()], dim=1)


def _mixed_ranks(rank, world_size, path):
    import torch.distributed.checkpoint as dcp
    from torchrec import KeyedJaggedTensor
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel

    from cncore_torch.dcp import CNLoadPlanner
    from cncore_torch.distributed import CNEmbeddingBagCollectionSharder

    def build(seed):
        torch.manual_seed(seed)  # TorchRec's tables start from random rows
        return DistributedModelParallel(_Mixed(), device=torch.device("cpu"),
                                        sharders=[CNEmbeddingBagCollectionSharder(), EmbeddingBagCollectionSharder()])

    def torchrec_shards(dmp):
        """This rank's part of TorchRec's tables (the planner picks their sharding)."""
        return {k: [s.tensor.clone() for s in v.local_shards()] if hasattr(v, "local_shards") else [v.clone()]
                for k, v in dmp.state_dict().items() if k.startswith("torchrec.")}
    dmp = build(0)
    kjt = KeyedJaggedTensor.from_lengths_sync(["f1", "f2", "f3"], torch.arange(36) * 4 + rank, torch.tensor([3] * 12))
    for _ in range(2):
        dmp(kjt).sum().backward()
    saved = {name: store.export() for name, store in dmp.module.ours.stores.items()}
    theirs = torchrec_shards(dmp)
    probe = dmp(kjt).detach()
    dcp.save({"model": dmp.state_dict()}, checkpoint_id=path)
    fresh = build(1)
    assert any(not torch.equal(a, b) for k, v in torchrec_shards(fresh).items() for a, b in zip(v, theirs[k]))
    state = {"model": fresh.state_dict()}
    dcp.load(state, checkpoint_id=path, planner=CNLoadPlanner())
    fresh.load_state_dict(state["model"])
    for key, shards in torchrec_shards(fresh).items():  # TorchRec's own tables: DCP's own resharding
        for got, want in zip(shards, theirs[key]):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    for name, e in saved.items():
        got = fresh.module.ours.stores[name].export()
        order, want = np.argsort(got.keys), np.argsort(e.keys)
        for f in FIELDS:
            np.testing.assert_array_equal(np.asarray(getattr(got, f))[order], np.asarray(getattr(e, f))[want])
    torch.testing.assert_close(fresh(kjt).detach(), probe, rtol=0, atol=0)


@pytest.mark.slow
def test_a_model_mixing_ours_with_torchrecs_ebc_round_trips_under_dmp(tmp_path):
    """The same DCP call carries TorchRec's sharded EBC (its ShardedTensors) and our tables."""
    from cncore_torch.distributed.launch import spawn
    spawn(_mixed_ranks, 2, str(tmp_path / "ckpt"), timeout=TIMEOUT)

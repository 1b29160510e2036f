"""`dcp.async_save` of dynamic tables with torch's own stagers, and what a DCP load without
`CNLoadPlanner` does.

async_save copies the state_dict before writing it (its stager), and the copies must still be
`TableEntry`s, or DCP takes the ranks' shards for replicas and keeps one rank's rows. One run of
2 gloo ranks with unequal rows saves a DMP model four ways: the default stager, DCP's
`DefaultStager` with shared memory and staging in a thread, a `FileSystemWriter` (which stages
itself through `_create_cpu_state_dict` / `_copy_state_dict`), and the checkpoint process
(`AsyncCheckpointerType.PROCESS`, which gets the staged entries pickled). Each checkpoint holds
every rank's chunk and loads back into a fresh model: the reference is each rank's own `export()`
taken when it saved (rows, optimizer state, counts, last steps) and its step."""
import os
import pickle

import numpy as np
import pytest
import torch

pytest.importorskip("torchrec")

from torch.distributed.checkpoint.api import CheckpointException

TIMEOUT = 240.0
FIELDS = ("keys", "rows", "optimizer_state", "counts", "last_steps")


def _configs(prefix):
    from torchrec import EmbeddingBagConfig
    return [EmbeddingBagConfig(name=f"{prefix}_a", embedding_dim=4, num_embeddings=200, feature_names=["f1", "f2"]),
            EmbeddingBagConfig(name=f"{prefix}_b", embedding_dim=2, num_embeddings=200, feature_names=["f3"])]


def _collection(device):
    import cncore
    from cncore_torch import CNEmbeddingBagCollection
    return CNEmbeddingBagCollection(_configs("o"), device=device, optimizer=cncore.Adagrad(lr=0.1), seed=4)


def _assert_same(store, saved, step):
    got = store.export()
    order, want = np.argsort(got.keys), np.argsort(saved.keys)
    assert len(got.keys) == len(saved.keys)
    for f in FIELDS:
        np.testing.assert_array_equal(np.asarray(getattr(got, f))[order], np.asarray(getattr(saved, f))[want],
                                      err_msg=f)
    assert store.step == step


def _async_ranks(rank, world_size, directory):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    from torchrec import KeyedJaggedTensor
    from torchrec.distributed.model_parallel import DistributedModelParallel

    from cncore_torch.dcp import CNLoadPlanner
    from cncore_torch.distributed import CNEmbeddingBagCollectionSharder

    def build():
        return DistributedModelParallel(_collection("meta"), device=torch.device("cpu"),
                                        sharders=[CNEmbeddingBagCollectionSharder()])
    dmp = build()
    n = 4 + 3 * rank  # unequal batches, so unequal rows
    kjt = KeyedJaggedTensor.from_lengths_sync(["f1", "f2", "f3"], torch.arange(9 * n) * 3 + rank,
                                              torch.tensor([3] * (3 * n)))
    for _ in range(2):
        dmp(kjt).values().sum().backward()
    saved = {name: store.export() for name, store in dmp.module.stores.items()}
    step = dmp.module.stores["o_a"].step
    counts = [None] * world_size
    dist.all_gather_object(counts, {name: len(e.keys) for name, e in saved.items()})
    assert counts[0] != counts[1]

    def path(kind):
        return os.path.join(directory, kind)
    stager = DefaultStager(StagingOptions(False, True, True, False))  # shared memory, staged in a thread
    saves = {
        "default": lambda: dcp.async_save({"model": dmp.state_dict()}, checkpoint_id=path("default")).result(),
        "threaded": lambda: dcp.async_save({"model": dmp.state_dict()}, checkpoint_id=path("threaded"),
                                           async_stager=stager).upload_completion.result(),
        "writer": lambda: dcp.async_save({"model": dmp.state_dict()},
                                         storage_writer=FileSystemWriter(path("writer"))).result(),
        "process": lambda: dcp.async_save({"model": dmp.state_dict()}, checkpoint_id=path("process"),
                                          async_checkpointer_type=AsyncCheckpointerType.PROCESS).result(),
    }
    fresh = build()
    for kind, save in saves.items():
        save()
        dist.barrier()
        metadata = FileSystemReader(path(kind)).read_metadata().state_dict_metadata
        for name in saved:
            for field in FIELDS:
                md = metadata[f"model.tables.{name}.{field}"]
                assert sorted(c.sizes[0] for c in md.chunks) == sorted(c[name] for c in counts), (kind, field)
        for store in fresh.module.stores.values():
            store.clear()  # each load starts from empty tables
        state = {"model": fresh.state_dict()}
        dcp.load(state, checkpoint_id=path(kind), planner=CNLoadPlanner())
        fresh.load_state_dict(state["model"])
        for name, e in saved.items():
            _assert_same(fresh.module.stores[name], e, step)
    stager.close()
    _torchs_helpers_on_the_sharded_module(dmp, fresh, saved, step, path("helpers"))
    # without CNLoadPlanner: every rank refuses while DCP plans, and the tables keep their rows
    with pytest.raises(CheckpointException, match=r"model.tables.o_[ab].\w+: a dynamic table's entries load with "
                                                  r"torch.distributed.checkpoint.load\(..., planner="
                                                  r"cncore_torch.dcp.CNLoadPlanner\(\)\)"):
        dcp.load({"model": fresh.state_dict()}, checkpoint_id=path("default"))
    for name, e in saved.items():
        _assert_same(fresh.module.stores[name], e, step)
    _per_rank_tables(rank, path)


def _torchs_helpers_on_the_sharded_module(dmp, fresh, saved, step, path):
    """torch's get_model_state_dict on the sharded module (TorchRec's DMP itself is not walkable
    by it, for TorchRec's own collections too): this rank's shard, as its state_dict, which
    DCP saves as every rank's rows; with full_state_dict=True (which would return a shard as
    the whole table) it is refused by name, on every rank."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from cncore_torch.dcp import CNLoadPlanner, TableEntry
    with pytest.raises(ValueError, match=r"full_state_dict=True\)\) on a dynamic table sharded over 2 ranks would "
                                         r"return this rank's shard as the whole table"):
        get_model_state_dict(dmp.module, options=StateDictOptions(full_state_dict=True))
    model_sd = get_model_state_dict(dmp.module)
    assert list(model_sd) == list(dmp.module.state_dict())
    assert isinstance(model_sd["tables.o_a.keys"], TableEntry)
    dcp.save({"model": model_sd}, checkpoint_id=path)
    for store in fresh.module.stores.values():
        store.clear()
    state = {"model": get_model_state_dict(fresh.module)}
    dcp.load(state, checkpoint_id=path, planner=CNLoadPlanner())
    fresh.module.load_state_dict(state["model"])
    for name, e in saved.items():
        _assert_same(fresh.module.stores[name], e, step)


def _per_rank_tables(rank, path):
    """Each rank's own unsharded tables (per_rank_tables=True) in one checkpoint of both ranks:
    refused while DCP plans (it would keep one rank's rows), nothing written; saved by each rank
    to a checkpoint of its own (no_dist), each loads its own rows back."""
    import torch.distributed.checkpoint as dcp

    import cncore
    from cncore_torch import CNEmbeddingBagCollection
    from cncore_torch.dcp import CNLoadPlanner

    def make():
        return CNEmbeddingBagCollection(_configs("r"), optimizer=cncore.SGD(lr=0.1), per_rank_tables=True)
    own = make()
    keys = np.arange(3 + rank) * 10 + rank
    own.stores["r_a"].find_or_insert(keys)
    with pytest.raises(CheckpointException, match=r"model.tables.r_[ab].\w+: an unsharded table saved by 2 ranks "
                                                  r"into one checkpoint, where DCP would keep one rank's rows"):
        dcp.save({"model": own.state_dict()}, checkpoint_id=path("per_rank"))
    assert not os.path.exists(os.path.join(path("per_rank"), ".metadata"))
    dcp.save({"model": own.state_dict()}, checkpoint_id=path(f"rank{rank}"), no_dist=True)
    back = make()
    state = {"model": back.state_dict()}
    dcp.load(state, checkpoint_id=path(f"rank{rank}"), planner=CNLoadPlanner(), no_dist=True)
    back.load_state_dict(state["model"])
    _assert_same(back.stores["r_a"], own.stores["r_a"].export(), own.stores["r_a"].step)
    assert sorted(back.stores["r_a"].export().keys.tolist()) == keys.tolist()


@pytest.mark.slow
def test_async_save_keeps_every_ranks_rows_with_torchs_own_stagers(tmp_path):
    """(and a load without CNLoadPlanner is refused on both ranks, the tables unchanged; each
    rank's own unsharded tables are refused in one checkpoint of both ranks)"""
    from cncore_torch.distributed.launch import spawn
    spawn(_async_ranks, 2, str(tmp_path), timeout=TIMEOUT)


def _trained_model(tier):
    """Both unsharded collections (one bounded, evicting; one on the SSD tier), the single
    modules and a dense layer, trained two steps."""
    from torchrec import EmbeddingConfig, KeyedJaggedTensor

    import cncore
    from cncore_torch import CNEmbedding, CNEmbeddingBag, CNEmbeddingBagCollection, CNEmbeddingCollection
    torch.manual_seed(1)
    model = torch.nn.ModuleDict({
        "pooled": CNEmbeddingBagCollection(_configs("p"), optimizer=cncore.Adagrad(lr=0.1), max_rows=30,
                                           eviction=cncore.LRU(), seed=2),
        "tiered": CNEmbeddingBagCollection(_configs("t"), optimizer=cncore.Adam(lr=0.1), seed=5,
                                           storage=cncore.Tiered(tier, cache_bytes=1 << 12)),
        "unpooled": CNEmbeddingCollection([EmbeddingConfig(name="u", embedding_dim=4, num_embeddings=99,
                                                           feature_names=["f1"])],
                                          optimizer=cncore.SGD(lr=0.1), seed=3),
        "bag": CNEmbeddingBag(99, 4, mode="sum", optimizer=cncore.Adagrad(lr=0.1), seed=6),
        "emb": CNEmbedding(99, 3, optimizer=cncore.RowWiseAdagrad(lr=0.1), seed=7),
        "dense": torch.nn.Linear(4, 1)})
    for step in range(2):
        kjt = KeyedJaggedTensor.from_lengths_sync(["f1", "f2", "f3"], torch.arange(36) * 7 + step,
                                                  torch.tensor([4] * 9))
        (model["pooled"](kjt).values().sum() + model["tiered"](kjt).values().sum()
         + model["unpooled"](kjt)["f1"].values().sum()
         + model["bag"](torch.arange(12) + step, torch.arange(0, 12, 3)).sum()
         + model["emb"](torch.arange(5) * 3 + step).sum()).backward()
    with torch.no_grad():
        model["dense"].weight.add_(1.0)
    return model


def _stores(model):
    out = {}
    for name in ("pooled", "tiered", "unpooled"):
        out.update({f"{name}.{t}": s for t, s in model[name].stores.items()})
    out.update({"bag": model["bag"].storage, "emb": model["emb"].storage})
    return out


def test_unsharded_modules_round_trip_through_async_save_with_the_default_stager(tmp_path):
    import torch.distributed.checkpoint as dcp

    from cncore_torch.dcp import CNLoadPlanner
    model = _trained_model(str(tmp_path / "tier"))
    saved = {name: (s.export(), s.step, s.evicted_count if hasattr(s, "evicted_count") else None)
             for name, s in _stores(model).items()}
    assert saved["pooled.p_a"][2] > 0  # the bounded table evicted
    dcp.async_save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True).result()
    fresh = _trained_model(str(tmp_path / "tier2"))
    for store in _stores(fresh).values():
        store.clear()
    state = {"model": fresh.state_dict()}
    dcp.load(state, checkpoint_id=str(tmp_path / "ckpt"), planner=CNLoadPlanner(), no_dist=True)
    fresh.load_state_dict(state["model"])
    for name, store in _stores(fresh).items():
        export, step, evicted = saved[name]
        _assert_same(store, export, step)
        if evicted is not None:
            assert store.evicted_count == evicted, name
    torch.testing.assert_close(fresh["dense"].weight, model["dense"].weight, rtol=0, atol=0)


def _entry(rows=3, rank=1, world_size=2):
    """Rank 1's entry of a table of 5 + 3 rows (the counts gathered already, as a stager does)."""
    from cncore_torch.dcp import ShardLayout, TableEntry
    layout = ShardLayout(rows, rank, world_size)
    layout._counts = [5, rows]
    return TableEntry(torch.arange(rows * 2, dtype=torch.float32).reshape(rows, 2), layout)


def test_stager_copies_of_an_entry_are_entries_in_the_same_place():
    """What DCP's stagers do to a tensor (StateDictStager's new_empty + set_, a BlockingAsyncStager's
    torch.empty + copy_, an offload's .to / .cpu) keeps the entry, its data copied, its place the same;
    arithmetic stays plain."""
    from torch.distributed.checkpoint.staging import BlockingAsyncStager, DefaultStager, StagingOptions

    from cncore_torch.dcp import TableEntry
    entry = _entry()
    plain = entry.as_subclass(torch.Tensor)
    stager = DefaultStager(StagingOptions(False, False, False, False))
    staged = [stager.stage({"m": {"x": entry}})["m"]["x"], BlockingAsyncStager().stage({"m": {"x": entry}})["m"]["x"],
              entry.to("cpu"), entry.cpu(), entry.clone(), entry.detach()]
    stager.close()
    for copy in staged:
        assert type(copy) is TableEntry and copy.cn_layout is entry.cn_layout and not copy.cn_per_rank
        assert torch.equal(copy.as_subclass(torch.Tensor), plain)
    assert staged[0].data_ptr() != entry.data_ptr() and staged[1].data_ptr() != entry.data_ptr()
    assert type(entry * 2) is torch.Tensor and type(entry.sum()) is torch.Tensor


def test_copying_an_entry_into_a_buffer_of_another_row_count_is_refused():
    """A stager's cached buffer sized for an earlier save: refused, the buffer unchanged."""
    buffer = torch.full((2, 2), 7.0)
    with pytest.raises(ValueError, match=r"copying a dynamic table's entry of shape \(3, 2\) into a buffer of shape "
                                         r"\(2, 2\): the table's row count is not the buffer's"):
        buffer.copy_(_entry())
    assert type(buffer) is torch.Tensor and torch.equal(buffer, torch.full((2, 2), 7.0))


def test_a_table_sharded_over_a_group_of_its_own_refuses_the_checkpoint_process():
    """The checkpoint process (AsyncCheckpointerType.PROCESS) only has the default group."""
    from multiprocessing.reduction import ForkingPickler

    from cncore_torch.dcp import ShardLayout, TableEntry
    entry = _entry()
    back = pickle.loads(ForkingPickler.dumps(entry))
    assert type(back) is TableEntry and torch.equal(back.as_subclass(torch.Tensor), entry.as_subclass(torch.Tensor))
    assert (back.cn_layout.rows, back.cn_layout.rank, back.cn_layout.world_size) == (3, 1, 2)
    assert back.cn_layout.row_counts() == [5, 3]  # the counts the stager gathered travel along
    own = TableEntry(torch.zeros(3, 2), ShardLayout(3, 1, 2, group=object()))  # counts not gathered
    with pytest.raises(ValueError, match=r"a table sharded over a process group of its own \(2 ranks, not the "
                                         r"default group\) cannot be saved from async_save's checkpoint process"):
        ForkingPickler.dumps(own)
    assert type(pickle.loads(pickle.dumps(entry))) is torch.Tensor  # plain pickling writes a plain tensor


def test_cn_stager_is_deprecated_and_still_keeps_the_entries():
    from cncore_torch.dcp import CNStager, TableEntry
    with pytest.warns(FutureWarning, match=r"CNStager is deprecated: torch.distributed.checkpoint.async_save's own "
                                           r"stager keeps every rank's rows"):
        stager = CNStager()
    entry = _entry()
    assert type(stager.stage({"x": entry})["x"]) is TableEntry
    stager.close()


@pytest.mark.parametrize("stateful", [False, True])
def test_a_load_without_cn_load_planner_is_refused_naming_it_and_nothing_is_loaded(tmp_path, stateful):
    """DCP's default planner sizes the load by the fresh model's entries: refused at planning,
    before any read, naming CNLoadPlanner, whether the row counts differ or happen to agree, and
    whether the state_dict or the module (a Stateful) is passed; the tables and the dense layer
    are unchanged."""
    import torch.distributed.checkpoint as dcp

    import cncore
    from cncore_torch import CNEmbeddingBagCollection

    def make():
        return torch.nn.ModuleDict({"ebc": CNEmbeddingBagCollection(_configs("o"), optimizer=cncore.SGD(lr=0.1)),
                                    "dense": torch.nn.Linear(2, 1)})
    model = make()
    model["ebc"].stores["o_a"].find_or_insert(np.array([1, 2, 3]))
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path), no_dist=True)
    fresh = make()
    dense = fresh["dense"].weight.detach().clone()
    for ids in ([], [5, 6, 7]):  # another row count, then the same one
        fresh["ebc"].stores["o_a"].find_or_insert(np.array(ids, dtype=np.int64))
        target = fresh if stateful else fresh.state_dict()
        with pytest.raises(CheckpointException, match=r"model.ebc.tables.o_a.keys: a dynamic table's entries load "
                                                      r"with torch.distributed.checkpoint.load\(..., planner="
                                                      r"cncore_torch.dcp.CNLoadPlanner\(\)\): a fresh table does not "
                                                      r"know the checkpoint's row count; nothing was loaded"):
            dcp.load({"model": target}, checkpoint_id=str(tmp_path), no_dist=True)
        assert sorted(fresh["ebc"].stores["o_a"].export().keys.tolist()) == sorted(ids)
        torch.testing.assert_close(fresh["dense"].weight, dense, rtol=0, atol=0)


def test_torchs_state_dict_helpers_get_and_set_state_dict_round_trip_through_dcp(tmp_path):
    """A user's flow with torch's model + optimizer helpers: get_state_dict hands back the model's
    own state_dict (every table entry, for a collection and a single module; with cpu_offload
    too) and the dense optimizer's; saved by DCP and loaded with CNLoadPlanner, set_state_dict
    restores every row and the dense optimizer's state (the reference: the saved model's stores
    and torch.optim's state)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
        set_state_dict,
    )

    import cncore
    from cncore_torch import CNEmbeddingBag, CNEmbeddingBagCollection
    from cncore_torch.dcp import CNLoadPlanner

    def make(seed):
        torch.manual_seed(seed)
        model = torch.nn.ModuleDict({"ebc": CNEmbeddingBagCollection(_configs("o"), optimizer=cncore.Adam(lr=0.1),
                                                                     seed=seed),
                                     "bag": CNEmbeddingBag(100, 4, optimizer=cncore.SGD(lr=0.1), seed=seed),
                                     "dense": torch.nn.Linear(4, 1)})
        return model, torch.optim.Adam(model["dense"].parameters(), lr=0.01)
    model, opt = make(0)
    from torchrec import KeyedJaggedTensor
    kjt = KeyedJaggedTensor.from_lengths_sync(["f1", "f2", "f3"], torch.arange(27) * 5, torch.tensor([3] * 9))
    for _ in range(2):
        pooled = model["ebc"](kjt).values()[:, :4] + model["bag"](torch.arange(9) * 7, torch.tensor([0, 3, 6]))
        model["dense"](pooled).sum().backward()
        opt.step()
    model_sd, optim_sd = get_state_dict(model, opt)
    own = model.state_dict()
    assert list(model_sd) == list(own) and "ebc.tables.o_a.keys" in own and "bag.keys" in own
    for key, value in own.items():
        torch.testing.assert_close(model_sd[key], value, rtol=0, atol=0, msg=key)
    offloaded = get_model_state_dict(model, options=StateDictOptions(cpu_offload=True))
    for key, value in own.items():
        torch.testing.assert_close(offloaded[key], value, rtol=0, atol=0, msg=key)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp_path), no_dist=True)
    fresh, fresh_opt = make(1)
    fresh_model_sd, fresh_optim_sd = get_state_dict(fresh, fresh_opt)
    state = {"model": fresh_model_sd, "optim": fresh_optim_sd}
    dcp.load(state, checkpoint_id=str(tmp_path), planner=CNLoadPlanner(), no_dist=True)
    set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for name, store in model["ebc"].stores.items():
        _assert_same(fresh["ebc"].stores[name], store.export(), store.step)
    _assert_same(fresh["bag"].storage, model["bag"].storage.export(), model["bag"].storage.step)
    torch.testing.assert_close(fresh["dense"].weight, model["dense"].weight, rtol=0, atol=0)
    for p, q in zip(model["dense"].parameters(), fresh["dense"].parameters()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(fresh_opt.state[q][key], opt.state[p][key], rtol=0, atol=0)


def test_the_model_state_dict_alone_with_get_optimizer_state_dict_loads_with_set_state_dict(tmp_path):
    """(the flow before torch's get_state_dict took our modules: model.state_dict() and
    get_optimizer_state_dict, saved by DCP, load with set_state_dict)"""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_state_dict

    import cncore
    from cncore_torch import CNEmbeddingBagCollection
    from cncore_torch.dcp import CNLoadPlanner

    def make(seed):
        torch.manual_seed(seed)
        model = torch.nn.ModuleDict({"ebc": CNEmbeddingBagCollection(_configs("o"), optimizer=cncore.Adam(lr=0.1),
                                                                     seed=seed),
                                     "dense": torch.nn.Linear(4, 1)})
        return model, torch.optim.Adam(model["dense"].parameters(), lr=0.01)
    model, opt = make(0)
    from torchrec import KeyedJaggedTensor
    kjt = KeyedJaggedTensor.from_lengths_sync(["f1", "f2", "f3"], torch.arange(27) * 5, torch.tensor([3] * 9))
    for _ in range(2):
        model["dense"](model["ebc"](kjt).values()[:, :4]).sum().backward()
        opt.step()
    dcp.save({"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=str(tmp_path), no_dist=True)
    fresh, fresh_opt = make(1)
    state = {"model": fresh.state_dict(), "optim": get_optimizer_state_dict(fresh, fresh_opt)}
    dcp.load(state, checkpoint_id=str(tmp_path), planner=CNLoadPlanner(), no_dist=True)
    set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for name, store in model["ebc"].stores.items():
        _assert_same(fresh["ebc"].stores[name], store.export(), store.step)
    torch.testing.assert_close(fresh["dense"].weight, model["dense"].weight, rtol=0, atol=0)
    for p, q in zip(model["dense"].parameters(), fresh["dense"].parameters()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(fresh_opt.state[q][key], opt.state[p][key], rtol=0, atol=0)

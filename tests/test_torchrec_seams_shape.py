"""The shape TorchRec code touches on our collections, against TorchRec's own modules doing the
same: `embedding_bags` / `embeddings` (per-table modules sharing the collection's tables), what
`.weight` tells, `reset_parameters`, `device`, the repr, `isinstance` and the sharder DMP picks,
`data_type` as the row dtype; TorchRec's module-test behaviours (shapes, keys, shared tables and
features, weights, meta, fx, duplicate names); and the refusal to run unsharded in a group of
several ranks."""
import functools

import numpy as np
import pytest
import torch

pytest.importorskip("torchrec")
from torch import nn
from torchrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
)
from torchrec.types import DataType

import cncore
from cncore_torch import CNEmbedding, CNEmbeddingBag, CNEmbeddingBagCollection, CNEmbeddingCollection
from cncore_torch.convert import to_dynamic
from cncore_torch.table_weight import TableWeight

ROWS = 10


def bag_configs(**kw):
    return [EmbeddingBagConfig(name="t1", embedding_dim=3, num_embeddings=ROWS, feature_names=["f1", "f3"], **kw),
            EmbeddingBagConfig(name="t2", embedding_dim=4, num_embeddings=ROWS, feature_names=["f2"], **kw)]


def ec_configs():
    return [EmbeddingConfig(name="t1", embedding_dim=5, num_embeddings=ROWS, feature_names=["f1", "f2"]),
            EmbeddingConfig(name="t2", embedding_dim=5, num_embeddings=ROWS, feature_names=["f2"])]


def kjt3(weighted=False, device="cpu"):
    return KeyedJaggedTensor.from_offsets_sync(
        keys=["f1", "f3", "f2"], values=torch.tensor([1, 2, 4, 5, 4, 3, 2, 9, 1, 3, 4, 7], device=device),
        offsets=torch.tensor([0, 2, 4, 6, 8, 10, 12], device=device),
        weights=torch.linspace(0.1, 1.2, 12, device=device) if weighted else None)


def copy_rows(ours, ref, modules):
    """Ours holds TorchRec's rows (row i as ID i)."""
    for name, store in ours.stores.items():
        store.insert_or_assign(np.arange(ROWS), getattr(ref, modules)[name].weight.detach().numpy())


# --- embedding_bags / embeddings ----------------------------------------------------------------

def test_embedding_bags_are_cn_embedding_bags_over_the_collections_own_tables():
    ebc = CNEmbeddingBagCollection(bag_configs(), optimizer=cncore.SGD(lr=0.5), seed=4)
    assert isinstance(ebc.embedding_bags, nn.ModuleDict) and list(ebc.embedding_bags) == ["t1", "t2"]
    for name, bag in ebc.embedding_bags.items():
        assert isinstance(bag, CNEmbeddingBag) and bag.store is ebc.stores[name]
        assert (bag.num_embeddings, bag.embedding_dim, bag.mode) == (ROWS, ebc.stores[name].dim, "sum")
    ebc(kjt3()).values().sum().backward()  # the collection inserts: the bag reads the same rows
    bag = ebc.embedding_bags["t1"]
    assert sorted(bag.keys().tolist()) == [1, 2, 3, 4, 5, 9]
    before = {k: r.copy() for k, r in zip([2, 9], ebc.stores["t1"].lookup(np.array([2, 9])))}
    bag(torch.tensor([[2, 9, 9]])).sum().backward()  # through the bag: the collection's rows, its SGD
    after = ebc.stores["t1"].lookup(np.array([2, 9]))
    np.testing.assert_array_equal(after[0], before[2] - np.float32(0.5))
    np.testing.assert_array_equal(after[1], before[9] - np.float32(0.5) * 2)


def test_embeddings_are_cn_embeddings_and_read_what_the_collection_reads():
    ec = CNEmbeddingCollection(ec_configs(), optimizer=cncore.SGD(lr=0.1))
    assert list(ec.embeddings) == ["t1", "t2"] and all(isinstance(e, CNEmbedding) for e in ec.embeddings.values())
    features = KeyedJaggedTensor.from_lengths_sync(["f1", "f2"], torch.tensor([7, 8, 7]), torch.tensor([2, 1]))
    out = ec(features)
    ec.eval()
    torch.testing.assert_close(ec.embeddings["t1"](torch.tensor([7, 8])), out["f1"].values().detach())
    torch.testing.assert_close(ec.embeddings["t2"](torch.tensor([7])), out["f2@t2"].values().detach())
    assert ec.embeddings["t2"].store is ec.stores["t2"]


def test_the_per_table_modules_add_no_parameter_and_no_state_dict_entry():
    ebc = CNEmbeddingBagCollection(bag_configs(), optimizer=cncore.SGD(lr=0.1))
    ebc(kjt3()).values().sum().backward()
    assert [n for n, _ in ebc.named_parameters()] == ["_anchor"]
    keys = list(ebc.state_dict())
    assert keys == ["_anchor"] + [f"tables.{t}.{f}" for t in ("t1", "t2") for f in
                                  ("keys", "rows", "optimizer_state", "counts", "last_steps", "step")]
    again = CNEmbeddingBagCollection(bag_configs(), optimizer=cncore.SGD(lr=0.1))
    result = again.load_state_dict(ebc.state_dict(), strict=True)
    assert result.missing_keys == [] and result.unexpected_keys == []
    np.testing.assert_array_equal(again.embedding_bags["t2"].export()["rows"].numpy(),
                                  ebc.stores["t2"].export().rows)


def test_the_per_table_modules_follow_to_empty_and_refuse_to_move_alone():
    ebc = CNEmbeddingBagCollection(bag_configs(), optimizer=cncore.SGD(lr=0.1), device="meta")
    bag = ebc.embedding_bags["t1"]
    assert bag.store is None and bag.weight.is_meta
    ebc.to_empty(device="cpu")
    assert bag.store is ebc.stores["t1"] and bag.weight.device == torch.device("cpu")
    with pytest.raises(ValueError, match=r"^table 't1' belongs to its collection and moves with it"):
        bag.move_to("meta")
    with pytest.raises(ValueError, match=r"^table 't1' belongs to its collection and moves with it"):
        bag.to("meta")
    bag.to("cpu")  # where it is: nothing to move
    assert bag.store is ebc.stores["t1"]
    with pytest.raises(RuntimeError, match="gradient hooks are for a CNEmbeddingBag / CNEmbedding of its own"):
        bag.register_gradient_hook(lambda ids, grads: None)


def test_a_bag_of_a_collection_without_optimizer_refuses_its_gradient_naming_both_ways():
    ebc = CNEmbeddingBagCollection(bag_configs())
    out = ebc.embedding_bags["t1"](torch.tensor([[1, 2]]))
    with pytest.raises(RuntimeError, match=r"CNEmbeddingBagCollection has no optimizer.*apply_optimizer_in_backward"):
        out.sum().backward()


def test_pickling_keeps_the_per_table_modules_on_the_collections_tables():
    import pickle
    ebc = CNEmbeddingBagCollection(bag_configs(), optimizer=cncore.SGD(lr=0.1))
    ebc(kjt3()).values().sum().backward()
    back = pickle.loads(pickle.dumps(ebc))
    assert back.embedding_bags["t1"].store is back.stores["t1"]
    ebc.eval(), back.eval()
    torch.testing.assert_close(back.embedding_bags["t1"](torch.tensor([[1, 9]])),
                               ebc.embedding_bags["t1"](torch.tensor([[1, 9]])))


# --- .weight ------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_weight_tells_device_dtype_dim_and_is_meta_as_torchrecs_does(device):
    ours = CNEmbeddingBagCollection(bag_configs(), device=device)
    ref = EmbeddingBagCollection(bag_configs(), device=torch.device(device))
    for name in ("t1", "t2"):
        w, want = ours.embedding_bags[name].weight, ref.embedding_bags[name].weight
        assert isinstance(w, TableWeight) and not isinstance(w, nn.Parameter)
        assert (w.device, w.dtype, w.is_meta, w.shape[1]) == (want.device, want.dtype, want.is_meta, want.shape[1])
        assert w.shape[0] == 0  # rows held now: none yet
    ec = CNEmbeddingCollection(ec_configs(), device=device)
    assert ec.embeddings["t1"].weight.device == EmbeddingCollection(ec_configs(), device=device).embeddings[
        "t1"].weight.device


def test_weight_counts_the_rows_held_and_refuses_every_read_or_write_of_values():
    bag = CNEmbeddingBag(ROWS, 4, mode="sum", row_dtype="bfloat16")
    bag(torch.tensor([[3, 2**40, 3]]))
    w = bag.weight
    assert tuple(w.shape) == (2, 4) and w.dtype == torch.bfloat16 and w.numel() == 8
    expected = (r"^CNEmbeddingBag.weight holds no values \({}\): the rows live in a dynamic hash table \(2 rows of 4, "
                r"bfloat16, on cpu\), drawn from the initializer as IDs arrive; read them with .export\(\) \(keys and "
                r"rows\) and write them with .insert\(ids, rows\) / .assign\(ids, rows\)$")
    for call, what in ((lambda: torch.nn.init.normal_(w), "aten.normal_"), (lambda: w.detach(), "aten.detach"),
                       (lambda: w[0], "aten.select.int"), (lambda: w.numpy(), r"numpy\(\)"),
                       (lambda: w.sum(), "aten.sum")):
        with pytest.raises(RuntimeError, match=expected.format(what)):
            call()
    assert len(bag.store) == 2  # nothing changed


# --- reset_parameters, device, repr -------------------------------------------------------------

def test_reset_parameters_redraws_every_row_as_a_fresh_collection_draws_it():
    trained = CNEmbeddingBagCollection(bag_configs(), optimizer=cncore.SGD(lr=0.5), seed=7)
    for _ in range(3):
        trained(kjt3()).values().sum().backward()
    trained.reset_parameters()
    assert trained.table_rows() == {"t1": 0, "t2": 0}
    fresh = CNEmbeddingBagCollection(bag_configs(), optimizer=cncore.SGD(lr=0.5), seed=7)
    torch.testing.assert_close(trained(kjt3()).values(), fresh(kjt3()).values(), rtol=0, atol=0)
    for name in ("t1", "t2"):  # each ID's row is its initial value again, its state too
        a, b = trained.stores[name].export(), fresh.stores[name].export()
        order_a, order_b = np.argsort(a.keys), np.argsort(b.keys)
        np.testing.assert_array_equal(a.rows[order_a], b.rows[order_b])
        np.testing.assert_array_equal(a.keys[order_a], b.keys[order_b])
    meta = CNEmbeddingCollection(ec_configs(), device="meta")
    meta.reset_parameters()  # on meta: nothing to reset, as TorchRec's
    assert meta.is_meta and meta.stores == {}


def test_dmps_meta_initialisation_replacing_the_anchor_then_resetting_makes_empty_tables():
    ebc = CNEmbeddingBagCollection(bag_configs(), optimizer=cncore.SGD(lr=0.1), device="meta")
    with torch.no_grad():  # what DistributedModelParallel._init_parameters does to an unsharded module
        ebc._parameters["_anchor"] = nn.Parameter(torch.empty_like(ebc._anchor, device="cpu"))
        ebc.reset_parameters()
    assert ebc.device == torch.device("cpu") and ebc.table_rows() == {"t1": 0, "t2": 0}
    ebc.to(torch.device("cpu"))  # and DMP's move to its device is no move
    ebc(kjt3()).values().sum().backward()
    assert ebc.table_rows() == {"t1": 6, "t2": 4} and ebc.stores["t1"].step == 1


def test_device_follows_the_argument_and_a_meta_device_context_as_torchrecs():
    for device in (None, "cpu", "meta", torch.device("meta")):
        want = torch.device(EmbeddingBagCollection(bag_configs(), device=device).device)  # (TorchRec's: as given)
        assert CNEmbeddingBagCollection(bag_configs(), device=device).device == want
        assert CNEmbeddingCollection(ec_configs(), device=device).device == want
    with torch.device("meta"):
        ours, ref = CNEmbeddingBagCollection(bag_configs()), EmbeddingBagCollection(bag_configs())
        unpooled = CNEmbeddingCollection(ec_configs())
    assert ours.device == ref.device == torch.device("meta") and ours.is_meta and unpooled.is_meta
    assert ours.embedding_bags["t1"].weight.device == ref.embedding_bags["t1"].weight.device


def test_repr_lists_the_tables_as_torchrecs_does():
    ours = CNEmbeddingBagCollection(bag_configs(), optimizer=cncore.SGD(lr=0.1))
    ref = EmbeddingBagCollection(bag_configs())
    assert repr(ref).splitlines()[1:3] == ["  (embedding_bags): ModuleDict(",
                                           "    (t1): EmbeddingBag(10, 3, mode='sum')"]
    assert repr(ours).splitlines() == [
        "CNEmbeddingBagCollection(", "  device=cpu, optimizer=SGD(lr=0.1)", "  (embedding_bags): ModuleDict(",
        "    (t1): CNEmbeddingBag(10, 3, mode='sum', rows=0)", "    (t2): CNEmbeddingBag(10, 4, mode='sum', rows=0)",
        "  )", ")"]
    ec = CNEmbeddingCollection(ec_configs(), device="meta")
    assert "    (t2): CNEmbedding(10, 5, rows=meta)" in repr(ec).splitlines()


# --- isinstance, the sharder DMP picks, to_dynamic --------------------------------------------

def test_ours_are_torchrecs_collections_and_the_planner_picks_our_sharder_by_exact_type():
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner.utils import sharder_name

    from cncore_torch.distributed import CNEmbeddingBagCollectionSharder, CNEmbeddingCollectionSharder
    ebc, ec = CNEmbeddingBagCollection(bag_configs()), CNEmbeddingCollection(ec_configs())
    assert isinstance(ebc, EmbeddingBagCollection) and isinstance(ec, EmbeddingCollection)
    sharders = [EmbeddingBagCollectionSharder(), EmbeddingCollectionSharder(), CNEmbeddingBagCollectionSharder(),
                CNEmbeddingCollectionSharder()]
    by_name = {sharder_name(s.module_type): s for s in sharders}  # how DMP's planner looks them up
    assert type(by_name[sharder_name(type(ebc))]) is CNEmbeddingBagCollectionSharder
    assert type(by_name[sharder_name(type(ec))]) is CNEmbeddingCollectionSharder


def test_the_default_planner_plans_our_sharder_for_ours_and_torchrecs_for_torchrecs():
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology

    from cncore_torch.distributed import CNEmbeddingBagCollectionSharder
    from cncore_torch.distributed.planner import KERNEL

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.ours = CNEmbeddingBagCollection(bag_configs(), device="meta")
            self.theirs = EmbeddingBagCollection(
                [EmbeddingBagConfig(name="x", embedding_dim=4, num_embeddings=ROWS, feature_names=["fx"])],
                device=torch.device("meta"))

    planner = EmbeddingShardingPlanner(topology=Topology(world_size=2, compute_device="cpu"))
    plan = planner.plan(Model(), [CNEmbeddingBagCollectionSharder(), EmbeddingBagCollectionSharder()])
    ours = {name: (p.sharding_type, p.compute_kernel) for name, p in plan.plan["ours"].items()}
    assert ours == {"t1": ("row_wise", KERNEL), "t2": ("row_wise", KERNEL)}
    assert plan.plan["theirs"]["x"].compute_kernel != KERNEL  # TorchRec's own sharder's kernel


def test_to_dynamic_converts_torchrecs_collections_and_leaves_ours_as_they_are():
    ours = CNEmbeddingBagCollection(bag_configs(), optimizer=cncore.SGD(lr=0.1))
    model = nn.ModuleDict({"ours": ours, "theirs": EmbeddingBagCollection(bag_configs())})
    to_dynamic(model, optimizer=cncore.SGD(lr=0.2))
    assert model["ours"] is ours and type(model["theirs"]) is CNEmbeddingBagCollection
    assert to_dynamic(ours, optimizer=cncore.SGD(lr=0.2)) is ours


# --- data_type ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("data_type", "dtype"), [(DataType.FP16, torch.float16), (DataType.BF16, torch.bfloat16),
                                                  (DataType.FP32, torch.float32)])
def test_data_type_is_the_row_dtype(data_type, dtype):
    ours = CNEmbeddingBagCollection(bag_configs(data_type=data_type), optimizer=cncore.SGD(lr=0.1))
    assert {s.config.dtype for s in ours.stores.values()} == {str(dtype).removeprefix("torch.")}
    assert ours.embedding_bags["t1"].weight.dtype == dtype
    out = ours(kjt3())
    rows = ours.stores["t1"].lookup(np.array([1, 2]))
    np.testing.assert_array_equal(rows, torch.from_numpy(rows).to(dtype).float().numpy())  # 16-bit values
    np.testing.assert_array_equal(out.values()[0, :3].detach().numpy(), rows.sum(0))  # outputs float32 sums
    assert out.values().dtype == torch.float32  # as TorchRec's EBC (.float())
    ec = CNEmbeddingCollection([EmbeddingConfig(name="u", embedding_dim=2, num_embeddings=5, feature_names=["f"],
                                                data_type=data_type)])
    assert ec.stores["u"].config.dtype == str(dtype).removeprefix("torch.")


@pytest.mark.parametrize("data_type", [DataType.INT8, DataType.INT4, DataType.INT2, DataType.UINT8])
def test_integer_data_types_are_refused_by_name(data_type):
    with pytest.raises(ValueError, match=rf"^table 't1': data_type DataType.{data_type.name} is not supported: rows "
                                         r"are stored as FP32, FP16 or BF16 \(pass one of those; for 8-bit "
                                         r"serving, quantize the trained model\)$"):
        CNEmbeddingBagCollection(bag_configs(data_type=data_type))


def test_row_dtype_agrees_with_data_type_or_is_refused():
    assert CNEmbeddingBagCollection(bag_configs(), row_dtype="bfloat16").stores["t2"].config.dtype == "bfloat16"
    half = CNEmbeddingBagCollection(bag_configs(data_type=DataType.FP16), row_dtype={"t1": torch.float16})
    assert half.stores["t1"].config.dtype == "float16"
    with pytest.raises(ValueError, match=r"^table 't1': row_dtype='bfloat16' disagrees with the config's data_type "
                                         r"DataType.FP16 \('float16'\); give one of them$"):
        CNEmbeddingBagCollection(bag_configs(data_type=DataType.FP16), row_dtype="bfloat16")


# --- what TorchRec's own module tests check, against TorchRec's modules ------------------------

FEATURES_2 = {"keys": ["f1", "f2"], "values": torch.tensor([0, 1, 2, 3, 4, 5, 6, 7]),
              "offsets": torch.tensor([0, 2, 2, 3, 4, 5, 8])}


@pytest.mark.parametrize("case", ["unweighted", "shared_tables", "shared_features", "weighted"])
def test_pooled_outputs_equal_torchrecs_ebc_on_the_same_rows(case):
    init = functools.partial(torch.nn.init.normal_, mean=0.0, std=1.5)
    configs, weighted, features = {
        "unweighted": ([EmbeddingBagConfig(name="t1", embedding_dim=3, num_embeddings=ROWS, feature_names=["f1"],
                                           init_fn=init),
                        EmbeddingBagConfig(name="t2", embedding_dim=4, num_embeddings=ROWS, feature_names=["f2"])],
                       False, KeyedJaggedTensor.from_offsets_sync(**FEATURES_2)),
        "shared_tables": ([EmbeddingBagConfig(name="t1", embedding_dim=3, num_embeddings=ROWS,
                                              feature_names=["f1", "f2"])], False,
                          KeyedJaggedTensor.from_offsets_sync(**FEATURES_2)),
        "shared_features": ([EmbeddingBagConfig(name="t1", embedding_dim=3, num_embeddings=ROWS, feature_names=["f1"]),
                             EmbeddingBagConfig(name="t2", embedding_dim=4, num_embeddings=ROWS, feature_names=["f1"])],
                            False, KeyedJaggedTensor.from_offsets_sync(keys=["f1"], values=FEATURES_2["values"],
                                                                       offsets=FEATURES_2["offsets"])),
        "weighted": (bag_configs(), True, kjt3(weighted=True)),
    }[case]
    ref = EmbeddingBagCollection(configs, is_weighted=weighted)
    ours = CNEmbeddingBagCollection(configs, is_weighted=weighted, optimizer=cncore.SGD(lr=0.1))  # (no backward)
    copy_rows(ours, ref, "embedding_bags")
    a, b = ours(features), ref(features)
    assert (a.keys(), a.offset_per_key(), a.values().shape) == (b.keys(), b.offset_per_key(), b.values().shape)
    torch.testing.assert_close(a.values(), b.values())


def test_unpooled_outputs_and_indices_equal_torchrecs_ec():
    ref = EmbeddingCollection(ec_configs(), need_indices=True)
    ours = CNEmbeddingCollection(ec_configs(), need_indices=True, optimizer=cncore.SGD(lr=0.1))  # (no backward)
    copy_rows(ours, ref, "embeddings")
    features = KeyedJaggedTensor.from_offsets_sync(keys=["f1", "f2"], values=torch.tensor([0, 1, 2, 3]),
                                                   offsets=torch.tensor([0, 2, 3, 3, 4]))
    a, b = ours(features), ref(features)
    assert list(a) == list(b) == ["f1", "f2@t1", "f2@t2"]
    for key in a:
        torch.testing.assert_close(a[key].values(), b[key].values())
        assert torch.equal(a[key].weights(), b[key].weights()) and torch.equal(a[key].lengths(), b[key].lengths())


def test_a_meta_collection_infers_torchrecs_shapes_from_a_meta_kjt():
    ours = CNEmbeddingBagCollection(bag_configs(), is_weighted=True, device="meta")
    ref = EmbeddingBagCollection(bag_configs(), is_weighted=True, device=torch.device("meta"))
    a, b = ours(kjt3(True, "meta")), ref(kjt3(True, "meta"))
    assert (a.keys(), a.offset_per_key(), a.values().shape, a.values().device) == \
        (b.keys(), b.offset_per_key(), b.values().shape, b.values().device)
    ec = CNEmbeddingCollection(ec_configs(), device="meta")
    out = ec(KeyedJaggedTensor.from_offsets_sync(keys=["f1", "f2"], values=torch.tensor([0, 1, 2, 3], device="meta"),
                                                 offsets=torch.tensor([0, 2, 3, 3, 4], device="meta")))
    assert out["f1"].values().is_meta and out["f1"].values().shape[1] == 5
    cpu = CNEmbeddingBagCollection(bag_configs(), is_weighted=True)
    with pytest.raises(ValueError, match=r"^features: values is a meta tensor, which holds no values"):
        cpu(kjt3(True, "meta"))  # a materialised collection still wants values


@pytest.mark.parametrize("pooled", [True, False])
def test_torchrecs_fx_trace_of_either_collection_runs_as_eager(pooled):
    from torchrec.fx import symbolic_trace
    if pooled:
        module = CNEmbeddingBagCollection(bag_configs(), is_weighted=True, optimizer=cncore.SGD(lr=0.1))
        features = kjt3(weighted=True)
    else:
        module = CNEmbeddingCollection(ec_configs(), optimizer=cncore.SGD(lr=0.1))
        features = KeyedJaggedTensor.from_offsets_sync(keys=["f1", "f2"], values=torch.tensor([0, 1, 2, 3]),
                                                       offsets=torch.tensor([0, 2, 3, 3, 4]))
    gm = symbolic_trace(module)
    assert sum(n.op == "call_function" for n in gm.graph.nodes) == 1  # the lookup: one node
    module.eval()
    traced, eager = gm(features), module(features)
    if pooled:
        assert traced.keys() == eager.keys() and traced.offset_per_key() == [0, 3, 6, 10]
        torch.testing.assert_close(traced.values(), eager.values())
    else:
        assert list(traced) == list(eager)
        for key in eager:
            torch.testing.assert_close(traced[key].values(), eager[key].values())


def test_duplicate_table_names_are_refused_as_torchrec_refuses_them():
    for ours, config in ((CNEmbeddingBagCollection, EmbeddingBagConfig), (CNEmbeddingCollection, EmbeddingConfig)):
        tables = [config(name="t1", embedding_dim=2, num_embeddings=ROWS, feature_names=["f1"]),
                  config(name="t1", embedding_dim=2, num_embeddings=ROWS, feature_names=["f2"])]
        with pytest.raises(ValueError, match=r"^tables: duplicate table name 't1'$"):
            ours(tables)


# --- unsharded in a group of several ranks ------------------------------------------------------

def _unsharded_ranks(rank, world_size):
    from torchrec.distributed.model_parallel import DistributedModelParallel

    sharder = r"Shard it: DistributedModelParallel\(model, sharders=\[cncore_torch.distributed.{}\(\)\]\)"
    ebc = CNEmbeddingBagCollection(bag_configs(), optimizer=cncore.SGD(lr=0.1))
    with pytest.raises(RuntimeError, match=r"^CNEmbeddingBagCollection runs unsharded in a process group of 2 ranks: "
                                           r"each rank would train its own copy of every table.*"
                                           + sharder.format("CNEmbeddingBagCollectionSharder")):
        ebc(kjt3())
    with pytest.raises(RuntimeError, match=sharder.format("CNEmbeddingBagCollectionSharder")):
        ebc.embedding_bags["t1"](torch.tensor([[1]]))
    ec = CNEmbeddingCollection(ec_configs(), optimizer=cncore.SGD(lr=0.1))
    with pytest.raises(RuntimeError, match=sharder.format("CNEmbeddingCollectionSharder")):
        ec(KeyedJaggedTensor.from_lengths_sync(["f1", "f2"], torch.tensor([1, 2]), torch.tensor([1, 1])))
    assert ebc.table_rows() == {"t1": 0, "t2": 0} and len(ec.stores["t1"]) == 0
    # DMP without our sharder, on a model built on meta: DMP accepts it; its first forward refuses
    dmp = DistributedModelParallel(CNEmbeddingBagCollection(bag_configs(), optimizer=cncore.SGD(lr=0.1),
                                                            device="meta"), device=torch.device("cpu"))
    with pytest.raises(RuntimeError, match=sharder.format("CNEmbeddingBagCollectionSharder")):
        dmp(kjt3())
    # with our sharder: sharded, data_type FP16 honoured by every rank's shard
    from cncore_torch.distributed import CNEmbeddingBagCollectionSharder
    half = DistributedModelParallel(CNEmbeddingBagCollection(bag_configs(data_type=DataType.FP16), device="meta",
                                                             optimizer=cncore.SGD(lr=0.1)),
                                    device=torch.device("cpu"), sharders=[CNEmbeddingBagCollectionSharder()])
    half(kjt3()).wait().values().sum().backward()
    assert {s.config.dtype for s in half.module.stores.values()} == {"float16"}
    assert sum(len(s) for s in half.module.stores.values()) > 0
    # each rank's own table, on purpose: runs, and the ranks' rows differ as their batches do
    mine = CNEmbeddingBagCollection(bag_configs(), optimizer=cncore.SGD(lr=0.1), per_rank_tables=True)
    features = KeyedJaggedTensor.from_lengths_sync(["f1", "f3", "f2"], torch.tensor([rank, 5, 6]),
                                                   torch.tensor([1, 1, 1]))
    mine(features).values().sum().backward()
    assert sorted(mine.stores["t1"].export().keys.tolist()) == [rank, 5]


@pytest.mark.slow
def test_an_unsharded_collection_in_two_ranks_refuses_at_its_first_forward_naming_the_sharder():
    from cncore_torch.distributed.launch import spawn
    spawn(_unsharded_ranks, 2, timeout=120.0)


def test_per_rank_tables_must_be_a_flag():
    with pytest.raises(TypeError, match=r"^per_rank_tables must be True or False, got 'yes'$"):
        CNEmbeddingBagCollection(bag_configs(), per_rank_tables="yes")


@pytest.mark.parametrize("make", [lambda: CNEmbeddingBagCollection(bag_configs()),
                                  lambda: nn.Sequential(nn.Linear(2, 2), CNEmbeddingCollection(ec_configs())),
                                  lambda: CNEmbeddingBag(ROWS, 4)])
def test_torch_jit_script_is_refused_naming_what_compiles_instead(make):
    module = make()
    name = type(module[1] if isinstance(module, nn.Sequential) else module).__name__
    with pytest.raises(TypeError, match=rf"^torch.jit.script cannot compile {name}: its rows live in a dynamic table "
                                        r"outside TorchScript; use torch.compile or torch.export \(docs/torchrec.md\), "
                                        r"or cncore_torch.serving.freeze\(model\) for a copy in plain torch$"):
        torch.jit.script(module)

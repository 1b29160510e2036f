"""Fallback rows through the torch front end: the collections' fallback_rows= / fallback_copy=
options (one value or per table), the state_dict entries that carry the fallback rows (saved,
loaded exactly, required, refused where the table has none), and the refusals of the device
index and of rows on an accelerator."""
import numpy as np
import pytest
import torch
from torchrec import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import cncore
from cncore_torch.collection import CNEmbeddingBagCollection

TABLES = [EmbeddingBagConfig(name="t_a", embedding_dim=4, num_embeddings=10, feature_names=["a"]),
          EmbeddingBagConfig(name="t_b", embedding_dim=4, num_embeddings=10, feature_names=["b"])]
KJT = KeyedJaggedTensor(keys=["a", "b"], values=torch.tensor([1, 2, 3, 4, 5, 6, 7]),
                        lengths=torch.tensor([2, 3, 1, 1]))


def collection(fallback_rows=0, **kw):
    return CNEmbeddingBagCollection(tables=TABLES, optimizer=cncore.Adagrad(lr=0.1), max_rows=2,
                                    fallback_rows=fallback_rows, **kw)


def trained(fallback_rows=0, **kw):
    ebc = collection(fallback_rows, **kw)
    ebc(KJT).values().sum().backward()
    return ebc


def test_the_options_reach_each_tables_config_once_or_per_table():
    ebc = collection({"t_a": 3}, fallback_copy={"t_b": False})
    # t_b takes the default: "auto" (a bounded table in the core)
    assert ebc.stores["t_a"].config.fallback_rows == 3 and ebc.stores["t_b"].config.fallback_rows == "auto"
    assert ebc.stores["t_a"].config.fallback_copy and not ebc.stores["t_b"].config.fallback_copy
    assert all(s.fallback_rows == 5 for s in collection(5).stores.values())


def test_a_collection_trains_its_fallback_rows_and_its_state_dict_carries_them_exactly():
    ebc = trained(3)
    fb_rows, fb_state = ebc.stores["t_a"].export_fallback()
    assert (fb_state != 0).any()  # keys past max_rows trained the fallback rows' Adagrad sums
    sd = ebc.state_dict()
    torch.testing.assert_close(sd["tables.t_a.fallback_rows"], torch.from_numpy(fb_rows), rtol=0, atol=0)
    torch.testing.assert_close(sd["tables.t_a.fallback_optimizer_state"], torch.from_numpy(fb_state), rtol=0, atol=0)
    other = collection(3)
    assert not other.load_state_dict(sd).missing_keys
    for name in ("t_a", "t_b"):
        for x, y in zip(other.stores[name].export_fallback(), ebc.stores[name].export_fallback()):
            np.testing.assert_array_equal(x, y)
    torch.testing.assert_close(other(KJT).values(), ebc(KJT).values(), rtol=0, atol=0)


def test_a_state_dict_without_fallback_rows_or_with_them_for_a_table_without_them_is_refused():
    sd = trained(3).state_dict()
    with pytest.raises(RuntimeError, match=r"tables.t_a.fallback_rows: the checkpoint holds fallback rows and this "
                                           r"table has none; build it with fallback_rows=3"):
        collection().load_state_dict(sd)
    target = collection(3)
    before = target.stores["t_a"].export_fallback()[0]
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "tables.t_a.fallback_rows"'):
        target.load_state_dict({k: v for k, v in sd.items() if "fallback" not in k})
    np.testing.assert_array_equal(target.stores["t_a"].export_fallback()[0], before)


def test_the_device_index_refuses_fallback_rows_naming_the_host_index():
    from cncore_torch.device_index import DeviceKeyIndex
    with pytest.raises(ValueError, match=r"fallback_rows=4: the device index keeps no fallback rows; a table with "
                                         r"them needs the host index"):
        DeviceKeyIndex(cncore.StoreConfig(dim=2, fallback_rows=4))


def test_rows_on_an_accelerator_refuse_fallback_rows_naming_the_core():
    from cncore_torch.device_rows import DeviceRows
    with pytest.raises(ValueError, match=r"fallback_rows=2: rows on an accelerator keep no fallback rows; keep this "
                                         r"table on device='cpu' \(the core\)"):
        DeviceRows(cncore.StoreConfig(dim=2, fallback_rows=2), torch.device("cpu"))


def test_a_module_takes_fallback_rows_and_its_state_dict_carries_them():
    from cncore_torch import CNEmbeddingBag
    bag = CNEmbeddingBag(10, 4, optimizer=cncore.SGD(lr=0.5), max_rows=1, headroom=0, fallback_rows=2)
    bag(torch.tensor([[1, 2, 3]])).sum().backward()
    other = CNEmbeddingBag(10, 4, optimizer=cncore.SGD(lr=0.5), max_rows=1, headroom=0, fallback_rows=2,
                           fallback_copy=False)
    assert other.load_state_dict(bag.state_dict()).missing_keys == []
    np.testing.assert_array_equal(other.store.export_fallback()[0], bag.store.export_fallback()[0])
    other.eval(), bag.eval()  # 1 reads its row, 2 and 3 their fallback rows
    torch.testing.assert_close(other(torch.tensor([[1, 2, 3]])), bag(torch.tensor([[1, 2, 3]])), rtol=0, atol=0)
    assert not other.store.config.fallback_copy and len(other.store) == 1


def test_a_shards_state_dict_carries_its_fallback_rows_as_its_part_of_every_ranks():
    """A shard's fallback rows are entries in their own place (its rank's part of one tensor of
    every rank's rows) beside its count of them, which a DCP load cuts the rows back by."""
    from cncore_torch.dcp import TableEntry
    from cncore_torch.state import save_store
    store = cncore.EmbeddingStore(dim=2, fallback_rows=2)
    destination = {}
    save_store(store, destination, "t.", shard=(1, 2, 7), fallback_entries=True)
    rows = destination["t.fallback_rows"]
    assert isinstance(rows, TableEntry) and not rows.cn_per_rank and rows.cn_layout.rank == 1
    np.testing.assert_array_equal(rows.numpy(), store.export_fallback()[0])
    assert destination["t.fallback_count"].cn_per_rank and int(destination["t.fallback_count"]) == 2
    undecided = {}  # an "auto" shard that has not split: 0 rows, so that every rank writes the entries
    save_store(cncore.EmbeddingStore(dim=2, max_rows=4), undecided, "t.", shard=(0, 2, 7), fallback_entries=True)
    assert tuple(undecided["t.fallback_rows"].shape) == (0, 2) and int(undecided["t.fallback_count"]) == 0


def test_sharding_a_collection_with_fallback_rows_keeps_them():
    """The sharded collections keep fallback rows (the unpooled one on one rank, no process
    group needed; both on 2 ranks in test_distributed_fallback.py): at world size 1 the shard is
    the table, with the fallback rows it was built with."""
    from torchrec import EmbeddingConfig
    from torchrec.distributed.types import ShardingEnv

    from cncore_torch.collection import CNEmbeddingCollection
    from cncore_torch.distributed import ShardedCNEmbeddingCollection, plan_for
    model = CNEmbeddingCollection(tables=[EmbeddingConfig(name="t_a", embedding_dim=4, num_embeddings=10,
                                                          feature_names=["a"])],
                                  optimizer=cncore.Adagrad(lr=0.1), fallback_rows=3, device="meta")
    module = ShardedCNEmbeddingCollection(model, plan_for(model, 1).plan[""],
                                          ShardingEnv(world_size=1, rank=0, pg=None), None)
    assert module.stores["t_a"].fallback_rows == 3
    assert module.state_dict()["tables.t_a.fallback_rows"].shape == (3, 4)

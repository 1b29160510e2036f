"""``fallback_rows``' default (None): ``"auto"`` where a table can take it (max_rows, rows in the
core's memory, miss mode, no admission; sharded or not) and 0 (a row per key) elsewhere. A default
table is an explicit ``fallback_rows="auto"`` one bit for bit, an explicit 0 the row-per-key
table; the placements that keep no fallback rows (accelerator rows, the device index) resolve the
default to 0 instead of refusing it; the sharder gives each shard "auto"."""
import numpy as np
import pytest
from test_bounded_auto_split import same_store, sgd_auto, train

import cncore
from cncore.config import with_default_split


def sgd_default(max_rows, **kw):
    return cncore.EmbeddingStore(dim=2, seed=3, optimizer=cncore.SGD(lr=1.0), initializer=cncore.Uniform(-1, 1),
                                 max_rows=max_rows, **kw)


CHURNING = [list(range(8)), list(range(8, 16)), list(range(16, 24))]  # 8 new keys a call into 10 rows: splits
REPEATED = [[1, 1, 1, 1, 2, 2, 2, 2], [3, 3, 3, 4, 4, 5, 5, 5], [1, 2, 3, 6, 6, 6, 6, 6]]  # into 4 rows: keeps


@pytest.mark.parametrize(("fields", "resolved"), [
    ({"max_rows": 10}, "auto"),
    ({"max_rows": 10, "eviction": cncore.LRU()}, "auto"),
    ({}, 0),
    ({"max_rows": 10, "admission": cncore.MinCount(2)}, 0),
    ({"max_rows": 10, "fallback_mode": "miss", "fallback_copy": False}, "auto"),
])
def test_the_store_resolves_the_default_where_auto_can_run(fields, resolved):
    config = cncore.StoreConfig(dim=2, **fields)
    assert config.fallback_rows == (None if resolved == "auto" else 0)
    assert cncore.EmbeddingStore(config).config.fallback_rows == resolved
    assert with_default_split(config, can_split=False).fallback_rows == 0
    assert cncore.StoreConfig(dim=2, fallback_rows=0, **fields).fallback_rows == 0  # explicit 0 stays 0


def test_a_tiered_table_resolves_the_default_to_0(tmp_path):
    store = cncore.make_store(cncore.StoreConfig(dim=2, storage=cncore.Tiered(str(tmp_path / "t"), 1 << 20)))
    assert store.config.fallback_rows == 0


def test_residual_mode_still_needs_fallback_rows_and_explicit_auto_still_refuses_by_name():
    with pytest.raises(ValueError, match="fallback_mode='residual' adds a shared fallback row"):
        cncore.StoreConfig(dim=2, max_rows=10, fallback_mode="residual")
    with pytest.raises(ValueError, match="fallback_rows='auto': admission="):
        cncore.StoreConfig(dim=2, max_rows=10, admission=cncore.MinCount(2), fallback_rows="auto")
    with pytest.raises(ValueError, match="fallback_rows='auto': it splits a row budget"):
        cncore.StoreConfig(dim=2, fallback_rows="auto")


@pytest.mark.parametrize(("batches", "max_rows", "fallback_rows"), [(CHURNING, 10, 9), (REPEATED, 4, 0)],
                         ids=["churning", "repeated"])
def test_a_default_table_trains_as_an_explicit_auto_one_bit_for_bit(batches, max_rows, fallback_rows):
    default, auto = sgd_default(max_rows), sgd_auto(max_rows)
    for keys in batches:
        np.testing.assert_array_equal(train(default, keys), train(auto, keys))
    same_store(default, auto)
    assert default.split_measures == auto.split_measures and default.split_measures.fallback_rows == fallback_rows


def test_an_explicit_0_keeps_a_row_per_key_where_the_default_splits():
    zero, default = sgd_default(10, fallback_rows=0), sgd_default(10)
    for keys in CHURNING:
        train(zero, keys)
        train(default, keys)
    assert (default.config.max_rows, default.fallback_rows) == (1, 9)
    assert (zero.config.max_rows, zero.config.fallback_rows, zero.fallback_rows) == (10, 0, 0)
    assert zero.split_measures is None and len(zero) <= 10 and zero.evicted_count > 0


def test_the_torch_modules_resolve_the_default_by_placement(cncard, monkeypatch):
    from torchrec import EmbeddingBagConfig

    from cncore_torch import CNEmbeddingBag, CNEmbeddingBagCollection
    assert CNEmbeddingBag(10, 2, max_rows=4).store.config.fallback_rows == "auto"
    assert CNEmbeddingBag(10, 2, max_rows=4, fallback_rows=0).store.config.fallback_rows == 0
    configs = [EmbeddingBagConfig(name="t", embedding_dim=2, num_embeddings=10, feature_names=["f"])]
    assert CNEmbeddingBagCollection(configs, max_rows=4).stores["t"].config.fallback_rows == "auto"
    for key_index in ("host", "device"):
        monkeypatch.setenv("CNCORE_DEVICE_INDEX", key_index)
        assert CNEmbeddingBag(10, 2, max_rows=4, device="cncard").device_rows.config.fallback_rows == 0
        assert CNEmbeddingBagCollection(configs, max_rows=4, device="cncard").stores["t"].config.fallback_rows == 0
        with pytest.raises(ValueError, match="fallback_rows=auto: (rows on an accelerator|the device index) keep"):
            CNEmbeddingBag(10, 2, max_rows=4, device="cncard", fallback_rows="auto")


def test_a_module_moves_to_an_accelerator_undecided_and_refuses_to_once_split(cncard):
    import torch

    from cncore_torch import CNEmbeddingBag
    undecided = CNEmbeddingBag(10, 1, mode="sum", optimizer=cncore.SGD(lr=1.0), max_rows=10)
    undecided(torch.tensor([[1, 2, 3]])).sum().backward()
    undecided.move_to("cncard")
    assert undecided.device_rows.config.fallback_rows == 0 and sorted(undecided.keys().tolist()) == [1, 2, 3]
    split = CNEmbeddingBag(10, 1, mode="sum", optimizer=cncore.SGD(lr=1.0), max_rows=10)
    for keys in CHURNING:
        split(torch.tensor([keys])).sum().backward()
    assert split.store.fallback_rows == 9
    before = split.export()
    with pytest.raises(ValueError, match=r"this table holds 9 fallback rows \(fallback_rows=9\), which rows on an "
                                         r"accelerator do not keep"):
        split.move_to("cncard")
    assert split.store is not None and split.store.fallback_rows == 9
    for name, value in before.items():
        torch.testing.assert_close(split.export()[name], value, rtol=0, atol=0)


def test_a_default_module_loads_a_split_checkpoint_as_the_split():
    import torch

    from cncore_torch import CNEmbeddingBag
    split = CNEmbeddingBag(10, 1, mode="sum", optimizer=cncore.SGD(lr=1.0), max_rows=10)
    for keys in CHURNING:
        split(torch.tensor([keys])).sum().backward()
    fresh = CNEmbeddingBag(10, 1, mode="sum", optimizer=cncore.SGD(lr=1.0), max_rows=10)
    fresh.load_state_dict(split.state_dict())
    same_store(fresh.store, split.store)


def test_the_sharder_gives_each_shard_the_default_auto_and_its_share_of_fixed_fallback_rows():
    pytest.importorskip("torchrec")
    from cncore_torch.distributed.embedding_sharding import shard_store_configs
    configs = shard_store_configs({"t": cncore.StoreConfig(dim=2, max_rows=8)}, world_size=2, rank=1)
    assert (configs["t"].fallback_rows, configs["t"].max_rows) == ("auto", 4)
    fixed = shard_store_configs({"t": cncore.StoreConfig(dim=2, max_rows=8, fallback_rows=5)}, world_size=2)
    assert (fixed["t"].fallback_rows, fixed["t"].max_rows) == (3, 4)  # ceil(5 / 2) each
    tiered = shard_store_configs({"t": cncore.StoreConfig(dim=2, max_rows=8, storage=cncore.Tiered(
        "/nonexistent-cn", cache_bytes=1 << 12))}, world_size=1)  # where auto cannot run: a row per key
    assert tiered["t"].fallback_rows == 0

"""Bounded tables sharded over 2 gloo processes: each rank's shard takes ceil(max_rows / 2) of
every table's budget and evicts by the table's policy when its share is full; no shard ever holds
more than its share, every shard evicts (the stream has 6x more IDs than the budget), keys stay on
their owner; the ranks' state_dicts merge (evicted counts summed) and load into one process whose
collection has the whole budget."""
import pytest
import torch

pytest.importorskip("torchrec")

TIMEOUT = 80.0
BUDGET = 40


def _configs():
    from torchrec import EmbeddingBagConfig
    return [EmbeddingBagConfig(name="t_a", embedding_dim=4, num_embeddings=BUDGET, feature_names=["fa"]),
            EmbeddingBagConfig(name="t_b", embedding_dim=2, num_embeddings=BUDGET, feature_names=["fb"])]


def _model(device):
    import cncore
    from cncore_torch import CNEmbeddingBagCollection
    # a row per key (fallback_rows=0): the merge below joins keyed rows, and a shard's trained
    # fallback rows do not merge (test_distributed_fallback.py)
    return CNEmbeddingBagCollection(_configs(), device=device, optimizer=cncore.Adagrad(lr=0.1),
                                    max_rows="num_embeddings", eviction=cncore.LRU(), headroom=2, seed=3,
                                    fallback_rows=0)


def _ranks(rank, world_size, out_path):
    import numpy as np
    import torch.distributed as dist
    from torchrec import KeyedJaggedTensor
    from torchrec.distributed.model_parallel import DistributedModelParallel

    from cncore_torch.distributed import CNEmbeddingBagCollectionSharder, owner_of

    dmp = DistributedModelParallel(_model("meta"), device=torch.device("cpu"),
                                   sharders=[CNEmbeddingBagCollectionSharder()])
    stores = dmp.module.stores
    assert {name: s.config.max_rows for name, s in stores.items()} == {"t_a": BUDGET // 2, "t_b": BUDGET // 2}
    rng = np.random.default_rng(rank)
    for _ in range(12):
        ids = rng.integers(0, 6 * BUDGET, 16)
        kjt = KeyedJaggedTensor.from_lengths_sync(["fa", "fb"], torch.from_numpy(ids),
                                                  torch.ones(16, dtype=torch.int64))
        dmp(kjt).wait().values().sum().backward()
        for store in stores.values():
            assert len(store) <= BUDGET // 2
    for store in stores.values():
        assert store.evicted_count > 0
        assert (owner_of(torch.from_numpy(store.export().keys), world_size) == rank).all()
    everyone = [None] * world_size
    dist.all_gather_object(everyone, dmp.state_dict())
    if rank == 0:
        torch.save(everyone, out_path)


@pytest.mark.slow
def test_each_shard_bounds_itself_and_the_merged_checkpoint_loads_into_one_process(tmp_path):
    from cncore_torch.distributed import merge_shards
    from cncore_torch.distributed.launch import spawn
    out = str(tmp_path / "shards.pt")
    spawn(_ranks, 2, out, timeout=TIMEOUT)
    shards = torch.load(out, weights_only=False)
    merged = merge_shards(shards)
    one = _model("cpu")
    one.load_state_dict(merged)
    for name in ("t_a", "t_b"):
        total = sum(int(sd[f"tables.{name}.evicted_count"]) for sd in shards)
        assert one.stores[name].evicted_count == total > 0
        assert len(one.stores[name]) == sum(len(sd[f"tables.{name}.keys"]) for sd in shards) <= BUDGET

"""TorchRec's planner sizes our tables as it sizes TorchRec's own with the same configs: each
shard's storage (and its output all-to-all) follows the row dtype (FP16 / BF16 half of FP32's).

TorchRec's EmbeddingEnumerator (what the planner runs) estimates every shard of our collections
and of TorchRec's EmbeddingBagCollection / EmbeddingCollection with the same configs, row-wise on
2 cpu ranks; the estimates must be equal shard by shard. TorchRec's EBC sharder offers row-wise
on cuda only: its reference here is that sharder with row-wise offered on cpu too (the storage
estimate is the same function of the parameter, kernel and sharding type).
"""
import pytest
import torch

pytest.importorskip("torchrec")


def _configs(config_type):
    from torchrec.types import DataType
    return [config_type(name=f"t{i}", embedding_dim=8, num_embeddings=1000 + 10 * i,
                        feature_names=[f"f{i}"], data_type=data_type)
            for i, data_type in enumerate([DataType.FP32, DataType.FP16, DataType.BF16])]


def _estimates(module, sharder):
    """{table: [(ddr, hbm) per shard]} of the row-wise options TorchRec's enumerator gives."""
    from torchrec.distributed.planner import Topology
    from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
    from torchrec.distributed.planner.types import ParameterConstraints
    constraints = {f"t{i}": ParameterConstraints(sharding_types=["row_wise"]) for i in range(3)}
    enumerator = EmbeddingEnumerator(topology=Topology(world_size=2, compute_device="cpu"), batch_size=64,
                                     constraints=constraints)
    out = {}
    for option in enumerator.enumerate(module, [sharder]):
        out.setdefault(option.name, set()).add(tuple((s.storage.ddr, s.storage.hbm) for s in option.shards))
    return out


@pytest.mark.parametrize("pooled", [True, False])
def test_planner_sizes_our_tables_as_torchrecs_by_row_dtype(pooled):
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    import cncore
    from cncore_torch import CNEmbeddingBagCollection, CNEmbeddingCollection
    from cncore_torch.distributed import CNEmbeddingBagCollectionSharder, CNEmbeddingCollectionSharder

    class RowWiseOnCpu(EmbeddingBagCollectionSharder):
        def sharding_types(self, compute_device_type):
            return ["row_wise"]

    config_type = EmbeddingBagConfig if pooled else EmbeddingConfig
    ours_type, theirs_type = ((CNEmbeddingBagCollection, EmbeddingBagCollection) if pooled
                              else (CNEmbeddingCollection, EmbeddingCollection))
    ours = ours_type(_configs(config_type), device="meta", optimizer=cncore.SGD(lr=0.1))
    sharder = CNEmbeddingBagCollectionSharder() if pooled else CNEmbeddingCollectionSharder()
    params = sharder.shardable_parameters(ours)
    assert [params[f"t{i}"].dtype for i in range(3)] == [torch.float32, torch.float16, torch.bfloat16]
    assert [tuple(params[f"t{i}"].shape) for i in range(3)] == [(1000, 8), (1010, 8), (1020, 8)]
    theirs = theirs_type(_configs(config_type), device=torch.device("meta"))
    expected = _estimates(theirs, RowWiseOnCpu() if pooled else EmbeddingCollectionSharder())
    got = _estimates(ours, sharder)
    assert got == expected and all(len(v) == 1 for v in got.values())
    # the 16-bit tables' shards: about half the bytes of the fp32 one (1000 vs 1010 and 1020 rows)
    ddr = [next(iter(got[f"t{i}"]))[0][0] for i in range(3)]
    assert ddr[1] < 0.6 * ddr[0] and ddr[2] == pytest.approx(ddr[1], rel=0.02)

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


@pytest.mark.parametrize("optimizer", ["SGD", "Adagrad", "RowWiseAdagrad", "Adam"])
def test_planner_adds_the_optimizer_state_as_for_torchrecs_fused_tables(optimizer):
    # TorchRec's planner adds a fused table's optimizer state from the class that
    # apply_optimizer_in_backward marks its parameter with: ours say theirs, set any of three ways
    import torchrec.optim as trec_optim
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    import cncore
    from cncore_torch import CNEmbeddingBagCollection
    from cncore_torch.distributed import CNEmbeddingBagCollectionSharder

    class RowWiseOnCpu(EmbeddingBagCollectionSharder):
        def sharding_types(self, compute_device_type):
            return ["row_wise"]

    ours_optimizer = getattr(cncore, optimizer)(lr=0.1)
    torch_class = {"SGD": torch.optim.SGD, "Adagrad": torch.optim.Adagrad, "RowWiseAdagrad": trec_optim.RowWiseAdagrad,
                   "Adam": torch.optim.Adam}[optimizer]
    theirs = EmbeddingBagCollection(_configs(EmbeddingBagConfig), device=torch.device("meta"))
    apply_optimizer_in_backward(torch_class, theirs.parameters(), {"lr": 0.1})
    expected = _estimates(theirs, RowWiseOnCpu())
    ours = CNEmbeddingBagCollection(_configs(EmbeddingBagConfig), device="meta", optimizer=ours_optimizer)
    assert _estimates(ours, CNEmbeddingBagCollectionSharder()) == expected
    tagged = CNEmbeddingBagCollection(_configs(EmbeddingBagConfig), device="meta")
    apply_optimizer_in_backward(torch_class if optimizer != "RowWiseAdagrad" else trec_optim.RowWiseAdagrad,
                                tagged.parameters(), {"lr": 0.1})
    assert _estimates(tagged, CNEmbeddingBagCollectionSharder()) == expected
    # against SGD's, each shard of t0 (500 rows x 8 float32 = 16,000 bytes) adds its state: none for
    # SGD, a value per value for Adagrad, a float a row for row-wise Adagrad, two values for Adam
    sgd = _estimates(CNEmbeddingBagCollection(_configs(EmbeddingBagConfig), device="meta",
                                              optimizer=cncore.SGD(lr=0.1)), CNEmbeddingBagCollectionSharder())
    state = {"SGD": 0, "Adagrad": 16_000, "RowWiseAdagrad": 500 * 4, "Adam": 32_000}[optimizer]
    got, base = next(iter(expected["t0"])), next(iter(sgd["t0"]))
    assert [g[0] - b[0] for g, b in zip(got, base)] == [state, state]


def test_planner_reads_the_optimizer_from_the_sharders_fused_params():
    import torchrec.optim as trec_optim
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagConfig

    from cncore_torch import CNEmbeddingBagCollection
    from cncore_torch.distributed import CNEmbeddingBagCollectionSharder
    sharder = CNEmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                                                            "learning_rate": 0.1})
    params = sharder.shardable_parameters(CNEmbeddingBagCollection(_configs(EmbeddingBagConfig), device="meta"))
    assert all(p._optimizer_classes == [trec_optim.RowWiseAdagrad] for p in params.values())
    # no optimizer anywhere: nothing to add (sharding itself then refuses the module by name)
    params = CNEmbeddingBagCollectionSharder().shardable_parameters(
        CNEmbeddingBagCollection(_configs(EmbeddingBagConfig), device="meta"))
    assert all(not hasattr(p, "_optimizer_classes") for p in params.values())

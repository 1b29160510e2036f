"""`plan_for`: the sharding plan DMP takes, without TorchRec's planner.

TorchRec keeps its plan builders (`construct_module_sharding_plan`, `row_wise`, ...) in
`torchrec.distributed.sharding_plan`; this is the same role for dynamic tables, above the
sharders it names.
"""
from __future__ import annotations

from torch import nn
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
from torchrec.distributed.types import ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig

from cncore_torch.collection import CNEmbeddingBagCollection, CNEmbeddingCollection
from cncore_torch.distributed.embedding import CNEmbeddingCollectionSharder
from cncore_torch.distributed.embeddingbag import CNEmbeddingBagCollectionSharder
from cncore_torch.distributed.planner import KERNEL

__all__ = ["plan_for"]


def plan_for(model: nn.Module, world_size: int, *, local_size: int | None = None,
             device_type: str = "cpu") -> ShardingPlan:
    """The sharding plan DMP takes, without TorchRec's planner: every table of every
    `CNEmbeddingBagCollection` (and `CNEmbeddingCollection`) in `model` row-wise over all
    `world_size` ranks with our kernel.

    `DistributedModelParallel(model, device=torch.device("cpu"), sharders=[CNEmbeddingBagCollectionSharder()],
    plan=plan_for(model, world_size))`. Use it to add TorchRec modules' plans by hand, or when the
    planner is not wanted (it needs a process group; this does not).

    Args:
        model (nn.Module): the model holding our collections.
        world_size (int): the ranks each table spreads over.
        local_size (int | None): ranks per host (default: world_size).
        device_type (str): "cpu".

    Returns:
        ShardingPlan: a module plan per collection path.
    """
    plan = {}
    for path, module in model.named_modules():
        if isinstance(module, (CNEmbeddingBagCollection, CNEmbeddingCollection)):
            sharder: CNEmbeddingBagCollectionSharder | CNEmbeddingCollectionSharder
            configs: list[EmbeddingBagConfig] | list[EmbeddingConfig]
            if isinstance(module, CNEmbeddingBagCollection):
                configs, sharder = module.embedding_bag_configs(), CNEmbeddingBagCollectionSharder()
            else:
                configs, sharder = module.embedding_configs(), CNEmbeddingCollectionSharder()
            plan[path] = construct_module_sharding_plan(
                module, {c.name: row_wise(compute_kernel=KERNEL) for c in configs},
                sharder=sharder, local_size=local_size or world_size, world_size=world_size, device_type=device_type)
    if not plan:
        raise ValueError("model holds no CNEmbeddingBagCollection or CNEmbeddingCollection to shard")
    return ShardingPlan(plan)

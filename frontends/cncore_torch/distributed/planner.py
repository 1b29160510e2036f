"""What a sharding plan says for dynamic tables, and what TorchRec's planner knows of them.

Every table shards row-wise (`ROW_WISE`: by key hash, see `routing.owner_of`) with our kernel
(`KERNEL`, TorchRec's `EmbeddingComputeKernel.CUSTOMIZED_KERNEL`), on cpu. `check_plan` refuses
any other plan when a sharded module is built; `register_planner_estimates` gives TorchRec's
planner the bandwidth of our kernel, so that it can plan them by itself (each sharder calls it
when it is built), and `planner_parameters` what it sizes each table by (its row dtype
included). `sharding_plan.plan_for` builds such a plan without the planner.
"""
from __future__ import annotations

import torch
from torch import nn
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.types import ShardingType

import cncore
from cncore_torch.distributed.embedding_sharding import sharded_optimizer
from cncore_torch.optim import resolve_optimizer

__all__ = ["KERNEL", "ROW_WISE", "check_plan", "register_planner_estimates", "planner_parameters"]

KERNEL = EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value
ROW_WISE = ShardingType.ROW_WISE.value
_ROW_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def check_plan(module, configs, table_name_to_parameter_sharding, device, fused_params=None) -> None:
    """The plan shards every table row-wise with our kernel, on cpu, and the module has an optimizer
    (optimizer=, apply_optimizer_in_backward or the sharder's fused_params)."""
    if device is not None and torch.device(device).type != "cpu":
        raise ValueError(f"device={device}: the tables' rows are in the core; shard onto device 'cpu' (the "
                         "process group's backend may still be NCCL for dense parts, untested)")
    sharded_optimizer(module, f"sharded {type(module).__name__}", fused_params)  # one is set, or a clear error
    for c in configs:
        ps = table_name_to_parameter_sharding.get(c.name)
        if ps is None:
            raise ValueError(f"table {c.name!r}: the plan has no entry for it (plan_for builds one)")
        if ps.sharding_type != ROW_WISE or ps.compute_kernel != KERNEL:
            raise ValueError(f"table {c.name!r}: planned as {ps.sharding_type}/{ps.compute_kernel}; dynamic "
                             f"tables shard as {ROW_WISE}/{KERNEL} (plan_for builds that plan)")


def register_planner_estimates() -> None:
    """Teach TorchRec's planner (its perf estimator) the bandwidth of our kernel, so that
    `DistributedModelParallel(model, sharders=[CNEmbeddingBagCollectionSharder()])` plans by
    itself. TorchRec knows the bandwidth of its own kernels only and refuses any other
    ("Unrecognized or unsupported compute kernel: customized_kernel for hardware aware perf
    estimators"); its extension point is `HardwarePerfConfig.kernel_device_bandwidths`
    (what the `device_bw(device=, compute_kernel=)` decorator fills). We add
    (cpu, customized_kernel) at the DDR bandwidth of TorchRec's fused CPU kernel (rows in host
    memory, as ours), only where no one set a value: nothing TorchRec or a user set is changed."""
    from torchrec.distributed.planner.constants import DDR_MEM_BW
    from torchrec.distributed.planner.estimator.types import HardwarePerfConfig

    HardwarePerfConfig.kernel_device_bandwidths.setdefault(("cpu", KERNEL), DDR_MEM_BW)


def planner_parameters(module, configs, fused_params: dict | None = None) -> dict[str, nn.Parameter]:
    """What a sharder's `shardable_parameters` gives TorchRec's planner: one (num_embeddings, dim)
    meta parameter per table, in the table's row dtype. The planner sizes a table (its storage and
    its output all-to-all) from its parameter's shape and element size, as it sizes TorchRec's own
    tables, whose parameters have the config's data_type; num_embeddings is a capacity hint and
    nothing is allocated. Each parameter also carries the optimizer's class as
    `apply_optimizer_in_backward` marks TorchRec's (`_optimizer_classes`), so the planner adds
    the optimizer state as it does for TorchRec's fused tables (none for SGD, a row for Adagrad,
    a float a row for row-wise Adagrad, two rows for Adam). Not counted, as TorchRec has no
    place for it: a row's key-index bucket and its access metadata (docs/design/key-index.md).

    Args:
        module (CNEmbeddingBagCollection | CNEmbeddingCollection): the unsharded collection (its
            store configs hold each table's row dtype).
        configs (list[EmbeddingBagConfig] | list[EmbeddingConfig]): its TorchRec table configs.
        fused_params (dict | None): the sharder's, where it sets the optimizer.

    Returns:
        dict[str, nn.Parameter]: a meta parameter per table name.

    >>> import cncore
    >>> from torchrec import EmbeddingBagConfig
    >>> from torchrec.types import DataType
    >>> from cncore_torch import CNEmbeddingBagCollection
    >>> ebc = CNEmbeddingBagCollection([EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=100,
    ...                                                    feature_names=["f"], data_type=DataType.FP16)],
    ...                                device="meta", optimizer=cncore.SGD(lr=0.1))
    >>> p = planner_parameters(ebc, ebc.embedding_bag_configs())["t"]
    >>> tuple(p.shape), p.dtype, p.is_meta, p._optimizer_classes
    ((100, 4), torch.float16, True, [<class 'torch.optim.sgd.SGD'>])
    """
    optimizer = resolve_optimizer(module._optimizer, module._anchor, f"sharded {type(module).__name__}", fused_params,
                                  sharded=True)
    params = {}
    for c in configs:
        p = nn.Parameter(torch.empty(c.num_embeddings, c.embedding_dim, device="meta",
                                     dtype=_ROW_DTYPES[module._store_configs[c.name].dtype]), requires_grad=False)
        if optimizer is not None:  # none: sharding refuses the module by name (check_plan)
            p._optimizer_classes = [_state_class(optimizer)]  # type: ignore[attr-defined]  # TorchRec's mark
        params[c.name] = p
    return params


def _state_class(optimizer) -> type:
    """The torch / TorchRec optimizer class whose state TorchRec's planner sizes as ours: its
    multiplier of the table's bytes (`_get_optimizer_multipler`) is 0 for SGD, 1 for Adagrad (one
    float per value), 1 / dim for TorchRec's RowWiseAdagrad (one float per row), 2 for Adam."""
    import torchrec.optim as trec_optim
    classes = {cncore.SGD: torch.optim.SGD, cncore.Adagrad: torch.optim.Adagrad,
               cncore.RowWiseAdagrad: trec_optim.RowWiseAdagrad, cncore.Adam: torch.optim.Adam}
    return classes[type(optimizer)]

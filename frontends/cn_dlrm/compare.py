"""`cn-dlrm --compare`: TorchRec's own tables trained on the same data as the dynamic tables,
to set their AUC, throughput and memory beside ours: fixed tables with every ID remapped
collision-free beforehand (the quality to match), the same under DistributedModelParallel with
fused FBGEMM tables (TorchRec's production path on CPU), and fixed tables of the dynamic
tables' memory with IDs hashed modulo their size (the usual way to fit unbounded IDs).
"""
from __future__ import annotations

import socket
import warnings

import numpy as np
import torch
from torchrec import EmbeddingBagCollection
from torchrec.optim import RowWiseAdagrad as TorchRecRowWiseAdagrad
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from cn_dlrm.data import SPARSE_KEYS
from cn_dlrm.options import InputError
from cn_dlrm.train import Data, Run, build_dlrm, core_stores, table_configs, used_bytes
from cncore_torch.collection import CNEmbeddingBagCollection

__all__ = ["equal_memory_rows", "fixed_run", "hashed_run", "collision_free_remap", "collision_free_run", "dmp_run"]


def equal_memory_rows(tables: CNEmbeddingBagCollection, dim: int) -> list[int]:
    """Rows of a fixed table (dim floats + one row-wise Adagrad float) in the memory each
    dynamic table uses (`used_bytes`: a fixed table would not need spare capacity either)."""
    return [max(1, used_bytes(store) // ((dim + 1) * 4)) for store in core_stores(tables).values()]


def fixed_run(args, name: str, rows: list[int], remap) -> Run:
    """TorchRec's own EmbeddingBagCollection (fixed tables of `rows`), IDs mapped by `remap`."""
    torch.manual_seed(args.seed)
    ebc = EmbeddingBagCollection(tables=table_configs(args.embedding_dim, rows))
    model = build_dlrm(ebc, args.embedding_dim)
    sparse = [p for n, p in model.named_parameters() if "embedding_bags" in n]
    dense = [p for n, p in model.named_parameters() if "embedding_bags" not in n]
    return Run(name, model, [torch.optim.Adagrad(dense, lr=args.dense_lr),
                             TorchRecRowWiseAdagrad(sparse, lr=args.sparse_lr)], remap=remap, fixed_rows=list(rows),
               dim=args.embedding_dim)


def hashed_run(args, rows: list[int]) -> Run:
    """IDs hashed modulo each table's size: the usual way to fit unbounded IDs in fixed tables."""
    sizes = torch.tensor(rows)

    def hashed(kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        size_per_value = torch.repeat_interleave(sizes, torch.tensor(kjt.length_per_key()))
        return KeyedJaggedTensor(keys=kjt.keys(), values=torch.remainder(kjt.values(), size_per_value),
                                 lengths=kjt.lengths())

    return fixed_run(args, "TorchRec EBC (hashed, same memory)", rows, hashed)


def collision_free_remap(args, data: Data):
    """(table sizes, remap): every ID the synthetic run can meet mapped to 0..N-1 beforehand."""
    gen = data.synthetic
    if gen is None:
        raise InputError("--compare's collision-free tables need the synthetic stream's item counts; "
                         "with --criteo-tsv only the hashed comparison runs")
    n_items = gen.items_by_batch(args.steps + args.eval_batches)
    sorted_ids, order = [], []
    for f, n in enumerate(n_items):
        raw = gen.raw_ids(f, n)
        o = np.argsort(raw)
        sorted_ids.append(raw[o])
        order.append(o)

    def remap(kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        by_key = kjt.to_dict()
        values = [order[f][np.searchsorted(sorted_ids[f], by_key[k].values().numpy())]
                  for f, k in enumerate(kjt.keys())]
        return KeyedJaggedTensor(keys=kjt.keys(), values=torch.from_numpy(np.concatenate(values).astype(np.int64)),
                                 lengths=kjt.lengths())

    return n_items, remap


def collision_free_run(args, data: Data) -> Run:
    """Fixed tables with no collisions: the quality dynamic tables should match."""
    rows, remap = collision_free_remap(args, data)
    return fixed_run(args, "TorchRec EBC (collision-free, remapped)", rows, remap)


def _free_port() -> int:
    """A port no one listens on now (a fixed one collides with other jobs on a shared machine)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dmp_run(args, data: Data) -> Run:
    """TorchRec's production path on CPU: DistributedModelParallel (gloo, world size 1) with
    fused FBGEMM tables and row-wise Adagrad applied in backward; IDs remapped collision-free."""
    import torch.distributed as dist
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
    from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
    from torchrec.distributed.planner.types import KernelConfig, TopologyFactory, TrainerConfig
    from torchrec.distributed.sharding_plan import get_default_sharders
    from torchrec.distributed.types import ShardingType
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    if not dist.is_initialized():
        # a port of its own, not MASTER_PORT in os.environ: child processes would inherit it
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    rows, remap = collision_free_remap(args, data)
    torch.manual_seed(args.seed)
    model = build_dlrm(EmbeddingBagCollection(tables=table_configs(args.embedding_dim, rows),
                                              device=torch.device("meta")), args.embedding_dim)
    apply_optimizer_in_backward(TorchRecRowWiseAdagrad, model.sparse_arch.parameters(), {"lr": args.sparse_lr})
    # Left alone, the planner puts small tables on its data-parallel "dense" kernel (dense
    # gradients); every table on FBGEMM's fused kernel is the production path we compare with.
    fused = {f"t_{key}": ParameterConstraints(sharding_types=[ShardingType.TABLE_WISE.value],
                                              compute_kernels=[EmbeddingComputeKernel.FUSED.value])
             for key in SPARSE_KEYS}
    # The topology factory and a fixed storage reservation: TorchRec warns about the plain
    # Topology(...) and its default heuristic reservation.
    topology = TopologyFactory.create_topology(TrainerConfig(world_size=1),
                                               kernel_config=KernelConfig(compute_device="cpu"))
    planner = EmbeddingShardingPlanner(topology=topology, constraints=fused,
                                       storage_reservation=FixedPercentageStorageReservation(0.15))
    plan = planner.plan(model, get_default_sharders())
    with warnings.catch_warnings():
        # TorchRec's own DistributedDataParallel call passes the deprecated argument: not ours to change.
        warnings.filterwarnings("ignore", message="`broadcast_buffers` is deprecated", category=FutureWarning)
        dmp = DistributedModelParallel(module=model, device=torch.device("cpu"), plan=plan)
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                  lambda ps: torch.optim.Adagrad(ps, lr=args.dense_lr))
    return Run("TorchRec DMP (fused FBGEMM, collision-free)", dmp,
               [CombinedOptimizer([dmp.fused_optimizer, dense])], remap=remap, fixed_rows=list(rows),
               dim=args.embedding_dim)

"""Throughput and communication of the sharded tables, ours beside TorchRec's, in one run.

    python asv_bench/scripts/distributed_bench.py --nproc 1 2 --batch-size 2048 --steps 20

For each process count: TorchRec's DLRM (the `cn-dlrm` model) on the synthetic Criteo-like
stream, trained by N gloo processes under DistributedModelParallel, (a) with our dynamic
tables sharded row-wise by key hash (`CNEmbeddingBagCollectionSharder`, row-wise Adagrad fused
in backward) and (b) with TorchRec's own EmbeddingBagCollection, row-wise sharded fused FBGEMM
tables (the same plan shape, row-wise Adagrad in backward), IDs folded modulo fixed tables of
the cardinality the run reaches (for throughput only: the folding collides). Every rank trains
its share of each global batch (equal shares: TorchRec's row-wise output dist needs equal batch
sizes on gloo). Reported: global samples/s (rank 0's wall time over the timed steps, after
warm-up), and for ours the bytes each rank sends per step, from the exact tensors our dists send
to other ranks (ids and lengths from the batches, pools as the output dist counted the tensors
it sent), against the analytic minimum (a key to its owner once: 8 bytes; a partial pool
only where another rank holds a key of that bag: dim x 4 bytes, and the same again for its
gradient).
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import warnings

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["main"]


def _fold(kjt, rows):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    sizes = torch.repeat_interleave(torch.tensor(rows), torch.tensor(kjt.length_per_key()))
    return KeyedJaggedTensor(keys=kjt.keys(), values=torch.remainder(kjt.values(), sizes), lengths=kjt.lengths(),
                             stride=kjt.stride())


def _bytes(kjt, world_size, rank, pool_bytes, dim):
    """(sent, minimum) bytes of rank `rank` per step for our sharded tables; `pool_bytes`: the
    partial pools and their gradients this rank sent, as its output dist counted them."""
    from cncore_torch.distributed import owner_of
    values = kjt.values()
    owner = owner_of(values, world_size)
    foreign = owner != rank
    n_features, stride = len(kjt.keys()), kjt.stride()
    sent_ids = int(foreign.sum()) * values.element_size()
    sent_lengths = (world_size - 1) * n_features * stride * kjt.lengths().element_size()
    sent_pools = pool_bytes  # forward partial pools + their gradients
    bag = torch.repeat_interleave(torch.arange(n_features * stride), kjt.lengths())
    foreign_bags = torch.unique(bag[foreign]).numel()  # (feature, sample) pairs with a key held elsewhere
    minimum = int(foreign.sum()) * 8 + foreign_bags * dim * 4 * 2
    return sent_ids + sent_lengths + sent_pools, minimum, {"ids": sent_ids, "lengths": sent_lengths,
                                                           "pools": sent_pools}


def _worker(rank, world_size, args, out_path):
    from torchrec import EmbeddingBagCollection
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingPlan
    from torchrec.optim import RowWiseAdagrad as TorchRecRowWiseAdagrad
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    import cncore
    from cn_dlrm.data import SyntheticCriteo
    from cn_dlrm.distributed import share
    from cn_dlrm.train import build_dlrm, table_configs
    from cncore_torch.collection import CNEmbeddingBagCollection
    from cncore_torch.distributed import CNEmbeddingBagCollectionSharder, plan_for
    from cncore_torch.distributed.rw_sharding import CNRwPooledEmbeddingDist

    torch.set_num_threads(args.threads)
    cncore.set_num_threads(args.threads)
    gen = SyntheticCriteo(seed=0, batch_size=args.batch_size)
    rows = gen.items_by_batch(args.steps + args.warmup)
    batches = [share(gen.batch(i), rank, world_size) for i in range(args.steps + args.warmup)]
    warnings.filterwarnings("ignore")
    results = {}
    for name in ("cncore (hash row-wise, dynamic)", "cncore, pack_pools=True", "TorchRec (row-wise, fused FBGEMM)"):
        torch.manual_seed(0)
        if name.startswith("cncore"):
            ebc = CNEmbeddingBagCollection(table_configs(args.dim, rows), device="meta", seed=0,
                                           optimizer=cncore.RowWiseAdagrad(lr=0.05))
            model = build_dlrm(ebc, args.dim)
            dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan_for(model, world_size),
                                           sharders=[CNEmbeddingBagCollectionSharder(pack_pools="pack" in name)])
            features = lambda kjt: kjt  # noqa: E731
        else:
            ebc = EmbeddingBagCollection(table_configs(args.dim, rows), device=torch.device("meta"))
            model = build_dlrm(ebc, args.dim)
            apply_optimizer_in_backward(TorchRecRowWiseAdagrad, model.sparse_arch.parameters(), {"lr": 0.05})
            sharder = EmbeddingBagCollectionSharder()
            plan = ShardingPlan({"sparse_arch.embedding_bag_collection": construct_module_sharding_plan(
                ebc, {c.name: row_wise(compute_kernel="fused") for c in ebc.embedding_bag_configs()}, sharder=sharder,
                local_size=world_size, world_size=world_size, device_type="cpu")})
            dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder])
            features = lambda kjt: _fold(kjt, rows)  # noqa: E731
        dense = [p for n, p in dmp.named_parameters() if "_anchor" not in n and "embedding_bags" not in n]
        opt = torch.optim.Adagrad(dense, lr=0.01)
        output_dists = [m for m in dmp.modules() if isinstance(m, CNRwPooledEmbeddingDist)]
        for i, b in enumerate(batches):
            if i == args.warmup:
                dist.barrier()
                t0 = time.perf_counter()
                pool_bytes_before = sum(d.bytes_sent for d in output_dists)
            logits = dmp(b.dense, features(b.sparse)).squeeze(1)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, b.labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
        dist.barrier()
        elapsed = time.perf_counter() - t0
        results[name] = {"samples_per_s": args.steps * args.batch_size / elapsed}
        if name.startswith("cncore"):
            pool_bytes = (sum(d.bytes_sent for d in output_dists) - pool_bytes_before) / args.steps
            sent, minimum, parts = zip(*(_bytes(b.sparse, world_size, rank, pool_bytes, args.dim)
                                         for b in batches[args.warmup:]))
            gathered = [None] * world_size
            dist.all_gather_object(gathered, (float(np.mean(sent)), float(np.mean(minimum)),
                                              {k: float(np.mean([p[k] for p in parts])) for k in parts[0]}))
            results[name]["bytes_per_rank_per_step"] = gathered
    if rank == 0:
        with open(out_path, "w") as fh:
            json.dump(results, fh)


def main(argv=None) -> int:
    from cncore_torch.distributed.launch import spawn

    ap = argparse.ArgumentParser(prog="distributed_bench.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--batch-size", type=int, default=2048, help="global batch")
    ap.add_argument("--steps", type=int, default=20, help="timed steps")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1, help="threads per process")
    args = ap.parse_args(argv)
    print("| processes | run | samples/s | bytes sent per rank per step (ids + lengths + pools) | analytic minimum |")
    print("|---|---|---|---|---|")
    for n in args.nproc:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "out.json")
            spawn(_worker, n, args, path, timeout=600)
            with open(path) as fh:
                res = json.load(fh)
        for name, r in res.items():
            traffic = r.get("bytes_per_rank_per_step")
            if traffic is not None:
                sent = " / ".join(f"{s:,.0f} ({p['ids']:,.0f} + {p['lengths']:,.0f} + {p['pools']:,.0f})"
                                  for s, _, p in traffic)
                low = " / ".join(f"{m:,.0f}" for _, m, _ in traffic)
            else:
                sent = low = "-"
            print(f"| {n} | {name} | {r['samples_per_s']:,.0f} | {sent} | {low} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""One-run comparison of the PyTorch module layer: CNEmbeddingBag against the core call it wraps
and against torch.nn.EmbeddingBag (+ sparse SGD), on the same rows.

    python asv_bench/scripts/compare_torch_modules.py [--quick]

Prints M IDs/s and two ratios: module / core (the cost of the torch layer; target: under 10%
overhead at batch 4096, pooling 20) and module / nn.EmbeddingBag.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch

import cncore
from cncore_torch import CNEmbeddingBag

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare_reference import make_ids, timed_round_robin  # the same timing rules


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(2)
    cncore.set_num_threads(2)
    n_rows = 20_000 if args.quick else 1_000_000
    batch = 256 if args.quick else 4096
    poolings = [20] if args.quick else [1, 20]
    reps = 3 if args.quick else args.reps
    rng = np.random.default_rng(0)
    print(f"# CNEmbeddingBag vs its core call and nn.EmbeddingBag, 2 threads, {n_rows:,} rows, batch {batch}\n")
    print("| dim | pooling | IDs | optimizer | fwd: core | fwd: module | module/core | fwd: EB | module/EB "
          "| step: core | step: module | module/core | step: EB+sparse SGD | module/EB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for dim in ([64] if args.quick else [64, 128]):
        weights = torch.from_numpy(rng.uniform(-0.05, 0.05, (n_rows, dim)).astype(np.float32))
        for opt_name, opt in [("sgd", cncore.SGD(lr=0.01)), ("rowwise", cncore.RowWiseAdagrad(lr=0.01))]:
            module = CNEmbeddingBag(n_rows, dim, mode="sum", include_last_offset=True, optimizer=opt)
            module.insert(torch.arange(n_rows), weights)
            core = cncore.EmbeddingStore(module.store.config)
            core.insert_or_assign(np.arange(n_rows), weights.numpy())
            eb = torch.nn.EmbeddingBag(n_rows, dim, mode="sum", sparse=True, include_last_offset=True)
            with torch.no_grad():
                eb.weight.copy_(weights)
            eb_opt = torch.optim.SGD(eb.parameters(), lr=0.01)
            for pooling, dist in [(p, d) for p in poolings for d in ("uniform", "zipf")]:
                ids = torch.from_numpy(make_ids(dist, batch * pooling, n_rows, rng).astype(np.int64))
                offsets = torch.arange(0, batch * pooling + 1, pooling)
                ids_np, off_np = ids.numpy(), offsets.numpy()
                grad = torch.randn(batch, dim) * 1e-3
                grad_np = grad.numpy()
                out_np = np.empty((batch, dim), np.float32)

                def core_fwd():
                    core.pooled_lookup(ids_np, off_np, out=out_np)

                def module_fwd():
                    with torch.no_grad():
                        module(ids, offsets)

                def core_step():
                    _, ctx = core.pooled_lookup(ids_np, off_np, out=out_np)
                    core.apply_gradients(ctx, grad_np)

                def module_step():
                    module(ids, offsets).backward(grad)

                def eb_fwd():
                    with torch.no_grad():
                        eb(ids, offsets)

                def eb_step():
                    eb_opt.zero_grad()
                    eb(ids, offsets).backward(grad)
                    eb_opt.step()

                fns = {"core_fwd": core_fwd, "module_fwd": module_fwd, "eb_fwd": eb_fwd, "core_step": core_step,
                       "module_step": module_step, "eb_step": eb_step}
                if opt_name != "sgd":  # forward and the EmbeddingBag step do not depend on our optimizer
                    fns = {k: v for k, v in fns.items() if k not in ("eb_fwd", "eb_step")}
                t = timed_round_robin(fns, reps)
                m = {k: batch * pooling / v / 1e6 for k, v in t.items()}
                eb_cols = (f"{m['eb_fwd']:.1f} | **{m['module_fwd'] / m['eb_fwd']:.2f}x**" if "eb_fwd" in m
                           else "- | -")
                eb_step = (f"{m['eb_step']:.1f} | **{m['module_step'] / m['eb_step']:.2f}x**" if "eb_step" in m
                           else "- | -")
                print(f"| {dim} | {pooling} | {dist} | {opt_name} | {m['core_fwd']:.1f} | {m['module_fwd']:.1f} | "
                      f"**{t['module_fwd'] / t['core_fwd']:.2f}x time** | {eb_cols} | {m['core_step']:.1f} | "
                      f"{m['module_step']:.1f} | **{t['module_step'] / t['core_step']:.2f}x time** | {eb_step} |")
    print("\nM IDs/s, medians of interleaved rounds, caches flushed before each call. module/core is a ratio of "
          "times (1.05x = 5% overhead); module/EB a ratio of throughputs.")


if __name__ == "__main__":
    main()

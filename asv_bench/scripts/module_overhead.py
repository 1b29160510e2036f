"""The cost of the PyTorch layer over the core call it wraps, per call, on a shared machine.

    python asv_bench/scripts/module_overhead.py [--batch 4096] [--pooling 1] [--calls 300] [--distinct N]

`CNEmbeddingBag` (mode sum, SGD fused) against `EmbeddingStore.pooled_lookup` (+
`apply_gradients` for the training step) on the same table, one thread each, warm rows (this
measures the layer, not the memory system: compare_torch_modules.py and forward_large.py do
that). Each number is the 10th percentile of `--calls` timed calls, the module's and the core's
interleaved in an order that reverses every call (the first call to touch the rows after the
other kind pays their cache misses: a fixed order put up to 0.7 ms on one side at pooling 20):
on a machine where other processes take the cores, medians move by 2x between runs and a low
percentile does not. Prints the two ratios (module time / core time), and the module's step
against the core's step followed by an empty `torch.autograd.Function`'s forward and backward
(the least any module that trains through autograd pays: `Function.apply`,
`torch.autograd.backward`'s Python and the engine), which splits the step's ratio into torch's
share and our layer's.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

import cncore
from cncore_torch import CNEmbeddingBag


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--pooling", type=int, default=1)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--distinct", type=int, default=10**5,
                    help="IDs drawn from this many (4096: every row in cache, the layer's cost alone)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cncore.set_num_threads(1)
    # glibc maps each block over its mmap threshold afresh (a page fault per 4 KiB on first
    # touch) and raises the threshold to the size of a mapped block that is freed: whether a 1 MiB
    # output or a keys copy costs those faults depended on what the process had freed before
    # (at pooling 20 the core's eval call measured 1.0 ms or 2.6 ms, the same code, after a
    # different first training step). One 16 MiB block freed here puts both sides in the same
    # state, no faults: this measures the layer, not the allocator.
    np.empty(16 << 20, dtype=np.uint8)
    bag = CNEmbeddingBag(10**6, args.dim, mode="sum", optimizer=cncore.SGD(lr=0.01))
    rng = np.random.default_rng(0)
    ids = torch.from_numpy(rng.integers(0, args.distinct, (args.batch, args.pooling)))
    keys, lengths = ids.reshape(-1).numpy(), np.full(args.batch, args.pooling, np.int64)
    grad = torch.full((args.batch, args.dim), 1e-3)
    grad_np = grad.numpy()
    store = bag.store

    def module_eval():  # eval mode: no insertion, as the core call's insert_missing=False
        with torch.no_grad():
            bag(ids)

    def core_eval():
        store.pooled_lookup(keys, lengths=lengths, insert_missing=False)

    def module_step():
        bag(ids).backward(grad)

    def core_step():
        _, ctx = store.pooled_lookup(keys, lengths=lengths)
        store.apply_gradients(ctx, grad_np)

    class Empty(torch.autograd.Function):
        """A node that does nothing, its output the shape of the module's: what autograd costs
        any module per step (Function.apply, torch.autograd.backward's Python, the engine), run
        right after the core's step so that it meets the caches as a real step leaves them."""

        @staticmethod
        def forward(ctx, anchor):
            return torch.from_numpy(np.empty((args.batch, args.dim), np.float32))

        @staticmethod
        def backward(ctx, g):
            return None

    anchor = torch.nn.Parameter(torch.empty(0))

    def floor_step():  # the core's step plus autograd's own cost: no autograd module can be faster
        core_step()
        Empty.apply(anchor).backward(grad)

    # Each comparison is its own pair, core and module interleaved in an order that reverses
    # every call (A B B A A B ...): each side follows itself and the other alike, so neither
    # finds the rows or its own Python warmer. (All four kinds in one reversing order let the
    # module's step follow itself half the time and the core's step never: 0.07x in the
    # module's favour.) The module's mode is set once per pair, as a training loop sets it once
    # per phase (the core takes it per call, insert_missing); bag.train() before every timed
    # step added 8 us, a cost of the harness, not of the layer.
    pairs = {"eval": (bag.eval, ("core eval", core_eval), ("module eval", module_eval)),
             "step": (bag.train, ("core step", core_step), ("module step", module_step)),
             "floor": (bag.train, ("floor step", floor_step), ("module step 2", module_step))}
    times: dict[str, list[float]] = {}
    bag.train()
    module_step()  # every row the calls read is in the table before anything is timed (warm rows)
    for set_mode, *pair in pairs.values():
        set_mode()
        for _ in range(10):
            for _, fn in pair:
                fn()
        for name, _ in pair:
            times[name] = []
        for call in range(args.calls):
            for name, fn in (pair if call % 2 else pair[::-1]):
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    us = {name: float(np.percentile(t, 10)) * 1e6 for name, t in times.items()}
    print(f"# batch {args.batch}, pooling {args.pooling}, dim {args.dim}, IDs from {args.distinct:,}, 1 thread, "
          f"p10 of {args.calls} calls, "
          f"load average {os.getloadavg()[0]:.1f}\n")
    print("| call | module us | core us | module / core |")
    print("|---|---|---|---|")
    for kind in ("eval", "step"):
        m, c = us[f"module {kind}"], us[f"core {kind}"]
        print(f"| {'forward (no_grad)' if kind == 'eval' else 'training step (forward + fused backward)'} | "
              f"{m:.0f} | {c:.0f} | **{m / c:.2f}x** |")
    m, c = us["module step 2"], us["floor step"]
    print(f"| training step, against the core's step + an empty autograd.Function | {m:.0f} | {c:.0f} | "
          f"**{m / c:.2f}x** |")
    print(f"\n(autograd's own cost, an empty Function's forward and backward after the core's step: "
          f"{us['floor step'] / us['core step']:.2f}x the core's step; the last row is our layer's own cost)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

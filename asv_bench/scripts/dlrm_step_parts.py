"""Where one training step of `cn-dlrm` goes, ours against TorchRec DMP's fused FBGEMM tables.

    python asv_bench/scripts/dlrm_step_parts.py                  # 400 steps each, both cores
    python asv_bench/scripts/dlrm_step_parts.py --one-thread     # torch and the core on one thread, thread CPU time

The job's default model and data (`cn-dlrm --compare`'s first and third runs), both runs in this
one process on the same pre-generated batches, stepped in blocks of 20 steps in turn so that the
machine's drifting load hits both alike. Each step does what `Run.step` does, with clocks read
at module hooks of the DLRM (sparse arch, dense arch, interaction) and around the loss, the
backward and the optimizers. Prints ms a step per part, after `--warm` steps. With
`--one-thread` the clock is the thread's CPU time (`time.thread_time`), which leaves out time
the thread waits for a core; otherwise wall time. The parts that both runs share (dense arch,
interaction and over arch, dense backward, dense optimizer) bound the ratio a free embedding
step could reach (docs/dlrm-job.md).
"""
from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch

import cncore
from cn_dlrm import compare, train
from cn_dlrm.options import parse_args

PARTS = ["remap", "fwd: dense arch", "fwd: sparse arch", "fwd: interaction + over arch", "fwd: other",
         "loss + zero_grad", "bwd: dense, to the embeddings' gradient", "bwd: embeddings (+ fused update)",
         "dense optimizer step", "step"]


class PartClock:
    """The clocks one run's module hooks read during a step, and the sums over the timed steps."""

    def __init__(self, run: train.Run, clock: Callable[[], float]):
        self.clock = clock
        self.sums: dict[str, float] = dict.fromkeys(PARTS, 0.0)
        self.at: dict[str, float] = {}
        model = run.model.module if hasattr(run.model, "module") else run.model
        model.sparse_arch.register_forward_pre_hook(lambda mod, inp: self.mark("sparse0"))
        model.sparse_arch.register_forward_hook(self._sparse_done)
        model.inter_arch.register_forward_pre_hook(lambda mod, inp: self.mark("inter0"))
        model.dense_arch.register_forward_pre_hook(lambda mod, inp: self.mark("dense0"))
        model.dense_arch.register_forward_hook(lambda mod, inp, out: self.mark("dense1"))

    def mark(self, name: str) -> None:
        self.at[name] = self.clock()

    def _sparse_done(self, mod, inp, out) -> None:
        self.mark("sparse1")
        if out.requires_grad:  # the embeddings' gradient arrives: the dense backward ends here
            out.register_hook(lambda grad: self.mark("sparse_grad"))

    def step(self, run: train.Run, batch) -> None:
        t0 = self.clock()
        if not run.model.training:
            run.model.train()
        feats = run.features(batch.sparse)
        t1 = self.clock()
        logits = run.model(batch.dense, feats).squeeze(1)
        t2 = self.clock()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        for opt in run.optimizers:
            opt.zero_grad()
        t3 = self.clock()
        loss.backward()
        t4 = self.clock()
        for opt in run.optimizers:
            opt.step()
        loss.item()
        t5 = self.clock()
        a, s = self.at, self.sums
        dense, sparse, inter = a["dense1"] - a["dense0"], a["sparse1"] - a["sparse0"], t2 - a["inter0"]
        values = {"remap": t1 - t0, "fwd: dense arch": dense, "fwd: sparse arch": sparse,
                  "fwd: interaction + over arch": inter, "fwd: other": (t2 - t1) - dense - sparse - inter,
                  "loss + zero_grad": t3 - t2, "bwd: dense, to the embeddings' gradient": a["sparse_grad"] - t3,
                  "bwd: embeddings (+ fused update)": t4 - a["sparse_grad"], "dense optimizer step": t5 - t4,
                  "step": t5 - t0}
        for name, value in values.items():
            s[name] += value

    def reset(self) -> None:
        self.sums = dict.fromkeys(PARTS, 0.0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=400, help="steps each run takes (default 400)")
    ap.add_argument("--warm", type=int, default=40, help="steps not counted (default 40)")
    ap.add_argument("--block", type=int, default=20, help="steps a run takes before the other's turn")
    ap.add_argument("--one-thread", action="store_true", help="torch and the core on one thread, thread CPU time")
    args = ap.parse_args(argv)
    if args.warm >= args.steps:
        ap.error(f"--warm ({args.warm}) must be below --steps ({args.steps})")
    job = parse_args(["--steps", str(max(args.steps, 1))])
    train._mute_is_fx_tracing_notice()
    torch.manual_seed(job.seed)
    data = train.Data(job)
    runs = {"ours": train.dynamic_run(job, data), "TorchRec DMP": compare.dmp_run(job, data)}
    clock: Callable[[], float] = time.perf_counter
    if args.one_thread:
        torch.set_num_threads(1)
        cncore.set_num_threads(1)
        clock = time.thread_time
    parts = {name: PartClock(run, clock) for name, run in runs.items()}
    if data.synthetic is None:
        raise SystemExit("dlrm_step_parts.py runs the job's synthetic data only")
    synthetic = data.synthetic
    batches = [synthetic.batch(i) for i in range(args.steps)]
    load0 = os.getloadavg()
    for start in range(0, args.steps, args.block):
        for name, run in runs.items():
            for i in range(start, min(args.steps, start + args.block)):
                if i == args.warm:
                    parts[name].reset()
                parts[name].step(run, batches[i])
    load1 = os.getloadavg()
    n = args.steps - args.warm
    print(f"# {n} steps each after {args.warm}, batch {job.batch_size}, "
          f"{'one thread, thread CPU time' if args.one_thread else 'default threads, wall time'}; "
          f"load average {load0[0]:.2f} -> {load1[0]:.2f}")
    print("| part (ms a step) | " + " | ".join(runs) + " |")
    print("|---|" + "---|" * len(runs))
    for part in PARTS:
        print(f"| {part} | " + " | ".join(f"{parts[r].sums[part] / n * 1e3:.2f}" for r in runs) + " |")
    rates = {r: job.batch_size * n / parts[r].sums["step"] for r in runs}
    print("| samples/s (steps only) | " + " | ".join(f"{rates[r]:,.0f}" for r in runs) + " |")
    print(f"ours / DMP: {rates['ours'] / rates['TorchRec DMP']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

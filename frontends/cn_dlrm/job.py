"""The `cn-dlrm` job for parsed options: on one process (here, with `train.py`'s parts and
`compare.py`'s runs) or on several (`distributed.py`: `--nproc N`, or each process of a
torchrun group one rank).

>>> from cn_dlrm.options import parse_args
>>> run(parse_args(["--steps", "1", "--resume", __file__]))
2
"""
from __future__ import annotations

import sys
import time

import torch

import cncore
from cn_dlrm import compare, distributed, train
from cn_dlrm.options import InputError

__all__ = ["run"]


def run(args) -> int:
    """Run the job for parsed options (`cn_dlrm.options.parse_args`); bad input data: one line on
    stderr, and 2."""
    try:
        if getattr(args, "nproc", 1) > 1 or distributed.launched_by_torchrun():
            return distributed.run(args)
        return one_process(args)
    except InputError as e:
        print(f"cn-dlrm: error: {e}", file=sys.stderr)
        return 2


def one_process(args) -> int:
    """The job on this process: train the dynamic tables (resumed from --resume, prefilled with
    --prefill), with --compare TorchRec's tables after them, then report; returns 0.
    `InputError` when the input data or the checkpoint does not do."""
    train._mute_is_fx_tracing_notice()
    if args.threads:
        torch.set_num_threads(args.threads)
        cncore.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    state = train.load_checkpoint(args.resume, args) if args.resume else None
    data = train.Data(args)
    ours = train.dynamic_run(args, data)
    if getattr(args, "prefill", False):
        if data.synthetic is None:
            raise InputError("--prefill fills the tables with the synthetic stream's items; not with --criteo-tsv")
        began = time.perf_counter()
        rows = train.prefill_tables(ours.tables, data.synthetic, args.steps + args.eval_batches)
        print(f"prefilled {rows:,} rows in {time.perf_counter() - began:.1f} s")
    start = 0
    if state is not None:
        start = train.restore(ours, state, args)
        print(f"resumed from {args.resume} at step {start}")
    results = [train.train(ours, data, args, start)]
    if args.compare:
        if data.synthetic is not None:
            results.append(train.train(compare.collision_free_run(args, data), data, args))
            results.append(train.train(compare.dmp_run(args, data), data, args))
        same_memory = compare.equal_memory_rows(ours.tables, args.embedding_dim)
        results.append(train.train(compare.hashed_run(args, same_memory), data, args))
    train.report(results, train.best_attainable(data), args)
    return 0

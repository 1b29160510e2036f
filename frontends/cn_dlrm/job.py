"""The `cn-dlrm` job for parsed options: on one process (`train.py`) or on several
(`distributed.py`: `--nproc N`, or each process of a torchrun group one rank).

>>> from cn_dlrm.options import parse_args
>>> run(parse_args(["--steps", "1", "--resume", __file__]))
2
"""
from __future__ import annotations

import sys

from cn_dlrm import distributed, train
from cn_dlrm.options import InputError

__all__ = ["run"]


def run(args) -> int:
    """Run the job for parsed options (`cn_dlrm.options.parse_args`); bad input data: one line on
    stderr, and 2."""
    try:
        if getattr(args, "nproc", 1) > 1 or distributed.launched_by_torchrun():
            return distributed.run(args)
        return train.run(args)
    except InputError as e:
        print(f"cn-dlrm: error: {e}", file=sys.stderr)
        return 2

"""`cn-dlrm`, the command: parse and check the options (`options.py`, no torch), then load the job
(`job.py`, which imports torch and TorchRec) and run it. A missing PyTorch or TorchRec is named
with its install line instead of a traceback.
"""
from __future__ import annotations

import sys

from cn_dlrm.options import build_parser, parse_args

__all__ = ["main", "build_parser", "parse_args", "install_hint", "TORCH_INSTALL", "TORCHREC_INSTALL"]

# What to run when a dependency is missing (the README's "Install" section says the same).
TORCH_INSTALL = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
TORCHREC_INSTALL = ("pip install fbgemm-gpu-cpu==1.8.0 && pip install --no-deps torchrec==1.8.0 && "
                    "pip install tensordict torchmetrics==1.0.3 tqdm pyre-extensions")
# TorchRec's own imports: a missing one means TorchRec is not (fully) installed.
TORCHREC_MODULES = {"torchrec", "fbgemm_gpu", "tensordict", "torchmetrics", "pyre_extensions"}


def install_hint(missing_module: str | None) -> str | None:
    """What to install when `missing_module` cannot be imported (None: not one of the job's).

    >>> install_hint("torchrec").startswith("TorchRec is not installed")
    True
    >>> install_hint("yaml") is None
    True
    """
    top = (missing_module or "").split(".")[0]
    if top == "torch":
        return (f"PyTorch is not installed; cn-dlrm needs it and TorchRec (CPU builds): {TORCH_INSTALL} && "
                f"{TORCHREC_INSTALL}")
    if top in TORCHREC_MODULES:
        what = "TorchRec is" if top == "torchrec" else f"TorchRec's dependency {top!r} is"
        return f"{what} not installed; install TorchRec with: {TORCHREC_INSTALL}"
    return None


def main(argv: list[str] | None = None) -> int:
    """`cn-dlrm`: parse and check the options, then import torch and TorchRec and run the job.
    A bad option exits with code 2 before torch loads:

    >>> main(["--steps", "0"])
    Traceback (most recent call last):
    ...
    SystemExit: 2
    """
    args = parse_args(argv)
    try:
        # cncore_torch first: before torch loads libgomp, it bounds the spin of torch's idle
        # OpenMP threads (cncore_torch._openmp_env), which job.py (importing torch first) missed.
        # Unbounded, they spun for ~8 ms after every torch op, on the cores the tables' own
        # threads work on next: on 2 cores beside niced jobs, --compare ran ours at 19.4 k and
        # TorchRec DMP at 7.7 k samples/s, and at 98 k and 75 k with the bound.
        import cncore_torch  # noqa: F401
        from cn_dlrm import job  # (here, not at the top: torch loads only once the options are good)
    except ModuleNotFoundError as e:
        hint = install_hint(e.name)
        if hint is None:
            raise
        print(f"cn-dlrm: error: {hint}", file=sys.stderr)
        return 2
    return job.run(args)


if __name__ == "__main__":
    raise SystemExit(main())

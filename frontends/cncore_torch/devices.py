"""Where a table's rows live.

- ``"cpu"`` (the default): rows in the core, lookups and fused updates in C.
- ``"meta"``: no storage at all (shape inference, TorchRec's lazy initialisation);
  ``module.to_empty(device="cpu")`` materialises an empty table.
- ``"cncard"``: the accelerator. It resolves to ``mlu`` (torch_mlu) when present, else ``cuda``;
  the key index stays in the core on the host, rows and optimizer state are device tensors,
  and gathering, pooling and updates run as PyTorch ops on the slots the core returns.
  With no accelerator it fails, saying so; ``CNCORE_CNCARD=cpu`` maps it onto the CPU, so
  that this code path runs (and is tested) on machines without one. ``CNCORE_DEVICE_INDEX=device``
  keeps the key index on the device too (``cncore_torch.device_index``; `device_rows.DeviceRows`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

__all__ = ["Placement", "resolve_device"]


@dataclass(frozen=True)
class Placement:
    kind: str             # "core", "device" or "meta"
    device: torch.device  # where the module's tensors (and, for "device", the rows) live


def _accelerator(index: int) -> torch.device:
    try:  # Cambricon MLU, through its PyTorch extension
        import torch_mlu  # noqa: F401
        if torch.mlu.is_available():  # type: ignore[attr-defined]  # torch_mlu adds it
            return torch.device("mlu", index)
    except ImportError:
        pass
    if torch.cuda.is_available():
        return torch.device("cuda", index)
    raise RuntimeError("device 'cncard' needs an accelerator, and none was found (no torch_mlu device, no CUDA "
                       "device); set CNCORE_CNCARD=cpu to run the accelerator code path on the CPU")


def resolve_device(device) -> Placement:
    """The placement for a `device=` argument (None, str or torch.device)."""
    if device is None:
        return Placement("core", torch.device("cpu"))
    if isinstance(device, str) and device.split(":")[0] == "cncard":
        index = int(device.split(":")[1]) if ":" in device else 0
        if os.environ.get("CNCORE_CNCARD") == "cpu":
            return Placement("device", torch.device("cpu"))
        return Placement("device", _accelerator(index))
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must be 'cpu', 'meta', 'cncard' or a torch device, got {device!r}") from exc
    if dev.type == "cpu":
        return Placement("core", dev)
    if dev.type == "meta":
        return Placement("meta", dev)
    return Placement("device", dev)

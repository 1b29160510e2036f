"""Count the host syncs a piece of torch code would make on an accelerator, on any device.

A host sync is a point where the host waits for the device: a value read back (`item`, `int`,
`bool`, `tolist`, `.cpu()`, `.numpy()`), an operator whose output size depends on the data
(`nonzero`, `unique`, `masked_select`, indexing with a bool mask, `repeat_interleave` without
`output_size`), or a copy between the host and the device. On the CPU none of these waits, so
`HostSyncs` records them where they are asked for:

- a `TorchDispatchMode` sees every aten operator (and its arguments) below the Python API:
  `_local_scalar_dense` (what `item`, `int`, `bool`, `float` and `__index__` call), the
  data-dependent-size operators, and copies whose source and destination devices differ (on an
  accelerator; on the CPU device they cannot happen);
- `Tensor.cpu`, `.numpy` and `.tolist` never reach the dispatcher for a CPU tensor, so they
  are wrapped at the Python level while the mode is on.

Each record names the operator and the innermost frame of the library (`frontends/`) that
asked for it, e.g. `"_local_scalar_dense in find_or_insert"`; calls from elsewhere (the test's
own checks, torch's internals below no library frame) are left out. What the mode cannot see:
syncs inside one operator's kernel (CUDA's `embedding_bag` dense backward reads its segment
count), which is why the device path computes sum and mean gradients itself.
"""
from __future__ import annotations

import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# Operators whose output size depends on the values of their input: the host must read it.
_DATA_DEPENDENT = {
    aten.nonzero.default, aten.masked_select.default, aten._unique.default, aten._unique2.default,
    aten.unique_dim.default, aten.unique_consecutive.default, aten.nonzero_numpy.default,
    aten.is_nonzero.default, aten.equal.default, aten._local_scalar_dense.default,
}
_REPEAT = {aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor}
_INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
_COPIES = {aten._to_copy.default, aten.copy_.default}
_PYTHON_READS = ("cpu", "numpy", "tolist")

_LIBRARY = os.sep + "frontends" + os.sep


def library_caller(depth: int = 2) -> str | None:
    """The innermost function of the library (`frontends/`) on the Python stack, or None."""
    frame = sys._getframe(depth)
    while frame is not None:
        if _LIBRARY in frame.f_code.co_filename:
            return frame.f_code.co_name
        frame = frame.f_back
    return None


def _has_bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in (indices or ()))


def _crosses_devices(func, args, kwargs) -> bool:
    if func is aten.copy_.default:
        dst, src = args[0], args[1]
        return isinstance(src, torch.Tensor) and src.device != dst.device
    src = args[0]
    device = kwargs.get("device")
    return device is not None and torch.device(device) != src.device


class HostSyncs(TorchDispatchMode):
    """Records the host syncs the library makes while it is on (see the module docstring).

    `records`: a list of "operator in function" strings, in call order.

    >>> with HostSyncs() as syncs:
    ...     n = int(torch.tensor([1, 2]).sum())
    >>> syncs.records  # (a call from outside the library is not recorded)
    []
    """

    def __init__(self):
        super().__init__()
        self.records: list[str] = []
        self._originals: dict[str, object] = {}

    def _note(self, what: str) -> None:
        caller = library_caller(3)
        if caller is not None:
            self.records.append(f"{what} in {caller}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _DATA_DEPENDENT:
            self._note(func.__name__.split(".")[0])
        elif func in _REPEAT and kwargs.get("output_size") is None:
            self._note("repeat_interleave")
        elif func in _INDEXING and _has_bool_index(args):
            self._note(func.__name__.split(".")[0] + "[bool]")
        elif func in _COPIES and _crosses_devices(func, args, kwargs):
            self._note(func.__name__.split(".")[0])
        return func(*args, **kwargs)

    def __enter__(self):
        for name in _PYTHON_READS:
            original = getattr(torch.Tensor, name)
            self._originals[name] = original

            def read(tensor, *a, _name=name, _original=original, **k):
                self._note(_name)
                return _original(tensor, *a, **k)
            setattr(torch.Tensor, name, read)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, original)
        self._originals.clear()
        return super().__exit__(*exc)

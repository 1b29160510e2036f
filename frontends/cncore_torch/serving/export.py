"""`export_program`: a frozen model as one `torch.export` program (a `.pt2` file), its rows
inside, with the batch and the number of IDs free to vary.

A `.pt2` is a snapshot of the rows at export time: `apply_delta` updates the eager frozen
model, and a fresh file is exported from it (`python -m cncore_torch.serving export`).
"""
from __future__ import annotations

import os

import torch
from torch import nn
from torch.export import Dim, ExportedProgram

__all__ = ["export_program", "dynamic_shapes_of"]


def _dims(t) -> dict | None:
    return None if t is None else dict.fromkeys(range(t.dim()), Dim.AUTO)


def dynamic_shapes_of(args: tuple) -> tuple:
    """`torch.export`'s dynamic_shapes for `args`: every dimension of every tensor free
    (`Dim.AUTO`: export keeps those the model fixes, such as a Linear's input width), and a
    KeyedJaggedTensor's values, weights, lengths and offsets free in length (TorchRec
    flattens a KJT into those six fields; its keys stay fixed)."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    out: list = []
    for arg in args:
        if isinstance(arg, KeyedJaggedTensor):
            out.append([_dims(arg.values()), _dims(arg.weights_or_none()), _dims(arg.lengths()),
                        _dims(arg.offsets_or_none()), None, None])
        elif isinstance(arg, torch.Tensor):
            out.append(_dims(arg))
        else:
            out.append(None)
    return tuple(out)


def export_program(model: nn.Module, args: tuple, path: str | os.PathLike | None = None) -> ExportedProgram:
    """`torch.export.export(model, args)` with every batch size and bag length left free
    (`dynamic_shapes_of`), saved to `path` (a `.pt2` file) when given. The file loads with
    `torch.export.load(path).module()` in a process that imports torch and torchrec only.

    Use example inputs with at least two bags and two IDs per feature: export fixes a
    dimension of size 0 or 1 to that size.

    Args:
        model (nn.Module): a frozen model (`cncore_torch.serving.freeze`).
        args (tuple): example positional inputs (tensors, KeyedJaggedTensors).
        path: where to save the program (None: not saved).

    Returns:
        ExportedProgram: the program, whose `.module()` runs it.
    """
    if not isinstance(args, tuple):
        raise TypeError(f"args must be a tuple of the model's positional inputs, got {type(args).__name__}")
    from cncore_torch.serving.table import TableSlots
    for module in model.modules():   # the ID arrays a delta left pending go into the program merged
        if isinstance(module, TableSlots):
            module.merge()
    program = torch.export.export(model, args, dynamic_shapes=dynamic_shapes_of(args), strict=False)
    if path is not None:
        # The example inputs (KJTs among them) would make torch.export.load fall back to an
        # unrestricted unpickler; the program does not need them.
        program.example_inputs = None
        torch.export.save(program, os.fspath(path))
    return program

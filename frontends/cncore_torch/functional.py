"""The functional forms of this front end's lookups: what the modules call, and users may too.

As `torch.nn.functional.embedding_bag` / `embedding` are to `nn.EmbeddingBag` / `nn.Embedding`:
`embedding_bag_lookup` and `embedding_lookup` take a module's anchor parameter and handle (the
tables are state the functions reach through `cncore_torch.bridge`) and `torch.nn`'s input
conventions, and return the pooled (or per-ID) rows; each is one node under `torch.fx`
(`torch.fx.wrap`), and under `torch.compile` one `cncore::lookup` operator (`cncore_torch.ops`).
`unpooled_lookup` is the collections' per-table lookup of one row per ID (also the sharded
`CNEmbeddingCollection`'s). The modules' eager fast path (`CNEmbeddingBag.forward`) skips these
checks for the calls that cannot fail them.

>>> import torch, cncore
>>> from cncore_torch import CNEmbeddingBag
>>> from cncore_torch.functional import embedding_bag_lookup
>>> bag = CNEmbeddingBag(10, 2, initializer=cncore.Constant(1.0))
>>> out = embedding_bag_lookup(bag._anchor, bag._handle, "core", 2, torch.tensor([3, 4, 5]),
...                            torch.tensor([0, 2]), None, "sum", False, None, True)   # training: inserts
>>> out.tolist(), bag.num_rows
([[2.0, 2.0], [1.0, 1.0]], 3)
"""
from __future__ import annotations

import torch

from cncore_torch import bridge

__all__ = ["embedding_bag_lookup", "embedding_lookup", "unpooled_lookup", "MODES"]

MODES = {"sum": 0, "mean": 1, "max": 2}



def _as_ids(input, name="input") -> torch.Tensor:
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of IDs, got {type(input).__name__}")
    if input.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name} must hold int64 or int32 IDs, got {input.dtype}")
    return input


@torch.fx.wrap
def embedding_bag_lookup(anchor: torch.Tensor, handle: int, placement: str, dim: int, input: torch.Tensor,
                         offsets: torch.Tensor | None, per_sample_weights: torch.Tensor | None, mode: str,
                         include_last_offset: bool, padding_idx: int | None, training: bool) -> torch.Tensor:
    """CNEmbeddingBag's forward: nn.EmbeddingBag's input conventions turned into (keys, B+1
    offsets, weights) for the core. One node under torch.fx (`torch.fx.wrap`)."""
    input = _as_ids(input)
    if offsets is not None:
        offsets = _as_ids(offsets, "offsets")
    if per_sample_weights is not None and (not isinstance(per_sample_weights, torch.Tensor)
                                           or not per_sample_weights.is_floating_point()):
        raise TypeError("per_sample_weights must be a floating point torch.Tensor, got "
                        f"{getattr(per_sample_weights, 'dtype', type(per_sample_weights).__name__)}")
    _check_device(placement, input=input, offsets=offsets, per_sample_weights=per_sample_weights)
    if per_sample_weights is not None:
        if mode == "max":
            raise ValueError("per_sample_weights work with mode='sum' or 'mean', not 'max'")
        if per_sample_weights.shape != input.shape:
            raise ValueError(f"per_sample_weights must have the shape of input {tuple(input.shape)}, got "
                             f"{tuple(per_sample_weights.shape)}")
    if input.dim() == 2:
        if offsets is not None:
            raise ValueError("offsets must be None when input is 2-D (each row is a bag)")
        n_bags, length = input.shape
        offsets = torch.arange(n_bags + 1, dtype=torch.int64, device=input.device) * length  # (valid: not checked)
        keys = input.reshape(-1)
        weights = None if per_sample_weights is None else per_sample_weights.reshape(-1)
    elif input.dim() == 1:
        if offsets is None:
            raise ValueError("offsets is required when input is 1-D")
        if offsets.dim() != 1:
            raise ValueError(f"offsets must be 1-D, got shape {tuple(offsets.shape)}")
        keys, weights = input, per_sample_weights
        if not include_last_offset:
            offsets = torch.cat([offsets.to(torch.int64), torch.tensor([keys.numel()], dtype=torch.int64,
                                                                       device=offsets.device)])
        elif offsets.numel() == 0:
            raise ValueError("offsets must hold B+1 entries with include_last_offset=True (at least [0]), got none")
    else:
        raise ValueError(f"input must be 1-D (with offsets) or 2-D, got shape {tuple(input.shape)}")
    keys = keys.to(torch.int64).contiguous()
    offsets = offsets.to(torch.int64).contiguous()
    if weights is not None:
        weights = weights.to(torch.float32).contiguous()
    if placement == "meta":  # shape inference: no values to read
        return _lookup(anchor, handle, placement, dim, keys, offsets, weights, MODES[mode], training)
    if input.dim() == 1 and (placement == "device" or padding_idx is not None):
        _check_offsets(offsets, keys.numel())  # the core checks its own input; PyTorch ops do not
    if padding_idx is not None:
        keys, offsets, weights = _drop_padding(keys, offsets, weights, padding_idx)
    return _lookup(anchor, handle, placement, dim, keys, offsets, weights, MODES[mode], training)


def _check_offsets(offsets: torch.Tensor, n_keys: int) -> None:
    """B+1 offsets: from 0, never decreasing, to the number of IDs."""
    bad = (offsets[0] != 0) | (offsets[-1] != n_keys) | (offsets[1:] < offsets[:-1]).any()
    if bool(bad):  # one read of the device
        raise ValueError(f"offsets must start at 0, never decrease and stay within the {n_keys} IDs of input "
                         f"(with include_last_offset=True, end at {n_keys}); got {offsets.tolist()[:10]}")


@torch.fx.wrap
def embedding_lookup(anchor: torch.Tensor, handle: int, placement: str, dim: int, input: torch.Tensor,
                     padding_idx: int | None, training: bool) -> torch.Tensor:
    """CNEmbedding's forward: each ID its own bag of one. One node under torch.fx."""
    input = _as_ids(input)
    _check_device(placement, input=input)
    keys = input.reshape(-1).to(torch.int64).contiguous()
    offsets = torch.arange(keys.numel() + 1, dtype=torch.int64)
    if padding_idx is not None and placement != "meta":
        keys, offsets, _ = _drop_padding(keys, offsets, None, padding_idx)
    out = _lookup(anchor, handle, placement, dim, keys, offsets, None, MODES["sum"], training)
    return out.reshape(*input.shape, dim)


def _check_device(placement: str, **tensors) -> None:
    """Inputs a table can read: not meta (no values), and on the CPU for a table in the core
    (device rows take their inputs from anywhere; a meta table does shape inference only)."""
    if placement == "meta":
        return
    for name, t in tensors.items():
        if t is None:
            continue
        if t.is_meta:
            raise ValueError(f"{name} is a meta tensor, which holds no values: expected {name} on the CPU"
                             + ("" if placement == "core" else " or the table's device") + " (build the "
                             "module with device='meta' for shape inference)")
        if placement == "core" and t.device.type != "cpu":
            raise ValueError(f"{name} is on {t.device}, but this table's rows are in the core (cpu): move "
                             f"{name} to the CPU, or the table with move_to('cncard')")


def _lookup(anchor, handle, placement, dim, keys, offsets, weights, mode, training):
    training = bridge.lookup_training(anchor, training)
    if placement != "meta" and torch.compiler.is_compiling():  # one opaque operator in the graph
        if placement == "device":  # the operator's outputs are where the rows are (the anchor's device)
            keys, offsets = keys.to(anchor.device), offsets.to(anchor.device)
            weights = None if weights is None else weights.to(anchor.device)
        return torch.ops.cncore.lookup(anchor, handle, [keys], [offsets], [weights], [mode], training)[0]
    if placement == "core":
        return bridge.lookup(anchor, bridge.table_of(handle), [keys], [offsets], [weights], [mode], training)
    if placement == "meta":  # shape inference only
        return torch.empty((offsets.shape[0] - 1, dim), device="meta")
    return _device_lookup(anchor, handle, keys, offsets, weights, mode, training)


def _device_lookup(anchor, handle, keys, offsets, weights, mode, training):
    return bridge.lookup(anchor, bridge.table_of(handle), [keys], [offsets], [weights], [mode], training)


def _drop_padding(keys, offsets, weights, padding_idx):
    """Remove the padding ID from the bags (it neither adds to a bag nor counts in its mean)."""
    keep = keys != padding_idx
    if bool(keep.all()):
        return keys, offsets, weights
    lengths = offsets[1:] - offsets[:-1]
    bag = torch.repeat_interleave(torch.arange(len(lengths), device=offsets.device), lengths, output_size=len(keys))
    kept = torch.bincount(bag[keep], minlength=len(lengths))
    new_offsets = torch.cat([torch.zeros(1, dtype=torch.int64, device=offsets.device), torch.cumsum(kept, 0)])
    return keys[keep], new_offsets, None if weights is None else weights[keep]


def unpooled_lookup(anchor, owner, keys_by_table, training: bool):
    """Unpooled lookups through the bridge: per table, the rows of its features' IDs
    concatenated (one bag per ID; a table shared by features gets one update per row with the
    summed gradient). Returns a tuple of (N_t, dim) rows, one per table."""
    offsets = [torch.arange(len(k) + 1, dtype=torch.int64) for k in keys_by_table]
    n = len(keys_by_table)
    if getattr(owner, "_placement", None) is not None and owner._placement.kind == "device":
        return _device_unpooled(anchor, owner, keys_by_table, offsets, n, training)
    return bridge.lookup(anchor, owner, keys_by_table, offsets, [None] * n, [0] * n, training, split=True)


@torch.compiler.disable
def _device_unpooled(anchor, owner, keys_by_table, offsets, n: int, training: bool):
    return bridge.lookup(anchor, owner, keys_by_table, offsets, [None] * n, [0] * n, training, split=True)

"""The lookup as PyTorch operators: `cncore::pooled_lookup` and its backward
`cncore::apply_gradients`, registered with `torch.library.custom_op`.

The table is hidden state (a store in the core, addressed by an integer handle), so the ops
are opaque to `torch.compile` and `torch.fx`: the lookup stays one node and compiles without a
graph break. The forward takes a zero-size `anchor` parameter of its module; its "gradient" is
what the backward op returns, so autograd (and AOTAutograd's dead-code elimination) always runs
the backward, where the rows are updated in place by the core.
"""
from __future__ import annotations

import weakref
from typing import Optional

import numpy as np
import torch

from cncore import _core
from cncore.grouped import _optim_tuple as optimizer_arguments
from cncore.grouped import tiers_faulted_in

_TABLES: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_next_handle = [0]


def register(table) -> int:
    """A handle for `table`: an object with `.store`, `.dim`, `.fused_optimizer` and
    `._deliver_gradients(ids, grads)` (the non-fused gradient delivery), i.e. a module of modules.py."""
    _next_handle[0] += 1
    _TABLES[_next_handle[0]] = table
    return _next_handle[0]


def table_of(handle: int):
    table = _TABLES.get(handle)
    if table is None:
        raise RuntimeError(f"cncore table handle {handle} is gone (its module was deleted)")
    return table


def _np(t: Optional[torch.Tensor]):
    return None if t is None else t.detach().numpy()


def lookup_impl(handle: int, keys, offsets, weights, mode: int, training: bool):
    """Pooled rows (B, dim), plus what the backward needs: slots (N,), argmax (B, dim) for max
    pooling (else empty), and info = [erase_epoch, step, n_new]. The erase epoch is the one the
    core read under the table's lock with the lookup; the backward checks it under the lock
    again, together with the slots, so an erase in between (or a move of the module to another
    device, which gives it a new table with another epoch) refuses the update instead of
    writing freed rows.

    The modules hand over int64 keys and B+1 offsets and float32 weights, contiguous, so this
    calls the core's grouped entry point directly (it checks the offsets in C) rather than the
    store's general Python API: in eager mode every microsecond here is per batch."""
    store = table_of(handle).store
    offsets_np = _np(offsets)
    out = np.empty((len(offsets_np) - 1, store.dim), dtype=np.float32)
    # A tiered table (cncore/tiered.py): its disk rows come into the cache first, and stay there
    # (no other thread moves them) through the core's lookup.
    with tiers_faulted_in([store], [_np(keys)], training):
        (slots, argmax, n_new, epoch), = _core.grouped_forward([store._table], [_np(keys)], [offsets_np],
                                                                [_np(weights)], [mode], [out], training)
    # The epoch is a uint64 stamp; int64 holds it as its two's complement (undone in apply_impl).
    info = torch.tensor([epoch - (1 << 64) if epoch >= 1 << 63 else epoch, store.step, n_new], dtype=torch.int64)
    argmax = torch.from_numpy(argmax) if argmax is not None else torch.empty(0, dtype=torch.int64)
    return torch.from_numpy(out), torch.from_numpy(slots), argmax, info


def apply_impl(handle: int, grad, keys, offsets, weights, slots, argmax, info, mode: int, training: bool) -> None:
    """Hand the output gradient to the table: the fused update straight through the core's
    grouped backward (one call, as in lookup_impl), or the gradient hooks."""
    table = table_of(handle)
    store = table.store
    if store is None:
        raise RuntimeError("this table moved off the core (to the accelerator or meta) since this lookup; its "
                           "gradient cannot be applied to rows that now live elsewhere. Nothing was updated")
    epoch, step, n_new = (int(v) for v in info.tolist())
    epoch &= (1 << 64) - 1
    grad_np = np.ascontiguousarray(grad.detach().numpy(), dtype=np.float32)
    if table.fused_optimizer is None:
        positions, grads = _core.unique_gradients(store._table, _np(slots), _np(offsets), _np(weights), mode,
                                                  _np(argmax) if mode == 2 else None, grad_np, training, step, epoch)
        table._deliver_gradients(keys[torch.from_numpy(positions)], torch.from_numpy(grads))
        return
    _core.grouped_backward([store._table], [_np(slots)], [_np(offsets)], [_np(weights)], [mode],
                           [_np(argmax) if mode == 2 else None], [grad_np],
                           [optimizer_arguments(store, table.fused_optimizer.lr)], [(training, step)], [epoch])


def weights_grad_impl(handle: int, grad, keys, offsets, mode: int):
    """d out[b] / d w_i = row_i . grad[b] (divided by the bag length for mean)."""
    rows = torch.from_numpy(table_of(handle).store.lookup(_np(keys)))
    lengths = offsets[1:] - offsets[:-1]
    bag = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    g = (rows * grad[bag]).sum(dim=1)
    if mode == 1:
        g = g / lengths[bag].clamp(min=1).to(g.dtype)
    return g


@torch.library.custom_op("cncore::pooled_lookup", mutates_args=())
def pooled_lookup(anchor: torch.Tensor, handle: int, keys: torch.Tensor, offsets: torch.Tensor,
                  weights: Optional[torch.Tensor], mode: int, training: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The lookup as an operator (see lookup_impl)."""
    return lookup_impl(handle, keys, offsets, weights, mode, training)


@pooled_lookup.register_fake
def _(anchor, handle, keys, offsets, weights, mode, training):
    dim = table_of(handle).dim
    n_bags = offsets.shape[0] - 1
    out = offsets.new_empty((n_bags, dim), dtype=torch.float32)
    argmax = offsets.new_empty((n_bags, dim) if mode == 2 else (0,), dtype=torch.int64)
    return out, keys.new_empty(keys.shape, dtype=torch.int64), argmax, offsets.new_empty((3,), dtype=torch.int64)


@torch.library.custom_op("cncore::apply_gradients", mutates_args=())
def apply_gradients(anchor: torch.Tensor, handle: int, grad: torch.Tensor, keys: torch.Tensor,
                    offsets: torch.Tensor, weights: Optional[torch.Tensor], slots: torch.Tensor,
                    argmax: torch.Tensor, info: torch.Tensor, mode: int, training: bool,
                    after: Optional[torch.Tensor]) -> torch.Tensor:
    """Backward of pooled_lookup: hands the output gradient to the table (fused optimizer update
    in the core, or the non-fused gradient hook). Returns the anchor's (zero) gradient.
    `after` is only a data dependency: whatever must read the rows before they change (the
    per-sample-weight gradient) is passed here, so no compiler can reorder the two."""
    apply_impl(handle, grad, keys, offsets, weights, slots, argmax, info, mode, training)
    return torch.zeros_like(anchor)


@apply_gradients.register_fake
def _(anchor, handle, grad, keys, offsets, weights, slots, argmax, info, mode, training, after):
    return torch.empty_like(anchor)


def _setup_context(ctx, inputs, output):
    anchor, handle, keys, offsets, weights, mode, training = inputs
    _, slots, argmax, info = output
    ctx.handle, ctx.mode, ctx.training = handle, mode, training
    ctx.weights_need_grad = weights is not None and weights.requires_grad
    ctx.save_for_backward(anchor, keys, offsets, weights, slots, argmax, info)


def _backward(ctx, grad_out, _grad_slots, _grad_argmax, _grad_info):
    anchor, keys, offsets, weights, slots, argmax, info = ctx.saved_tensors
    grad_out = grad_out.contiguous()
    grad_weights = None
    if ctx.weights_need_grad:
        # d out[b] / d w_i = row_i (scaled by 1/len for mean): read the rows before they move.
        grad_weights = per_sample_weights_grad(ctx.handle, grad_out, keys, offsets, ctx.mode)
    grad_anchor = apply_gradients(anchor, ctx.handle, grad_out, keys, offsets, weights, slots, argmax, info,
                                  ctx.mode, ctx.training, grad_weights)
    return grad_anchor, None, None, None, grad_weights, None, None


pooled_lookup.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("cncore::per_sample_weights_grad", mutates_args=())
def per_sample_weights_grad(handle: int, grad: torch.Tensor, keys: torch.Tensor, offsets: torch.Tensor,
                            mode: int) -> torch.Tensor:
    return weights_grad_impl(handle, grad, keys, offsets, mode)


@per_sample_weights_grad.register_fake
def _(handle, grad, keys, offsets, mode):
    return grad.new_empty(keys.shape)


class EagerLookup(torch.autograd.Function):
    """The same lookup and backward as the operators, for eager mode: the custom-op machinery
    costs ~100 us a call in Python, an autograd.Function a tenth of that. torch.compile and
    torch.fx use the operators (see modules._lookup)."""

    @staticmethod
    def forward(ctx, anchor, handle, keys, offsets, weights, mode, training):
        out, slots, argmax, info = lookup_impl(handle, keys, offsets, weights, mode, training)
        ctx.handle, ctx.mode, ctx.training = handle, mode, training
        ctx.save_for_backward(keys, offsets, weights, slots, argmax, info)
        ctx.mark_non_differentiable(slots, argmax, info)
        return out, slots, argmax, info

    @staticmethod
    def backward(ctx, grad_out, _grad_slots, _grad_argmax, _grad_info):
        keys, offsets, weights, slots, argmax, info = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_weights = None
        if ctx.needs_input_grad[4]:
            grad_weights = weights_grad_impl(ctx.handle, grad_out, keys, offsets, ctx.mode)  # before rows move
        apply_impl(ctx.handle, grad_out, keys, offsets, weights, slots, argmax, info, ctx.mode, ctx.training)
        return None, None, None, None, grad_weights, None, None

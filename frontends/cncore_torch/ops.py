"""The `cncore::` operators: every lookup of this front end as one opaque node for `torch.compile`.

Eager mode reaches the tables through `cncore_torch.bridge` (autograd Functions); a compiled
graph reaches them through these operators, which call the same bridge. Each forward operator
returns its rows and a token (an int64 tensor) naming what its backward needs (`token_for`,
`pending_of`: the entry leaves when the token dies); the backward operators take the token.

- `cncore::lookup`: the modules' pooled lookup (per-feature keys, offsets, weights);
  `cncore::weights_grad`: the gradient of its per-sample weights; `cncore::apply_gradients`:
  the backward of every lookup operator (the fused update, or the gradient hooks);
- `cncore::collection_pooled_lookup` / `cncore::collection_pooled_backward`:
  `CNEmbeddingBagCollection`'s lookup of a whole KJT (values, lengths, weights, each feature's
  position among its keys and each key's batch size (None: one), known when traced, and the inverse indices
  of a KJT with a batch size per key), and its backward: the per-sample-weight gradient, then
  the update;
- `cncore::collection_unpooled_lookup` / `cncore::collection_unpooled_apply_gradients`:
  `CNEmbeddingCollection`'s, whose outputs have sizes known only at run time (unbacked sizes
  when traced).

The collection operators hand the KJT's parts to their owner (`_pooled_rows` /
`_unpooled_rows`), which checks and splits it as its eager forward does; nothing here needs
TorchRec.

Registration
------------
`torch.library.custom_op` registers an operator with the dispatcher when it is called, and
`torch.compile` / `torch.export` need it registered before they trace a call. Every operator
names its owner by a handle that only a built module has (`bridge.register`), so no traced
program can call one before some module exists: `register_operators` runs when the first module
or collection is built (or unpickled), once per process, not at import. Importing cncore_torch
registers nothing.

An operator is renamed whenever its backward changes: Inductor's on-disk cache keys a compiled
graph by its forward operators, and a cache written by a previous version (whose forward had
the operator's name) would replay a backward calling an operator that no longer exists.
"""
from __future__ import annotations

import itertools
import threading
import weakref

import torch

from cncore_torch.bridge import Pending, backward_impl, forward_impl, table_of, weights_grad_impl
from cncore_torch.variable_batch import gather_gradients

__all__ = ["register_operators", "token_for", "pending_of"]

# --- tokens: what a backward operator needs, named by an int64 tensor ---------------------------------

_PENDING: dict[int, Pending] = {}
_tokens = itertools.count(1)


def token_for(pending: Pending) -> torch.Tensor:
    """An int64 tensor naming `pending` until the tensor dies."""
    number = next(_tokens)
    _PENDING[number] = pending
    token = torch.tensor([number], dtype=torch.int64)
    weakref.finalize(token, _PENDING.pop, number, None)
    return token


def _token_fake() -> torch.Tensor:
    """The token as the fakes give it: on the host, as `token_for` makes it, wherever the rows are."""
    return torch.empty((1,), dtype=torch.int64)


def pending_of(token: torch.Tensor) -> Pending:
    pending = _PENDING.get(int(token[0]))
    if pending is None:
        raise RuntimeError("this lookup's contexts are gone (its graph was freed); nothing was updated")
    return pending


# --- the modules' lookup -----------------------------------------------------------------------------

def lookup_op(anchor: torch.Tensor, handle: int, keys: list[torch.Tensor], offsets: list[torch.Tensor],
              weights: list[torch.Tensor | None], modes: list[int], training: bool
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The pooled lookup as an operator: (B, sum of dims) rows and the token of its contexts."""
    owner = table_of(handle)
    out, pending = forward_impl(owner, owner._lookup_tables(), keys, offsets, weights, modes, training)
    return out, token_for(pending)


def _lookup_fake(anchor, handle, keys, offsets, weights, modes, training):
    dims = sum(t.dim for t in table_of(handle)._lookup_tables())
    return (keys[0].new_empty((offsets[0].shape[0] - 1, dims), dtype=torch.float32),
            _token_fake())


def weights_grad_op(grad: torch.Tensor, token: torch.Tensor, keys: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every feature's per-sample-weight gradient (read from the rows before they move)."""
    pending = pending_of(token)
    by_feature = weights_grad_impl(pending, grad, list(range(len(pending.tables))))
    return [w for w in by_feature if w is not None]  # every feature is listed: none is None


def _weights_grad_fake(grad, token, keys):
    return [k.new_empty(k.shape, dtype=torch.float32) for k in keys]


def apply_gradients_op(anchor: torch.Tensor, grads: list[torch.Tensor], token: torch.Tensor,
                       after: list[torch.Tensor]) -> torch.Tensor:
    """Backward of every lookup operator: the fused update (or the hooks) with the output's
    gradient (one block, or one per feature of a split lookup). Returns the anchor's (zero)
    gradient. `after` is only a data dependency: what must read the rows before they change
    (the per-sample-weight gradient) is passed here, so no compiler reorders the two."""
    pending = pending_of(token)
    backward_impl(pending, grads if pending.split else grads[0])
    return torch.zeros_like(anchor)


def _apply_gradients_fake(anchor, grads, token, after):
    return torch.empty_like(anchor)


def _lookup_setup_context(ctx, inputs, output):
    anchor, _handle, keys, _offsets, weights, _modes, _training = inputs
    ctx.weights_need_grad = any(w is not None and w.requires_grad for w in weights)
    ctx.n = len(keys)
    ctx.weights_given = any(w is not None for w in weights)  # a list of Nones is one leaf to autograd
    ctx.save_for_backward(anchor, output[1], *keys)


def _lookup_backward(ctx, grad_out, _grad_token):
    anchor, token, *keys = ctx.saved_tensors
    grad_out = grad_out.contiguous()
    weight_grads = torch.ops.cncore.weights_grad(grad_out, token, keys) if ctx.weights_need_grad else []
    grad_anchor = torch.ops.cncore.apply_gradients(anchor, [grad_out], token, weight_grads)
    none = [None] * ctx.n
    return grad_anchor, None, none, none, (weight_grads or none) if ctx.weights_given else None, None, None


# --- the collections' lookups ------------------------------------------------------------------------

def collection_pooled_lookup(anchor: torch.Tensor, handle: int, values: torch.Tensor, lengths: torch.Tensor,
                             weights: torch.Tensor | None, n_keys: int, positions: list[int],
                             strides: list[int] | None, inverse: torch.Tensor | None,
                             training: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """CNEmbeddingBagCollection's lookup as an operator: (B, sum of dims) pooled rows and the
    token of its contexts. The collection checks the KJT as its eager forward does; `strides`
    (each key's batch size, None when they share one) and `inverse` ((F, B) bag of each sample
    per feature, or None) carry a KJT with a batch size per key."""
    out, pending = table_of(handle)._pooled_rows(values, lengths, weights, n_keys, positions, strides, inverse,
                                                 training)
    return out, token_for(pending)


def _pooled_lookup_fake(anchor, handle, values, lengths, weights, n_keys, positions, strides, inverse, training):
    dims = sum(table_of(handle)._lengths_per_embedding)
    bags = inverse.shape[1] if inverse is not None else lengths.shape[0] // n_keys
    return values.new_empty((bags, dims), dtype=torch.float32), _token_fake()


def _pooled_lookup_setup_context(ctx, inputs, output):
    weights = inputs[4]
    ctx.n_weights = None if weights is None else weights.shape[0]
    ctx.weights_dtype = None if weights is None else weights.dtype
    ctx.save_for_backward(inputs[0], output[1])


def _pooled_lookup_backward(ctx, grad_out, _grad_token):
    anchor, token = ctx.saved_tensors
    wants_weights = ctx.n_weights is not None and ctx.needs_input_grad[4]
    grad_anchor, grad_weights = torch.ops.cncore.collection_pooled_backward(
        anchor, grad_out.contiguous(), token, ctx.needs_input_grad[0], ctx.n_weights if wants_weights else -1)
    grad_weights = grad_weights.to(ctx.weights_dtype) if wants_weights else None
    return grad_anchor, None, None, None, grad_weights, None, None, None, None, None


def collection_pooled_backward(anchor: torch.Tensor, grad: torch.Tensor, token: torch.Tensor, update: bool,
                               n_weights: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Backward of `collection_pooled_lookup`: the gradient of the KJT's weights (its
    `n_weights` values; -1: none wanted, an empty tensor), read from the rows before they move,
    then (`update`: the anchor needs its gradient, i.e. the collection is not frozen) the fused
    update. Returns (the anchor's zero gradient, the weights' gradient)."""
    pending = pending_of(token)
    grads = grad if pending.expanded is None else gather_gradients(  # (each feature's bags: their samples' sum)
        grad, pending.expanded, [len(c.offsets) - 1 for c in pending.ctxs], [t.dim for t in pending.tables])
    grad_weights = torch.empty(0, device=grad.device)
    if n_weights >= 0:
        grad_weights = torch.zeros(n_weights, device=grad.device)
        by_feature = weights_grad_impl(pending, grads, list(range(len(pending.tables))))
        assert pending.spans is not None  # a lookup with weights records their spans
        for (start, stop), g in zip(pending.spans, by_feature):
            if g is not None:
                grad_weights[start:stop] += g
    if update:
        backward_impl(pending, grads)
    return torch.zeros_like(anchor), grad_weights


def _pooled_backward_fake(anchor, grad, token, update, n_weights):
    return torch.empty_like(anchor), grad.new_empty((max(n_weights, 0),))


def collection_unpooled_lookup(anchor: torch.Tensor, handle: int, values: torch.Tensor, lengths: torch.Tensor,
                               n_keys: int, positions: list[int], strides: list[int] | None, training: bool,
                               need_indices: bool) -> list[torch.Tensor]:
    """CNEmbeddingCollection's lookup as an operator (see collection_pooled_lookup): the (N_f,
    dim) rows of each feature, then (need_indices) each feature's IDs, then the token."""
    outputs, pending = table_of(handle)._unpooled_rows(values, lengths, n_keys, positions, strides, training,
                                                       need_indices)
    return outputs + [token_for(pending)]


def _unpooled_rows_fake(anchor, handle, values, lengths, n_keys, positions, strides, training, need_indices):
    ctx, dim = torch.library.get_ctx(), table_of(handle)._dim
    counts = [ctx.new_dynamic_size() for _ in positions]
    rows = [values.new_empty((n, dim), dtype=torch.float32) for n in counts]
    indices = [values.new_empty((n,)) for n in counts] if need_indices else []
    return rows + indices + [_token_fake()]


def _unpooled_rows_setup_context(ctx, inputs, output):
    ctx.n_features = len(inputs[5])
    ctx.save_for_backward(inputs[0], output[-1])


def _unpooled_rows_backward(ctx, grads):
    anchor, token = ctx.saved_tensors
    if not ctx.needs_input_grad[0]:  # (a frozen collection: its rows stay)
        return (None,) * 9
    grad_anchor = torch.ops.cncore.collection_unpooled_apply_gradients(anchor, list(grads[:ctx.n_features]), token)
    return grad_anchor, None, None, None, None, None, None, None, None


def collection_unpooled_apply_gradients(anchor: torch.Tensor, grads: list[torch.Tensor | None],
                                        token: torch.Tensor) -> torch.Tensor:
    """Each feature's row gradients joined per table (a missing one as zeros); a table none of
    whose features has a gradient gets an empty block, which the bridge skips (as in eager,
    where such a table's outputs are unused). Then the bridge's backward."""
    pending = pending_of(token)
    dim = pending.tables[0].dim
    device = next((g.device for g in grads if g is not None), torch.device("cpu"))  # (the rows' device)
    by_table, at = [], 0
    assert pending.sizes is not None  # an unpooled collection's lookup records its features' sizes
    for sizes in pending.sizes:
        parts = grads[at:at + len(sizes)]
        at += len(sizes)
        by_table.append(torch.empty((0, dim), device=device) if all(g is None for g in parts) else torch.cat(
            [torch.zeros((k, dim), device=device) if g is None else g.contiguous() for g, k in zip(parts, sizes)]))
    return torch.ops.cncore.apply_gradients(anchor, by_table, token, [])


def _unpooled_apply_gradients_fake(anchor, grads, token):
    return torch.empty_like(anchor)


# --- registration --------------------------------------------------------------------------------------

# (name, implementation, fake, (backward, setup_context) or None)
_OPERATORS = (
    ("cncore::lookup", lookup_op, _lookup_fake, (_lookup_backward, _lookup_setup_context)),
    ("cncore::weights_grad", weights_grad_op, _weights_grad_fake, None),
    ("cncore::apply_gradients", apply_gradients_op, _apply_gradients_fake, None),
    ("cncore::collection_pooled_lookup", collection_pooled_lookup, _pooled_lookup_fake,
     (_pooled_lookup_backward, _pooled_lookup_setup_context)),
    ("cncore::collection_pooled_backward", collection_pooled_backward, _pooled_backward_fake, None),
    ("cncore::collection_unpooled_lookup", collection_unpooled_lookup, _unpooled_rows_fake,
     (_unpooled_rows_backward, _unpooled_rows_setup_context)),
    ("cncore::collection_unpooled_apply_gradients", collection_unpooled_apply_gradients,
     _unpooled_apply_gradients_fake, None),
)
_REGISTERED: list = []  # the CustomOpDefs, once registered
_LOCK = threading.Lock()


def register_operators() -> None:
    """Register every `cncore::` operator with torch's dispatcher (once per process; later calls
    return at once). Called when a module or collection is built or unpickled: see
    "Registration" above."""
    if _REGISTERED:
        return
    with _LOCK:
        if _REGISTERED:
            return
        defined = []
        for name, impl, fake, autograd in _OPERATORS:
            # (cudagraph_unsafe: a lookup reads the host and mutates hidden tables; a CUDA graph
            # replaying its kernels would skip both, so Inductor leaves it out of the graphs it captures)
            op = torch.library.custom_op(name, impl, mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
            op.register_fake(fake)
            if autograd is not None:
                op.register_autograd(autograd[0], setup_context=autograd[1])
            defined.append(op)
        _REGISTERED.extend(defined)

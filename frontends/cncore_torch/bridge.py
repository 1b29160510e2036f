"""The bridge between PyTorch's autograd and the tables: one forward and one backward for every
module of this front end (`CNEmbeddingBag` / `CNEmbedding`, both TorchRec collections, the
sharded kernels) over every kind of row storage:

- tables in the core (`cncore.EmbeddingStore`, and the SSD tier's `TieredStore`, which is one):
  every feature of a call in one grouped core call each way (`cncore.grouped`);
- rows on an accelerator (`DeviceRows`): the core resolves keys on the host, PyTorch ops pool
  and update on the device.

A lookup reads features: feature f looks up keys[f] (int64) in bags offsets[f] (B_f + 1) with
optional per-ID weights in tables[f], pooled by modes[f] (0 sum, 1 mean, 2 max). Its output is
one (B, sum of dims) block, feature f in its own columns (TorchRec's KeyedTensor layout; the
modules are the case of one feature), or with `split` one tensor per feature (the unpooled
collection, whose features have different lengths). The backward applies the owner's fused
optimizer (a store under several features gets one update per row, as a fused TBE does), or
hands (unique IDs, gradient rows) to `owner._deliver_gradients` (the modules' non-fused mode),
and returns the gradient of per-sample weights that ask for one.

The owner (a module) is registered under an integer handle, so the operators (`cncore_torch.ops`)
can name it: the tables are hidden state, opaque to `torch.compile` and `torch.fx`, and each pass stays
one node. The forward takes a zero-size `anchor` parameter of its module; its "gradient" is
what the backward returns, so autograd (and AOTAutograd's dead-code elimination) always runs
the backward, where the rows are updated in place.

Two ways in, one implementation (`forward_impl`, `weights_grad_impl`, `backward_impl`):
`Lookup`, an `autograd.Function` for eager mode, and the `cncore::` operators for
`torch.compile` (`cncore_torch.ops`), where what the backward needs waits under a token (an
int64 tensor autograd hands back; the entry leaves when the token dies). Accelerator rows go the
same two ways (their operators' outputs on the rows' device, the token on the host); inside an
operator their PyTorch ops run eagerly, as the index's sizes depend on the keys. The modules'
common call (one table in the core, no per-sample weights: a (B, L) batch, 1-D IDs with
offsets, CNEmbedding's IDs of any shape) has a third, leaner way in,
`lookup_table` / `TableLookup`: the same core calls, with one `forward_one` record kept by the
autograd node instead of a `Pending` of LookupContexts, and Function.apply without its Python
wrapper. torch.jit.trace is refused (`_refuse_jit_trace`).

Rejected: eager calls through the operators (`torch.library.custom_op` + `register_autograd`),
which cost more a step than `autograd.Function`; calling `_core` with no record kept;
`np.from_dlpack(t)` for a tensor's NumPy view (slower than `t.numpy()`); `torch.empty` +
`.numpy()` for the output (slower than `np.empty` + `torch.from_numpy`). Neither pass uses
saved-tensor hooks or `retain_graph`. What the bridge costs over the core call, and the numbers
behind these choices: docs/design/torch-bridge.md.
"""
from __future__ import annotations

import weakref

import numpy as np
import torch

from cncore import _core
from cncore.config import Optimizer
from cncore.grouped import MODES, apply_blocks, apply_one, backward_one, context_of, forward_one, lookup_arrays
from cncore.grouped import _optim_tuple as optimizer_arguments
from cncore_torch.device_rows import DeviceLookup, DeviceRows, lookup_features

_TABLES: weakref.WeakValueDictionary[int, object] = weakref.WeakValueDictionary()
_next_handle = [0]


def register(owner) -> int:
    """A handle for `owner`: a module with `_lookup_tables()` (the table of each feature its
    lookup reads), `fused_optimizer` (None or an object with `.lr`) and, for the non-fused
    mode, `_deliver_gradients(ids, grads)`."""
    _next_handle[0] += 1
    _TABLES[_next_handle[0]] = owner
    return _next_handle[0]


def table_of(handle: int):
    owner = _TABLES.get(handle)
    if owner is None:
        raise RuntimeError(f"cncore table handle {handle} is gone (its module was deleted)")
    return owner


class Pending:
    """What a lookup's backward needs: its owner, tables, per-feature contexts, layout."""
    __slots__ = ("ctxs", "expanded", "on_device", "owner", "sizes", "spans", "split", "tables")

    def __init__(self, owner, tables, ctxs, on_device: bool, split: bool):
        self.owner, self.tables, self.ctxs = owner, tables, ctxs
        self.on_device, self.split = on_device, split
        # What a caller splits the outputs by (the unpooled collection's features).
        self.sizes: list[list[int]] | None = None
        # (F, B) inverse indices a pooled collection expanded its bags by (variable batch).
        self.expanded: torch.Tensor | None = None
        # Each feature's (start, stop) in the KJT's weights (a pooled collection's operator).
        self.spans: list[tuple[int, int]] | None = None


def _np(t):
    """A tensor's NumPy view (no copy); arrays (the modules' shared offsets) pass as they are."""
    return t if t is None or isinstance(t, np.ndarray) else t.detach().numpy()


def forward_impl(owner, tables, keys, offsets, weights, modes, training: bool, split: bool = False,
                 backward: bool = True):
    """(out, Pending): the pooled rows of every feature (see the module docstring); with
    `backward=False` (no backward will run) the contexts are not made. Inputs are
    contiguous int64 keys and offsets, float32 weights or None, on the CPU for core tables
    (tensors, or NumPy arrays there: the modules pass their keys and shared offsets so);
    modes as codes or names ('sum', 'mean', 'max')."""
    if len(tables) == 1 and not split and not isinstance(tables[0], DeviceRows):  # the modules
        table, mode = tables[0], modes[0]
        out = np.empty((len(offsets[0]) - 1, table.dim), dtype=np.float32)
        ctxs = lookup_arrays(tables, [_np(keys[0])], [_np(offsets[0])], [_np(weights[0])],
                             [MODES[mode] if isinstance(mode, str) else mode], [out], training, [0, table.dim],
                             contexts=backward)
        return torch.from_numpy(out), Pending(owner, tables, ctxs, False, False)
    modes = [MODES[m] if isinstance(m, str) else m for m in modes]
    if tables and isinstance(tables[0], DeviceRows):
        outs, ctxs = lookup_features(tables, keys, offsets, weights, modes, training)
        return (outs if split else torch.cat(outs, dim=1)), Pending(owner, tables, ctxs, True, split)
    dims = [t.dim for t in tables]
    if split:
        views = [np.empty((len(o) - 1, d), dtype=np.float32) for o, d in zip(offsets, dims)]
        starts = None
    else:
        starts = [0]
        for d in dims:
            starts.append(starts[-1] + d)
        out = np.empty((len(offsets[0]) - 1, starts[-1]), dtype=np.float32)
        views = [out] if len(dims) == 1 else [out[:, starts[f]:starts[f + 1]] for f in range(len(tables))]
    ctxs = lookup_arrays(tables, [_np(k) for k in keys], [_np(o) for o in offsets], [_np(w) for w in weights],
                         modes, views, training, starts, contexts=backward)
    result = [torch.from_numpy(v) for v in views] if split else torch.from_numpy(out)
    return result, Pending(owner, tables, ctxs, False, split)


def _grad_blocks(pending: Pending, grad) -> list[torch.Tensor]:
    """Each feature's (B_f, dim_f) block of the output gradient."""
    if pending.split:
        return list(grad)
    if len(pending.tables) == 1:  # the modules: the whole gradient (autograd checked its shape)
        return [grad]
    blocks, at = [], 0
    for table in pending.tables:
        blocks.append(grad[:, at:at + table.dim])
        at += table.dim
    return blocks


def weights_grad_impl(pending: Pending, grad, features: list[int]) -> list[torch.Tensor | None]:
    """d out[b] / d w_i = row_i . grad[b] (divided by the bag length for mean) for the features
    listed (None for the others). Reads the rows, so it runs before backward_impl moves them."""
    blocks = _grad_blocks(pending, grad)
    result: list[torch.Tensor | None] = [None] * len(pending.tables)
    for f in features:
        table, ctx, g = pending.tables[f], pending.ctxs[f], blocks[f]
        if g is None:  # (a split lookup's unused output)
            g = torch.zeros((len(ctx.offsets) - 1, table.dim))
        if pending.on_device:
            rows, lengths = table.rows_of(ctx), ctx.offsets[1:] - ctx.offsets[:-1]
        else:  # (the context's arrays are read-only: np.diff makes a new one)
            rows, lengths = torch.from_numpy(table.lookup(ctx.keys)), torch.from_numpy(np.diff(ctx.offsets))
        bag = torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths,
                                      output_size=len(rows))  # (a size known here: no read of the device)
        w = (rows * g.to(rows.device)[bag]).sum(dim=1)
        if ctx.mode == 1:
            w = w / lengths[bag].clamp(min=1).to(w.dtype)
        result[f] = w
    return result


# (optimizer config, lr, their checked tuple); no config yet: the first call computes the tuple.
_last_arguments: tuple[Optimizer | None, float | None, tuple] = (None, None, ())


def _optimizer_arguments(store, lr: float) -> tuple:
    """`optimizer_arguments(store, lr)`, a pure function of the store's optimizer config (a
    frozen dataclass, replaced whole by set_optimizer) and lr, so the last answer is reused
    while both are the same (~2 us a step less; one tuple, rebound at once, so threads never
    see a config paired with another's answer)."""
    global _last_arguments
    opt, last_lr, arguments = _last_arguments
    config = store.config.optimizer
    if config is not opt or config is None or lr != last_lr:
        arguments = optimizer_arguments(store, lr)  # raises for a bad lr or no optimizer
        _last_arguments = (config, lr, arguments)
    return arguments


def _moved():
    raise RuntimeError("this table moved off the core (or between placements) since this lookup; its gradient "
                       "cannot be applied to rows that now live elsewhere. Nothing was updated")


def _no_optimizer(owner):
    check = getattr(owner, "_require_optimizer", None)
    if check is not None:
        check()  # raises, saying both ways to set one
    raise RuntimeError(f"{type(owner).__name__} has no fused optimizer; its rows cannot be trained")


def _grad_rows(grad: torch.Tensor, dim: int) -> np.ndarray:
    """A non-empty output gradient as the core reads it: autograd made it float32 and the
    output's shape ((B, dim), or a CNEmbedding's input.shape + (dim,), read as (B, dim)); a
    strided one (an expanded sum's) is copied by NumPy."""
    g = (grad.detach() if grad.requires_grad else grad).numpy()  # (requires grad: create_graph=True)
    return np.ascontiguousarray(g, dtype=np.float32).reshape(-1, dim)


def backward_impl(pending: Pending, grad) -> None:
    """Hand the output gradient to the tables: the owner's fused optimizer, or its gradient
    hooks (`_deliver_gradients`, one feature: the modules)."""
    owner, tables = pending.owner, pending.tables
    optimizer = owner.fused_optimizer
    current = owner._lookup_tables()
    if optimizer is not None and len(tables) == 1 and not pending.split and not pending.on_device:
        if len(current) != 1 or current[0] is not tables[0]:
            _moved()
        if grad.numel():  # (no bags: no update, as below)
            apply_one(pending.ctxs[0], _grad_rows(grad, tables[0].dim), _optimizer_arguments(tables[0], optimizer.lr))
        return
    deliver = getattr(owner, "_deliver_gradients", None) if optimizer is None else None
    if optimizer is None and deliver is None:
        _no_optimizer(owner)
    if len(current) != len(tables) or any(a is not b for a, b in zip(current, tables)):
        _moved()
    if not pending.split:
        grad = grad.contiguous()
    if deliver is None and not pending.split and not pending.on_device:
        # The fused update of one grouped output: each feature's columns sliced in NumPy (26
        # features: 13 us a step, against 140 us for torch slices turned into arrays).
        if grad.numel():
            rows = _grad_rows(grad, grad.shape[-1])
            apply_blocks(pending.ctxs, [rows[:, ctx.columns] for ctx in pending.ctxs],
                         _store_arguments(pending.ctxs, optimizer.lr))
        return
    blocks = _grad_blocks(pending, grad)
    if pending.on_device:
        _device_backward(pending, blocks, optimizer, deliver)
        return
    if deliver is not None:  # (no optimizer: the gradient hooks)
        for ctx, g in zip(pending.ctxs, blocks):
            rows_grad = np.ascontiguousarray(g.detach().numpy(), dtype=np.float32).reshape(ctx.n_bags, ctx.store.dim)
            positions, grads = _core.unique_gradients(ctx.store._table, ctx.slots, ctx.offsets, ctx.weights, ctx.mode,
                                                      ctx.argmax if ctx.mode == 2 else None, rows_grad, ctx.training,
                                                      ctx.step, ctx.erase_epoch)
            deliver(torch.from_numpy(ctx.keys[positions]), torch.from_numpy(grads))
        return
    ctxs, arrays = [], []
    for ctx, g in zip(pending.ctxs, blocks):
        if g is not None and len(g):  # (a split lookup's table without a gradient: no update)
            ctxs.append(ctx)
            arrays.append(g.detach().numpy().astype(np.float32, copy=False))
    if ctxs:
        apply_blocks(ctxs, arrays, _store_arguments(ctxs, optimizer.lr))


def _store_arguments(ctxs, lr: float) -> list[tuple]:
    """Each context's optimizer arguments, checked once per store."""
    optims, by_store = [], {}
    for ctx in ctxs:
        key = id(ctx.store)
        if key not in by_store:
            by_store[key] = _optimizer_arguments(ctx.store, lr)
        optims.append(by_store[key])
    return optims


def _device_backward(pending: Pending, blocks, optimizer, deliver) -> None:
    """Per table: the gradients of every feature it served summed per row (one update per row,
    as in the core), the rows' access recorded, then the update (or the hooks)."""
    by_table: dict[int, tuple[DeviceRows, DeviceLookup, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]] = {}
    for table, ctx in zip(pending.tables, pending.ctxs):
        table.check_fresh(ctx)
    for table, ctx, g in zip(pending.tables, pending.ctxs, blocks):
        if pending.split and (g is None or not len(g)):
            continue
        idx, grads, occurrences, _ = table.gradients(ctx.rows_idx, ctx.offsets, ctx.weights, ctx.mode,
                                                     g.contiguous().to(table.device))
        by_table.setdefault(id(table), (table, ctx, []))[2].append((idx, grads, occurrences))
    for table, ctx, parts in by_table.values():
        idx, grads, occurrences = table.join_gradients(parts)
        if ctx.training:
            table.record_access(idx, occurrences, ctx.step)
        with torch.no_grad():
            if optimizer is not None:
                table.apply(idx, grads, optimizer.lr)
            else:
                deliver(*table.gradient_keys(idx, grads))


class Lookup(torch.autograd.Function):
    """The eager way in: forward_impl, then (weights_grad_impl and) backward_impl.
    apply(anchor, (owner, modes, training, split, keys, offsets, inputs), *weights): autograd sees the
    anchor and the weights (the only inputs with a gradient) and one tuple it does not look
    into. It walks every argument of apply in both passes: the 8 arguments of one feature, with
    keys and offsets as tensors, cost a step ~2 us warm more than 3 (and 6+2F for F features)."""

    @staticmethod
    def forward(ctx, anchor, call, *weights):
        owner, modes, training, split, keys, offsets, inputs = call
        ctx.versions = input_versions(*keys, *offsets, *weights, *inputs)
        out, ctx.pending = forward_impl(owner, owner._lookup_tables(), keys, offsets, weights, modes, training,
                                        split)
        if split:  # an output nobody used gets None, and its table no update (as the operators do)
            ctx.set_materialize_grads(False)
        return tuple(out) if split else out

    @staticmethod
    def backward(ctx, *grads):
        check_versions(ctx.versions)
        pending = ctx.pending
        grad = grads if pending.split else grads[0]
        wants = ctx.needs_input_grad[_ARGS:]  # (per feature: a weight that needs its gradient)
        update = ctx.needs_input_grad[0]  # (a frozen module's anchor needs none: its rows stay)
        if True not in wants:
            backward_impl(pending, grad)  # (the anchor needs its gradient, or there would be no backward)
            return (None,) * (_ARGS + len(wants))
        weight_grads = weights_grad_impl(pending, grad, [f for f, want in enumerate(wants) if want])
        if update:
            backward_impl(pending, grad)
        return (None,) * _ARGS + tuple(weight_grads)


_ARGS = 2  # Lookup.apply's arguments before the weights


class TableLookup(torch.autograd.Function):
    """The modules' common lookup (`lookup_table`): one table in the core, no per-sample
    weights. apply(anchor, (owner, keys, offsets, mode, training, shape)): keys and offsets
    as NumPy arrays (int64; offsets B+1), `shape` the output's (None: (B, dim)). What
    Lookup does for this case without its lists, loops and weights: the forward is one
    `forward_one`, whose record the node keeps (no LookupContext), the fused backward one
    `backward_one` once the table is found where it was; anything else (no fused optimizer:
    the hooks; a moved table: the error) goes through backward_impl, as Lookup's does."""

    @staticmethod
    def forward(ctx, anchor, call):
        owner, keys, offsets, mode, training, shape, inputs = call
        ctx.versions = input_versions(*inputs)
        table = owner.storage
        out = np.empty((len(offsets) - 1, table.dim) if shape is None else shape, dtype=np.float32)
        # (an output of input.shape + (dim,) is written through its (B, dim) view)
        ctx.lookup = owner, table, forward_one(table, keys, offsets, None, mode,
                                               out if shape is None else out.reshape(-1, table.dim), training)
        return torch.from_numpy(out)  # (never kept in ctx: the node would keep its own output alive)

    @staticmethod
    def backward(ctx, grad):
        check_versions(ctx.versions)
        owner, table, record = ctx.lookup
        optimizer = owner.fused_optimizer
        if optimizer is None or owner.storage is not table:
            backward_impl(Pending(owner, [table], [context_of(table, record)], False, False), grad)
        elif grad.numel():  # (no bags: no update)
            backward_one(table, record, _grad_rows(grad, table.dim), _optimizer_arguments(table, optimizer.lr))
        return None, None


class _NoNode:
    """Where TableLookup.forward leaves its record when no backward will follow (one a call)."""
    __slots__ = ("lookup", "versions")


def input_versions(*inputs) -> tuple:
    """(tensor, its version counter) for each tensor among `inputs` (None and NumPy arrays
    skipped): the IDs, offsets and weights a lookup's backward reads again (the slots come from
    the forward, but the bags, the weights and the hooks' IDs from these arrays). 0.1 us a
    tensor; torch's own saved tensors cost more and must be inputs or outputs."""
    return tuple((t, t._version) for t in inputs if isinstance(t, torch.Tensor))


def check_versions(versions: tuple) -> None:
    """What autograd does for the tensors a node saved (nn.EmbeddingBag raises so): a tensor
    the forward read and the backward reads again was changed in place in between. Raised
    before any row or hook sees the gradient: the tables are unchanged."""
    for tensor, version in versions:
        if tensor._version != version:
            raise RuntimeError(
                "one of the inputs of a cncore lookup (its IDs, offsets or per-sample weights, "
                f"{tensor.dtype} of shape {tuple(tensor.shape)}) was modified by an inplace operation between the "
                f"forward and the backward: it is at version {tensor._version}; expected version {version}. The "
                "backward reads them again; clone them before reusing their memory. Nothing was updated")


# Function.apply minus its Python wrapper, which checks for functorch transforms and their
# dead wrappers and then calls this: 2.4 us of a 7 us apply (a bare Function, batch 1). The
# call tuple holds no tensor and the anchor is the module's own parameter, and the modules
# never take this path under a transform (modules._fast_ids), so the wrapper has nothing to do.
_apply_table = super(torch.autograd.Function, TableLookup).apply


def lookup_training(anchor: torch.Tensor, training: bool) -> bool:
    """Whether a lookup runs as a training one (inserting unseen IDs, recording the rows'
    accesses): in training mode, with gradients on, for a module whose rows can train (its
    anchor requires grad). Under `torch.no_grad()` (a validation loop without `.eval()`) and for
    a frozen module (`requires_grad_(False)`) it reads as in eval mode: unseen IDs give zero
    rows and nothing is inserted.

    Args:
        anchor (torch.Tensor): the module's anchor parameter.
        training (bool): the module's `training`.

    Returns:
        bool: the lookup's `training`.

    >>> anchor = torch.nn.Parameter(torch.empty(0))
    >>> lookup_training(anchor, True), lookup_training(anchor.requires_grad_(False), True)
    (True, False)
    >>> with torch.no_grad():
    ...     lookup_training(anchor.requires_grad_(True), True)
    False
    """
    return training and torch.is_grad_enabled() and anchor.requires_grad


def lookup_table(owner, keys, offsets, mode: int, training: bool, shape=None, inputs=()) -> torch.Tensor:
    """The modules' eager lookup of their one table in the core, no per-sample weights (see
    TableLookup), with no functorch transform active: keys (N,) int64 and offsets (B+1,)
    int64 as NumPy arrays; `inputs`: the caller's tensors they are views of, which the backward
    checks were not changed in place since (check_versions). Under torch.no_grad(), or for a
    frozen module, no context is kept and nothing is inserted (`lookup_training`)."""
    anchor = owner._parameters["_anchor"]
    if not torch.is_grad_enabled() or not anchor.requires_grad:  # (no backward: its record dies here)
        return TableLookup.forward(_NoNode(), None, (owner, keys, offsets, mode, False, shape, inputs))
    return _apply_table(anchor, (owner, keys, offsets, mode, training, shape, inputs))


def lookup(anchor, owner, keys, offsets, weights, modes, training: bool, split: bool = False, inputs: tuple = ()):
    """The eager lookup of `owner`'s tables (see the module docstring); weights: a list with
    None for unweighted features. Under torch.no_grad() no backward can follow: the lookup
    runs without autograd and keeps no contexts (the evaluation path: ~30 us less a call).
    It inserts only where a backward can train the rows (`lookup_training`). `inputs`: the
    tensors that keys, offsets or weights given as NumPy arrays are views of, which the
    backward checks were not changed in place since (`check_versions`)."""
    if torch.jit.is_tracing():
        _refuse_jit_trace(owner)
    training = lookup_training(anchor, training)
    if not torch.is_grad_enabled():
        out, _ = forward_impl(owner, owner._lookup_tables(), keys, offsets, weights, modes, training, split,
                              backward=False)
        return tuple(out) if split else out
    return Lookup.apply(anchor, (owner, modes, training, split, keys, offsets, inputs), *weights)


def _refuse_jit_trace(owner):
    """torch.jit.trace records tensor operations; this lookup runs in the core, where the tracer
    cannot see it: the IDs reach it inside a Python tuple, which a trace would keep as a
    constant. Unrefused, tracing failed with errors that named nothing of ours (`TypeError:
    unsupported operand type(s) for *: 'numpy.ndarray' and 'Tensor'` through the modules'
    fast path, `RuntimeError: unordered_map::at` through Lookup), and the operator
    (`cncore::lookup`) is refused by the tracer for its list of optional weights. Refused
    before any table changes."""
    raise RuntimeError(f"torch.jit.trace cannot record the lookup of {type(owner).__name__}: its rows live in the "
                       "cncore tables, outside TorchScript, so a trace would replay the IDs it was traced with. Run "
                       "the model eagerly, with torch.compile (the lookup is one operator), or torch.fx.symbolic_trace "
                       "(one node); the table is unchanged")

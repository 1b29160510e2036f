"""The traced side of the lookups: how a call reaches the core, and the gradient calls.

Below both `cncore_jax.table` (whose `Table.lookup` / `Table.apply_gradients` call in here)
and `cncore_jax.lookup` (the functional API, which checks its tables are `Table` handles and
calls in here): nothing here needs the `Table` class, only handles with a `dim` and a store
(`cncore_jax._host` reads them). See `cncore_jax.lookup` for the route (`set_boundary`), the
`custom_vjp` and the contexts.
"""
from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback
from jax.typing import ArrayLike

from cncore_jax import _ffi, _host
from cncore_jax._checks import as_flag, as_int_array, as_mode, as_weights, per_feature

__all__ = ["LookupRef", "SparseGrad", "set_boundary", "pooled_lookup", "apply_gradients", "accumulate_gradients",
           "discard", "discard_pending"]


@dataclass(frozen=True)
class _Spec:
    """What is fixed when tracing: the tables, and each feature's pooling and layout."""
    tables: tuple[Any, ...]  # cncore_jax.Table handles, checked by the caller
    modes: tuple[str, ...]
    is_lengths: tuple[bool, ...]
    weighted: tuple[int | None, ...]  # padded id count of each weighted feature, else None
    training: bool
    n_bags: int
    fused: bool = False  # the update runs in the backward pass (the modules' route)
    axis_name: Any = None  # data parallel: one lookup of every device's batch, one update

    @property
    def width(self) -> int:
        return sum(t.dim for t in self.tables)


class TableHandle(Protocol):
    """What a lookup's reference reads of its tables (`cncore_jax.Table`): their row width."""

    @property
    def dim(self) -> int: ...


# LookupRef's static pytree data: tables, n_bags, id_counts, id_dtypes, axis_name.
_RefAux = tuple[tuple[TableHandle, ...], int, tuple[int, ...], tuple[str, ...], Hashable | None]


@jax.tree_util.register_pytree_node_class
class LookupRef:
    """Refers to a lookup's context, kept on the host until its gradient is applied (or
    accumulated) once. A pytree: it may leave one jitted function and enter another. Made by
    the lookups (`cncore_jax.lookup`, `grouped_lookup`, `Table.lookup`), not by hand.

    Args:
        token (jax.Array): the int64 scalar naming the context on the host.
        tables (tuple[TableHandle, ...]): the lookup's tables (`cncore_jax.Table`), one per feature.
        n_bags (int): B, the bags of every feature.
        id_counts (tuple[int, ...]): each feature's (padded) ID count.
        id_dtypes (tuple[str, ...]): each feature's ID dtype.
        axis_name (Hashable | None): the named axis the batch was split over, or None.

    Example::

        >>> import jax.numpy as jnp, cncore_jax as cj
        >>> t = cj.Table(dim=2)
        >>> out, ctx = cj.lookup(t, jnp.array([1, 2, 3]), jnp.array([2, 1]))
        >>> ctx.n_bags, ctx.width, ctx.id_counts
        (2, 2, (3,))
        >>> cj.discard(ctx)
    """

    def __init__(self, token: jax.Array, tables: tuple[TableHandle, ...], n_bags: int, id_counts: tuple[int, ...],
                 id_dtypes: tuple[str, ...], axis_name: Hashable | None = None) -> None:
        self.token, self.tables, self.n_bags = token, tables, n_bags
        self.id_counts, self.id_dtypes, self.axis_name = id_counts, id_dtypes, axis_name

    @property
    def width(self) -> int:
        return sum(t.dim for t in self.tables)

    def tree_flatten(self) -> tuple[tuple[jax.Array], _RefAux]:
        """JAX's pytree protocol: the token is the one leaf, the rest static data.

        Returns:
            tuple: ((token,), (tables, n_bags, id_counts, id_dtypes, axis_name)).
        """
        return (self.token,), (self.tables, self.n_bags, self.id_counts, self.id_dtypes, self.axis_name)

    @classmethod
    def tree_unflatten(cls, aux: _RefAux, children: tuple[jax.Array]) -> LookupRef:
        """JAX's pytree protocol: the reference rebuilt from its token and static data.

        Args:
            aux (tuple): the static data `tree_flatten` returned (tables, n_bags, id_counts,
                id_dtypes, axis_name).
            children (tuple[jax.Array]): the token.

        Returns:
            LookupRef: the reference.
        """
        return cls(children[0], *aux)

    def __repr__(self) -> str:
        return f"LookupRef(token={self.token}, tables={len(self.tables)}, n_bags={self.n_bags})"


class SparseGrad(NamedTuple):
    """The gradient of one table's distinct looked-up rows, padded to a fixed shape:
    ids[:count] (first-occurrence order) and rows[:count]; the rest is zeros."""
    ids: jax.Array
    rows: jax.Array
    count: jax.Array  # type: ignore[assignment]  # the public field shadows tuple.count, as named


_BOUNDARY = ["callback"]


def set_boundary(route: str) -> str:
    """How traced code reaches the core from now on (for functions traced after the call):
    "callback" (default): `io_callback(ordered=True)`, JAX's ordered effect, so every call of
    the program runs in program order; "ffi": an XLA FFI custom call declared with side effects
    (`cncore_jax._ffi`, compiled on first use), a fraction of the fixed cost, but ordered only
    by data (a lookup before its own update; independent calls in one program in any order).

    Args:
        route (str): "callback" or "ffi".

    Returns:
        str: the previous route.

    Example::

        >>> import cncore_jax as cj
        >>> previous = cj.set_boundary("callback")
        >>> cj.set_boundary(previous)
        'callback'
    """
    if route not in ("callback", "ffi"):
        raise ValueError(f"route: expected 'callback' or 'ffi', got {route!r}")
    if route == "ffi" and not _ffi.available():
        raise RuntimeError(f"route 'ffi' is unavailable here: {_ffi.unavailable_reason()}")
    previous, _BOUNDARY[0] = _BOUNDARY[0], route
    return previous


def _call(host_fn, result_shape, *args, write_into: bool = False):
    try:
        if _BOUNDARY[0] == "ffi":
            return _ffi.call(host_fn, result_shape, *args, write_into=write_into)
        return io_callback(host_fn, result_shape, *args, ordered=True)
    except (ValueError, NotImplementedError) as e:
        if "vmap" in str(e):
            raise TypeError("cncore_jax: a lookup or update cannot run under jax.vmap: it inserts and updates "
                            "rows, effects that must happen once, in order. Call it on the whole batch (its "
                            "bags are the batch dimension).") from None
        raise


def _run(spec: _Spec, keep: bool, ids, bags, weights, refuse: str = ""):
    if spec.axis_name is not None:
        return _run_gathered(spec, keep, ids, bags, refuse)
    shape = (jax.ShapeDtypeStruct((spec.n_bags, spec.width), jnp.float32), jax.ShapeDtypeStruct((), jnp.int32))
    fn = partial(_host.forward, spec.tables, spec.modes, spec.is_lengths, spec.training, keep, refuse=refuse)
    return _call(fn, shape, ids, bags, weights, write_into=True)


def _run_gathered(spec: _Spec, keep: bool, ids, bags, refuse: str):
    """Data parallel: every device's batch is gathered, the device of index 0 looks up their
    concatenation in one core call (the others' callbacks do nothing), the pooled rows are
    shared with a psum (zeros elsewhere: exact) and each device keeps its own bags."""
    axis = spec.axis_name
    index = jax.lax.axis_index(axis)
    all_ids = tuple(jax.lax.all_gather(k, axis) for k in ids)
    all_bags = tuple(jax.lax.all_gather(b, axis) for b in bags)
    n_dev = all_ids[0].shape[0]
    shape = (jax.ShapeDtypeStruct((n_dev * spec.n_bags, spec.width), jnp.float32),
             jax.ShapeDtypeStruct((), jnp.int32))
    fn = partial(_host.forward_gathered, spec.tables, spec.modes, spec.is_lengths, spec.training, keep,
                 refuse=refuse)
    out, token = _call(fn, shape, index, all_ids, all_bags)
    out, token = jax.lax.psum((out, token), axis)
    return jax.lax.dynamic_slice_in_dim(out, index * spec.n_bags, spec.n_bags), token


def _update_in_backward(spec: _Spec, token, g_out, after):
    """The modules' fused update, run by the lookup's backward: once per differentiation, in
    program order (an ordered effect); `after` (the weights' gradients) orders it after them
    on the FFI route too, which orders by data only."""
    if spec.axis_name is None:
        _call(partial(_host.apply_in_backward, spec.tables), None, token, g_out, after)
        return
    index = jax.lax.axis_index(spec.axis_name)
    all_g = jax.lax.all_gather(g_out, spec.axis_name)
    _call(partial(_host.apply_gathered, spec.tables), None, index, token, all_g)


def _keep(spec: _Spec, differentiating: bool) -> bool:
    # Training lookups keep their context for the update; a differentiated evaluation lookup
    # keeps it only when its weights' gradient needs the rows.
    return spec.training or (differentiating and any(n is not None for n in spec.weighted))


NOT_DIFFERENTIATED = (
    "cncore_jax: a module's training lookup ran outside differentiation, so its gradient can never reach "
    "the table; it is refused and nothing was inserted. Train with the loss differentiated over the model: "
    "nnx.value_and_grad(loss_fn)(model) (a table is an nnx.Param, cncore_jax.modules.TableState, so the "
    "default wrt=nnx.Param trains it; a filter that leaves TableState out cannot), under nnx.jit or jax.jit; "
    "for a forward pass that only reads, call model.eval() first.")


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _lookup(spec, ids, bags, weights, sink):
    # Not differentiated: a module's training lookup would insert rows that no update can reach.
    refuse = NOT_DIFFERENTIATED if spec.fused and spec.training else ""
    return _run(spec, _keep(spec, False), ids, bags, weights, refuse=refuse)


def _lookup_fwd(spec, ids, bags, weights, sink):
    out, token = _run(spec, _keep(spec, True), ids, bags, weights)
    return (out, token), token


def _lookup_bwd(spec, token, cotangents):
    g_out = cotangents[0]
    g_weights = [None] * len(spec.tables)
    padded = [n for n in spec.weighted if n is not None]
    if padded:
        shapes = tuple(jax.ShapeDtypeStruct((n,), jnp.float32) for n in padded)
        grads = iter(_call(partial(_host.weight_grads, spec.tables), shapes, token, g_out, tuple(spec.weighted)))
        g_weights = [None if n is None else next(grads) for n in spec.weighted]
    if not spec.fused:
        return None, None, tuple(g_weights), g_out
    if spec.training:
        _update_in_backward(spec, token, g_out, tuple(g for g in g_weights if g is not None))
    return None, None, tuple(g_weights), jnp.zeros((), jnp.float32)  # the tap's cotangent: always 0


_lookup.defvjp(_lookup_fwd, _lookup_bwd)


def pooled_lookup(tables, ids, lengths=None, *, offsets=None, modes="sum", weights=None, training: bool = True,
                  sink=None, tap=None, axis_name=None):
    """`cncore_jax.grouped_lookup` on tables already checked to be `Table` handles: the same
    arguments, checks and result. `tap` (the modules' route): a float32 scalar, the value of
    the tables' `TableState`, whose differentiation runs the fused update in the backward pass;
    the result's ctx is then None. `axis_name`: the named axis of pmap / shard_map over which
    the batch is split (one lookup of every device's bags, one update of their gradients)."""
    n = len(tables)
    if not isinstance(ids, (list, tuple)) or len(ids) != n:
        raise ValueError(f"ids: expected a list with one array per table ({n})")
    lengths = per_feature(lengths, n, "lengths")
    offsets = per_feature(offsets, n, "offsets")
    weights = per_feature(weights, n, "weights")
    modes = per_feature([modes] * n if isinstance(modes, str) else modes, n, "modes")
    training = as_flag(training, "training")
    id_arrays, bag_arrays, w_arrays, is_lengths, weighted, modes_ok = [], [], [], [], [], []
    n_bags = None
    for f in range(n):
        k = as_int_array(ids[f], f"ids[{f}]", "ids")
        if (lengths[f] is None) == (offsets[f] is None):
            raise ValueError(f"table {f}: give exactly one of lengths (B,) or offsets (B+1,)")
        if lengths[f] is not None:
            b = as_int_array(lengths[f], f"lengths[{f}]", "bag lengths")
            bags_here = b.shape[0]
        else:
            b = as_int_array(offsets[f], f"offsets[{f}]", "bag offsets")
            if b.shape[0] == 0:
                raise ValueError(f"offsets[{f}]: needs B+1 >= 1 entries")
            bags_here = b.shape[0] - 1
        if n_bags is None:
            n_bags = bags_here
        elif bags_here != n_bags:
            raise ValueError(f"table {f}: has {bags_here} bags, table 0 has {n_bags}; all share B")
        mode = as_mode(modes[f], f"modes[{f}]" if n > 1 else "mode")
        w = None if weights[f] is None else as_weights(weights[f], f"weights[{f}]" if n > 1 else "weights",
                                                      k.shape[0], mode)
        id_arrays.append(k)
        bag_arrays.append(b)
        w_arrays.append(w)
        is_lengths.append(lengths[f] is not None)
        weighted.append(None if w is None else k.shape[0])
        modes_ok.append(mode)
    if axis_name is not None and any(w is not None for w in w_arrays):
        raise ValueError(f"weights: per-sample weights are not supported with axis_name={axis_name!r} (data "
                         "parallel); look up without weights, or without axis_name on one device")
    assert n_bags is not None  # the callers pass at least one table
    spec = _Spec(tuple(tables), tuple(modes_ok), tuple(is_lengths), tuple(weighted), training, n_bags,
                 fused=tap is not None, axis_name=axis_name)
    if tap is not None:
        if sink is not None:
            raise ValueError("sink: a module's lookup updates its tables in the backward pass; it has no sink")
        tap = jnp.asarray(tap)
        if tap.shape != () or tap.dtype != jnp.float32:
            raise TypeError(f"tap: expected the float32 scalar of a TableState, got {tap.dtype}{list(tap.shape)}")
        out, _ = _lookup(spec, tuple(id_arrays), tuple(bag_arrays), tuple(w_arrays), tap)
        return out, None
    if sink is not None:
        sink = jnp.asarray(sink)
        if sink.shape != (n_bags, spec.width):
            raise ValueError(f"sink: expected shape ({n_bags}, {spec.width}), the output's, got {sink.shape}")
        sink = sink.astype(jnp.float32)
    out, token = _lookup(spec, tuple(id_arrays), tuple(bag_arrays), tuple(w_arrays), sink)
    ref = LookupRef(token, spec.tables, n_bags, tuple(k.shape[0] for k in id_arrays),
                    tuple(str(k.dtype) for k in id_arrays), axis_name)
    return out, ref


def _as_ref(ctx) -> LookupRef:
    if not isinstance(ctx, LookupRef):
        raise TypeError(f"ctx: expected the LookupRef returned by a cncore_jax lookup, got {type(ctx).__name__}")
    return ctx


def _as_grad(ctx: LookupRef, grad):
    if not hasattr(grad, "shape") or not hasattr(grad, "dtype"):
        raise TypeError(f"grad: expected an array, got {type(grad).__name__}")
    if tuple(grad.shape) != (ctx.n_bags, ctx.width):
        raise ValueError(f"grad: expected shape ({ctx.n_bags}, {ctx.width}), the lookup's output, got "
                         f"{tuple(grad.shape)}")
    if jnp.dtype(grad.dtype).kind != "f":
        raise TypeError(f"grad: expected a floating-point array, got {grad.dtype}")
    return jnp.asarray(grad, jnp.float32)


def apply_gradients(ctx: LookupRef, grad: ArrayLike, *, lr: ArrayLike | None = None) -> None:
    """The fused update: update every row the lookup used and its optimizer state in place,
    with each table's own optimizer. Runs once, in program order, after the lookup; a second
    call for one lookup is refused.

    Args:
        ctx (LookupRef): the lookup's context.
        grad (ArrayLike): (B, sum of dims) float32, d(loss)/d(out).
        lr (ArrayLike | None): a learning rate for this step (a number or a traced scalar,
            e.g. from a schedule), or None (each optimizer's own).

    Example::

        >>> import jax.numpy as jnp, cncore, cncore_jax as cj
        >>> t = cj.Table(dim=1, initializer=cncore.Constant(1.0), optimizer=cncore.SGD(lr=1.0))
        >>> out, ctx = cj.lookup(t, jnp.array([7]), jnp.array([1]))
        >>> cj.apply_gradients(ctx, jnp.array([[0.25]]), lr=2.0)
        >>> t.store.lookup([7]).tolist()
        [[0.5]]
    """
    ctx = _as_ref(ctx)
    grad = _as_grad(ctx, grad)
    if ctx.axis_name is not None:
        if lr is not None:
            raise ValueError(f"lr: a learning rate override is not supported with axis_name={ctx.axis_name!r}; "
                             "set the table's optimizer (Table.store.set_optimizer) instead")
        index = jax.lax.axis_index(ctx.axis_name)
        _call(partial(_host.apply_gathered, ctx.tables), None, index, ctx.token,
              jax.lax.all_gather(grad, ctx.axis_name))
        return
    args = (ctx.token, grad) if lr is None else (ctx.token, grad, jnp.asarray(lr, jnp.float32))

    def host(token, g, rate=None):
        _host.apply(ctx.tables, token, g, rate)

    _call(host, None, *args)


def accumulate_gradients(ctx: LookupRef, grad: ArrayLike) -> list[SparseGrad]:
    """The non-fused backward, for updating rows yourself (e.g. with optax). Consumes the
    context, and records the accesses of a training lookup as `apply_gradients` does.

    Args:
        ctx (LookupRef): the lookup's context.
        grad (ArrayLike): (B, sum of dims) float32, d(loss)/d(out).

    Returns:
        list[SparseGrad]: one per table of the lookup, padded to that table's ID count: ids,
        rows (count, dim) summed per distinct ID, and count.

    >>> import jax.numpy as jnp, cncore, cncore_jax as cj
    >>> t = cj.Table(dim=1)
    >>> out, ctx = cj.lookup(t, jnp.array([4, 4, 9, 0], jnp.int32), jnp.array([2, 1], jnp.int32))
    >>> (g,) = cj.accumulate_gradients(ctx, jnp.array([[1.0], [10.0]]))
    >>> g.ids.tolist(), g.rows[:, 0].tolist(), int(g.count)    # 4 twice in bag 0; 0 was padding
    ([4, 9, 0, 0], [2.0, 10.0, 0.0, 0.0], 2)
    """
    ctx = _as_ref(ctx)
    grad = _as_grad(ctx, grad)
    if ctx.axis_name is not None:
        raise ValueError(f"ctx: accumulate_gradients is not supported for a lookup with axis_name="
                         f"{ctx.axis_name!r}; use apply_gradients(ctx, grad)")
    # The result's structure: a SparseGrad per table whose fields are ShapeDtypeStructs.
    shapes = tuple(SparseGrad._make((jax.ShapeDtypeStruct((n,), jnp.dtype(dt)),
                                     jax.ShapeDtypeStruct((n, t.dim), jnp.float32),
                                     jax.ShapeDtypeStruct((), jnp.int32)))
                   for t, n, dt in zip(ctx.tables, ctx.id_counts, ctx.id_dtypes))

    def host(token, g):
        out = []
        for (keys, rows), s in zip(_host.accumulate(ctx.tables, token, g), shapes):
            ids = np.zeros(s.ids.shape, s.ids.dtype)
            ids[:len(keys)] = keys
            full = np.zeros(s.rows.shape, np.float32)
            full[:len(keys)] = rows
            out.append(SparseGrad(ids, full, np.int32(len(keys))))
        return tuple(out)

    return list(_call(host, shapes, ctx.token, grad))


def discard(ctx: LookupRef) -> None:
    """Drop a lookup's context without updating anything (a step you abandon on purpose).
    Not needed for correctness: forgotten contexts are dropped once too many wait.

    Args:
        ctx (LookupRef): the lookup's context.

    Example::

        >>> import jax.numpy as jnp, cncore_jax as cj
        >>> out, ctx = cj.lookup(cj.Table(dim=2), jnp.array([1]), jnp.array([1]))
        >>> cj.discard(ctx)
    """
    ctx = _as_ref(ctx)
    _call(lambda token: _host.REGISTRY.discard(token) and None, None, ctx.token)


def discard_pending() -> int:
    """Drop every context still waiting for its gradient (their rows stay, untrained), after
    the steps this thread dispatched have run; returns how many. Outside `jit`: what to call
    once a training lookup was refused because too many wait.

    Returns:
        int: how many contexts were dropped.

    >>> import cncore_jax as cj
    >>> cj.discard_pending() >= 0
    True
    """
    jax.effects_barrier()
    return _host.REGISTRY.discard_all()

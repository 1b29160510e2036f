"""The traced side of the lookups: how a call reaches the core, and the gradient calls.

Below both `cncore_jax.table` (whose `Table.lookup` / `Table.apply_gradients` call in here)
and `cncore_jax.lookup` (the functional API, which checks its tables are `Table` handles and
calls in here): nothing here needs the `Table` class, only handles with a `dim` and a store
(`cncore_jax._host` reads them). See `cncore_jax.lookup` for the route (`set_boundary`), the
`custom_vjp` and the contexts.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from cncore_jax import _ffi, _host
from cncore_jax._checks import as_flag, as_int_array, as_mode, as_weights, per_feature

__all__ = ["LookupRef", "SparseGrad", "set_boundary", "pooled_lookup", "apply_gradients", "accumulate_gradients",
           "discard"]


@dataclass(frozen=True)
class _Spec:
    """What is fixed when tracing: the tables, and each feature's pooling and layout."""
    tables: tuple[Any, ...]  # cncore_jax.Table handles, checked by the caller
    modes: tuple[str, ...]
    is_lengths: tuple[bool, ...]
    weighted: tuple[int | None, ...]  # padded id count of each weighted feature, else None
    training: bool
    n_bags: int

    @property
    def width(self) -> int:
        return sum(t.dim for t in self.tables)


@jax.tree_util.register_pytree_node_class
class LookupRef:
    """Refers to a lookup's context, kept on the host until its gradient is applied (or
    accumulated) once. A pytree: it may leave one jitted function and enter another."""

    def __init__(self, token, tables, n_bags, id_counts, id_dtypes):
        self.token, self.tables, self.n_bags = token, tables, n_bags
        self.id_counts, self.id_dtypes = id_counts, id_dtypes

    @property
    def width(self) -> int:
        return sum(t.dim for t in self.tables)

    def tree_flatten(self):
        return (self.token,), (self.tables, self.n_bags, self.id_counts, self.id_dtypes)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], *aux)

    def __repr__(self) -> str:
        return f"LookupRef(token={self.token}, tables={len(self.tables)}, n_bags={self.n_bags})"


class SparseGrad(NamedTuple):
    """The gradient of one table's distinct looked-up rows, padded to a fixed shape:
    ids[:count] (first-occurrence order) and rows[:count]; the rest is zeros."""
    ids: jax.Array
    rows: jax.Array
    count: jax.Array


_BOUNDARY = ["callback"]


def set_boundary(route: str) -> str:
    """How traced code reaches the core from now on (for functions traced after the call):
    "callback" (default): `io_callback(ordered=True)`, JAX's ordered effect, so every call of
    the program runs in program order; "ffi": an XLA FFI custom call declared with side effects
    (`cncore_jax._ffi`, compiled on first use), a fraction of the fixed cost, but ordered only
    by data (a lookup before its own update; independent calls in one program in any order).
    Returns the previous route."""
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


def _run(spec: _Spec, keep: bool, ids, bags, weights):
    shape = (jax.ShapeDtypeStruct((spec.n_bags, spec.width), jnp.float32), jax.ShapeDtypeStruct((), jnp.int32))
    fn = partial(_host.forward, spec.tables, spec.modes, spec.is_lengths, spec.training, keep)
    return _call(fn, shape, ids, bags, weights, write_into=True)


def _keep(spec: _Spec, differentiating: bool) -> bool:
    # Training lookups keep their context for the update; a differentiated evaluation lookup
    # keeps it only when its weights' gradient needs the rows.
    return spec.training or (differentiating and any(n is not None for n in spec.weighted))


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _lookup(spec, ids, bags, weights, sink):
    return _run(spec, _keep(spec, False), ids, bags, weights)


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
    return None, None, tuple(g_weights), g_out


_lookup.defvjp(_lookup_fwd, _lookup_bwd)


def pooled_lookup(tables, ids, lengths=None, *, offsets=None, modes="sum", weights=None, training: bool = True,
                  sink=None):
    """`cncore_jax.grouped_lookup` on tables already checked to be `Table` handles: the same
    arguments, checks and result."""
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
    spec = _Spec(tuple(tables), tuple(modes_ok), tuple(is_lengths), tuple(weighted), training, n_bags)
    if sink is not None:
        sink = jnp.asarray(sink)
        if sink.shape != (n_bags, spec.width):
            raise ValueError(f"sink: expected shape ({n_bags}, {spec.width}), the output's, got {sink.shape}")
        sink = sink.astype(jnp.float32)
    out, token = _lookup(spec, tuple(id_arrays), tuple(bag_arrays), tuple(w_arrays), sink)
    ref = LookupRef(token, spec.tables, n_bags, tuple(k.shape[0] for k in id_arrays),
                    tuple(str(k.dtype) for k in id_arrays))
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


def apply_gradients(ctx, grad, *, lr=None) -> None:
    """The fused update: given d(loss)/d(out) (B, sum of dims), update every row the lookup
    used and its optimizer state in place, with each table's own optimizer; `lr` (a number or
    a traced scalar, e.g. from a schedule) overrides the learning rate for this step. Runs
    once, in program order, after the lookup; a second call for one lookup is refused."""
    ctx = _as_ref(ctx)
    grad = _as_grad(ctx, grad)
    args = (ctx.token, grad) if lr is None else (ctx.token, grad, jnp.asarray(lr, jnp.float32))

    def host(token, g, rate=None):
        _host.apply(ctx.tables, token, g, rate)

    _call(host, None, *args)


def accumulate_gradients(ctx, grad):
    """The non-fused backward, for updating rows yourself (e.g. with optax): one `SparseGrad`
    per table of the lookup, padded to that table's id count. Consumes the context, and
    records the accesses of a training lookup as `apply_gradients` does.

    >>> import jax.numpy as jnp, cncore, cncore_jax as cj
    >>> t = cj.Table(dim=1)
    >>> out, ctx = cj.lookup(t, jnp.array([4, 4, 9, 0], jnp.int32), jnp.array([2, 1], jnp.int32))
    >>> (g,) = cj.accumulate_gradients(ctx, jnp.array([[1.0], [10.0]]))
    >>> g.ids.tolist(), g.rows[:, 0].tolist(), int(g.count)    # 4 twice in bag 0; 0 was padding
    ([4, 9, 0, 0], [2.0, 10.0, 0.0, 0.0], 2)
    """
    ctx = _as_ref(ctx)
    grad = _as_grad(ctx, grad)
    shapes = tuple(SparseGrad(jax.ShapeDtypeStruct((n,), jnp.dtype(dt)), jax.ShapeDtypeStruct((n, t.dim), jnp.float32),
                              jax.ShapeDtypeStruct((), jnp.int32))
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


def discard(ctx) -> None:
    """Drop a lookup's context without updating anything (a step you abandon on purpose).
    Not needed for correctness: forgotten contexts are dropped once too many wait."""
    ctx = _as_ref(ctx)
    _call(lambda token: _host.REGISTRY.discard(token) and None, None, ctx.token)

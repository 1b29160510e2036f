"""Pooled lookups and their gradients, usable under `jax.jit`: the functional API.

One training step, as a jitted function (the pattern of jax-tpu-embedding: the activations
are an input of the loss, their gradient is what the table's update needs):

    pooled, ctx = cj.lookup(table, ids, lengths)                 # inserts unseen IDs
    loss, (g_params, g_pooled) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, pooled)
    cj.apply_gradients(ctx, g_pooled)                            # fused update, in the core

How it reaches the core (`set_boundary`): by default `jax.experimental.io_callback(...,
ordered=True)`. An ordered callback runs exactly once per execution, in program order, and is
never dropped, merged or replayed by XLA (a `pure_callback` may be any of these, which would
lose or repeat inserts). `set_boundary("ffi")` uses an XLA FFI custom call instead
(`cncore_jax._ffi`), declared with side effects so XLA keeps it: a fraction of the fixed cost
and no copy of the output, but ordered only by data (a lookup before its update; two
independent calls in one program may swap). The default is the route whose ordering JAX
guarantees; `asv_bench/scripts/jax_boundary.py` measures both. Under either route, `vmap` of a lookup
or update is refused with a TypeError (a batch of bags is already the batched form), and JAX
itself refuses `jax.checkpoint` (remat) around one, which would repeat the lookup.

The lookup is a `jax.custom_vjp`: when a loss is differentiated through it, the cotangent of
its output is the gradient of the pooled rows (exposed through `sink`, an argument whose
cotangent is that gradient), and per-sample weights get their gradient
(<bag gradient, row>, / length for mean). A functional lookup never updates inside autodiff:
its update is the explicit `apply_gradients` call, which JAX cannot replay or drop. (The Flax
NNX modules, `cncore_jax.modules`, differentiate a `TableState` instead, and their lookup's
backward runs the update: the usual NNX train step.)

How a traced program refers to the lookup's host-side context: the lookup's callback keeps
the contexts in a bounded registry (`cncore_jax._host`) and returns an int32 token; the
returned `LookupRef` carries it. `apply_gradients` / `accumulate_gradients` take it out.

Shapes stay fixed under `jit` while the number of IDs varies: IDs past the last bag (the sum
of `lengths`, or the last offset) are padding and ignored (their weight gradients are 0).

>>> import jax, jax.numpy as jnp, numpy as np, cncore, cncore_jax as cj
>>> table = cj.Table(dim=2, initializer=cncore.Constant(1.0), optimizer=cncore.SGD(lr=0.5))
>>> @jax.jit
... def step(ids, lengths):
...     pooled, ctx = cj.lookup(table, ids, lengths)
...     loss, g = jax.value_and_grad(lambda p: p.sum())(pooled)
...     cj.apply_gradients(ctx, g)
...     return pooled
>>> step(jnp.array([7, 8, 7, 0], jnp.int32), jnp.array([2, 1], jnp.int32)).tolist()  # last id: padding
[[2.0, 2.0], [1.0, 1.0]]
>>> table.store.lookup(np.array([7, 8, 0])).tolist()   # 7 twice: 1 - 0.5 * 2; 0 was padding
[[0.0, 0.0], [0.5, 0.5], [0.0, 0.0]]
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence

import jax
from jax.typing import ArrayLike

from cncore_jax._traced import (
    LookupRef,
    SparseGrad,
    accumulate_gradients,
    apply_gradients,
    discard,
    discard_pending,
    pooled_lookup,
    set_boundary,
)
from cncore_jax.table import Table

__all__ = ["lookup", "grouped_lookup", "apply_gradients", "accumulate_gradients", "discard", "discard_pending",
           "LookupRef",
           "SparseGrad", "set_boundary"]


def grouped_lookup(tables: Sequence[Table], ids: Sequence[ArrayLike],
                   lengths: Sequence[ArrayLike | None] | None = None, *,
                   offsets: Sequence[ArrayLike | None] | None = None, modes: str | Sequence[str] = "sum",
                   weights: Sequence[ArrayLike | None] | None = None, training: bool = True,
                   sink: ArrayLike | None = None, axis_name: Hashable | None = None) -> tuple[jax.Array, LookupRef]:
    """Pooled lookup of several tables in one core call: feature f pools ids[f] in tables[f].
    Every feature has B bags; IDs past the last bag are padding.

    Args:
        tables (Sequence[Table]): F tables, one per feature (a table may appear twice).
        ids (Sequence[ArrayLike]): F 1-D int32/int64 arrays (int64 needs `jax_enable_x64`;
            int32 is widened).
        lengths (Sequence[ArrayLike | None] | None): F (B,) bag lengths; or give `offsets`
            (per feature one or the other).
        offsets (Sequence[ArrayLike | None] | None): F (B + 1,) bag offsets.
        modes (str | Sequence[str]): "sum", "mean" or "max", one for all or one per feature.
        weights (Sequence[ArrayLike | None] | None): F (N_f,) float arrays or None (sum and mean
            only).
        training (bool): insert unseen IDs (True) or read them as zero rows and change nothing
            (False, evaluation).
        sink (ArrayLike | None): a (B, sum of dims) array whose value is ignored and whose
            cotangent is the gradient of the output.
        axis_name (Hashable | None): under `pmap` / `shard_map`, the named axis the batch is
            split over: the devices' bags are looked up as one batch (device order) and
            `apply_gradients` applies the sum of their gradients once, as one device would on
            the concatenated batch. Under a `jit` over a mesh, leave it None: the lookup
            already sees the whole batch.

    Returns:
        tuple[jax.Array, LookupRef]: out, (B, sum of dims) float32, feature f in its own column
        block; and ctx, for `apply_gradients` / `accumulate_gradients`.

    Example::

        >>> import jax.numpy as jnp, cncore, cncore_jax as cj
        >>> a, b = cj.Table(dim=1, initializer=cncore.Constant(1.0)), cj.Table(dim=2)
        >>> out, ctx = cj.grouped_lookup([a, b], [jnp.array([3, 4]), jnp.array([9])],
        ...                              [jnp.array([2]), jnp.array([1])])
        >>> out.shape, out[0, 0].item()
        ((1, 3), 2.0)
        >>> cj.discard(ctx)
    """
    if not isinstance(tables, (list, tuple)) or not tables:
        raise TypeError("tables: expected a non-empty list of cncore_jax.Table")
    for f, t in enumerate(tables):
        if not isinstance(t, Table):
            raise TypeError(f"tables[{f}]: expected a cncore_jax.Table, got {type(t).__name__}")
    return pooled_lookup(tables, ids, lengths, offsets=offsets, modes=modes, weights=weights, training=training,
                         sink=sink, axis_name=axis_name)


def lookup(table: Table, ids: ArrayLike, lengths: ArrayLike | None = None, *, offsets: ArrayLike | None = None,
           mode: str = "sum", weights: ArrayLike | None = None, training: bool = True, sink: ArrayLike | None = None,
           axis_name: Hashable | None = None) -> tuple[jax.Array, LookupRef]:
    """Pooled lookup of one table (`grouped_lookup` of one feature).

    Args:
        table (Table): the table.
        ids (ArrayLike): (N,) int32/int64 IDs.
        lengths (ArrayLike | None): (B,) bag lengths; or give `offsets`.
        offsets (ArrayLike | None): (B + 1,) bag offsets.
        mode (str): "sum", "mean" or "max".
        weights (ArrayLike | None): (N,) float per-ID weights (sum and mean only).
        training (bool): insert unseen IDs (True) or read them as zero rows (False).
        sink (ArrayLike | None): a (B, dim) array whose cotangent is the output's gradient.
        axis_name (Hashable | None): the named axis the batch is split over (see
            `grouped_lookup`).

    Returns:
        tuple[jax.Array, LookupRef]: the (B, dim) float32 pooled rows, and the lookup's
        context.

    Example::

    >>> import jax.numpy as jnp, cncore, cncore_jax as cj
    >>> t = cj.Table(dim=1, initializer=cncore.Constant(2.0))
    >>> out, ctx = cj.lookup(t, jnp.array([5, 6, 6], jnp.int32), offsets=jnp.array([0, 0, 3], jnp.int32),
    ...                      mode="mean", weights=jnp.array([1.0, 2.0, 3.0]))
    >>> out.tolist()                 # an empty bag, then (1*2 + 2*2 + 3*2) / 3
    [[0.0], [4.0]]
    """
    return grouped_lookup([table], [ids], None if lengths is None else [lengths],
                          offsets=None if offsets is None else [offsets], modes=mode,
                          weights=None if weights is None else [weights], training=training, sink=sink,
                          axis_name=axis_name)

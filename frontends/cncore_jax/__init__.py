"""cncore_jax: growable embedding tables for JAX.

The rows live in cncore's tables (host memory, any int64 key); JAX code reaches them through
ordered host callbacks that `jax.jit` keeps exactly once, in program order.

- `Table`: a handle on a table (a leafless pytree: static under `jit`), saved and loaded in
  the table file format every front end shares (`cncore.tablefile`).
- `lookup` / `grouped_lookup`: pooled lookups (sum, mean, max, per-sample weights) returning
  ``(out, ctx)``; a `jax.custom_vjp` gives weights their gradient.
- `apply_gradients(ctx, grad)`: the fused optimizer update, an explicit ordered step;
  `accumulate_gradients(ctx, grad)`: the non-fused alternative (`SparseGrad` per table).
- `set_boundary("callback" | "ffi")`: how traced code reaches the core (ordered io_callback,
  the default, or an XLA FFI custom call compiled on first use; see `cncore_jax.lookup`).
- `cncore_jax.modules.EmbeddingBag` / `EmbeddingBagCollection`: Flax NNX modules trained by
  the usual NNX step (`nnx.value_and_grad(loss_fn)(model)`; each table a `TableState`);
  `cncore_jax.checkpoint`: orbax checkpoints with the tables; `cncore_jax.frozen`: frozen
  tables for `jax.export`; `python examples/jax_dlrm.py`: a DLRM trained that way.
- `discard_pending()`: drop the contexts still waiting for their gradients (past
  `MAX_PENDING` of them a training lookup is refused; none is dropped silently).

>>> import jax, jax.numpy as jnp, cncore, cncore_jax as cj
>>> t = cj.Table(dim=2, initializer=cncore.Constant(1.0))
>>> out, ctx = cj.lookup(t, jnp.array([1, 2, 3], jnp.int32), jnp.array([2, 1], jnp.int32))
>>> out.tolist(), len(t)
([[2.0, 2.0], [1.0, 1.0]], 3)
"""
from cncore_jax.lookup import (
                               LookupRef,
                               SparseGrad,
                               accumulate_gradients,
                               apply_gradients,
                               discard,
                               discard_pending,
                               grouped_lookup,
                               lookup,
                               set_boundary,
)
from cncore_jax.table import Table

__all__ = ["Table", "lookup", "grouped_lookup", "apply_gradients", "accumulate_gradients", "discard", "discard_pending",
           "LookupRef",
           "SparseGrad", "set_boundary"]

"""Flax NNX modules over cncore tables.

NNX, not Linen: Flax 0.12's documentation presents NNX as the API for new code (Linen is kept
for existing code), and NNX's mutable modules fit a table that changes in place: the module
holds the `Table` handle as a plain static attribute, with no parameter collection to keep in
sync with rows that live in the core. Train and eval follow NNX's convention: the attribute
`deterministic` (what `model.train()`, `model.eval()` and `nnx.view(model, deterministic=...)`
set, as for `nnx.Dropout`); a deterministic (eval) lookup inserts nothing and changes nothing.

The gradient of the pooled output is the update's input, so a train step differentiates the
dense part with respect to the pooled activations and hands that gradient to the table:

>>> import jax, jax.numpy as jnp, optax, cncore
>>> from flax import nnx
>>> from cncore_jax.modules import EmbeddingBag
>>> class Model(nnx.Module):
...     def __init__(self, rngs):
...         self.emb = EmbeddingBag(dim=4, optimizer=cncore.SGD(lr=0.1), initializer=cncore.Constant(0.1))
...         self.head = nnx.Linear(4, 1, rngs=rngs)
>>> model = Model(nnx.Rngs(0))
>>> opt = nnx.Optimizer(model.head, optax.sgd(0.1), wrt=nnx.Param)
>>> @nnx.jit
... def train_step(model, opt, ids, lengths, y):
...     pooled, ctx = model.emb(ids, lengths)                    # inserts unseen IDs
...     loss_fn = lambda head, pooled: jnp.mean((head(pooled)[:, 0] - y) ** 2)
...     loss, (g_head, g_pooled) = nnx.value_and_grad(loss_fn, argnums=(0, 1))(model.head, pooled)
...     opt.update(model.head, g_head)
...     model.emb.apply_gradients(ctx, g_pooled)                 # the fused update, once, in order
...     return loss
>>> ids, lengths = jnp.array([3, 4, 3], jnp.int32), jnp.array([2, 1], jnp.int32)
>>> losses = [float(train_step(model, opt, ids, lengths, jnp.array([1.0, -1.0]))) for _ in range(20)]
>>> losses[-1] < losses[0], len(model.emb.table)
(True, 2)
>>> model.eval()                                                 # deterministic: no inserts
>>> _ = model.emb(jnp.array([99], jnp.int32), jnp.array([1], jnp.int32)); len(model.emb.table)
2
"""
from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
from flax import nnx

from cncore_jax.lookup import apply_gradients, grouped_lookup, lookup
from cncore_jax.table import Table

__all__ = ["EmbeddingBag", "EmbeddingBagCollection"]


class EmbeddingBag(nnx.Module):
    """One growable table with pooling: ``out, ctx = bag(ids, lengths)`` (or ``offsets=``),
    out (B, dim). `table` (a `cncore_jax.Table`) or the fields of a `cncore.StoreConfig` as
    keywords (dim=..., optimizer=..., initializer=..., seed=...); `mode` "sum", "mean" or
    "max". Per-sample `weights` get their gradient through `jax.grad`."""

    def __init__(self, table: Table | None = None, *, mode: str = "sum", deterministic: bool = False,
                 **config_fields):
        if table is None:
            table = Table(**config_fields)
        elif config_fields:
            raise TypeError("pass either a table or its config fields as keywords, not both")
        elif not isinstance(table, Table):
            raise TypeError(f"table: expected a cncore_jax.Table, got {type(table).__name__}")
        self.table = table
        self.mode = mode
        self.deterministic = deterministic

    def __call__(self, ids, lengths=None, *, offsets=None, weights=None, sink=None):
        return lookup(self.table, ids, lengths, offsets=offsets, mode=self.mode, weights=weights,
                      training=not self.deterministic, sink=sink)

    def apply_gradients(self, ctx, grad, *, lr=None) -> None:
        self.table.apply_gradients(ctx, grad, lr=lr)

    def set_view(self, deterministic: bool | None = None):
        """For `nnx.view(model, deterministic=...)`: True is evaluation (no inserts)."""
        if deterministic is not None:
            self.deterministic = deterministic


class EmbeddingBagCollection(nnx.Module):
    """Several tables looked up in one core call (as TorchRec's collection):
    ``out, ctx = ebc(ids, lengths)`` with dicts keyed by table name; out is
    (B, sum of dims), the tables' blocks in the order of `tables`."""

    def __init__(self, tables: dict[str, Table], *, modes="sum", deterministic: bool = False):
        if not isinstance(tables, dict) or not tables:
            raise TypeError("tables: expected a non-empty dict of name -> cncore_jax.Table")
        self.names: Sequence[str] = tuple(tables)
        self.tables = tuple(tables.values())
        self.modes = modes
        self.deterministic = deterministic

    def __call__(self, ids: dict, lengths: dict | None = None, *, offsets: dict | None = None,
                 weights: dict | None = None):
        for name, arg in (("ids", ids), ("lengths", lengths), ("offsets", offsets)):
            if arg is not None and (not isinstance(arg, dict) or set(arg) != set(self.names)):
                raise ValueError(f"{name}: expected a dict with one entry per table {list(self.names)}")
        def pick(d):
            return None if d is None else [d[n] for n in self.names]

        w = None if weights is None else [weights.get(n) for n in self.names]
        return grouped_lookup(list(self.tables), pick(ids), pick(lengths), offsets=pick(offsets), modes=self.modes,
                              weights=w, training=not self.deterministic)

    def apply_gradients(self, ctx, grad, *, lr=None) -> None:
        apply_gradients(ctx, grad, lr=lr)

    def set_view(self, deterministic: bool | None = None):
        """For `nnx.view(model, deterministic=...)`: True is evaluation (no inserts)."""
        if deterministic is not None:
            self.deterministic = deterministic

    def split(self, out) -> dict[str, jnp.ndarray]:
        """The pooled output as {table name: (B, dim)}."""
        result, start = {}, 0
        for name, t in zip(self.names, self.tables):
            result[name] = out[:, start:start + t.dim]
            start += t.dim
        return result

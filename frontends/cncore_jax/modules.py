"""Flax NNX modules on growable tables, trained by the usual NNX train step.

Flax recommends NNX as the API for new code, and its train step is the one every tutorial
writes: the lookup inside `__call__`, one `nnx.value_and_grad(loss_fn)(model)`, an
`nnx.Optimizer` for the dense parameters, all under `nnx.jit` (or `jax.jit` with
`nnx.split` / `nnx.merge`). That step trains the tables too, with their own fused optimizer:

How. Each table is an `nnx.Param` of its own type, `TableState`, whose value is a float32
scalar 0 (the "tap") and whose metadata is the `cncore_jax.Table` handle (static under `jit`).
The lookup is a `jax.custom_vjp` with the tap as its differentiable input: differentiating the
loss over the model (the default `wrt=nnx.Param` includes every `TableState`) runs its
backward, which applies the fused update to the rows the lookup used, through an ordered host
call: once per differentiation, in program order, never replayed or dropped by XLA. The tap's
gradient is always 0, so the optax optimizer leaves the tap at 0 (0 update for a 0 gradient
and a 0 parameter: SGD, Adam, Adagrad, weight decay). Of the mechanisms possible, this one
needs nothing from the user's step: an optax transform or a gradient of a table-state array
would need the pooled gradient (B, dim), which only the lookup's backward has.

What cannot train the tables is refused, before anything is inserted: a lookup in training
mode that is not differentiated (`model(x)` outside `nnx.value_and_grad`, or a `wrt` filter
that leaves `TableState` out) raises at its first run, naming the step that works; call
`model.eval()` (the `deterministic` attribute, as for `nnx.Dropout`) for a lookup that only
reads. Differentiating one lookup twice (two `grad` calls over one forward) is refused by the
second update ("already used").

>>> import jax, jax.numpy as jnp, numpy as np, optax, cncore
>>> from flax import nnx
>>> from cncore_jax.modules import EmbeddingBag
>>> class Model(nnx.Module):
...     def __init__(self, rngs):
...         self.emb = EmbeddingBag(dim=4, optimizer=cncore.SGD(lr=0.1), initializer=cncore.Constant(0.1))
...         self.head = nnx.Linear(4, 1, rngs=rngs)
...     def __call__(self, ids, lengths):
...         return self.head(self.emb(ids, lengths))[:, 0]
>>> model = Model(nnx.Rngs(0))
>>> optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
>>> @nnx.jit
... def train_step(model, optimizer, ids, lengths, y):
...     loss_fn = lambda model: jnp.mean((model(ids, lengths) - y) ** 2)
...     loss, grads = nnx.value_and_grad(loss_fn)(model)     # the tables' update runs here
...     optimizer.update(model, grads)
...     return loss
>>> ids, lengths = jnp.array([3, 4, 3], jnp.int32), jnp.array([2, 1], jnp.int32)
>>> losses = [float(train_step(model, optimizer, ids, lengths, jnp.array([1.0, -1.0]))) for _ in range(20)]
>>> losses[-1] < losses[0], len(model.emb.table), model.emb.table.store.step
(True, 2, 20)
>>> model.eval()                                               # deterministic: no inserts
>>> _ = model(jnp.array([99], jnp.int32), jnp.array([1], jnp.int32)); len(model.emb.table)
2
"""
from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from cncore_jax._traced import pooled_lookup
from cncore_jax.table import Table

__all__ = ["TableState", "EmbeddingBag", "EmbeddingBagCollection"]


class TableState(nnx.Param):
    """A table as an NNX variable: ``TableState(table)``; its value is the float32 scalar 0
    whose differentiation trains the table (see the module docstring), its metadata `table`
    the `cncore_jax.Table` (``var.table``). In `nnx.state(model)` and its filters
    (``nnx.state(model, TableState)``); `nnx.clone` copies the rows into a new table.
    Checkpoints: `cncore_jax.checkpoint`."""

    def __init__(self, table: Table, **metadata):
        if not isinstance(table, Table):
            raise TypeError(f"table: expected a cncore_jax.Table, got {type(table).__name__}")
        super().__init__(jnp.zeros((), jnp.float32), table=table, **metadata)

    def copy(self, value=nnx.variablelib.MISSING, *, _copy_ref: bool = True, **updates):
        # nnx.clone (merge with copy=True) copies variables: a table is state, so its rows are
        # copied too. Inside a trace (the value is a tracer) the copy is of the graph only.
        current = self.get_raw_value()
        if "table" not in updates and not isinstance(current, jax.core.Tracer):
            updates["table"] = self.get_metadata()["table"].copy()
        return super().copy(value, _copy_ref=_copy_ref, **updates)


def _table_of(config: dict, table: Table | None) -> Table:
    if table is None:
        return Table(**config)
    if config:
        raise TypeError("pass either a table or its config fields as keywords, not both")
    if not isinstance(table, Table):
        raise TypeError(f"table: expected a cncore_jax.Table, got {type(table).__name__}")
    return table


class EmbeddingBag(nnx.Module):
    """One growable table with pooling: ``out = bag(ids, lengths)`` (or ``offsets=``), out
    (B, dim) float32, trained by differentiating the loss over the model.

    Args:
        table: a `cncore_jax.Table`, or None and the fields of a `cncore.StoreConfig` as
            keywords (dim=..., optimizer=..., initializer=..., seed=...).
        mode: "sum", "mean" or "max" pooling.
        deterministic: True for evaluation (reads only, inserts nothing); `model.eval()` /
            `model.train()` set it.
        axis_name: under `pmap` / `shard_map`, the axis the batch is split over: one lookup of
            every device's bags and one update with the sum of their gradients.

    `embedding` is the `TableState`; `table` the `cncore_jax.Table`. Per-sample `weights`
    (B ids,) get their gradient through `nnx.grad`.
    """

    def __init__(self, table: Table | None = None, *, mode: str = "sum", deterministic: bool = False,
                 axis_name=None, **config_fields):
        self.embedding = TableState(_table_of(config_fields, table))
        self.mode = mode
        self.deterministic = deterministic
        self.axis_name = axis_name

    @property
    def table(self) -> Table:
        return self.embedding.table

    def __call__(self, ids, lengths=None, *, offsets=None, weights=None) -> jax.Array:
        out, _ = pooled_lookup([self.table], [ids], None if lengths is None else [lengths],
                               offsets=None if offsets is None else [offsets], modes=self.mode,
                               weights=None if weights is None else [weights], training=not self.deterministic,
                               tap=self.embedding[...], axis_name=self.axis_name)
        return out

    def set_view(self, deterministic: bool | None = None):
        """For `nnx.view(model, deterministic=...)`: True is evaluation (no inserts)."""
        if deterministic is not None:
            self.deterministic = deterministic


class EmbeddingBagCollection(nnx.Module):
    """Several tables looked up in one core call (as TorchRec's collection):
    ``out = ebc(ids, lengths)`` with dicts keyed by table name; out is (B, sum of dims), the
    tables' blocks in the order of `tables` (`split(out)` gives them by name). Trained as
    `EmbeddingBag` is; `embeddings[name]` is each table's `TableState`."""

    def __init__(self, tables: dict[str, Table], *, modes="sum", deterministic: bool = False, axis_name=None):
        if not isinstance(tables, dict) or not tables:
            raise TypeError("tables: expected a non-empty dict of name -> cncore_jax.Table")
        self.names: Sequence[str] = tuple(tables)
        self.embeddings = nnx.data({name: TableState(_table_of({}, t)) for name, t in tables.items()})
        self.modes = modes
        self.deterministic = deterministic
        self.axis_name = axis_name

    @property
    def tables(self) -> tuple[Table, ...]:
        return tuple(self.embeddings[n].table for n in self.names)

    def __call__(self, ids: dict, lengths: dict | None = None, *, offsets: dict | None = None,
                 weights: dict | None = None) -> jax.Array:
        for name, arg in (("ids", ids), ("lengths", lengths), ("offsets", offsets)):
            if arg is not None and (not isinstance(arg, dict) or set(arg) != set(self.names)):
                raise ValueError(f"{name}: expected a dict with one entry per table {list(self.names)}")

        def pick(d):
            return None if d is None else [d[n] for n in self.names]

        w = None if weights is None else [weights.get(n) for n in self.names]
        tap = sum(self.embeddings[n][...] for n in self.names)  # each table's tap gets the (zero) cotangent
        out, _ = pooled_lookup(list(self.tables), pick(ids), pick(lengths), offsets=pick(offsets), modes=self.modes,
                               weights=w, training=not self.deterministic, tap=tap, axis_name=self.axis_name)
        return out

    def set_view(self, deterministic: bool | None = None):
        """For `nnx.view(model, deterministic=...)`: True is evaluation (no inserts)."""
        if deterministic is not None:
            self.deterministic = deterministic

    def split(self, out) -> dict[str, jax.Array]:
        """The pooled output as {table name: (B, dim)}."""
        result, start = {}, 0
        for name, t in zip(self.names, self.tables):
            result[name] = out[:, start:start + t.dim]
            start += t.dim
        return result

"""`Table`: a handle on a growable cncore table that JAX code can close over or pass to `jit`.

The rows live in the core (host memory), not in a JAX array: the handle is a pytree with no
leaves, so `jax.jit`, Flax and Equinox treat it as a static value (hashed by identity), and
the lookups reach the rows through ordered host callbacks (`cncore_jax.lookup`).
Checkpoints use the table file format shared by every front end (`cncore.tablefile`), so a
table saved here opens in PyTorch (`cncore_torch`) and in `cn-table`, and back.

JAX dispatches a jitted step asynchronously: it may return before the step's host work (the
lookup's inserts, the update) has run. So every host-side access through the handle (`len`,
`store`, `save`, `repr`) first waits, with `jax.effects_barrier()`, for the computations with
side effects that this thread has dispatched: the callback route's ordered effect and the FFI
route's side-effecting call both leave a runtime token there. JAX keeps those tokens per
thread, so a step dispatched by another thread is not waited for; `save` holds the table's
lock, which every host callback takes too, so a save made while another thread's step runs
holds each of that step's lookup and update wholly or not at all (never a torn row, never
"the store changed"). To save at a step boundary from another thread, have the training
thread wait for its steps before handing over (`jax.effects_barrier()`, or any read through
the handle: a step's outputs can be ready before its update has run). A store reference kept
from before a step (``s = table.store``) does not wait: read through the handle.

>>> import os, tempfile, numpy as np, cncore
>>> from cncore_jax import Table
>>> t = Table(dim=2, initializer=cncore.Constant(0.5), optimizer=cncore.SGD(lr=0.1))
>>> _ = t.store.find_or_insert(np.array([3, 4]))
>>> path = os.path.join(tempfile.mkdtemp(), "t.cnt")
>>> t.save(path)
>>> u = Table.load(path)
>>> len(u), u.store.lookup(np.array([4])).tolist(), u.config.optimizer
(2, [[0.5, 0.5]], SGD(lr=0.1))
"""
from __future__ import annotations

from typing import Any

import jax
from jax.typing import ArrayLike

import cncore
from cncore.tier import TieredStore
from cncore_jax import _host, _traced

__all__ = ["Table"]


@jax.tree_util.register_pytree_node_class
class Table:
    """A cncore `EmbeddingStore` seen from JAX. Build it from a `StoreConfig` (or its fields as
    keywords), wrap an existing store with `Table.from_store`, or `Table.load` a table file.
    Everything the store does (find, erase, export, ...) is on `table.store`.

    Args:
        config (cncore.StoreConfig | None): the table's configuration, or None to build one
            from `config_fields`.
        **config_fields: `cncore.StoreConfig`'s fields (dim, initializer, optimizer, ...),
            when `config` is None.

    Example::

        >>> import jax.numpy as jnp, cncore
        >>> from cncore_jax import Table
        >>> t = Table(dim=2, initializer=cncore.Constant(1.0), optimizer=cncore.SGD(lr=0.5))
        >>> out, ctx = t.lookup(jnp.array([4, 5]), jnp.array([2]))
        >>> t.apply_gradients(ctx, jnp.ones((1, 2)))
        >>> out.tolist(), t.store.lookup([4]).tolist()
        ([[2.0, 2.0]], [[0.5, 0.5]])
    """

    def __init__(self, config: cncore.StoreConfig | None = None, **config_fields: Any) -> None:
        self._store = cncore.make_store(config, **config_fields)

    @classmethod
    def from_store(cls, store: cncore.EmbeddingStore | TieredStore) -> Table:
        """A handle on `store` itself (no copy): updates through JAX change it.

        Args:
            store (cncore.EmbeddingStore | TieredStore): the store to wrap.

        Returns:
            Table: a handle whose lookups read and update `store`.
        """
        if not isinstance(store, (cncore.EmbeddingStore, TieredStore)):
            raise TypeError(f"store: expected a cncore.EmbeddingStore or TieredStore, got {type(store).__name__}")
        table = cls.__new__(cls)
        table._store = store
        return table

    @classmethod
    def load(cls, path: str, verify: bool = True) -> Table:
        """A table read from a table file directory (`cncore.tablefile`), checked.

        Args:
            path (str): the table file (a directory written by `save`).
            verify (bool): check every array's SHA-256 and the keys' uniqueness.

        Returns:
            Table: a new in-memory table holding the file's rows, optimizer state, metadata,
            step and config.
        """
        from cncore.tablefile import load_store
        return cls.from_store(load_store(path, verify=verify))

    def save(self, path: str) -> None:
        """Write the table (rows, optimizer state, metadata, step) to the directory `path` in
        the shared table file format; an existing table there is replaced atomically. Call it
        between steps, outside `jit` (host I/O is not part of a traced program); it waits for
        the steps this thread dispatched, and holds the table still while it writes.

        Args:
            path (str): the directory to write (replaced atomically if it holds a table).
        """
        from cncore.tablefile import save_table
        store = self._settled()
        with _host.holding([store]):
            save_table(store, path)

    def copy(self) -> Table:
        """A new table holding a copy of every row, its optimizer state, metadata and the step
        (what `nnx.clone` of a model gives its tables). An in-memory table only: a tiered
        table's rows live in its files; save it and `Table.load` the copy instead.

        Returns:
            Table: the copy, on a new `cncore.EmbeddingStore`.
        """
        store = self._settled()
        if not isinstance(store, cncore.EmbeddingStore):
            raise TypeError(f"Table.copy: a {type(store).__name__} (tiered) table is not copied in memory; save it "
                            "(Table.save) and Table.load the copy")
        with _host.holding([store]):
            batch = store.export()
            twin = cncore.EmbeddingStore(store.config)
            twin.load(batch.keys, batch.rows, batch.optimizer_state, batch.counts, batch.last_steps)
            twin.step = store.step
        return Table.from_store(twin)

    def _settled(self) -> cncore.EmbeddingStore | TieredStore:
        """The store, once every computation with side effects this thread dispatched is done
        (the steps that may still insert into or update it)."""
        jax.effects_barrier()
        return self._store

    @property
    def store(self) -> cncore.EmbeddingStore | TieredStore:
        """The `cncore.EmbeddingStore` (a `TieredStore` with `storage=`), after this thread's
        dispatched steps have run."""
        return self._settled()

    @property
    def config(self) -> cncore.StoreConfig:
        return self._store.config

    @property
    def dim(self) -> int:
        return self._store.dim

    def __len__(self) -> int:
        return len(self._settled())

    def __repr__(self) -> str:
        return f"cncore_jax.Table(rows={len(self)}, config={self.config})"

    # A pytree with no leaves: jit sees it as static structure, compared by identity.
    def tree_flatten(self) -> tuple[tuple[()], Table]:
        """JAX's pytree protocol: no leaves; the table itself is static data, compared by
        identity under `jit`.

        Returns:
            tuple[tuple[()], Table]: ((), the table).
        """
        return (), self

    @classmethod
    def tree_unflatten(cls, table: Table, children: tuple[()]) -> Table:
        """JAX's pytree protocol: the table itself, which `tree_flatten` kept as static data.

        Args:
            table (Table): the static data `tree_flatten` returned.
            children (tuple[()]): no leaves.

        Returns:
            Table: `table`.
        """
        return table

    # Shortcuts to the functional API (cncore_jax.lookup), for one table.
    def lookup(self, ids: ArrayLike, lengths: ArrayLike | None = None, *, offsets: ArrayLike | None = None,
               mode: str = "sum", weights: ArrayLike | None = None, training: bool = True,
               sink: ArrayLike | None = None) -> tuple[jax.Array, _traced.LookupRef]:
        """`cncore_jax.lookup(self, ids, lengths, ...)`: the pooled rows of each bag.

        Args:
            ids (ArrayLike): (N,) integer IDs.
            lengths (ArrayLike | None): (B,) bag lengths; or give `offsets`.
            offsets (ArrayLike | None): (B + 1,) bag starts, the last N.
            mode (str): "sum", "mean" or "max".
            weights (ArrayLike | None): (N,) float per-ID weights (sum and mean only).
            training (bool): insert unseen IDs (True) or read them as zero rows (False).
            sink (ArrayLike | None): a (B, dim) array whose cotangent is the output's gradient.

        Returns:
            tuple[jax.Array, LookupRef]: the (B, dim) float32 pooled rows, and the lookup's
            context for `apply_gradients` / `accumulate_gradients`.
        """
        return _traced.pooled_lookup([self], [ids], None if lengths is None else [lengths],
                                     offsets=None if offsets is None else [offsets], modes=mode,
                                     weights=None if weights is None else [weights], training=training, sink=sink)

    def apply_gradients(self, ctx: _traced.LookupRef, grad: ArrayLike, *, lr: ArrayLike | None = None) -> None:
        """`cncore_jax.apply_gradients(ctx, grad, lr=lr)` for a lookup of this table.

        Args:
            ctx (LookupRef): the context this table's `lookup` returned.
            grad (ArrayLike): (B, dim) float32, the gradient of its output.
            lr (ArrayLike | None): the learning rate (a float or scalar array), or None (the
                optimizer's own).
        """
        if ctx.tables != (self,):
            raise ValueError("ctx: it belongs to a lookup of other tables")
        _traced.apply_gradients(ctx, grad, lr=lr)

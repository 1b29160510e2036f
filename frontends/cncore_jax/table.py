"""`Table`: a handle on a growable cncore table that JAX code can close over or pass to `jit`.

The rows live in the core (host memory), not in a JAX array: the handle is a pytree with no
leaves, so `jax.jit`, Flax and Equinox treat it as a static value (hashed by identity), and
the lookups reach the rows through ordered host callbacks (`cncore_jax.lookup`).
Checkpoints use the table file format shared by every front end (`cncore.tablefile`), so a
table saved here opens in PyTorch (`cncore_torch`) and in `cn-table`, and back.

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

from typing import Optional

import jax

import cncore

__all__ = ["Table"]


@jax.tree_util.register_pytree_node_class
class Table:
    """A cncore `EmbeddingStore` seen from JAX. Build it from a `StoreConfig` (or its fields as
    keywords), wrap an existing store with `Table.from_store`, or `Table.load` a table file.
    Everything the store does (find, erase, export, ...) is on `table.store`."""

    def __init__(self, config: Optional[cncore.StoreConfig] = None, **config_fields):
        self._store = cncore.EmbeddingStore(config, **config_fields)

    @classmethod
    def from_store(cls, store: cncore.EmbeddingStore) -> "Table":
        """A handle on `store` itself (no copy): updates through JAX change it."""
        if not isinstance(store, cncore.EmbeddingStore):
            raise TypeError(f"store: expected a cncore.EmbeddingStore, got {type(store).__name__}")
        table = cls.__new__(cls)
        table._store = store
        return table

    @classmethod
    def load(cls, path: str, verify: bool = True) -> "Table":
        """A table read from a table file directory (`cncore.tablefile`), checked."""
        from cncore.tablefile import load_store
        return cls.from_store(load_store(path, verify=verify))

    def save(self, path: str) -> None:
        """Write the table (rows, optimizer state, metadata, step) to the directory `path` in
        the shared table file format; an existing table there is replaced atomically. Call it
        between steps, outside `jit` (host I/O is not part of a traced program)."""
        from cncore.tablefile import save_table
        save_table(self._store, path)

    @property
    def store(self) -> cncore.EmbeddingStore:
        return self._store

    @property
    def config(self) -> cncore.StoreConfig:
        return self._store.config

    @property
    def dim(self) -> int:
        return self._store.dim

    def __len__(self) -> int:
        return len(self._store)

    def __repr__(self) -> str:
        return f"cncore_jax.Table(rows={len(self)}, config={self.config})"

    # A pytree with no leaves: jit sees it as static structure, compared by identity.
    def tree_flatten(self):
        return (), self

    @classmethod
    def tree_unflatten(cls, table, children):
        return table

    # Shortcuts to the functional API (cncore_jax.lookup), for one table.
    def lookup(self, ids, lengths=None, **kwargs):
        """`cncore_jax.lookup(self, ids, lengths, ...)`."""
        from cncore_jax.lookup import lookup
        return lookup(self, ids, lengths, **kwargs)

    def apply_gradients(self, ctx, grad, *, lr=None) -> None:
        """`cncore_jax.apply_gradients(ctx, grad, lr=lr)` for a lookup of this table."""
        from cncore_jax.lookup import apply_gradients
        if ctx.tables != (self,):
            raise ValueError("ctx: it belongs to a lookup of other tables")
        apply_gradients(ctx, grad, lr=lr)

"""Checkpoints of a Flax NNX model with its tables, through orbax (or any pytree checkpointer).

`nnx.state(model)` holds each table as a `TableState` (a scalar and the table handle): what
`jit` needs every step, not the rows. A checkpoint needs the rows, so `to_pure_dict(model)`
is `nnx.to_pure_dict(nnx.state(model))` with every table's entry replaced by its rows as
arrays (keys, rows, optimizer state, counts, last steps, step), and `load_pure_dict(model,
pure)` puts such a dict back: the dense variables with `nnx.update`, each table's rows
replacing the table's (the table keeps its config: dims must match). Keys and the step are
stored as uint32 pairs, so a restore never narrows them, with or without `jax_enable_x64`;
every array has one leading header row (row 0 of `keys`: the row count and the optimizer
state's width), because orbax refuses arrays of size zero (an empty table, SGD's state).

>>> import os, tempfile, numpy as np, jax.numpy as jnp, orbax.checkpoint as ocp, cncore
>>> from flax import nnx
>>> from cncore_jax.modules import EmbeddingBag
>>> from cncore_jax.checkpoint import to_pure_dict, load_pure_dict
>>> bag = EmbeddingBag(dim=2, initializer=cncore.Constant(0.5))
>>> _ = bag.table.store.find_or_insert(np.array([3, 2**40]))
>>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
>>> with ocp.StandardCheckpointer() as ckptr:
...     ckptr.save(path, to_pure_dict(bag))
>>> fresh = EmbeddingBag(dim=2)
>>> with ocp.StandardCheckpointer() as ckptr:
...     load_pure_dict(fresh, ckptr.restore(path))
>>> len(fresh.table), fresh.table.store.lookup(np.array([2**40])).tolist()
(2, [[0.5, 0.5]])
"""
from __future__ import annotations

from typing import Any

import numpy as np
from flax import nnx

from cncore_jax import _host
from cncore_jax.modules import TableState

__all__ = ["to_pure_dict", "load_pure_dict"]

_FIELDS = ("keys", "rows", "optimizer_state", "counts", "last_steps", "step")


def _as_u32_pairs(values: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=np.int64).view(np.uint32).reshape(-1, 2)


def _from_u32_pairs(pairs) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(pairs), dtype=np.uint32).reshape(-1).view(np.int64)


def _table_paths(model) -> dict[tuple, Any]:
    """Path -> TableState of every table of `model`."""
    return dict(nnx.to_flat_state(nnx.state(model, TableState)))


def _get(tree: dict, path: tuple):
    for key in path:
        tree = tree[key] if key in tree else tree[str(key)]
    return tree


def to_pure_dict(model) -> dict:
    """`nnx.to_pure_dict(nnx.state(model))` with each table's entry its rows as NumPy arrays
    (keys and step as (N, 2) / (1, 2) uint32 pairs): a pytree of arrays that orbax saves.

    Args:
        model: an `nnx.Module` (or graph node) holding `TableState` variables.
    Returns:
        A nested dict of arrays; call it between steps (it waits for this thread's steps).
    """
    pure = nnx.to_pure_dict(nnx.state(model))
    for path, var in _table_paths(model).items():
        store = var.table.store  # waits for the steps this thread dispatched
        with _host.holding([store]):
            batch = store.export()
            step = store.step
        n, width = len(batch.keys), batch.optimizer_state.shape[1]
        state = np.zeros((n + 1, max(width, 1)), np.float32)
        state[1:, :width] = batch.optimizer_state
        parent = _get(pure, path[:-1])
        parent[path[-1]] = {
            "keys": np.concatenate([np.array([[n, width]], np.uint32), _as_u32_pairs(batch.keys)]),
            "rows": np.concatenate([np.zeros((1, batch.rows.shape[1]), np.float32), batch.rows]),
            "optimizer_state": state,
            "counts": np.concatenate([np.zeros(1, np.uint32), batch.counts.astype(np.uint32)]),
            "last_steps": np.concatenate([np.zeros(1, np.uint32), batch.last_steps.astype(np.uint32)]),
            "step": _as_u32_pairs(np.array([step]))}
    return pure


def load_pure_dict(model, pure: dict) -> None:
    """Put a dict made by `to_pure_dict` (as orbax restores it) back into `model`: every table
    gets exactly the saved rows, optimizer state, metadata and step (its own rows are replaced),
    the other variables their saved values. Refused before anything changes if a table is
    missing from `pure` or its width differs.

    Args:
        model: the `nnx.Module` to restore into (built as the saved one was).
        pure: the nested dict of arrays restored from the checkpoint.
    """
    if not isinstance(pure, dict):
        raise TypeError(f"pure: expected the nested dict to_pure_dict made (as restored), got {type(pure).__name__}")
    tables = _table_paths(model)
    saved = {}
    for path, var in tables.items():
        try:
            entry = _get(pure, path)
        except (KeyError, TypeError):
            raise ValueError(f"pure: no entry for the table at {'/'.join(map(str, path))}; was it saved with "
                             "cncore_jax.checkpoint.to_pure_dict(model)?") from None
        if not isinstance(entry, dict) or set(entry) != set(_FIELDS):
            raise ValueError(f"pure: the entry at {'/'.join(map(str, path))} is not a table's rows (expected the "
                             f"fields {list(_FIELDS)}); save with cncore_jax.checkpoint.to_pure_dict(model)")
        rows = np.asarray(entry["rows"], np.float32)[1:]
        if rows.ndim != 2 or rows.shape[1] != var.table.dim:
            raise ValueError(f"pure: the table at {'/'.join(map(str, path))} has rows of shape {rows.shape}; this "
                             f"model's table has dim {var.table.dim}")
        saved[path] = entry
    dense = nnx.state(model, nnx.Not(TableState))
    rest = nnx.to_pure_dict(dense)
    for path, _ in nnx.to_flat_state(dense):
        try:
            value = _get(pure, tuple(path))
        except (KeyError, TypeError):
            raise ValueError(f"pure: no entry for the variable at {'/'.join(map(str, path))}; the checkpoint is of "
                             "another model") from None
        _get(rest, tuple(path[:-1]))[path[-1]] = value
    nnx.replace_by_pure_dict(dense, rest)
    nnx.update(model, dense)
    for path, entry in saved.items():
        store = tables[path].table.store
        keys = np.asarray(entry["keys"], np.uint32)
        width = int(keys[0, 1])
        with _host.holding([store]):
            store.clear()
            store.load(_from_u32_pairs(keys[1:]), np.asarray(entry["rows"], np.float32)[1:],
                       np.ascontiguousarray(np.asarray(entry["optimizer_state"], np.float32)[1:, :width]),
                       np.asarray(entry["counts"], np.uint32)[1:], np.asarray(entry["last_steps"], np.uint32)[1:])
            store.step = int(_from_u32_pairs(entry["step"])[0])

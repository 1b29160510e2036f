"""Frozen tables for serving: the rows as arrays and an in-graph lookup, so an inference
function exports with `jax.export` and runs where cncore is not installed.

`freeze(model)` returns a copy of an NNX model whose `EmbeddingBag` / `EmbeddingBagCollection`
modules are replaced by frozen ones: each table's keys, sorted (int64), and its rows become
`FrozenRows` variables, and the lookup is `jnp.searchsorted` on the keys, a gather, and the
pooling (sum, mean, max, per-sample weights) as the evaluation lookup does it: absent keys
read as zero rows, IDs past the last bag are padding, an empty bag is zeros. Nothing in the
frozen model reaches the core; the original model is unchanged and keeps training.

Keys are int64: freezing needs `jax.config.update("jax_enable_x64", True)` (without it JAX
would narrow the keys), unless every key fits in int32.

>>> import jax, jax.numpy as jnp, numpy as np, cncore
>>> from cncore_jax.modules import EmbeddingBag
>>> from cncore_jax.frozen import freeze
>>> bag = EmbeddingBag(dim=2, initializer=cncore.Constant(1.0))
>>> _ = bag.table.store.find_or_insert(np.array([3, 9]))
>>> served = freeze(bag)
>>> exported = jax.export.export(jax.jit(served))(jax.ShapeDtypeStruct((3,), jnp.int32),
...                                               jax.ShapeDtypeStruct((2,), jnp.int32))
>>> exported.call(jnp.array([3, 7, 9], jnp.int32), jnp.array([2, 1], jnp.int32)).tolist()  # 7 is absent
[[1.0, 1.0], [1.0, 1.0]]

``exported.serialize()`` gives the bytes to ship (JAX's serializer needs the `flatbuffers`
package); ``jax.export.deserialize(blob).call(ids, lengths)`` runs them with JAX alone.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cncore_jax import _host
from cncore_jax._checks import as_int_array, as_mode, as_weights
from cncore_jax.modules import EmbeddingBag, EmbeddingBagCollection
from cncore_jax.table import Table

__all__ = ["FrozenRows", "FrozenEmbeddingBag", "FrozenEmbeddingBagCollection", "freeze", "frozen_lookup"]


class FrozenRows(nnx.Variable):
    """A frozen table's sorted keys or rows: state, not a parameter (nothing trains it)."""


def _arrays_of(table: Table) -> tuple[jax.Array, jax.Array]:
    store = table.store  # waits for the steps this thread dispatched
    with _host.holding([store]):
        batch = store.export()
    order = np.argsort(batch.keys, kind="stable")
    keys = batch.keys[order]
    if not jax.config.jax_enable_x64 and len(keys) and (keys[0] < -(2**31) or keys[-1] >= 2**31):  # type: ignore[attr-defined]
        raise TypeError("freeze: the table holds int64 keys; enable jax.config.update('jax_enable_x64', True) "
                        "before freezing (without it JAX narrows them)")
    # one zero row past the last: where an absent key's lookup lands
    rows = np.concatenate([batch.rows[order], np.zeros((1, store.dim), np.float32)])
    return jnp.asarray(keys), jnp.asarray(rows)


def frozen_lookup(keys, rows, ids, lengths=None, *, offsets=None, mode: str = "sum", weights=None) -> jax.Array:
    """Pooled lookup of sorted `keys` (N,) with `rows` (N + 1, dim) (the last row zeros): out
    (B, dim) float32, as `cncore_jax.lookup(..., training=False)` gives it.

    Args:
        keys, rows: a frozen table's arrays (`FrozenEmbeddingBag.keys` / `.rows`).
        ids: (N_ids,) int32/int64; lengths (B,) or offsets (B + 1,); IDs past the last bag
            are padding.
        mode: "sum", "mean" or "max"; weights: (N_ids,) floats for sum and mean.
    """
    ids = as_int_array(ids, "ids", "ids")
    mode = as_mode(mode, "mode")
    if (lengths is None) == (offsets is None):
        raise ValueError("give exactly one of lengths (B,) or offsets (B+1,)")
    if lengths is not None:
        lengths = as_int_array(lengths, "lengths", "bag lengths")
        ends = jnp.cumsum(lengths)
    else:
        offsets = as_int_array(offsets, "offsets", "bag offsets")
        ends = offsets[1:] - offsets[0]
        lengths = jnp.diff(offsets)
    n_bags, n = ends.shape[0], ids.shape[0]
    w = None if weights is None else as_weights(weights, "weights", n, mode)
    pos = jnp.clip(jnp.searchsorted(keys, ids.astype(keys.dtype)), 0, max(keys.shape[0] - 1, 0))
    found = (keys[pos] == ids) if keys.shape[0] else jnp.zeros(n, bool)
    picked = rows[jnp.where(found, pos, rows.shape[0] - 1)]
    if w is not None:
        picked = picked * w[:, None]
    bag = jnp.searchsorted(ends, jnp.arange(n), side="right")  # bag of each id; n_bags for padding
    if mode == "max":
        out = jax.ops.segment_max(picked, bag, num_segments=n_bags + 1)[:n_bags]
        return jnp.where((lengths > 0)[:, None], out, 0.0)
    out = jax.ops.segment_sum(picked, bag, num_segments=n_bags + 1)[:n_bags]
    if mode == "mean":
        out = out / jnp.maximum(lengths, 1)[:, None].astype(out.dtype)
    return out


class FrozenEmbeddingBag(nnx.Module):
    """An `EmbeddingBag` frozen for serving: ``out = bag(ids, lengths)`` (or ``offsets=``,
    ``weights=``) from `keys` and `rows` (`FrozenRows`), with no call into cncore."""

    def __init__(self, bag: EmbeddingBag):
        keys, rows = _arrays_of(bag.table)
        self.keys, self.rows, self.mode = FrozenRows(keys), FrozenRows(rows), bag.mode

    def __call__(self, ids, lengths=None, *, offsets=None, weights=None) -> jax.Array:
        return frozen_lookup(self.keys[...], self.rows[...], ids, lengths, offsets=offsets, mode=self.mode,
                             weights=weights)


class FrozenEmbeddingBagCollection(nnx.Module):
    """An `EmbeddingBagCollection` frozen for serving: the same dicts in, (B, sum of dims) out."""

    def __init__(self, ebc: EmbeddingBagCollection):
        self.names = ebc.names
        modes = [ebc.modes] * len(ebc.names) if isinstance(ebc.modes, str) else list(ebc.modes)
        self.modes = tuple(modes)
        arrays = [_arrays_of(t) for t in ebc.tables]
        self.keys = nnx.data({n: FrozenRows(k) for n, (k, _) in zip(ebc.names, arrays)})
        self.rows = nnx.data({n: FrozenRows(r) for n, (_, r) in zip(ebc.names, arrays)})

    def __call__(self, ids: dict, lengths: dict | None = None, *, offsets: dict | None = None,
                 weights: dict | None = None) -> jax.Array:
        parts = []
        for name, mode in zip(self.names, self.modes):
            parts.append(frozen_lookup(self.keys[name][...], self.rows[name][...], ids[name],
                                       None if lengths is None else lengths[name],
                                       offsets=None if offsets is None else offsets[name], mode=mode,
                                       weights=None if weights is None else weights.get(name)))
        return jnp.concatenate(parts, axis=1)


def freeze(model):
    """A copy of `model` for serving: every `EmbeddingBag` / `EmbeddingBagCollection` replaced
    by its frozen form (the rows as they are now), every other variable shared with `model`.

    Args:
        model: an `nnx.Module` (a bag or collection itself, or a model holding them).
    Returns:
        The frozen model; export a function of it with `jax.export`.
    """
    def frozen_of(node):
        if isinstance(node, EmbeddingBag):
            return FrozenEmbeddingBag(node)
        if isinstance(node, EmbeddingBagCollection):
            return FrozenEmbeddingBagCollection(node)
        return None

    root = frozen_of(model)
    if root is not None:
        return root
    copy = nnx.merge(*nnx.split(model))  # new module objects; the variables are shared
    targets = [(path, node) for path, node in nnx.iter_graph(copy) if frozen_of(node) is not None]
    for path, node in targets:
        parent = copy
        for key in path[:-1]:
            parent = getattr(parent, str(key)) if isinstance(parent, nnx.Module) else parent[key]
        replacement = frozen_of(node)
        if isinstance(parent, nnx.Module):
            setattr(parent, str(path[-1]), replacement)
        else:
            parent[path[-1]] = replacement
    return copy

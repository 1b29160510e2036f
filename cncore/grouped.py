"""Pooled lookups and their backward over several stores in one core call.

A DLRM batch has 26 sparse features; calling the core once per table pays the call overhead
26 times. `grouped_pooled_lookup` resolves, inserts and pools every feature in one nogil
section and writes each feature's pooled rows into its column block of one (B, sum of dims)
output, the layout of TorchRec's KeyedTensor. `grouped_apply_gradients` is its backward.

>>> import numpy as np
>>> from cncore import EmbeddingStore, Constant, SGD, grouped_pooled_lookup, grouped_apply_gradients
>>> a = EmbeddingStore(dim=2, initializer=Constant(1.0), optimizer=SGD(lr=0.5))
>>> b = EmbeddingStore(dim=3, initializer=Constant(2.0), optimizer=SGD(lr=0.5))
>>> out, ctxs = grouped_pooled_lookup([a, b], [np.array([1, 2]), np.array([7])],
...                                   lengths=[np.array([2]), np.array([1])])
>>> out.tolist()
[[2.0, 2.0, 2.0, 2.0, 2.0]]
>>> grouped_apply_gradients(ctxs, np.ones((1, 5), dtype=np.float32))
>>> a.lookup(np.array([1])).tolist(), b.lookup(np.array([7])).tolist()
([[0.5, 0.5]], [[1.5, 1.5, 1.5]])
"""
from __future__ import annotations

import contextlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from numpy.typing import ArrayLike

from cncore import _core
from cncore._interchange import as_float_rows, as_floats, as_keys, as_offsets, as_output

__all__ = ["LookupContext", "grouped_pooled_lookup", "grouped_apply_gradients", "check_context", "as_flag"]

MODES = {"sum": 0, "mean": 1, "max": 2}

# What only a lookup puts into a context (LookupContext._seal).
_SEAL = object()


def _sealed(store, keys, slots, offsets, weights, mode, argmax, erase_epoch, columns, n_new, training, step):
    """A lookup's LookupContext: its arrays made read-only and the seal put in. Written straight
    into the instance's __dict__: the frozen dataclass's __init__ sets each of the 12 fields
    through object.__setattr__, 4.7 us a context with the seal against 1.6 so (6 us of a training
    step's ~60 us of Python, in module_overhead.py). tests/test_core_hardening.py checks the
    names against the dataclass's fields."""
    for array in (keys, slots, offsets, weights, argmax):
        if array is not None:
            array.setflags(write=False)
    ctx = object.__new__(LookupContext)
    ctx.__dict__.update(store=store, keys=keys, slots=slots, offsets=offsets, weights=weights, mode=mode,
                        argmax=argmax, erase_epoch=erase_epoch, columns=columns, n_new=n_new, training=training,
                        step=step, _seal=_SEAL)
    return ctx


class CoreStore(Protocol):
    """What a lookup and its backward read from a store (an `EmbeddingStore` or a
    `TieredStore`, which import this module): the core table its rows are in, and their width."""

    @property
    def _table(self) -> _core.Table: ...

    @property
    def dim(self) -> int: ...


class FaultingStore(CoreStore, Protocol):
    """A store with a disk tier (`cncore.tier.TieredStore`): a lookup runs with its keys
    faulted into the memory cache."""

    def faulted_in(self, keys: np.ndarray, insert: bool) -> contextlib.AbstractContextManager[np.ndarray | None]: ...


@dataclass(frozen=True)
class LookupContext:
    """What the backward of one pooled lookup needs (kept by autograd between the passes).

    It holds its own copies of the keys, offsets and weights, so the caller may reuse its
    arrays between the lookup and the backward. The backward checks the context against the
    store under the store's lock (the erase epoch, which is unique to the store, the offsets
    and the slots' range), so a context that went stale (keys erased, store cleared, a module
    moved to another device) or was forged is refused with every row unchanged; it never
    reaches memory it should not.

    A context is opaque: only a lookup makes one. Its arrays are read-only, and a copy made by
    `dataclasses.replace`, `copy` or pickling carries no seal and is refused by the backward,
    so a context either is what its lookup made or is not used at all.

    Args:
        store (CoreStore): the store the lookup read (an `EmbeddingStore` or `TieredStore`).
        keys (np.ndarray): (N,) int64, the lookup's keys.
        slots (np.ndarray): (N,) the keys' rows in the store at the lookup.
        offsets (np.ndarray): (B + 1,) int64, where each bag's keys start.
        weights (np.ndarray | None): (N,) float32 per-sample weights, or None.
        mode (int): the pooling: 0 sum, 1 mean, 2 max.
        argmax (np.ndarray | None): (B, dim) the key each max-pooled value came from, or None.
        erase_epoch (int): the store's erase epoch at the lookup.
        columns (slice): this lookup's column block in the grouped output.
        n_new (int): rows the lookup inserted.
        training (bool): whether the lookup inserted unseen keys (and its backward records the
            rows' accesses).
        step (int): the store's step at the lookup.

    Example::

        >>> import numpy as np
        >>> from cncore import EmbeddingStore, LookupContext
        >>> store = EmbeddingStore(dim=2)
        >>> out, ctx = store.pooled_lookup(np.array([3, 4]), np.array([0, 2]))
        >>> isinstance(ctx, LookupContext), ctx.n_bags, ctx.columns
        (True, 1, slice(0, 2, None))
    """
    store: CoreStore
    keys: np.ndarray
    slots: np.ndarray
    offsets: np.ndarray
    weights: np.ndarray | None
    mode: int
    argmax: np.ndarray | None
    erase_epoch: int
    columns: slice  # this lookup's column block in the grouped output
    n_new: int      # rows this lookup inserted (a store under several features: all of them, on the first)
    training: bool  # inserted unseen keys; its backward records the rows' accesses
    step: int       # the store's step at the lookup (recorded as the rows' last step)
    _seal: object = field(default=None, init=False, repr=False, compare=False)

    @property
    def n_bags(self) -> int:
        return len(self.offsets) - 1


def check_context(ctx, store=None, name: str = "ctx") -> None:
    """ctx is a LookupContext made by a lookup (of `store`, when given). Whether its rows are
    still alive is checked by the core under the store's lock, where the check cannot race an
    erase."""
    if not isinstance(ctx, LookupContext):
        raise TypeError(f"{name} must be the LookupContext returned by pooled_lookup, got {type(ctx).__name__}")
    if ctx._seal is not _SEAL:
        raise ValueError(f"{name} was not made by a lookup (a replaced, copied or unpickled context); contexts "
                         "cannot be modified: use the one pooled_lookup returned")
    if store is not None and ctx.store is not store:
        raise ValueError(f"{name} comes from a lookup on another store")


def as_flag(value, name: str) -> bool:
    """A bool argument: True/False (NumPy's too); anything else is refused rather than read by
    its truth value (`insert_missing="no"` inserted)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def _per_feature(value, n: int, name: str) -> list:
    if value is None:
        return [None] * n
    if not isinstance(value, (list, tuple)) or len(value) != n:
        raise ValueError(f"{name}: expected a list with one entry per store ({n})")
    return list(value)


def grouped_pooled_lookup(stores: Sequence[CoreStore], keys: Sequence[ArrayLike],
                          offsets: Sequence[ArrayLike | None] | None = None, *,
                          lengths: Sequence[ArrayLike | None] | None = None, modes: str | Sequence[str] = "sum",
                          per_sample_weights: Sequence[ArrayLike | None] | None = None,
                          insert_missing: bool = True,
                          out: np.ndarray | None = None) -> tuple[np.ndarray, list[LookupContext]]:
    """Pooled lookup of F features at once; feature f looks up keys[f] in stores[f].

    All features have the same number of bags B (the batch size). A store may appear several
    times (features sharing a table): it is looked up once with all of its features' keys, so
    a bounded store never evicts a row another feature of the call uses. Bad input raises
    before any store changes. Rows a bounded store evicts reach its ``on_evict`` callbacks
    before this returns.

    Args:
        stores (Sequence[CoreStore]): F stores (`EmbeddingStore` or `TieredStore`), one per
            feature.
        keys (Sequence[ArrayLike]): F integer arrays, (N_f,) each: feature f's keys.
        offsets (Sequence[ArrayLike | None] | None): F arrays of B + 1 bag starts (the last is
            N_f); give exactly one of offsets and lengths per feature.
        lengths (Sequence[ArrayLike | None] | None): F arrays of B bag lengths.
        modes (str | Sequence[str]): "sum", "mean" or "max", one for all or one per feature.
        per_sample_weights (Sequence[ArrayLike | None] | None): F float arrays, (N_f,) each, or
            None (sum and mean only).
        insert_missing (bool): insert unseen keys with their initial rows (training), or read
            them as zero rows and change nothing (evaluation).
        out (np.ndarray | None): a (B, sum of dims) float32 C-contiguous array to write into.

    Returns:
        tuple[np.ndarray, list[LookupContext]]: out, (B, sum of dims) float32, feature f in
        columns [sum of earlier dims, + its dim); and ctxs, ctxs[f] feature f's context for
        `grouped_apply_gradients`.
    """
    insert_missing = as_flag(insert_missing, "insert_missing")
    if not isinstance(stores, (list, tuple)):
        raise TypeError(f"stores: expected a list of EmbeddingStore, got {type(stores).__name__}")
    n = len(stores)
    if n == 0:
        raise ValueError("stores: at least one store is needed")
    for f, s in enumerate(stores):
        if not isinstance(getattr(s, "_table", None), _core.Table):  # a store whose rows the core computes on
            raise TypeError(f"stores[{f}]: expected an EmbeddingStore or TieredStore, got {type(s).__name__}")
    keys = _per_feature(keys, n, "keys")
    offsets = _per_feature(offsets, n, "offsets")
    lengths = _per_feature(lengths, n, "lengths")
    weights = _per_feature(per_sample_weights, n, "per_sample_weights")
    if isinstance(modes, str):
        modes = [modes] * n
    modes = _per_feature(modes, n, "modes")

    key_arrays: list[np.ndarray] = []
    offset_arrays: list[np.ndarray] = []
    weight_arrays: list[np.ndarray | None] = []
    mode_codes: list[int] = []
    for f in range(n):
        k, o, w, code = feature_arrays(f, keys[f], offsets[f], lengths[f], weights[f], modes[f])
        if f and len(o) - 1 != len(offset_arrays[0]) - 1:
            raise ValueError(f"feature {f}: has {len(o) - 1} bags, feature 0 has {len(offset_arrays[0]) - 1}; all "
                             "features share B")
        key_arrays.append(k)
        offset_arrays.append(o)
        weight_arrays.append(w)
        mode_codes.append(code)

    # Plain Python for the columns: NumPy's concatenate/cumsum/tolist took 9 us warm and ~100 with
    # the caches cold, for a few small ints. One feature writes to `out` itself, not a view of it.
    starts = list(itertools.accumulate((s.dim for s in stores), initial=0))
    out = output_array(out, len(offset_arrays[0]) - 1, starts[-1])
    outs = [out] if n == 1 else [out[:, starts[f]:starts[f + 1]] for f in range(n)]
    return out, lookup_checked(stores, key_arrays, offset_arrays, weight_arrays, mode_codes, outs, insert_missing,
                               starts)


def pooled_lookup_one(store, keys, offsets, lengths, mode: str, per_sample_weights, insert_missing, out):
    """`pooled_lookup` of one store (EmbeddingStore's and TieredStore's): grouped_pooled_lookup
    of [store] without its per-list checks. Returns ``(out, ctx)``."""
    insert_missing = as_flag(insert_missing, "insert_missing")
    k, o, w, code = feature_arrays(0, keys, offsets, lengths, per_sample_weights, mode)
    out = output_array(out, len(o) - 1, store.dim)
    return out, lookup_checked([store], [k], [o], [w], [code], [out], insert_missing, [0, store.dim])[0]


def unique_gradients_one(store, ctx, grad_output):
    """`accumulate_gradients` of one store (EmbeddingStore's and TieredStore's): ``(unique_keys,
    grads)`` of the lookup `ctx` made on `store`."""
    check_context(ctx, store)
    grad = as_float_rows(grad_output, "grad_output", (ctx.n_bags, store.dim))
    if not isinstance(ctx.keys, np.ndarray) or ctx.keys.shape != getattr(ctx.slots, "shape", None):
        raise ValueError("ctx: its keys and slots differ in shape (a forged context)")
    positions, grads = _core.unique_gradients(store._table, ctx.slots, ctx.offsets, ctx.weights, ctx.mode,
                                              ctx.argmax, grad, ctx.training, ctx.step, ctx.erase_epoch)
    return ctx.keys[positions], grads


def feature_arrays(f: int, keys, offsets, lengths, weights, mode: str):
    """Feature f's checked input as the core reads it: (keys, offsets, weights or None, mode
    code), each array a copy (the context keeps them for the backward, and the caller may reuse
    its arrays). Errors name the argument as `keys[f]`, `offsets[f]`, ..."""
    k = np.array(as_keys(keys, f"keys[{f}]"), copy=True)
    if (offsets is None) == (lengths is None):
        raise ValueError(f"feature {f}: give exactly one of offsets (B+1) or lengths (B)")
    if offsets is not None:
        o = np.array(as_offsets(offsets, f"offsets[{f}]"), copy=True)
        if len(o) == 0:
            raise ValueError(f"offsets[{f}]: needs B+1 >= 1 entries (the last is len(keys))")
    else:
        ln = as_offsets(lengths, f"lengths[{f}]")
        # Each length within [0, len(keys)] first, so the cumulative sum cannot wrap around
        # (lengths of 2**63 once added up to 4).
        if ln.size and (ln.min() < 0 or ln.max() > len(k)):
            raise ValueError(f"lengths[{f}]: must be in [0, len(keys[{f}])] = [0, {len(k)}]")
        o = np.zeros(len(ln) + 1, dtype=np.int64)
        np.cumsum(ln, out=o[1:])
        if o[-1] != len(k):
            raise ValueError(f"lengths[{f}]: must add up to len(keys[{f}]) = {len(k)}, they add up to {o[-1]}")
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"modes[{f}]: expected 'sum', 'mean' or 'max', got {mode!r}")
    w = None
    if weights is not None:
        if mode == "max":
            raise ValueError(f"per_sample_weights[{f}]: weights apply to 'sum' and 'mean' pooling, not 'max'")
        w = np.array(as_floats(weights, f"per_sample_weights[{f}]", (len(k),)), copy=True)
    return k, o, w, MODES[mode]


def output_array(out, n_bags: int, width: int) -> np.ndarray:
    """The (n_bags, width) float32 output of a lookup: a new one, or the caller's `out` checked."""
    if out is None:
        return np.empty((n_bags, width), dtype=np.float32)
    return as_output(out, "out", (n_bags, width))


def lookup_arrays(stores, keys, offsets, weights, modes, outs, insert_missing: bool, starts=None, *,
                  contexts: bool = True):
    """The grouped lookup for front ends that checked their input already (the torch bridge):
    keys[f] (int64), offsets[f] (B_f + 1, int64), weights[f] (float32 or None) and modes[f]
    (0 sum, 1 mean, 2 max) as arrays, outs[f] the (B_f, dim_f) float32 array (or column view)
    feature f's rows go to; `starts`: the features' first columns in one grouped output (None
    when each has its own output). The core still checks the offsets and sizes; the arrays
    are not copied (the caller keeps them unchanged until the backward). Returns the contexts
    (None with `contexts=False`: no backward will follow)."""
    if len(stores) > 1:  # (one store: lookup_checked hands its arrays to forward_one, which converts them)
        keys = [np.ascontiguousarray(k, dtype=np.int64) for k in keys]
        offsets = [np.ascontiguousarray(o, dtype=np.int64) for o in offsets]
        weights = [None if w is None else np.ascontiguousarray(w, dtype=np.float32) for w in weights]
    return lookup_checked(stores, keys, offsets, weights, modes, outs, bool(insert_missing), starts, contexts)


def lookup_checked(stores, keys, offsets, weights, modes, outs, insert_missing: bool, starts, contexts: bool = True):
    """lookup_arrays on arrays that are already C-contiguous int64 keys and offsets and float32
    weights (feature_arrays' copies: converting them again cost a NumPy call each); one store's
    go to forward_one, which converts them (a no-op for those)."""
    if len(stores) == 1:
        ctx = lookup_one(stores[0], keys[0], offsets[0], weights[0], modes[0], outs[0], insert_missing,
                         None if starts is None else slice(starts[0], starts[1]), context=contexts)
        return [ctx] if contexts else None
    if insert_missing:
        split_before_training(stores, keys)
    held, found = tiers_faulted_in(stores, keys, insert_missing)
    with held:
        results = _core.grouped_forward([s._table for s in stores], keys, offsets, weights, list(modes), outs,
                                        insert_missing, found)
    if not contexts:
        return None
    columns = ([slice(starts[f], starts[f + 1]) for f in range(len(stores))] if starts is not None
               else [slice(0, s.dim) for s in stores])
    ctxs = []
    for f in range(len(stores)):
        k, slots, o, w = _as_read(keys[f], offsets[f], weights[f], results[f])
        ctxs.append(_sealed(stores[f], k, slots, o, w, modes[f], results[f][1], results[f][3], columns[f],
                            results[f][2], insert_missing, stores[f].step))
    return ctxs


def split_before_training(stores, keys) -> None:
    """Before a grouped training lookup: every undecided ``fallback_rows="auto"`` store chooses
    its split if the call's keys do not fit it (cncore/store_split.py), with the keys of all of
    its features. One attribute read a store when none is undecided."""
    pending: dict[int, tuple] = {}
    for s, k in zip(stores, keys):
        if getattr(s, "_split_pending", False):
            pending.setdefault(id(s), (s, []))[1].append(k)
    if pending and any(s.step >= _core.STEP_MAX for s in stores):
        return  # the core refuses the call (a table at its last step), and a refused call changes no table
    for s, ks in pending.values():
        s.split_before_training(ks[0] if len(ks) == 1 else np.concatenate(ks))


def _as_read(keys, offsets, weights, result) -> tuple:
    """(keys, slots, offsets, weights) of one feature as its backward reads them: a table with
    residual fallback rows (cn_table_core.h) hands back each key as two occurrences."""
    if len(result) > 4 and result[4] is not None:
        keys, offsets, weights = result[4]
    return keys, result[0], offsets, weights


def lookup_one(store, keys, offsets, weights, mode: int, out, insert_missing: bool, columns: slice | None = None,
               *, context: bool = True) -> LookupContext | None:
    """`lookup_arrays` for one feature (`EmbeddingStore.pooled_lookup`, the torch bridge): the
    same core call and context without the per-feature lists. `columns`: its block of a
    grouped output (default: all of `out`). Returns its context (None with `context=False`)."""
    record = forward_one(store, keys, offsets, weights, mode, out, insert_missing)
    return context_of(store, record, columns) if context else None


# One feature's lookup as the core returned it, in one tuple (forward_one): what its backward
# needs, as a LookupContext carries it (context_of). A caller that keeps the lookup to itself
# (the torch modules' autograd node) keeps the tuple and hands it to backward_one: sealing a
# context cost ~3 us a step warm (three setflags, the instance's dict, the call; timeit), about
# 1% of a training step at batch 4096, pooling 1 (module_overhead.py), and the core checks what
# the backward reads under the store's lock either way.
RECORD_FIELDS = ("keys", "offsets", "weights", "mode", "slots", "argmax", "n_new", "erase_epoch", "training", "step")


def forward_one(store, keys, offsets, weights, mode: int, out, insert_missing: bool) -> tuple:
    """The pooled lookup of one feature, its input checked by the caller (as lookup_arrays'):
    rows into `out`; returns its record (RECORD_FIELDS)."""
    keys = np.ascontiguousarray(keys, dtype=np.int64)
    offsets = np.ascontiguousarray(offsets, dtype=np.int64)
    if weights is not None:
        weights = np.ascontiguousarray(weights, dtype=np.float32)
    insert_missing = bool(insert_missing)
    if insert_missing and getattr(store, "_split_pending", False) and store.step < _core.STEP_MAX:
        store.split_before_training(keys)  # fallback_rows="auto", undecided (at STEP_MAX the core refuses)
    # (A tiered store holds the keys in memory around the call, and hands over the slots its
    # fault-in found, so that the lookup does not find them again; see TieredStore._fault_in.)
    with store.faulted_in(keys, insert_missing) if hasattr(store, "faulted_in") else _NOTHING_HELD as found:
        result = _core.grouped_forward([store._table], [keys], [offsets], [weights], [mode], [out], insert_missing,
                                       None if found is None else [found])[0]
    slots, argmax, n_new, epoch = result[:4]
    if len(result) > 4 and result[4] is not None:
        # Residual fallback rows: the backward reads each key as its two rows' occurrences.
        keys, offsets, weights = result[4]
    return keys, offsets, weights, mode, slots, argmax, n_new, epoch, insert_missing, store.step


def context_of(store, record: tuple, columns: slice | None = None) -> LookupContext:
    """The LookupContext of a lookup of `store` from its record (forward_one)."""
    keys, offsets, weights, mode, slots, argmax, n_new, epoch, training, step = record
    return _sealed(store, keys, slots, offsets, weights, mode, argmax, epoch,
                   slice(0, store.dim) if columns is None else columns, n_new, training, step)


def backward_one(store, record: tuple, grad: np.ndarray, optim: tuple) -> None:
    """The fused backward of one lookup of `store` from its record (forward_one): its (B, dim)
    float32 gradient, its `_optim_tuple`. The core checks the record against the store under
    its lock (erase epoch, offsets, slots), as it does a context's."""
    _keys, offsets, weights, mode, slots, argmax, _n_new, epoch, training, step = record
    _core.grouped_backward([store._table], [slots], [offsets], [weights], [mode], [argmax], [grad], [optim],
                           [(training, step)], [epoch])


_NOTHING_HELD = contextlib.nullcontext()  # reusable: no tiered store in a call (the common case)


def tiers_faulted_in(stores, key_arrays, insert: bool):
    """A context in which every key a call uses is in the memory cache of its tiered store
    (cncore/tier/), all features of one store faulted in together (so that making room for
    one feature's keys cannot evict another's), and no other thread moves a row of those stores
    between the tiers: the caller runs its core lookup inside it. Stores are locked in one
    order (by id), so two grouped calls over the same stores cannot deadlock. Stores that are
    not tiered are untouched.

    Returns (the context, found): found[f] is the cache slots of feature f's keys when its store
    is tiered, used by f alone in this call, and gave them (TieredStore._fault_in), else None;
    `found` is None when no store gave any (_core.grouped_forward's found_slots)."""
    by_store: dict[int, tuple[FaultingStore, list[np.ndarray], list[int]]] = {}
    for f, (store, k) in enumerate(zip(stores, key_arrays)):
        if hasattr(store, "faulted_in"):
            entry = by_store.setdefault(id(store), (store, [], []))
            entry[1].append(k)
            entry[2].append(f)
    if not by_store:
        return _NOTHING_HELD, None
    held = contextlib.ExitStack()  # entered here; the caller's `with` closes it
    found: list[np.ndarray | None] | None = None
    try:
        for _, (store, parts, features) in sorted(by_store.items()):
            slots = held.enter_context(store.faulted_in(np.concatenate(parts) if len(parts) > 1 else parts[0], insert))
            if slots is not None and len(features) == 1:
                found = found or [None] * len(stores)
                found[features[0]] = slots
    except BaseException:
        held.close()
        raise
    return held, found


def _merge(ctxs: list[LookupContext], grads: list[np.ndarray]):
    """One lookup equivalent to several lookups of one store (features sharing a table), so
    that each row gets one update with its summed gradient, as a fused TBE does. Mean pooling
    becomes weights of 1/len; max keeps its own argmax and cannot be merged."""
    slots, offsets, weights, blocks = [], [np.zeros(1, dtype=np.int64)], [], []
    base = 0
    for ctx, g in zip(ctxs, grads):
        lens = np.diff(ctx.offsets)
        w = ctx.weights if ctx.weights is not None else np.ones(len(ctx.keys), dtype=np.float32)
        if ctx.mode == MODES["mean"]:
            w = w / np.repeat(np.maximum(lens, 1), lens).astype(np.float32)
        slots.append(ctx.slots)
        offsets.append(ctx.offsets[1:] + base)
        weights.append(w.astype(np.float32, copy=False))
        blocks.append(g)
        base += len(ctx.keys)
    return (np.concatenate(slots), np.concatenate(offsets), np.concatenate(weights),
            np.ascontiguousarray(np.concatenate(blocks, axis=0)))


def _optim_tuple(store, lr):
    opt = store.config.optimizer
    if opt is None:
        raise TypeError("apply_gradients: this store has no optimizer (StoreConfig.optimizer=None), so it has no "
                        "fused update; use accumulate_gradients and update the rows yourself")
    rate = opt.lr if lr is None else lr
    if isinstance(rate, (bool, np.bool_)) or not isinstance(rate, (int, float, np.integer, np.floating)) \
            or not np.isfinite(rate) or rate < 0 or rate > 3.4e38:
        raise ValueError(f"lr must be a finite number >= 0, got {lr!r}")
    return (opt.kind, float(rate), float(opt.eps), float(opt.betas[0]), float(opt.betas[1]))


def grouped_apply_gradients(ctxs: Sequence[LookupContext], grad_output: ArrayLike, *,
                            lr: float | Sequence[float | None] | None = None,
                            stores: Sequence[CoreStore] | None = None) -> None:
    """Fused backward of `grouped_pooled_lookup`: each store's rows are updated by its own
    optimizer. A store used by several features gets one update per row with the summed
    gradient (except with max pooling, where its features are applied one after another).
    The rows' access metadata of training lookups is recorded here: count += occurrences in
    the batch, last_step = the store's step at the lookup. A stale or forged context is
    refused with every row unchanged.

    Args:
        ctxs (Sequence[LookupContext]): the contexts one `grouped_pooled_lookup` returned, all
            of them, in order.
        grad_output (ArrayLike): (B, sum of dims) float32, the gradient of its `out`.
        lr (float | Sequence[float | None] | None): one learning rate for all, one per
            context, or None (each optimizer's own).
        stores (Sequence[CoreStore] | None): the store of each context, checked against it
            when given.

    Example::

        >>> import numpy as np
        >>> from cncore import SGD, Constant, EmbeddingStore, grouped_apply_gradients, grouped_pooled_lookup
        >>> s = EmbeddingStore(dim=2, initializer=Constant(1.0), optimizer=SGD(lr=1.0))
        >>> out, ctxs = grouped_pooled_lookup([s], [np.array([5])], lengths=[np.array([1])])
        >>> grouped_apply_gradients(ctxs, np.full((1, 2), 0.25, dtype=np.float32), lr=2.0)
        >>> s.lookup(np.array([5])).tolist()
        [[0.5, 0.5]]
    """
    if not isinstance(ctxs, (list, tuple)):
        raise TypeError(f"ctxs: expected a list of LookupContext, got {type(ctxs).__name__}")
    ctxs = list(ctxs)
    if not ctxs:
        return
    if stores is not None and len(stores) != len(ctxs):
        raise ValueError(f"stores: expected one store per context ({len(ctxs)}), got {len(stores)}")
    for f, ctx in enumerate(ctxs):
        check_context(ctx, None if stores is None else stores[f], "ctx" if stores else f"ctxs[{f}]")
    n_bags = ctxs[0].n_bags
    for f, ctx in enumerate(ctxs):
        # Every context, not only the first: a second lookup with more bags read past the gradient.
        if ctx.n_bags != n_bags:
            raise ValueError(f"ctxs[{f}]: has {ctx.n_bags} bags, ctxs[0] has {n_bags}; contexts of one grouped "
                             "lookup share B")
        # The contexts of one grouped lookup tile its output's columns in order; a context of
        # another lookup (or a subset out of order) would read another feature's gradient.
        start = ctxs[f - 1].columns.stop if f else 0
        if ctx.columns.start != start:
            raise ValueError(f"ctxs[{f}]: covers columns {ctx.columns.start}:{ctx.columns.stop} of its lookup's "
                             f"output, expected {start}:{start + ctx.store.dim}; pass the contexts of one grouped "
                             "lookup, all of them, in order")
    total = max(ctx.columns.stop for ctx in ctxs)
    grad = as_float_rows(grad_output, "grad_output", (n_bags, total))
    lrs = lr if isinstance(lr, (list, tuple)) else [lr] * len(ctxs)
    if len(lrs) != len(ctxs):
        raise ValueError("lr: expected one value or one per context")
    optims = [_optim_tuple(ctx.store, rate) for ctx, rate in zip(ctxs, lrs)]
    apply_blocks(ctxs, [grad[:, ctx.columns] for ctx in ctxs], optims)


def apply_blocks(ctxs: Sequence[LookupContext], grads: Sequence[np.ndarray], optims: Sequence[tuple]) -> None:
    """The fused backward of contexts one grouped lookup of this process made, already checked
    (grouped_apply_gradients checks what a caller hands in; the torch bridge calls this with
    the contexts its own lookup made): grads[f] is feature f's (B_f, dim) float32 gradient
    block, optims[f] its `_optim_tuple`. Features sharing a store are merged into one update
    per row (max pooling: one after another). The core checks each context's erase epoch and
    slots under the store's lock."""
    if len(ctxs) == 1:  # one feature (the modules): no grouping to do
        apply_one(ctxs[0], grads[0], optims[0])
        return
    by_store: dict[int, list[int]] = {}
    for f, ctx in enumerate(ctxs):
        by_store.setdefault(id(ctx.store), []).append(f)
    tables, slots, offsets, weights, modes, argmaxes = [], [], [], [], [], []
    grad_list, opt_list, metas, epochs = [], [], [], []
    sequential = []
    for members in by_store.values():
        first = ctxs[members[0]]
        blocks = [grads[f] for f in members]
        if len(members) == 1:
            tables.append(first.store._table)
            slots.append(first.slots)
            offsets.append(first.offsets)
            weights.append(first.weights)
            modes.append(first.mode)
            argmaxes.append(first.argmax)
            grad_list.append(blocks[0])
            opt_list.append(optims[members[0]])
            metas.append((first.training, first.step))
            epochs.append(first.erase_epoch)
        elif len({ctxs[f].erase_epoch for f in members}) > 1:
            raise RuntimeError(f"ctxs {members}: lookups of one store from before and after an erase; the older "
                               "one's rows may be gone, so nothing was updated")
        elif any(ctxs[f].mode == MODES["max"] for f in members) or \
                len({(ctxs[f].training, ctxs[f].step) for f in members}) > 1:
            sequential.extend(members)
        else:
            s, o, w, g = _merge([ctxs[f] for f in members], blocks)
            tables.append(first.store._table)
            slots.append(s)
            offsets.append(o)
            weights.append(w)
            modes.append(MODES["sum"])
            argmaxes.append(None)
            grad_list.append(g)
            opt_list.append(optims[members[0]])
            metas.append((first.training, first.step))
            epochs.append(first.erase_epoch)
    if tables:
        _core.grouped_backward(tables, slots, offsets, weights, modes, argmaxes, grad_list, opt_list, metas,
                               epochs)
    for f in sequential:
        apply_one(ctxs[f], grads[f], optims[f])


def apply_one(ctx: LookupContext, grad: np.ndarray, optim: tuple) -> None:
    """`apply_blocks` for one context (checked already): its (B, dim) float32 gradient, its
    `_optim_tuple`."""
    backward_one(ctx.store, (ctx.keys, ctx.offsets, ctx.weights, ctx.mode, ctx.slots, ctx.argmax, ctx.n_new,
                             ctx.erase_epoch, ctx.training, ctx.step), grad, optim)

"""The host side of the JAX boundary: what the ordered callbacks run, and where a lookup's
context waits for its gradient. Imports no JAX: everything here takes and returns NumPy.

A traced program cannot hold a Python object, so a lookup leaves its `cncore.LookupContext`
list here, in a bounded registry keyed by an int32 token, and hands the token to the program
as an array. The update (or accumulation) callback that runs after it in program order takes
the context out again. A step abandoned between the two (an exception in the loss, a lookup
whose gradient is never used) leaves its context behind. The registry holds at most
`MAX_PENDING` of them and drops none: a training lookup that would exceed the bound is refused
before it inserts anything, with a message that names what consumes a context (`discard` for
one, `discard_pending` for all); a token whose context was discarded or already used is
refused with a message that says which.

Every host function here holds the lock of each table it touches (`holding`) while it runs, and
`cncore_jax.Table.save` takes the same lock: a save from one Python thread never sees half of
another thread's lookup or update, however the two interleave.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

import cncore
from cncore.grouped import CoreStore
from cncore.tier import TieredStore

MAX_PENDING = 64     # contexts waiting for their gradient, all tables together; more are refused
_HISTORY = 4096      # tokens remembered after they leave, to say why a late one is refused
NO_CONTEXT = -1      # the token of an evaluation lookup made outside differentiation


_LOCKS: weakref.WeakKeyDictionary[CoreStore, threading.RLock] = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()


def store_lock(store: CoreStore) -> threading.RLock:
    """The lock of one store, shared by every `Table` handle on it (re-entrant: a table method
    may call another)."""
    with _LOCKS_GUARD:
        lock = _LOCKS.get(store)
        if lock is None:
            lock = _LOCKS[store] = threading.RLock()
        return lock


@contextlib.contextmanager
def holding(stores: Iterable[CoreStore]) -> Iterator[None]:
    """Hold the locks of `stores`, taken in one global order (by id) so two grouped calls over
    the same tables in different orders cannot deadlock."""
    unique = {id(s): s for s in stores}
    with contextlib.ExitStack() as stack:
        for key in sorted(unique):
            stack.enter_context(store_lock(unique[key]))
        yield


class Registry:
    """Token -> contexts of one grouped lookup, oldest dropped beyond `limit`."""

    def __init__(self, limit: int = MAX_PENDING):
        self.limit = limit
        self._lock = threading.Lock()
        self._pending: OrderedDict[int, list[cncore.LookupContext]] = OrderedDict()
        self._gone: OrderedDict[int, str] = OrderedDict()
        self._next = 0

    def __len__(self) -> int:
        return len(self._pending)

    def _forget(self, token: int, why: str) -> None:
        self._gone[token] = why
        while len(self._gone) > _HISTORY:
            self._gone.popitem(last=False)

    def check_room(self) -> None:
        """Refuse a new training lookup while `limit` contexts wait (nothing is dropped)."""
        if len(self._pending) >= self.limit:
            raise RuntimeError(
                f"cncore_jax: {len(self._pending)} training lookups are waiting for their gradients (the "
                f"limit, MAX_PENDING = {self.limit}); this lookup is refused and the tables are unchanged. Each "
                "training lookup needs its update once: differentiate through the module (nnx.value_and_grad"
                "(loss_fn)(model); a module whose output does not reach the loss never gets its backward, so "
                "use its output or look up in eval mode), or call cncore_jax.apply_gradients(ctx, grad) for a "
                "functional lookup; "
                "cncore_jax.discard(ctx) drops one you abandon, cncore_jax.discard_pending() drops them all "
                "(their rows stay, untrained).")

    def put(self, ctxs: list[cncore.LookupContext]) -> int:
        with self._lock:
            self.check_room()
            token = self._next
            self._next = (self._next + 1) % 2**31  # int32 tokens; the registry never holds 2^31
            self._pending[token] = ctxs
            return token

    def discard_all(self) -> int:
        """Drop every pending context; the number dropped."""
        with self._lock:
            tokens = list(self._pending)
            self._pending.clear()
            for token in tokens:
                self._forget(token, "discarded")
            return len(tokens)

    def get(self, token: int, tables: Sequence, pop: bool) -> list[cncore.LookupContext]:
        token = int(token)
        with self._lock:
            if token == NO_CONTEXT:
                raise ValueError("ctx: this lookup was made with training=False outside differentiation, so it "
                                 "kept no context; an evaluation lookup has no gradient to apply")
            ctxs = self._pending.get(token)
            if ctxs is None:
                why = self._gone.get(token, "unknown to this process")
                raise ValueError(f"ctx: the context of lookup #{token} is {why}; the tables are unchanged. "
                                 "Look up again, then apply that lookup's gradient once.")
            if [c.store for c in ctxs] != [t._store for t in tables]:
                raise ValueError("ctx: it belongs to a lookup of other tables")
            if pop:
                del self._pending[token]
                self._forget(token, "already used: its gradient was applied or accumulated (one lookup, one "
                                    "update)")
            return ctxs

    def discard(self, token: int) -> bool:
        """Drop a pending context without using it; False if there was none."""
        with self._lock:
            ctxs = self._pending.pop(int(token), None)
            if ctxs is not None:
                self._forget(int(token), "discarded")
            return ctxs is not None


REGISTRY = Registry()


def _trim(ids: np.ndarray, bags: np.ndarray, is_lengths: bool, weights, name: str):
    """The IDs the bags use: IDs past the last bag (the sum of lengths, or the last offset)
    are padding, so a jitted step can keep one shape while the number of IDs varies."""
    used = int(bags.sum()) if is_lengths else (int(bags[-1]) if len(bags) else 0)
    if is_lengths and bags.size and bags.min() < 0:
        raise ValueError(f"lengths[{name}]: must be >= 0; the tables are unchanged")
    if not 0 <= used <= len(ids):
        what = "add up to" if is_lengths else "end at"
        raise ValueError(f"{'lengths' if is_lengths else 'offsets'}[{name}]: {what} {used}, but only {len(ids)} "
                         f"ids were given (ids past the last bag are padding; there must be at least as many); "
                         "the tables are unchanged")
    return ids[:used], (None if weights is None else weights[:used])


def forward(tables, modes, is_lengths, training: bool, keep: bool, ids, bags, weights, outs=None, refuse: str = ""):
    """Grouped pooled lookup: (out (B, sum of dims) float32, token int32).
    `keep`: register the contexts (a training lookup, or any lookup being differentiated).
    `outs`: the caller's output buffers (the FFI route): the pooled rows are written there.
    `refuse`: a lookup that must not run (this message is raised before anything changes)."""
    if refuse:
        raise RuntimeError(refuse)
    if keep:
        REGISTRY.check_room()
    keys, lens, offs, ws = [], [], [], []
    for f in range(len(tables)):
        b = np.asarray(bags[f], dtype=np.int64)
        k, w = _trim(np.asarray(ids[f], dtype=np.int64), b, is_lengths[f], weights[f], str(f))
        keys.append(k)
        ws.append(None if w is None else np.asarray(w, dtype=np.float32))
        lens.append(b if is_lengths[f] else None)
        offs.append(None if is_lengths[f] else b)
    stores = [t._store for t in tables]
    with holding(stores):
        out, ctxs = cncore.grouped_pooled_lookup(stores, keys, offs, lengths=lens, modes=list(modes),
                                                 per_sample_weights=ws, insert_missing=training,
                                                 out=None if outs is None else outs[0])
    token = REGISTRY.put(ctxs) if keep else NO_CONTEXT
    return out, np.int32(token)


def forward_gathered(tables, modes, is_lengths, training: bool, keep: bool, index, ids, bags, refuse: str = ""):
    """Data parallel: on the device of index 0, one lookup of every device's bags, in device
    order (ids (n_dev, N), bags (n_dev, B) or (n_dev, B + 1) per feature; each device's
    padding trimmed); (out (n_dev * B, sum of dims), token). Other devices return zeros and
    change nothing."""
    n_dev, n_bags = ids[0].shape[0], (bags[0].shape[1] if is_lengths[0] else bags[0].shape[1] - 1)
    width = sum(t.dim for t in tables)
    if int(index) != 0:
        return np.zeros((n_dev * n_bags, width), np.float32), np.int32(0)
    all_ids, all_lengths = [], []
    for f in range(len(tables)):
        keys, lens = [], []
        for d in range(n_dev):
            b = np.asarray(bags[f][d], dtype=np.int64)
            k, _ = _trim(np.asarray(ids[f][d], dtype=np.int64), b, is_lengths[f], None, f"{f}, device {d}")
            keys.append(k)
            lens.append(b if is_lengths[f] else np.diff(b))
        all_ids.append(np.concatenate(keys))
        all_lengths.append(np.concatenate(lens))
    return forward(tables, modes, (True,) * len(tables), training, keep, all_ids, all_lengths,
                   [None] * len(tables), refuse=refuse)


def apply_in_backward(tables, token, grad, after=()) -> None:
    """The update a module's lookup runs in its backward pass (`after`: what it waits for)."""
    apply(tables, token, grad, None)


def apply_gathered(tables, index, token, grads) -> None:
    """Data parallel: the device of index 0 applies every device's gradient (n_dev, B, width),
    in device order, as one update of the one lookup; the others do nothing."""
    if int(index) == 0:
        grads = np.asarray(grads, dtype=np.float32)
        apply(tables, token, grads.reshape(-1, grads.shape[-1]), None)


def weight_grads(tables, token, grad, padded: Sequence[int | None]):
    """d(loss)/d(per-sample weight) of each weighted feature: <grad of its bag, its row>, over
    the bag's length for mean; zeros for padding. Reads rows, changes nothing."""
    ctxs = REGISTRY.get(token, tables, pop=False)
    grad = np.asarray(grad, dtype=np.float32)
    result = []
    for ctx, n in zip(ctxs, padded):
        if n is None:
            continue
        lens = np.diff(ctx.offsets)
        bag = np.repeat(np.arange(len(lens)), lens)
        store = ctx.store
        assert isinstance(store, (cncore.EmbeddingStore, TieredStore))  # a Table's store: one of the two
        with holding([store]):
            rows = store.read(ctx.keys).rows  # absent keys (evaluation) read as zeros, as in the forward
        g = (grad[bag, ctx.columns] * rows).sum(axis=1)
        if ctx.mode == 1:  # mean
            g = g / lens[bag]
        full = np.zeros(n, dtype=np.float32)
        full[:len(g)] = g
        result.append(full)
    return tuple(result)


def apply(tables, token, grad, lr) -> None:
    ctxs = REGISTRY.get(token, tables, pop=False)
    rate = None if lr is None else float(lr)
    with holding(c.store for c in ctxs):
        cncore.grouped_apply_gradients(ctxs, np.asarray(grad, dtype=np.float32), lr=rate)
    REGISTRY.get(token, tables, pop=True)  # only once the update succeeded: a refused one may be retried


def accumulate(tables, token, grad):
    """Per table: (unique ids in first-occurrence order, their gradient rows)."""
    ctxs = REGISTRY.get(token, tables, pop=False)
    grad = np.asarray(grad, dtype=np.float32)
    with holding(c.store for c in ctxs):
        result = [ctx.store.accumulate_gradients(ctx, np.ascontiguousarray(grad[:, ctx.columns])) for ctx in ctxs]
    REGISTRY.get(token, tables, pop=True)
    return result

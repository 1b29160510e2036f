"""One frozen table: its rows as a tensor and the ID-to-row map a delta merges into.

Table Layout
    `ids`    int64 (N,), sorted: every ID the table held when frozen (or after the last delta);
    `slots`  int64 (N,): the weight row of `ids[i]`;
    `free`   int64: weight rows no ID uses (an evicted ID's row, kept for the next new ID);
    weight   (capacity, dim): row 0 is zeros, where IDs the table never saw go (`UNSEEN`);
             the module may reserve more zero rows (a padding row); then the table's
             `fallback_rows` N shared rows (none for most tables), rows
             `first_slot - N .. first_slot - 1`; the keyed rows from `first_slot` on.

Lookup
    Requests do not read these arrays: the collections and the modules alike read FBGEMM's
    pruned-index hash table built from them (`collection.IdRemap` over `hashmap.PrunedHash`:
    one operator call for every feature of a request). The sorted arrays are what the hash is
    built from (at freeze, and when a delta rebuilds it whole) and what a serving file keeps.
    Every int64 is a valid ID (no value is reserved as empty), as in the live tables.

Pending changes
    A delta finds its IDs' rows through the hash (O(delta)), not these arrays, and only notes
    its new and evicted IDs here (`record`); the arrays take them (`merge`, O(N)) when read
    (`ids`, `slots`, a state_dict, a pickle, a copy, an export), when a delta rebuilds the hash
    whole, or once the pending IDs pass a quarter of the table (amortized: a merge per N / 4
    IDs changed), so a delta's own cost does not grow with the table.

Why unseen IDs read zeros: it is what the live tables answer in eval mode (they never insert
there, unless it has fallback rows: then an unseen ID reads its fallback row, in-graph,
`serving.fallback`), what `to_fixed`'s extra zero row gave, and it is the identity of every pooling (sum
and mean count it as one zero row, as the live tables do). The initializer's row could be
computed in-graph, but a serving model would then answer differently for an ID it never
trained than the model that was evaluated.
"""
from __future__ import annotations

from typing import cast

import numpy as np
import torch
from torch import nn

__all__ = ["UNSEEN", "TableSlots", "dense_rows", "id_tensor"]

UNSEEN = 0  # the weight row of IDs the table does not hold: zeros


def id_tensor(a: np.ndarray) -> torch.Tensor:
    """`torch.from_numpy(a)` of a 1-D int64 array, but a fresh tensor when `a` is empty.

    NumPy's empty arrays come back from `from_numpy` with stride (0,), which `torch.export.save`
    cannot write (a table with no rows made its `.pt2` fail with "numel: integer multiplication
    overflow").

    >>> id_tensor(np.zeros(0, np.int64)).stride(), id_tensor(np.arange(3)).tolist()
    ((1,), [0, 1, 2])
    """
    t = torch.from_numpy(np.ascontiguousarray(a))
    return t if t.numel() else torch.zeros(0, dtype=t.dtype)


class TableSlots(nn.Module):
    """The ID -> slot map of one table (buffers `ids`, `slots`, `free`; see the module
    docstring), and the bookkeeping a delta needs. Not called: `collection.IdRemap` reads
    these arrays through the hash it builds from them.

    >>> t = TableSlots(np.array([40, 10]), first_slot=1)
    >>> t.ids.tolist(), t.slots.tolist()
    ([10, 40], [2, 1])
    """

    ids: torch.Tensor
    slots: torch.Tensor
    free: torch.Tensor
    fallback_rows = 0   # (serving files written before fallback rows froze hold none)
    # the deltas' (evicted IDs, new IDs, their slots) not merged into ids / slots yet, in order
    # (module docstring); None: none
    _pending: list[tuple[np.ndarray, np.ndarray, np.ndarray]] | None = None

    def __init__(self, keys: np.ndarray, first_slot: int = 1, fallback_rows: int = 0) -> None:
        super().__init__()
        keys = np.asarray(keys, dtype=np.int64)
        order = np.argsort(keys, kind="stable")
        self.first_slot = first_slot
        self.fallback_rows = fallback_rows   # rows first_slot - fallback_rows .. first_slot - 1
        self.register_buffer("ids", id_tensor(keys[order]))
        self.register_buffer("slots", id_tensor(order.astype(np.int64) + first_slot))
        self.register_buffer("free", torch.zeros(0, dtype=torch.int64))

    def __getattr__(self, name: str):
        if name in ("ids", "slots") and self.__dict__.get("_pending") is not None:
            self.merge()
        return super().__getattr__(name)

    def __getstate__(self) -> dict:
        self.merge()
        return super().__getstate__()

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        self.merge()
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _apply(self, fn, recurse=True):
        self.merge()
        return super()._apply(fn, recurse)

    def merged(self, removed: np.ndarray, added: np.ndarray, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The (ids, slots) arrays with the pending changes and then these: `removed` IDs
        dropped, `added` IDs (none held) with their `slots` inserted. O(N); reads only.

        Args:
            removed: int64 IDs to drop (ones not held are ignored).
            added: int64 IDs to add, none of them held after `removed` is dropped.
            slots: int64, their weight rows.

        Returns:
            tuple: int64 (ids sorted, slots).

        >>> t = TableSlots(np.array([40, 10]), first_slot=1)
        >>> [a.tolist() for a in t.merged(np.array([10]), np.array([20]), np.array([7]))]
        [[20, 40], [7, 1]]
        """
        events = [*(self.__dict__.get("_pending") or []), (removed, added, slots)]
        # every ID a pending delta names leaves the old arrays; the ones whose last event is an
        # addition come back with that slot (an added ID was not held just before)
        keys = np.concatenate([k for r, a, _ in events for k in (r, a)]).astype(np.int64)
        is_add = np.concatenate([np.full(len(k), j, bool) for r, a, _ in events for j, k in ((False, r), (True, a))])
        at = np.concatenate([x for r, _, sl in events for x in (np.zeros(len(r), np.int64), sl)]).astype(np.int64)
        last = len(keys) - 1 - np.unique(keys[::-1], return_index=True)[1]   # each ID's last event
        gone = keys[last]                                                   # sorted
        new, at = gone[is_add[last]], at[last][is_add[last]]
        ids, held = self._array("ids").numpy(), self._array("slots").numpy()
        if len(gone) and len(ids):
            pos = np.searchsorted(ids, gone).clip(max=len(ids) - 1)
            drop = pos[ids[pos] == gone]
            if len(drop):
                keep = np.ones(len(ids), bool)
                keep[drop] = False
                ids, held = ids[keep], held[keep]
        if len(new):
            order = np.argsort(new, kind="stable")
            where = np.searchsorted(ids, new[order])
            ids, held = np.insert(ids, where, new[order]), np.insert(held, where, at[order])
        return ids, held

    def _array(self, name: str) -> torch.Tensor:
        """A buffer as it is, pending changes or not (`ids` / `slots` would merge them)."""
        return cast(torch.Tensor, self._buffers[name])

    def merge(self) -> None:
        """Write the pending changes into `ids` / `slots` (O(N); nothing when none)."""
        if self.__dict__.get("_pending") is None:
            return
        self.set_arrays(*self.merged(*(np.empty(0, np.int64),) * 3))

    def set_arrays(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """Replace the arrays (sorted ids and their slots), dropping the pending changes."""
        self.__dict__["_pending"] = None
        self._buffers["ids"], self._buffers["slots"] = id_tensor(ids), id_tensor(slots)

    def record(self, removed: np.ndarray, added: np.ndarray, slots: np.ndarray) -> None:
        """Note a delta's evicted IDs (held ones) and new IDs (with their slots) as pending;
        merged once they pass a quarter of the table (see the module docstring).

        Args:
            removed: int64 IDs the table held and drops.
            added: int64 IDs it did not hold (after `removed`), with `slots` their weight rows.
            slots: int64.

        >>> t = TableSlots(np.array([40, 10]), first_slot=1)
        >>> t.record(np.array([40]), np.array([5]), np.array([1]))
        >>> t.ids.tolist(), t.slots.tolist()
        ([5, 10], [1, 2])
        """
        if not len(removed) and not len(added):
            return
        pending = [*(self.__dict__.get("_pending") or []), (removed, added, slots)]
        self.__dict__["_pending"] = pending
        # amortized: a merge (O(N)) per quarter of the table named by deltas; noting one is O(1)
        if sum(len(r) + len(a) for r, a, _ in pending) > self._array("ids").numel() // 4 + 4096:
            self.merge()

    @property
    def first_fallback(self) -> int:
        """The weight row of fallback row 0."""
        return self.first_slot - self.fallback_rows

    def extra_repr(self) -> str:
        return f"ids={self.ids.numel()}, free={self.free.numel()}, fallback_rows={self.fallback_rows}"


def dense_rows(rows: np.ndarray, first_slot: int, capacity: int | None = None,
               fallback: np.ndarray | None = None) -> torch.Tensor:
    """A float32 (capacity, dim) weight: zeros, then `fallback` rows (if any) from row
    `first_slot` on, then `rows`."""
    rows = np.asarray(rows, dtype=np.float32)
    if fallback is not None and len(fallback):
        rows = np.concatenate([np.asarray(fallback, dtype=np.float32).reshape(-1, rows.shape[1]), rows])
    n, dim = rows.shape
    weight = torch.zeros((capacity or first_slot + n, dim), dtype=torch.float32)
    weight[first_slot:first_slot + n] = torch.from_numpy(rows)
    return weight

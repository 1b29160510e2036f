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
    one operator call for every feature of a request). The sorted arrays are what a delta
    merges its new and evicted IDs into (O(N)), before the hash is rebuilt from them aside.
    Every int64 is a valid ID (no value is reserved as empty), as in the live tables.

Why unseen IDs read zeros: it is what the live tables answer in eval mode (they never insert
there, unless it has fallback rows: then an unseen ID reads its fallback row, in-graph,
`serving.fallback`), what `to_fixed`'s extra zero row gave, and it is the identity of every pooling (sum
and mean count it as one zero row, as the live tables do). The initializer's row could be
computed in-graph, but a serving model would then answer differently for an ID it never
trained than the model that was evaluated.
"""
from __future__ import annotations

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

    def __init__(self, keys: np.ndarray, first_slot: int = 1, fallback_rows: int = 0) -> None:
        super().__init__()
        keys = np.asarray(keys, dtype=np.int64)
        order = np.argsort(keys, kind="stable")
        self.first_slot = first_slot
        self.fallback_rows = fallback_rows   # rows first_slot - fallback_rows .. first_slot - 1
        self.register_buffer("ids", id_tensor(keys[order]))
        self.register_buffer("slots", id_tensor(order.astype(np.int64) + first_slot))
        self.register_buffer("free", torch.zeros(0, dtype=torch.int64))

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

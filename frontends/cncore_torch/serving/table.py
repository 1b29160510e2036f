"""One frozen table: its rows as a tensor and an in-graph map from raw int64 IDs to row slots.

Table Layout
    `ids`    int64 (N,), sorted: every ID the table held when frozen (or after the last delta);
    `slots`  int64 (N,): the weight row of `ids[i]`;
    `free`   int64: weight rows no ID uses (an evicted ID's row, kept for the next new ID);
    weight   (capacity, dim): row 0 is zeros, where IDs the table never saw go (`UNSEEN`);
             the module may reserve more zero rows (a padding row); then the table's
             `fallback_rows` N shared rows (none for most tables), rows
             `first_slot - N .. first_slot - 1`; the keyed rows from `first_slot` on.

Lookup
    `torch.searchsorted(ids, x)` then one compare: a hit reads `slots[pos]`, a miss row 0.
    Plain tensor operations, so `torch.export` records them and the rows travel with the
    program. Every int64 is a valid ID (no value is reserved as empty), as in the live tables.
    The modules (one table, one feature) read this sorted array: a delta merges its new IDs in
    O(N). The collections read FBGEMM's pruned-index hash table built from every table's
    arrays (`hashmap.PrunedHash`: one operator call for all features at once).

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

__all__ = ["UNSEEN", "TableSlots", "slots_of", "dense_rows"]

UNSEEN = 0  # the weight row of IDs the table does not hold: zeros


def slots_of(ids: torch.Tensor, keys: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The weight row of each ID in `ids` (any shape): `slots[i]` where `keys[i]` is the ID,
    `UNSEEN` where no key is.

    >>> slots_of(torch.tensor([[7, 3], [5, -1]]), torch.tensor([3, 7]), torch.tensor([4, 9])).tolist()
    [[9, 4], [0, 0]]
    """
    ids = ids.to(torch.int64)
    if keys.numel() == 0:
        return torch.zeros_like(ids)
    pos = torch.searchsorted(keys, ids).clamp(max=keys.numel() - 1)
    return torch.where(keys[pos] == ids, slots[pos], UNSEEN)


class TableSlots(nn.Module):
    """The ID -> slot map of one table (buffers `ids`, `slots`, `free`; see the module
    docstring), and the bookkeeping a delta needs.

    >>> t = TableSlots(np.array([40, 10]), first_slot=1)
    >>> t.ids.tolist(), t.slots.tolist()
    ([10, 40], [2, 1])
    >>> t(torch.tensor([10, 11, 40])).tolist()
    [2, 0, 1]
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
        self.register_buffer("ids", torch.from_numpy(np.ascontiguousarray(keys[order])))
        self.register_buffer("slots", torch.from_numpy(order.astype(np.int64) + first_slot))
        self.register_buffer("free", torch.zeros(0, dtype=torch.int64))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return slots_of(ids, self.ids, self.slots)

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

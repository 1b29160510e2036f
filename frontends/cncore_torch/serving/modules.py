"""The frozen `CNEmbeddingBag` / `CNEmbedding`: `nn.EmbeddingBag` / `nn.Embedding` calls over
a frozen table (an `IdRemap` of one table + a weight buffer), the same answers as the live
module in eval mode: unseen IDs read the zero row 0 (and count in a mean's length, as there),
or their fallback row (rows 2 .. N + 1, `fallback`) where the table has N fallback rows,
`padding_idx` IDs read the zero row 1 and are left out of a mean's length (as
`nn.EmbeddingBag`'s).

The ID remap is the collections' (`collection.IdRemap`: FBGEMM's pruned-index hash, one
operator call), with one feature whose one bag is the whole input: a module's table is one
region, so the request's own bags (or shape) do not matter to the remap, and offsets a caller
passes never reach FBGEMM's loop over bags (`nn.EmbeddingBag` checks them after). A delta
writes its IDs into the hash in place (`delta.apply_delta`), as for the collections.
"""
from __future__ import annotations

from typing import cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from cncore_torch.serving.collection import IdRemap
from cncore_torch.serving.table import TableSlots, dense_rows

__all__ = ["FrozenEmbeddingBag", "FrozenEmbedding"]

PADDING = 1  # the weight row padding_idx IDs read: zeros, left out of a mean's length
TABLE, FEATURE = "table", "ids"   # the one table and feature of a module's IdRemap


class _FrozenTable(nn.Module):
    weight: torch.Tensor
    remap: IdRemap

    def __init__(self, keys: np.ndarray, rows: np.ndarray, padding_idx: int | None = None,
                 fallback: np.ndarray | None = None) -> None:
        super().__init__()
        self.embedding_dim = int(np.asarray(rows).shape[1])
        self.padding_idx = padding_idx
        n = 0 if fallback is None else len(fallback)
        self.remap = IdRemap({TABLE: TableSlots(keys, first_slot=2 + n, fallback_rows=n)}, {FEATURE: TABLE})
        self.register_buffer("weight", dense_rows(rows, first_slot=2, fallback=fallback))

    @property
    def table(self) -> TableSlots:
        """The table's ID map (sorted IDs and their rows, what a delta merges into)."""
        return cast(TableSlots, self.remap.tables[TABLE])

    def __setstate__(self, state: dict) -> None:
        # A serving file written while the modules remapped with searchsorted holds the table's
        # TableSlots as `table` (the same layout: zero row, padding row, fallback rows, keyed rows):
        # its sorted IDs become the hash here, so the file loads and answers as it did.
        modules = state.get("_modules", {})
        old = modules.pop("table", None) if "remap" not in modules else None
        super().__setstate__(state)
        if old is not None:
            self.remap = IdRemap({TABLE: old}, {FEATURE: TABLE})

    def _slots(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).to(torch.int64)
        one_bag = torch.arange(2, dtype=torch.int64) * flat.numel()   # [0, n]
        slots = self.remap.rows(flat, one_bag).view(ids.shape)
        if self.padding_idx is not None:
            slots = torch.where(ids == self.padding_idx, PADDING, slots)
        return slots


class FrozenEmbeddingBag(_FrozenTable):
    """`CNEmbeddingBag.forward` (input (B, L) or 1-D with offsets, per_sample_weights with sum
    and mean) over frozen rows. Built by `cncore_torch.serving.freeze`.

    Args:
        keys: int64 (N,) IDs; rows: float32 (N, dim), row i of keys[i]; mode: "sum", "mean"
            or "max"; include_last_offset, padding_idx: as the live module's; fallback:
            float32 (M, dim) fallback rows the IDs not in keys read (None: zero rows).

    >>> import numpy as np
    >>> bag = FrozenEmbeddingBag(np.array([5, 9]), np.array([[1.0, 2.0], [3.0, 4.0]]), mode="mean")
    >>> bag(torch.tensor([[5, 9], [9, 77]])).tolist()      # 77 is unseen: a zero row
    [[2.0, 3.0], [1.5, 2.0]]
    """

    def __init__(self, keys: np.ndarray, rows: np.ndarray, mode: str = "mean", include_last_offset: bool = False,
                 padding_idx: int | None = None, fallback: np.ndarray | None = None) -> None:
        super().__init__(keys, rows, padding_idx, fallback)
        self.mode = mode
        self.include_last_offset = include_last_offset

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        """The pooled rows of each bag, as `nn.EmbeddingBag.forward`.

        Args:
            input (Tensor): (B, L) IDs, or 1-D IDs with `offsets`.
            offsets (Tensor): (B,) bag starts (B + 1 with include_last_offset) for 1-D input.
            per_sample_weights (Tensor): weights of input's shape (sum and mean).

        Returns:
            Tensor: (B, dim) float32.
        """
        if input.dim() == 2:
            n_bags, length = input.shape
            offsets = torch.arange(0, n_bags * length + 1, max(length, 1), dtype=torch.int64)[:n_bags + 1]
            input = input.reshape(-1)
            if per_sample_weights is not None:
                per_sample_weights = per_sample_weights.reshape(-1)
        elif offsets is None:
            raise ValueError("offsets: a 1-D input needs offsets (as nn.EmbeddingBag)")
        else:
            offsets = offsets.to(torch.int64)
            if not self.include_last_offset:
                offsets = torch.cat([offsets, torch.tensor([input.numel()], dtype=torch.int64)])
        slots = self._slots(input)
        pooled = F.embedding_bag(slots, self.weight, offsets, mode="max" if self.mode == "max" else "sum",
                                 per_sample_weights=per_sample_weights, include_last_offset=True,
                                 # a padding row (zeros) adds nothing to a sum: only max leaves it out
                                 padding_idx=PADDING if self.padding_idx is not None and self.mode == "max" else None)
        if self.mode != "mean":
            return pooled
        counted = (slots != PADDING).to(torch.int64) if self.padding_idx is not None else torch.ones_like(slots)
        ends = torch.cat([torch.zeros(1, dtype=torch.int64), counted.cumsum(0)])
        lengths = (ends[offsets[1:]] - ends[offsets[:-1]]).clamp(min=1).to(pooled.dtype)
        return pooled * (1.0 / lengths).unsqueeze(1)  # the live tables' float32 arithmetic


class FrozenEmbedding(_FrozenTable):
    """`CNEmbedding.forward` (any input shape -> input.shape + (dim,)) over frozen rows.

    Args:
        keys: int64 (N,) IDs; rows: float32 (N, dim), row i of keys[i]; padding_idx: as the
            live module's (positions holding it read zeros); fallback: as `FrozenEmbeddingBag`'s.

    >>> import numpy as np
    >>> emb = FrozenEmbedding(np.array([5]), np.array([[1.0, 2.0]]))
    >>> emb(torch.tensor([5, 6])).tolist()
    [[1.0, 2.0], [0.0, 0.0]]
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """The rows of `input`'s IDs.

        Args:
            input (Tensor): int IDs of any shape.

        Returns:
            Tensor: input.shape + (dim,) float32.
        """
        return F.embedding(self._slots(input), self.weight)

"""Row gradients of a pooled lookup with static shapes: no host sync, on any torch device.

A lookup of N IDs reads N device rows (row 0: the zero row of keys without a row). Its
backward sums each distinct row's gradient once, for a fused update per row. `torch.unique`
gives the distinct rows with a size that depends on the data, which an accelerator answers
with a host sync; here the distinct rows sit in a buffer of N entries instead:

- `distinct_rows`: a sort, run starts, and a cumulative sum give every ID its entry (the
  rank of its row among the distinct rows, as `torch.unique`'s inverse); the entries past the
  distinct rows hold row 0 with no occurrence (the fill);
- `pooled_row_gradients`: sum and mean pooling's gradient of an ID is its bag's output
  gradient times its weight (or 1 / its bag's length), added into its entry (`index_add_`);
  max pooling's goes to the entry `embedding_bag`'s max picked in each bag and column (no
  autograd: the backward runs inside an operator when compiled, where autograd is off). The
  zero row's entry, and the fill, get a zero gradient and no occurrence, so an update of the N entries
  changes only the rows the lookup read (row 0 stays zero: a zero gradient moves no row under
  SGD, Adagrad, row-wise Adagrad or Adam).

Sum and mean do not go through `embedding_bag`'s own backward: on CUDA its dense backward
reads its segment count on the host.
"""
from __future__ import annotations

import torch

__all__ = ["distinct_rows", "pooled_row_gradients", "join_row_gradients"]


def distinct_rows(rows_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The distinct values of `rows_idx` in a buffer of its own length, with no host sync.

    Args:
        rows_idx (torch.Tensor): (N,) int64 rows, >= 0.

    Returns:
        (rows (N,) int64: the distinct rows ascending, then 0; position (N,) int64: each ID's
        entry in `rows`; occurrences (N,) int64: how many IDs each entry holds, 0 for the fill).

    >>> rows, position, occurrences = distinct_rows(torch.tensor([5, 2, 5, 9]))
    >>> rows.tolist(), position.tolist(), occurrences.tolist()
    ([2, 5, 9, 0], [1, 0, 1, 2], [1, 2, 1, 0])
    """
    n = rows_idx.shape[0]
    sorted_rows, order = torch.sort(rows_idx)
    start = torch.ones(n, dtype=torch.bool, device=rows_idx.device)
    start[1:] = sorted_rows[1:] != sorted_rows[:-1]
    run = torch.cumsum(start, 0) - 1
    position = torch.empty_like(run).scatter_(0, order, run)
    rows = torch.zeros_like(rows_idx).scatter_(0, run, sorted_rows)
    occurrences = torch.zeros_like(rows_idx).scatter_add_(0, run, torch.ones_like(rows_idx))
    return rows, position, occurrences


def _bag_of_ids(offsets: torch.Tensor, n: int) -> torch.Tensor:
    """(N,) the bag of every ID from B+1 offsets (no repeat_interleave: its size is read on the host)."""
    return torch.searchsorted(offsets[1:], torch.arange(n, device=offsets.device), right=True)


def pooled_row_gradients(table_rows: torch.Tensor, rows_idx: torch.Tensor, offsets: torch.Tensor,
                         weights: torch.Tensor | None, mode: int, grad_out: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Each distinct row's gradient of a pooled lookup, in static shapes.

    Args:
        table_rows (torch.Tensor): (R, dim) the rows the lookup read from.
        rows_idx (torch.Tensor): (N,) int64 the row of every ID (0: the zero row).
        offsets (torch.Tensor): (B+1,) int64 bag offsets.
        weights (torch.Tensor | None): (N,) per-ID weights (sum, or mean as sum(w x) / len).
        mode (int): 0 sum, 1 mean, 2 max.
        grad_out (torch.Tensor): (B, dim) the output's gradient.

    Returns:
        (rows (N,), gradients (N, dim), occurrences (N,), d/d weights (N,) or None): the
        distinct rows (then the fill, row 0), their summed gradients (zero for row 0 and the
        fill) and how many IDs read them (0 for row 0 and the fill).

    >>> table = torch.arange(12.0).reshape(4, 3)
    >>> rows, grads, occ, _ = pooled_row_gradients(table, torch.tensor([3, 0, 3]), torch.tensor([0, 2, 3]),
    ...                                            None, 0, torch.ones(2, 3))
    >>> rows.tolist(), grads[:, 0].tolist(), occ.tolist()
    ([0, 3, 0], [0.0, 2.0, 0.0], [0, 2, 0])
    """
    n = rows_idx.shape[0]
    rows, position, occurrences = distinct_rows(rows_idx)
    grad_weights = None
    if mode == 2:  # each bag's column goes to the entry embedding_bag's max picked (none for an empty bag)
        _, _, bag_size, picked = torch.ops.aten._embedding_bag(table_rows.index_select(0, rows).detach(), position,
                                                              offsets, False, 2, False, None, True)
        spare = torch.zeros((n + 1, grad_out.shape[1]), dtype=grad_out.dtype, device=grad_out.device)
        picked = torch.where((bag_size > 0)[:, None], picked, n)  # an empty bag's: the spare row, dropped
        grads = spare.scatter_add_(0, picked, grad_out)[:n]
    else:
        bag = _bag_of_ids(offsets, n)
        per_id = grad_out.index_select(0, bag)
        inv_len = None
        if mode == 1:  # 1 / the bag's length, as embedding_bag's mean and the weighted mean's sum(w / len x)
            inv_len = (1.0 / (offsets[1:] - offsets[:-1]).clamp(min=1).to(grad_out.dtype)).index_select(0, bag)
        if weights is not None:
            grad_weights = (table_rows.index_select(0, rows_idx) * per_id).sum(dim=1)
            scale = weights if inv_len is None else weights * inv_len
            if inv_len is not None:
                grad_weights = grad_weights * inv_len
            per_id = per_id * scale[:, None]
        elif inv_len is not None:
            per_id = per_id * inv_len[:, None]
        grads = torch.zeros((n, grad_out.shape[1]), dtype=grad_out.dtype, device=grad_out.device)
        grads.index_add_(0, position, per_id)
    real = rows != 0  # (where, not a product: a non-finite gradient of row 0 must not reach it as NaN)
    return rows, torch.where(real[:, None], grads, 0.0), torch.where(real, occurrences, 0), grad_weights


def join_row_gradients(parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One entry per distinct row from several lookups' (rows, gradients, occurrences), summed,
    in static shapes (the entries of all parts; the fill: row 0, no gradient, no occurrence).

    Args:
        parts: per lookup of the same table, what `pooled_row_gradients` returned.

    Returns:
        (rows, gradients, occurrences), as `pooled_row_gradients`'s.

    >>> a = (torch.tensor([2, 5]), torch.ones(2, 1), torch.tensor([1, 1]))
    >>> b = (torch.tensor([5, 0]), torch.ones(2, 1), torch.tensor([3, 0]))
    >>> rows, grads, occ = join_row_gradients([a, b])
    >>> rows.tolist(), grads[:, 0].tolist(), occ.tolist()
    ([0, 2, 5, 0], [0.0, 1.0, 2.0, 0.0], [0, 1, 4, 0])
    """
    if len(parts) == 1:
        return parts[0]
    rows, position, _ = distinct_rows(torch.cat([p[0] for p in parts]))
    grads = torch.cat([p[1] for p in parts])
    grads = torch.zeros_like(grads).index_add_(0, position, grads)
    occurrences = torch.zeros_like(rows).index_add_(0, position, torch.cat([p[2] for p in parts]))
    real = rows != 0
    return rows, torch.where(real[:, None], grads, 0.0), torch.where(real, occurrences, 0)

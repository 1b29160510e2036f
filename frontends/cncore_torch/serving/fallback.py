"""Fallback rows in-graph: the row a live table gives an ID without a row of its own.

A table built with `fallback_rows=N` (docs/bounded-tables.md, fallback rows) answers such an
ID with its shared row `cn_hash_key(id) % N`: the core's SplitMix64 finalizer of the ID read
as an unsigned 64-bit integer, then an unsigned modulo. `mix64` and `fallback_slot` compute
the same with torch int64 operations only, so `torch.export` records them and a program runs
them without cncore:

- a multiply of int64 tensors wraps modulo 2^64, as the unsigned multiply does (the two's
  complement bits are the same);
- a logical right shift is the arithmetic one with the bits it copies from the sign masked off;
- the unsigned modulo of a negative int64 h (the unsigned value h + 2^64) is
  (h + (2^64 mod N)) mod N, a floor remainder (`torch.remainder`) that never overflows, since
  h < 0 and 2^64 mod N < N; for N a power of two it is a mask of the low bits.
"""
from __future__ import annotations

import torch

from cncore_torch.serving.table import UNSEEN

__all__ = ["mix64", "fallback_slot", "wrap_of", "misses_to_fallback"]

_C1 = 0xBF58476D1CE4E5B9 - 2**64   # the finalizer's constants, as the int64 of their bits
_C2 = 0x94D049BB133111EB - 2**64


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 `z` by `k` (0 < k < 64)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def mix64(ids: torch.Tensor) -> torch.Tensor:
    """The core's `cn_mix64` of each ID (as uint64), as the int64 holding the same bits.

    Args:
        ids (Tensor): int64 IDs, any shape.

    Returns:
        Tensor: int64, same shape.

    >>> mix64(torch.tensor([0, 1, -1])).tolist()
    [0, 6238072747940578789, -5417735806833148549]
    """
    z = ids.to(torch.int64)
    z = (z ^ _shr(z, 30)) * _C1
    z = (z ^ _shr(z, 27)) * _C2
    return z ^ _shr(z, 31)


def wrap_of(n: int) -> int:
    """2^64 mod `n`: what an unsigned modulo adds to a negative int64 before a floor remainder.

    Args:
        n (int): the number of fallback rows (> 0).

    Returns:
        int: 2^64 mod n.

    >>> wrap_of(3), wrap_of(8)
    (1, 0)
    """
    return 2**64 % n


def fallback_slot(ids: torch.Tensor, n: int | torch.Tensor, wrap: int | torch.Tensor | None = None) -> torch.Tensor:
    """`cn_hash_key(id) % n` for each ID: the fallback row (0 .. n - 1) the live table reads.

    Args:
        ids (Tensor): int64 IDs, any shape.
        n: the number of fallback rows (> 0): an int, or an int64 tensor broadcasting with `ids`
            (one per ID, for features of tables with different numbers).
        wrap: `wrap_of(n)` (a tensor like `n` where `n` is one); computed from an int `n` when None.

    Returns:
        Tensor: int64, same shape as `ids`.

    >>> fallback_slot(torch.tensor([0, 1, -1, 2**62]), 5).tolist()
    [0, 4, 2, 0]
    """
    h = mix64(ids)
    if isinstance(n, int):
        if n & (n - 1) == 0:           # a power of two: the low bits, whatever the sign
            return h & (n - 1)
        wrap = wrap_of(n)
    assert wrap is not None, "wrap: give wrap_of(n) per ID with a tensor n"
    return (h + ((h >> 63) & wrap)).remainder(n)


def misses_to_fallback(slots: torch.Tensor, ids: torch.Tensor, first: int | torch.Tensor, n: int | torch.Tensor,
                       wrap: int | torch.Tensor | None = None) -> torch.Tensor:
    """`slots` with every miss (`UNSEEN`) replaced by its ID's fallback row, weight row
    `first + fallback_slot(id, n)`: what a live table with fallback rows answers there.

    Args:
        slots (Tensor): int64 weight rows, `UNSEEN` where the table lacks the ID.
        ids (Tensor): the int64 IDs, same shape.
        first: the weight row of fallback row 0 (an int, or a tensor like `n`).
        n: the number of fallback rows (> 0), as `fallback_slot` takes it.
        wrap: as `fallback_slot` takes it.

    Returns:
        Tensor: int64, same shape.

    >>> misses_to_fallback(torch.tensor([UNSEEN, 9]), torch.tensor([1, 2]), 3, 5).tolist()
    [7, 9]
    """
    return torch.where(slots == UNSEEN, first + fallback_slot(ids, n, wrap), slots)

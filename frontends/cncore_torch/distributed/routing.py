"""Which rank owns a key: a hash of the raw int64 key, never the key itself.

`owner = (high 32 bits of mix64(key ^ ROUTE_SALT)) * world_size >> 32`, with mix64 the core's
64-bit mixer (SplitMix64's finaliser, `cn_mix.h`). Why each part:

- a hash, not `key % world_size`: IDs are often structured (even/odd, multiples of a shard
  count, timestamps), and `key % 2` puts every odd key on one rank;
- salted, and the high bits: the core's key index places a key at `mix64(key) & mask` (low
  bits). Routing by those same low bits would leave every rank with keys whose low hash bits
  agree, i.e. half (a third, ...) of each rank's buckets never used and long probe runs. The
  salt makes the two hashes unrelated; the high bits keep them apart even without it;
- multiply-shift instead of `%`: uniform for any world size, no division.

Raw keys travel unchanged (the owner stores the key itself), so a checkpoint written by N ranks
is re-split for M ranks by calling `owner_of(keys, M)` on its keys.

>>> import torch
>>> owner_of(torch.tensor([0, 1, 2, 3, -1, 2**62]), 3).tolist()
[2, 1, 0, 1, 2, 2]
"""
from __future__ import annotations

import torch

__all__ = ["ROUTE_SALT", "owner_of", "mix64"]

ROUTE_SALT = 0x5851F42D4C957F2D  # PCG's multiplier: any odd constant unrelated to the index's hash


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_C1, _C2, _SALT = _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB), _signed(ROUTE_SALT)


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def mix64(keys: torch.Tensor) -> torch.Tensor:
    """cn_mix64 on int64 tensors (two's complement wrap-around, as uint64 in C)."""
    z = keys.to(torch.int64)
    z = (z ^ _shr(z, 30)) * _C1
    z = (z ^ _shr(z, 27)) * _C2
    return z ^ _shr(z, 31)


def owner_of(keys: torch.Tensor, world_size: int) -> torch.Tensor:
    """The rank (int64, in [0, world_size)) that owns each key."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if world_size == 1:
        return torch.zeros(keys.shape, dtype=torch.int64, device=keys.device)
    return (_shr(mix64(keys.to(torch.int64) ^ _SALT), 32) * world_size) >> 32

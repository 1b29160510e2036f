"""Which rank owns a key: a hash of the raw int64 key, never the key itself.

The function is defined once, in NumPy, in `cncore.routing` (the table files' offline tools
re-split shards with it, without torch); this is the same function on torch tensors (any
device, for the sharded lookup's input dist), built from its constants, and held equal to
it by a test. See `cncore.routing` for why a salted multiply-shift of the core's mixer.

Raw keys travel unchanged (the owner stores the key itself), so a checkpoint written by N ranks
is re-split for M ranks by calling `owner_of(keys, M)` on its keys.

>>> import torch
>>> owner_of(torch.tensor([0, 1, 2, 3, -1, 2**62]), 3).tolist()
[2, 1, 0, 1, 2, 2]
"""
from __future__ import annotations

import torch

from cncore.routing import MIX_C1, MIX_C2, ROUTE_SALT

__all__ = ["ROUTE_SALT", "owner_of", "mix64"]


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_C1, _C2, _SALT = _signed(MIX_C1), _signed(MIX_C2), _signed(ROUTE_SALT)


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
    """The rank that owns each key (a hash of the key, the same on every rank and in cncore.routing).

    Args:
        keys (torch.Tensor): int64 keys, any shape.
        world_size (int): the ranks, >= 1.

    Returns:
        torch.Tensor: int64 ranks in [0, world_size), the shape of `keys`.

    >>> owner_of(torch.tensor([5, 5, -1]), 1).tolist()
    [0, 0, 0]
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if world_size == 1:
        return torch.zeros(keys.shape, dtype=torch.int64, device=keys.device)
    return (_shr(mix64(keys.to(torch.int64) ^ _SALT), 32) * world_size) >> 32

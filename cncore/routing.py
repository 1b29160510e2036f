"""Which shard owns a key, in NumPy: the one definition the sharded tables, their table files
and the offline tools (`cn-table reshard`) agree on. No framework is imported here;
`cncore_torch.distributed.routing` computes the same function on torch tensors (any device)
from the constants below, and a test holds the two equal.

`owner = (high 32 bits of mix64(key ^ ROUTE_SALT)) * world_size >> 32`, with mix64 the core's
64-bit mixer (SplitMix64's finaliser, `cn_mix.h`). Why each part:

- a hash, not `key % world_size`: IDs are often structured (even/odd, multiples of a shard
  count, timestamps), and `key % 2` puts every odd key on one rank;
- salted: the core's key index places a key by the high bits of `mix64(key ^ mix64(n_buckets))`
  (cn_index.h). Routing by the bits the index uses would leave every rank with keys that agree
  in them, i.e. half (a third, ...) of each rank's buckets never used and long probe runs. The
  two salts make the hashes unrelated (the index's also differs with its size);
- multiply-shift instead of `%`: uniform for any world size, no division.

Raw keys are stored unchanged by their owner, so N shards are re-split into M by calling
`owner_of(keys, M)` on their keys. A shard's table file is named by its place in the split,
`shard_name(rank, world_size)` = ``shard-R-of-N``: the sharded collections save under that name
and `cn-table reshard` / `merge-shards` read it (`parse_shard_name`).

>>> import numpy as np
>>> owner_of(np.array([0, 1, 2, 3, -1, 2**62]), 3).tolist()
[2, 1, 0, 1, 2, 2]
>>> owner_of(np.array([5, 6]), 1).tolist()
[0, 0]
"""
from __future__ import annotations

import numpy as np

__all__ = ["ROUTE_SALT", "MIX_C1", "MIX_C2", "owner_of", "mix64", "shard_name", "parse_shard_name"]

ROUTE_SALT = 0x5851F42D4C957F2D  # PCG's multiplier: any odd constant unrelated to the index's hash
MIX_C1, MIX_C2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # SplitMix64's finaliser (cn_mix.h)


def mix64(keys) -> np.ndarray:
    """cn_mix64 of int64 keys, as uint64 (wrap-around arithmetic, as in C)."""
    z = np.asarray(keys).astype(np.int64, copy=False).view(np.uint64)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(MIX_C1)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(MIX_C2)
    return z ^ (z >> np.uint64(31))


def owner_of(keys, world_size: int) -> np.ndarray:
    """The shard (int64, in [0, world_size)) that owns each int64 key."""
    if not isinstance(world_size, (int, np.integer)) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    keys = np.asarray(keys)
    if keys.dtype.kind not in "iu":
        raise TypeError(f"keys must be integers (int64), got dtype {keys.dtype}")
    if world_size == 1:
        return np.zeros(keys.shape, dtype=np.int64)
    salted = keys.astype(np.int64, copy=False).view(np.uint64) ^ np.uint64(ROUTE_SALT)
    high = mix64(salted.view(np.int64)) >> np.uint64(32)
    return ((high * np.uint64(world_size)) >> np.uint64(32)).astype(np.int64)


# --- shard tables: one table file per rank, named by its place in the split ------------------

_SHARD_PREFIX = "shard-"


def shard_name(rank: int, world_size: int) -> str:
    """The table directory name of rank `rank`'s shard of a table split over `world_size`.

    >>> shard_name(1, 3), parse_shard_name("shard-1-of-3"), parse_shard_name("t_a")
    ('shard-1-of-3', (1, 3), None)
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    return f"{_SHARD_PREFIX}{rank}-of-{world_size}"


def parse_shard_name(name: str):
    """(rank, world_size) of a shard table's directory name, or None if it is not one."""
    if not name.startswith(_SHARD_PREFIX):
        return None
    rank, sep, world = name[len(_SHARD_PREFIX):].partition("-of-")
    if not (sep and rank.isdigit() and world.isdigit() and rank.isascii() and world.isascii()):
        return None
    r, w = int(rank), int(world)
    if not 0 <= r < w or name != shard_name(r, w):  # one spelling: no leading zeros
        return None
    return r, w

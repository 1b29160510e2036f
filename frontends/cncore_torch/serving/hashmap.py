"""A static cuckoo hash from raw int64 IDs to weight rows, per table, looked up in-graph.

Layout (`StaticHash`)
    `keys`, `slots`  int64 (E,): every table's region, one after another; a region is two halves
                     of `half` entries (a power of two), an ID sits in one of its two places:
                     `base + (h & (half-1))` or `base + half + ((h >> 32) & (half-1))`, where
                     `h = mix64(id)`. An empty entry holds key 0 and slot `UNSEEN` (0).
    `params`         int64 (tables + 1, 3): (base, half - 1, base + half) of each region; the
                     last row is a region of two empty entries, for features of no table.

Lookup (`lookup`): two places per ID, each one gather of the key and one of the slot, one
compare, the two hits' slots summed; no data-dependent control flow, so `torch.export` records it. Since each table has
its own region, an ID never meets another table's entry, and an empty entry's key 0 adds
slot 0 (`UNSEEN`) to the sum: every int64 stays a valid ID. A half of `half >= 1.25 N`
entries keeps the load under 0.4, where the two-choice placement (built here by rounds of
parallel claims and evictions) succeeds almost always; when it does not, the region doubles.

Against one `searchsorted` over every table's sorted IDs it reads 2 entries per ID instead of
log2(N), at about 2.4x the entries' memory; a delta rebuilds the regions aside (O(N) per round).
"""
from __future__ import annotations

import numpy as np
import torch

__all__ = ["StaticHash", "mix64", "mix64_np", "place", "lookup"]

_M1 = -7046029254386353131   # 0x9E3779B97F4A7C15 (Fibonacci hashing) as int64
_M2 = -4658895280553007687   # 0xBF58476D1CE4E5B9 (splitmix64's second multiplier) as int64
_ROUNDS = 500                # claim rounds before a region doubles instead
_MAX_GROWTH = 8              # doublings before placement gives up (the IDs must repeat)


def mix64_np(ids: np.ndarray) -> np.ndarray:
    """The 64-bit mix of `mix64`, in NumPy (wrapping int64 products, logical shifts by mask).

    >>> bool((mix64_np(np.array([1, 2, -5])) == mix64(torch.tensor([1, 2, -5])).numpy()).all())
    True
    """
    with np.errstate(over="ignore"):
        x = np.asarray(ids, dtype=np.int64) * np.int64(_M1)
        x = x ^ ((x >> np.int64(31)) & np.int64((1 << 33) - 1))
        x = x * np.int64(_M2)
        return x ^ ((x >> np.int64(29)) & np.int64((1 << 35) - 1))


def mix64(ids: torch.Tensor) -> torch.Tensor:
    """Multiply-xorshift mix of int64 IDs in torch int64 operations (products wrap around).

    >>> mix64(torch.tensor([0])).tolist()
    [0]
    """
    x = ids * _M1
    x = x ^ ((x >> 31) & ((1 << 33) - 1))
    x = x * _M2
    return x ^ ((x >> 29) & ((1 << 35) - 1))


def place(ids: np.ndarray, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """One table's region: (keys, slots, half) with every `ids[i]` at one of its two places.

    Args:
        ids: distinct int64 IDs.
        slots: int64, the weight row of each.

    Returns:
        tuple: (keys (2 * half,), slots (2 * half,), half).

    >>> keys, slots, half = place(np.array([10, 20, 30]), np.array([1, 2, 3]))
    >>> half, sorted(slots[keys == 20].tolist())
    (4, [2])
    """
    ids = np.asarray(ids, dtype=np.int64)
    slots = np.asarray(slots, dtype=np.int64)
    n = len(ids)
    half = 1 << int(np.ceil(np.log2(max(1.25 * n, 1.0))))
    x = mix64_np(ids)
    for _ in range(_MAX_GROWTH):
        mask = np.int64(half - 1)
        homes = np.stack([x & mask, ((x >> np.int64(32)) & mask) + half])
        owner = np.full(2 * half, -1, np.int64)
        claim = np.empty(2 * half, np.int64)
        choice = np.zeros(n, np.int64)
        pending = np.arange(n)
        for _ in range(_ROUNDS):
            if len(pending) == 0:
                break
            # every pending ID claims its current place; one claimant of each place wins and
            # evicts the place's owner, which (like the losers) tries its other place next
            pos = homes[choice[pending], pending]
            claim[pos] = pending
            won = claim[pos] == pending
            evicted = owner[pos[won]]
            evicted = evicted[evicted >= 0]
            owner[pos[won]] = pending[won]
            lost = pending[~won]
            choice[lost] ^= 1
            choice[evicted] ^= 1
            pending = np.concatenate([lost, evicted])
        if len(pending) == 0:
            keys = np.zeros(2 * half, np.int64)
            out = np.zeros(2 * half, np.int64)
            used = owner >= 0
            keys[used], out[used] = ids[owner[used]], slots[owner[used]]
            return keys, out, half
        half *= 2
    raise ValueError(f"ids: {n} IDs found no cuckoo placement in {_MAX_GROWTH} doublings; "
                     "they must be distinct (a table holds each ID once)")


class StaticHash:
    """Every table's region (see the module docstring), built from each table's (ids, slots).

    Args:
        tables: list of (int64 ids, int64 slots) pairs, one per table index.

    >>> h = StaticHash([(np.array([7, 9]), np.array([1, 2])), (np.array([9]), np.array([1]))])
    >>> lookup(h.keys, h.slots, h.params[torch.tensor([0, 0, 1, 1, 2])], torch.tensor([9, 5, 9, 7, 9])).tolist()
    [2, 0, 1, 0, 0]
    """

    def __init__(self, tables: list[tuple[np.ndarray, np.ndarray]]) -> None:
        keys, slots, params, base = [], [], [], 0
        for ids, table_slots in tables:
            k, s, half = place(ids, table_slots)
            keys.append(k)
            slots.append(s)
            params.append((base, half - 1, base + half))
            base += len(k)
        keys.append(np.zeros(2, np.int64))
        slots.append(np.zeros(2, np.int64))
        params.append((base, 0, base + 1))
        self.keys = torch.from_numpy(np.concatenate(keys))
        self.slots = torch.from_numpy(np.concatenate(slots))
        self.params = torch.tensor(params, dtype=torch.int64)


def lookup(keys: torch.Tensor, slots: torch.Tensor, params: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The slot of each ID in its table's region (`params`: one (base, half - 1, base + half)
    row per ID), 0 where the region does not hold it.

    Args:
        keys, slots: a `StaticHash`'s.
        params: int64 (n, 3), the region of each ID's table.
        ids: int64 (n,).

    Returns:
        torch.Tensor: int64 (n,).
    """
    h = mix64(ids)
    mask = params[:, 1]
    first = (h & mask) + params[:, 0]
    second = ((h >> 32) & mask) + params[:, 2]
    # a sum, not a choice: an empty entry (key 0) may sit at one place while ID 0 sits at the
    # other, and it adds slot 0
    return (torch.take(slots, first) * (torch.take(keys, first) == ids)
            + torch.take(slots, second) * (torch.take(keys, second) == ids))

"""A static cuckoo hash from raw int64 IDs to weight rows, per table, looked up in-graph.

Layout (`StaticHash`)
    `entries`  int64 (E, 2): (key, slot) pairs, so that one place is one read of 16 contiguous
               bytes. Every table has its own region, one after another: two halves of `half`
               entries (a power of two, 2**bits), and an ID sits at one of its two places
               (`places`): `base + fib(id, M1)` or `base + half + fib(id, M2)`, where
               `fib(id, M) = (id * M) >> (64 - bits)`, the top bits of a wrapping product
               (Fibonacci hashing: they depend on every bit of the ID). An empty entry holds key
               0 and slot `UNSEEN` (0).
    `params`   int64 (4, tables + 1): (base, base + half, 64 - bits, half - 1) of each region,
               one column each (a request's per-ID copies are then four contiguous rows); the
               last is a region of two empty entries, for features of no table.

Lookup (`lookup`): two places per ID, each one row gather (key and slot) and one compare, the
two hits' slots summed; no data-dependent control flow, so `torch.export` records it. Since
each table has its own region, an ID never meets another table's entry, and an empty entry's
key 0 adds slot 0 (`UNSEEN`) to the sum: every int64 stays a valid ID. A half of
`half >= 1.25 N` entries keeps the load under 0.4, where the two-choice placement (built here by
rounds of parallel claims and evictions) succeeds almost always; when it does not, the region
doubles.

Against one `searchsorted` over every table's sorted IDs it reads 2 entries per ID instead of
log2(N), at about 2.4x the sorted arrays' memory; a delta rebuilds the regions aside.
"""
from __future__ import annotations

import numpy as np
import torch

__all__ = ["StaticHash", "places", "place", "lookup"]

_M1 = -7046029254386353131   # 0x9E3779B97F4A7C15 (Fibonacci hashing's 2**64 / golden ratio) as int64
_M2 = -4658895280553007687   # 0xBF58476D1CE4E5B9 (splitmix64's second multiplier) as int64
_ROUNDS = 500                # claim rounds before a region doubles instead
_MAX_GROWTH = 8              # doublings before placement gives up (the IDs must repeat)


def places(ids: torch.Tensor, params: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two places of each ID: int64 products wrap around, and the arithmetic shift's
    sign-filled bits are masked off.

    Args:
        ids: int64 (n,).
        params: int64 (4, n), (base, base + half, 64 - bits, half - 1) of each ID's region.

    Returns:
        tuple: (first, second), int64 (n,) each.

    >>> places(torch.tensor([1, -5]), torch.tensor([[0, 0], [4, 4], [62, 62], [3, 3]]))
    (tensor([2, 3]), tensor([6, 5]))
    """
    first = (((ids * _M1) >> params[2]) & params[3]) + params[0]
    second = (((ids * _M2) >> params[2]) & params[3]) + params[1]
    return first, second


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
    half = 1 << max(int(np.ceil(np.log2(max(1.25 * n, 1.0)))), 1)
    for _ in range(_MAX_GROWTH):
        # `places` with the region's parameters as scalars (the same operations, faster)
        shift, t = 64 - half.bit_length() + 1, torch.from_numpy(ids)
        homes = np.stack([(((t * _M1) >> shift) & (half - 1)).numpy(),
                          (((t * _M2) >> shift) & (half - 1)).numpy() + half])
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
    >>> lookup(h.entries, h.params[:, [0, 0, 1, 1, 2]], torch.tensor([9, 5, 9, 7, 9])).tolist()
    [2, 0, 1, 0, 0]
    """

    def __init__(self, tables: list[tuple[np.ndarray, np.ndarray]]) -> None:
        keys, slots, params, base = [], [], [], 0
        for ids, table_slots in tables:
            k, s, half = place(ids, table_slots)
            keys.append(k)
            slots.append(s)
            params.append((base, base + half, 64 - half.bit_length() + 1, half - 1))
            base += len(k)
        keys.append(np.zeros(2, np.int64))
        slots.append(np.zeros(2, np.int64))
        params.append((base, base + 1, 63, 0))
        self.entries = torch.from_numpy(np.stack([np.concatenate(keys), np.concatenate(slots)], axis=1))
        self.params = torch.tensor(params, dtype=torch.int64).t().contiguous()


def lookup(entries: torch.Tensor, params: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The slot of each ID in its table's region, 0 where the region does not hold it.

    Args:
        entries: a `StaticHash`'s.
        params: int64 (4, n), the region of each ID's table (`StaticHash.params`' columns).
        ids: int64 (n,).

    Returns:
        torch.Tensor: int64 (n,).
    """
    first, second = places(ids, params)
    # a sum, not a choice: an empty entry (key 0) may sit at one place while ID 0 sits at the
    # other, and it adds slot 0
    a, b = entries.index_select(0, first), entries.index_select(0, second)
    return torch.where(a[:, 0] == ids, a[:, 1], 0) + torch.where(b[:, 0] == ids, b[:, 1], 0)

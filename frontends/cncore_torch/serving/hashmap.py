"""Every table's ID-to-row map as FBGEMM's pruned-index hash table, read in-graph by one op.

Table Layout (`PrunedHash`)
    `table`    int64 (C, 2): (key, row) pairs in the layout of FBGEMM's `pruned_hashmap_insert` /
               `pruned_hashmap_lookup`, the operators TorchRec's inference TBE uses to remap the
               indices of pruned tables. Open addressing with linear probing from a 64-bit
               MurmurHash3 finalizer of the key; an empty entry is (-1, -1).
    `offsets`  int64 (F + 1,): feature f's region is `table[offsets[f]:offsets[f + 1]]`, one
               region per feature in the collection's feature order (FBGEMM reads region f for
               the f-th feature of a request), of capacity 2 N rounded up to a multiple of 32
               (at least 32): a load under 0.5, so an empty entry always ends a probe. Features
               sharing a table hold one copy of its region each.
    `mask`     int: the keys are stored XOR `mask` (below).

Lookup (`lookup`)
    One call of `torch.ops.fbgemm.pruned_hashmap_lookup` over a request's values and offsets,
    every feature at once, in C++: -1 where the region lacks the ID, clamped to row 0
    (`UNSEEN`, the zero row). `torch.export` records it as one node (a Meta kernel is
    registered here for the tracing; FBGEMM ships none), and a fresh process runs the program
    with torch and torchrec imported (torchrec loads FBGEMM's operators).

Updated in place (`insert`, what a delta does)
    A delta's new IDs are inserted into the live regions and its removed IDs keep their entry
    with row `TOMBSTONE` (-2): the lookup finds the key and reads -2, clamped to row 0 like a
    miss, while the probes of other keys go on past it (an emptied entry would cut their probe
    chains; FBGEMM's insert also skips row -1, so -1 cannot mark it). An ID removed then added
    again finds its own entry and takes its new row. Tombstones and new IDs fill a region up:
    past `_FULL` of its entries in use, the delta rebuilds the hash whole instead (aside, as
    before), which drops the tombstones. Cost: one FBGEMM insert call over the delta's new and
    removed IDs, under the lock; nothing proportional to the table.

Every int64 is a valid ID
    FBGEMM's empty key -1 would make ID -1 unreachable. So a table stores `id ^ mask`, with
    `mask` the smallest s >= 0 whose complement ~s (the one ID that becomes -1) no table holds:
    0, no XOR at all, unless a table holds -1. The ID ~s then probes for key -1, meets an empty
    entry and reads row 0, its right answer since no table holds it.

Alternatives measured (docs/serving.md, the lookup): a static cuckoo hash of tensor operations
(two gathers per ID, about twenty operations a request, each a fixed cost) and `searchsorted`
over sorted IDs (log2(N) reads per ID) both cost more per request than this one call, whose
rebuild after a delta is also one call.
"""
from __future__ import annotations

from collections.abc import Sequence

import fbgemm_gpu  # noqa: F401 (registers torch.ops.fbgemm)
import numpy as np
import torch

from cncore_torch.serving.table import UNSEEN

__all__ = ["PrunedHash", "lookup", "insert", "region_capacity", "key_mask", "TOMBSTONE"]

EMPTY = -1          # FBGEMM's empty key (and the row a miss reads before the clamp)
_LOAD = 0.5         # TorchRec's default pruning_hash_load_factor
_ALIGN = 32         # FBGEMM rounds each region up to a multiple of 32 entries
TOMBSTONE = -2      # the row of a removed ID's entry (read as a miss; FBGEMM's insert skips row -1)
# In-place inserts stop at this share of a region in use (live IDs and tombstones): linear probing's
# expected probes for a miss, (1 + 1 / (1 - a)^2) / 2, are 2.5 at the build's 0.5 and 3.6 at 0.6 (8.5
# at 0.75). Between the two a region takes 0.2 N inserts (N: its IDs at the last rebuild) before a
# delta rebuilds it whole.
_FULL = 0.6


def _lookup_meta(indices: torch.Tensor, offsets: torch.Tensor, hash_table: torch.Tensor,
                 hash_table_offsets: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(indices)


_FBGEMM_IMPL = torch.library.Library("fbgemm", "IMPL")
if not torch._C._dispatch_has_kernel_for_dispatch_key("fbgemm::pruned_hashmap_lookup", "Meta"):
    _FBGEMM_IMPL.impl("pruned_hashmap_lookup", _lookup_meta, "Meta")


def region_capacity(n: int) -> int:
    """The entries of a region holding `n` IDs: 2 n rounded up to a multiple of 32, >= 32.

    Args:
        n (int): IDs in the region.

    Returns:
        int: its capacity.

    >>> region_capacity(0), region_capacity(16), region_capacity(17)
    (32, 32, 64)
    """
    return max(_ALIGN, -(-int(np.ceil(n / _LOAD)) // _ALIGN) * _ALIGN)


def key_mask(id_sets: Sequence[np.ndarray]) -> int:
    """The smallest s >= 0 such that no array in `id_sets` holds ~s (the ID that `^ s` turns
    into FBGEMM's empty key -1).

    Args:
        id_sets: int64 arrays of IDs.

    Returns:
        int: the mask (0 unless -1 is held).

    >>> key_mask([np.array([3, 5])]), key_mask([np.array([-1, 7]), np.array([-2])])
    (0, 2)
    """
    held = set()
    for ids in id_sets:
        near = ids[ids < 0]            # ~s < 0 for every s >= 0
        held.update((~near[near >= -(len(near) + 2)]).tolist())
    s = 0
    while s in held:
        s += 1
    return s


class PrunedHash:
    """The regions of every feature (see the module docstring), built from each feature's
    table as (ids, rows).

    Args:
        regions: one (int64 ids, int64 rows) pair per feature, in feature order; the ids of
            one pair distinct.

    >>> h = PrunedHash([(np.array([7, -1]), np.array([1, 2])), (np.array([7]), np.array([1]))])
    >>> h.mask, h.offsets.tolist()
    (1, [0, 32, 64])
    >>> lookup(h.table, h.offsets, h.mask, torch.tensor([7, -1, 5, 7, -1]), torch.tensor([0, 2, 3, 4, 5])).tolist()
    [1, 2, 0, 1, 0]
    """

    def __init__(self, regions: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
        ids = [np.asarray(i, dtype=np.int64) for i, _ in regions]
        rows = [np.asarray(r, dtype=np.int64) for _, r in regions]
        self.mask = key_mask(ids)
        self.used = [len(i) for i in ids]     # entries in use per region (tombstones count)
        capacities = [region_capacity(len(i)) for i in ids]
        self.offsets = torch.tensor(np.concatenate([[0], np.cumsum(capacities)]), dtype=torch.int64)
        self.table = torch.full((int(self.offsets[-1]), 2), EMPTY, dtype=torch.int64)
        if regions:
            keys = torch.from_numpy(np.concatenate(ids) ^ self.mask)
            counts = torch.tensor(np.concatenate([[0], np.cumsum([len(i) for i in ids])]), dtype=torch.int64)
            torch.ops.fbgemm.pruned_hashmap_insert(keys, torch.from_numpy(np.concatenate(rows)), counts,
                                                  self.table, self.offsets)


def region_room(offsets: torch.Tensor, used: Sequence[int]) -> list[int]:
    """How many more entries each region takes in place before it is rebuilt (`_FULL`).

    Args:
        offsets: int64 (F + 1,) region offsets.
        used: entries in use per region.

    Returns:
        list[int]: per region, `_FULL` of its capacity less `used` (may be negative).

    >>> region_room(torch.tensor([0, 32, 96]), [10, 38])
    [9, 0]
    """
    capacities = (offsets[1:] - offsets[:-1]).tolist()
    return [int(c * _FULL) - u for c, u in zip(capacities, used)]


def insert(table: torch.Tensor, offsets: torch.Tensor, mask: int, ids: Sequence[np.ndarray],
           rows: Sequence[np.ndarray]) -> int:
    """Write `ids[f] -> rows[f]` into region f of `table` in place (an ID it holds takes its new
    row, `TOMBSTONE` marks a removed one); one FBGEMM call. The caller keeps readers out and
    the regions under `_FULL` (`region_room`), and no ID equal to `~mask`.

    Args:
        table: a `PrunedHash`'s `table`, written in place.
        offsets: its region offsets (F + 1,).
        mask: its key mask.
        ids: F int64 arrays, the IDs of each region (empty where none), each distinct.
        rows: F int64 arrays, their rows.

    Returns:
        int: entries written.

    >>> h = PrunedHash([(np.array([7, 8]), np.array([1, 2]))])
    >>> insert(h.table, h.offsets, h.mask, [np.array([8, 9])], [np.array([TOMBSTONE, 3])])
    2
    >>> lookup(h.table, h.offsets, h.mask, torch.tensor([7, 8, 9]), torch.tensor([0, 3])).tolist()
    [1, 0, 3]
    """
    counts = [len(i) for i in ids]
    if len(counts) != len(offsets) - 1 or len(rows) != len(ids):
        raise ValueError(f"ids, rows: expected one array per region ({len(offsets) - 1}), got {len(ids)} and "
                         f"{len(rows)}")
    if not sum(counts):
        return 0
    keys = np.concatenate([np.asarray(i, dtype=np.int64) for i in ids])
    if bool((keys == ~mask).any()):
        raise ValueError(f"ids: {~mask} would be stored as FBGEMM's empty key under mask {mask}; rebuild the hash")
    bags = torch.tensor(np.concatenate([[0], np.cumsum(counts)]), dtype=torch.int64)
    torch.ops.fbgemm.pruned_hashmap_insert(torch.from_numpy(keys ^ mask),
                                          torch.from_numpy(np.concatenate(rows).astype(np.int64)), bags,
                                          table, offsets)
    return int(keys.size)


def lookup(table: torch.Tensor, regions: torch.Tensor, mask: int, ids: torch.Tensor,
           offsets: torch.Tensor) -> torch.Tensor:
    """The row of every ID, each bag read in its feature's region; `UNSEEN` where it lacks it.

    Args:
        table: a `PrunedHash`'s `table`.
        regions: int64 (F + 1,), the region offsets of the request's F features in order.
        mask: the `PrunedHash`'s `mask`.
        ids: int64 (n,), the request's values, feature by feature.
        offsets: int64 (F * B + 1,), the request's bag offsets (a KJT's `offsets()`).

    Returns:
        torch.Tensor: int64 (n,) rows.

    Raises:
        ValueError: eagerly, when `offsets` does not hold B bags for each of the F features, or
            its last offset is not `len(ids)` (FBGEMM checks neither: it leaves the bags past
            F * (n_bags // F) unread and reads `ids` up to the last offset). In a traced or
            exported graph the checks are left out; the collections build consistent offsets.
    """
    if not torch.compiler.is_compiling():
        _check_bags(regions, ids, offsets)
    if mask:
        ids = ids ^ mask
    if offsets.numel() <= 1:        # no bag: FBGEMM refuses a batch of 0
        return torch.zeros_like(ids)
    return torch.ops.fbgemm.pruned_hashmap_lookup(ids, offsets, table, regions).clamp_(min=UNSEEN)


def _check_bags(regions: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor) -> None:
    """`lookup`'s argument checks (shapes, and the last offset: one read)."""
    n_features, n_bags = regions.numel() - 1, offsets.numel() - 1
    if n_features < 1:
        raise ValueError(f"regions: expected F + 1 >= 2 region offsets, got {regions.numel()}")
    if n_bags > 0 and n_bags % n_features:
        raise ValueError(f"offsets: expected B bags for each of the {n_features} features (a multiple of "
                         f"{n_features} bags), got {n_bags}")
    last = int(offsets[-1]) if n_bags > 0 else 0
    if last != ids.numel():
        raise ValueError(f"offsets: the last offset must be len(ids) = {ids.numel()}, got {last}")

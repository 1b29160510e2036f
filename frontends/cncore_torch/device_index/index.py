"""A key index held in torch tensors on the rows' device: batched find, find-or-insert,
erase, growth and bounded eviction with the core's semantics.

Table layout
------------
Buckets of `WAYS` entries (HierarchicalKV's layout): `bucket_keys` and `bucket_slots`, two flat
int64 tensors of n_buckets * WAYS entries plus one spare entry at the end that masked writes
aim at (so that a batch writes with one static-shape scatter). An entry is occupied when its
slot is >= 0: occupancy lives in the slot, never in the key, so every int64 is a valid key. A
key lives in bucket mix64(key) mod n_buckets, in any of its ways; a find compares the key with
the bucket's WAYS entries at once (no probe loop, no host sync).

Slots
-----
A key's slot is its row number, allocated exactly as the core's arena does (`cn_arena.h`): the
newest freed slot first (a stack of the slots that erase and eviction release, in release
order), else the next never-used slot. New keys take slots in the order of their first
occurrence in the batch, so the same sequence of calls gives the same slots as a core store.
Per slot: its key, a live flag, the access count and the last step (what the policies read).

Batched insert
--------------
Duplicates in a batch are resolved with a stable sort: each occurrence points at the first
occurrence of its key, which is the one that inserts. The new keys of a bucket take its free
ways in batch order (a stable sort by bucket gives each its rank; a cumulative sum of the
bucket's free ways turns the rank into a way). Host syncs in a find-or-insert: one when every
key is present (the count of absent keys: zero, done); with absent keys, also one read of the
number of new keys, which decides eviction and the slot arrays' growth, together with whether
every new key found a free way (a bucket that would overflow doubles the buckets, a batched
rehash, and the placement runs again, reading its flag); an eviction round reads the victims'
count. `find` has no host sync.

Eviction
--------
Exact, as `cn_evict.h` states it: victims in ascending (score, key) order, keys as signed
int64; LRU and TTL score by last step, LFU by (count aged by its halvings, last step). The
selection is three stable sorts of the slot arrays (key, then the score's parts), run once per
eviction round (a round frees `headroom` rows beyond the need, as the core's).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

import cncore
from cncore.config import with_default_split
from cncore_torch.device_index.hashing import admission_draw, mix64, sketch_columns

__all__ = ["DeviceKeyIndex", "EvictedSlots", "InsertResult", "WAYS", "MAX_LOAD"]

WAYS = 32        # entries a bucket holds (a find compares a key with all of them at once)
MAX_LOAD = 0.5   # keys per entry past which the buckets double before inserting
_COUNT_MAX = 2**32 - 1
_STEP_MAX = 2**32 - 1
_MAX_BUCKETS = 2**36


class InsertResult(NamedTuple):
    """What `DeviceKeyIndex.find_or_insert` returns (tensors on the index's device).

    slots (N,) int64: each key's slot (-1: not admitted); found (N,) bool: present before the
    call; new_slots, new_keys (M,) int64: the rows this call inserted, in first-occurrence order.
    """
    slots: torch.Tensor
    found: torch.Tensor
    new_slots: torch.Tensor
    new_keys: torch.Tensor


class EvictedSlots(NamedTuple):
    """Rows an eviction removes, in eviction order, handed to the sinks before their slots are
    reused: keys, slots, counts, last_steps (M,) int64 tensors on the index's device."""
    keys: torch.Tensor
    slots: torch.Tensor
    counts: torch.Tensor
    last_steps: torch.Tensor


def _first_occurrence(keys: torch.Tensor) -> torch.Tensor:
    """(N,) index of the first occurrence of each key's value (a stable sort; static shapes)."""
    n = len(keys)
    if n == 0:
        return keys.new_empty(0)
    order = torch.sort(keys, stable=True).indices
    sk = keys[order]
    start = torch.ones(n, dtype=torch.bool, device=keys.device)
    start[1:] = sk[1:] != sk[:-1]
    run = torch.cumsum(start, 0) - 1
    first = torch.full((n,), n, dtype=torch.int64, device=keys.device).scatter_reduce(0, run, order, "amin")
    rep = torch.empty_like(order)
    rep[order] = first[run]
    return rep


class DeviceKeyIndex:
    """A key index in device memory with the semantics of a core store's index.

    Args:
        config: the table's `cncore.StoreConfig`: `capacity` (rows to size for), `max_rows`,
            `eviction`, `admission` and `headroom` as a core store reads them.
        device: where the index's tensors live (any torch device).

    >>> import cncore, torch
    >>> idx = DeviceKeyIndex(cncore.StoreConfig(dim=4), torch.device("cpu"))
    >>> r = idx.find_or_insert(torch.tensor([7, -1, 7, 2**63 - 1]))
    >>> r.slots.tolist(), r.found.tolist(), r.new_keys.tolist()
    ([0, 1, 0, 2], [False, False, False, False], [7, -1, 9223372036854775807])
    >>> idx.find(torch.tensor([-1, 5]))[0].tolist()
    [1, -1]
    """

    def __init__(self, config: cncore.StoreConfig, device: torch.device | str = "cpu"):
        if not isinstance(config, cncore.StoreConfig):
            raise TypeError(f"config must be a cncore.StoreConfig, got {type(config).__name__}")
        config = with_default_split(config, can_split=False)  # the default here: one row per key
        if config.fallback_rows:
            raise ValueError(f"fallback_rows={config.fallback_rows}: the device index keeps no fallback rows; a table "
                             "with them needs the host index (cncore.EmbeddingStore, the default CPU placement), or "
                             "set fallback_rows=0")
        self.config = config
        self.device = torch.device(device)
        self.max_rows = config.max_rows or 0
        self.low_water = self.max_rows - (config.headroom or 0)
        self._sinks: list[Callable[[EvictedSlots], None]] = []
        self.evicted_count = 0
        self._step = 0
        adm = config.admission
        self._sketch = None
        if isinstance(adm, cncore.MinCount):
            self._sketch = torch.zeros((adm.depth, adm.width), dtype=torch.int64, device=self.device)
        rows = min(config.capacity, self.max_rows) if self.max_rows else config.capacity
        self._reset(max(16, rows))

    def _reset(self, slot_capacity: int) -> None:
        self.n_buckets = 1 << max(0, math.ceil(math.log2(max(1.0, slot_capacity / (WAYS * MAX_LOAD)))))
        self._new_buckets(self.n_buckets)
        self.slot_keys = torch.zeros(slot_capacity + 1, dtype=torch.int64, device=self.device)
        self.live = torch.zeros(slot_capacity + 1, dtype=torch.bool, device=self.device)
        self.counts = torch.zeros(slot_capacity + 1, dtype=torch.int64, device=self.device)
        self.last_steps = torch.zeros(slot_capacity + 1, dtype=torch.int64, device=self.device)
        self._free = torch.zeros(slot_capacity, dtype=torch.int64, device=self.device)
        self._n_free = 0
        self._high = 0
        self._size = 0

    def _new_buckets(self, n_buckets: int) -> None:
        self.n_buckets = n_buckets
        self.bucket_keys = torch.zeros(n_buckets * WAYS + 1, dtype=torch.int64, device=self.device)
        self.bucket_slots = torch.full((n_buckets * WAYS + 1,), -1, dtype=torch.int64, device=self.device)

    # --- sizes ----------------------------------------------------------------------------------

    def __len__(self) -> int:
        return self._size

    @property
    def size(self) -> int:
        """Keys held."""
        return self._size

    @property
    def capacity(self) -> int:
        """Bucket entries (n_buckets * WAYS)."""
        return self.n_buckets * WAYS

    @property
    def load_factor(self) -> float:
        """size / capacity."""
        return self._size / self.capacity

    @property
    def slot_capacity(self) -> int:
        """Slots the per-slot tensors hold before they grow (every slot < it)."""
        return len(self.slot_keys) - 1

    @property
    def high_water(self) -> int:
        """One past the highest slot ever handed out (row tensors need this many rows)."""
        return self._high

    @property
    def nbytes(self) -> int:
        """Bytes of device memory the index holds (buckets, per-slot arrays, free stack, sketch)."""
        ts = [self.bucket_keys, self.bucket_slots, self.slot_keys, self.live, self.counts, self.last_steps,
              self._free] + ([self._sketch] if self._sketch is not None else [])
        return sum(t.numel() * t.element_size() for t in ts)

    @property
    def step(self) -> int:
        """The step recorded as an access's last step, and "now" for TTL and LFU aging."""
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value <= _STEP_MAX:
            raise ValueError(f"step must be an int in [0, 2**32 - 1], got {value!r}")
        self._step = int(value)

    # --- finding ----------------------------------------------------------------------------------

    def _keys(self, keys, name: str = "keys") -> torch.Tensor:
        t = keys if isinstance(keys, torch.Tensor) else torch.as_tensor(np.asarray(keys))
        if t.dtype in (torch.bool,) or t.is_floating_point() or t.is_complex():
            raise TypeError(f"{name}: expected an integer tensor of keys, got dtype {t.dtype}; pass int64 keys")
        if t.dim() != 1:
            raise ValueError(f"{name}: expected a 1-D tensor of keys, got shape {tuple(t.shape)}; flatten it first")
        return t.to(device=self.device, dtype=torch.int64)

    def _buckets_of(self, keys: torch.Tensor) -> torch.Tensor:
        return mix64(keys) & (self.n_buckets - 1)

    def _probe(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(entry of each key, or the spare entry; found) with one gather of each bucket."""
        base = self._buckets_of(keys) * WAYS
        entries = base[:, None] + torch.arange(WAYS, device=self.device)[None, :]
        match = (self.bucket_slots[entries] >= 0) & (self.bucket_keys[entries] == keys[:, None])
        found = match.any(1)
        way = match.to(torch.uint8).argmax(1)
        return torch.where(found, base + way, self.n_buckets * WAYS), found

    def find(self, keys) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots of keys (-1 where absent) and the found mask; inserts nothing, no host sync.

        Args:
            keys: (N,) integer tensor (moved to the index's device as int64).

        Returns:
            (slots (N,) int64, found (N,) bool) on the index's device.
        """
        keys = self._keys(keys)
        entry, found = self._probe(keys)
        return torch.where(found, self.bucket_slots[entry], -1), found

    def contains(self, keys) -> torch.Tensor:
        """(N,) bool: which keys are present."""
        return self.find(keys)[1]

    # --- inserting --------------------------------------------------------------------------------

    def _place(self, keys: torch.Tensor, mask: torch.Tensor, slots: torch.Tensor) -> bool:
        """Write keys[mask] with their slots into free ways of their buckets, in batch order;
        False (nothing written) when a bucket lacks the ways."""
        at, overflow = self._placement(keys, mask)
        if bool(overflow):
            return False
        self._write_entries(at, keys, slots)
        return True

    def _write_entries(self, at: torch.Tensor, keys: torch.Tensor, slots: torch.Tensor) -> None:
        self.bucket_keys[at] = keys
        self.bucket_slots[at] = slots

    def _placement(self, keys: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(entry of each key of keys[mask] in a free way of its bucket, in batch order (the
        spare entry for the others); a 0-d bool tensor: whether a bucket lacks the ways). No
        host sync: the caller reads the flag with whatever else it reads."""
        n, nb = len(keys), self.n_buckets
        b = torch.where(mask, self._buckets_of(keys), nb)
        order = torch.sort(b, stable=True).indices
        sb = b[order]
        pos = torch.arange(n, device=self.device)
        start = torch.ones(n, dtype=torch.bool, device=self.device)
        start[1:] = sb[1:] != sb[:-1]
        run_first = torch.cummax(torch.where(start, pos, 0), 0).values
        rank = torch.empty_like(pos)
        rank[order] = pos - run_first
        bc = b.clamp(max=nb - 1)
        entries = bc[:, None] * WAYS + torch.arange(WAYS, device=self.device)[None, :]
        free_ways = torch.cumsum((self.bucket_slots[entries] < 0).to(torch.int64), 1)
        way = torch.searchsorted(free_ways, (rank + 1)[:, None]).squeeze(1)
        return torch.where(mask, bc * WAYS + way.clamp(max=WAYS - 1), nb * WAYS), (mask & (way >= WAYS)).any()

    def _rehash(self, n_buckets: int) -> None:
        """Move every entry into n_buckets buckets (doubling again while a bucket overflows)."""
        occupied = self.bucket_slots[:-1] >= 0
        keys, slots = self.bucket_keys[:-1][occupied], self.bucket_slots[:-1][occupied]
        while True:
            if n_buckets > _MAX_BUCKETS:
                raise MemoryError(f"the device key index would need more than {_MAX_BUCKETS} buckets for "
                                  f"{self._size} keys (more than {WAYS} keys share a bucket at every size)")
            self._new_buckets(n_buckets)
            if self._place(keys, torch.ones(len(keys), dtype=torch.bool, device=self.device), slots):
                return
            n_buckets *= 2

    def _ensure_slots(self, n_slots: int) -> None:
        cap = self.slot_capacity
        if n_slots <= cap:
            return
        while cap < n_slots:
            cap *= 2
        for name in ("slot_keys", "live", "counts", "last_steps"):
            old = getattr(self, name)
            new = old.new_zeros(cap + 1)
            new[: len(old) - 1] = old[:-1]
            setattr(self, name, new)

    def _push_free(self, slots: torch.Tensor) -> None:
        k = len(slots)
        if self._n_free + k > len(self._free):
            grown = self._free.new_zeros(max(2 * len(self._free), self._n_free + k))
            grown[: self._n_free] = self._free[: self._n_free]
            self._free = grown
        self._free[self._n_free: self._n_free + k] = slots
        self._n_free += k

    def _admitted(self, keys: torch.Tensor, missing: torch.Tensor) -> torch.Tensor:
        """Which keys the core's admission (cn_admit.h) admits; counts the missing ones' sightings."""
        adm = self.config.admission
        if isinstance(adm, cncore.Probability):
            return admission_draw(keys, self.config.seed, adm.threshold)
        if self._sketch is None or not isinstance(adm, cncore.MinCount):
            return torch.ones_like(missing)
        cols = sketch_columns(keys, adm.depth, adm.width)
        add = missing.to(torch.int64)
        for i in range(adm.depth):
            self._sketch[i].index_add_(0, cols[i], add)
        self._sketch.clamp_(max=_COUNT_MAX)
        estimate = self._sketch.gather(1, cols).min(0).values
        return estimate >= adm.count

    def decay_admission(self) -> None:
        """Halve every admission counter (as `EmbeddingStore.decay_admission`)."""
        if self._sketch is not None:
            self._sketch >>= 1

    def find_or_insert(self, keys, *, admit: bool = False) -> InsertResult:
        """Slots of keys, inserting the absent ones (evicting first when a budget needs room).

        Args:
            keys: (N,) integer tensor; duplicates share one new slot.
            admit: a training lookup: the table's admission decides which absent keys get a slot
                (the others get -1). False inserts every absent key (an explicit write).

        Returns:
            `InsertResult` (slots, found, new_slots, new_keys).

        Raises:
            ValueError: without `admit`, the call's distinct keys exceed max_rows (the index is
                unchanged); a training lookup (`admit`) that large gives slots to the first new
                keys that fit and -1 to the rest, as the core's.
        """
        keys = self._keys(keys)
        n = len(keys)
        entry, found = self._probe(keys)
        slots = torch.where(found, self.bucket_slots[entry], -1)
        want = ~found
        if admit and self.config.admission is not None:
            want = want & self._admitted(keys, want)
        empty = keys.new_empty(0)
        if int(want.sum()) == 0:  # the host sync of a batch of known keys: nothing more to do
            return InsertResult(slots, found, empty, empty)
        rep = _first_occurrence(keys)
        is_new = want & (rep == torch.arange(n, device=self.device))
        # The new keys' entries are chosen before eviction and growth: eviction only frees
        # entries, so a free way stays free; growth moves every entry and places them again.
        at, overflow = self._placement(keys, is_new)
        n_new, placed = torch.stack([is_new.sum(), (~overflow).to(torch.int64)]).tolist()  # one read
        rank = torch.cumsum(is_new, 0) - 1
        if self.max_rows:
            room = self._make_room(slots, found, n_new, overflow=admit)  # refuses only without admit
            if room < n_new:  # overflow: the new keys past the room get no slot, as keys not admitted
                is_new = is_new & (rank < room)
                want = want & is_new[rep]
                n_new = room
                if n_new == 0:
                    return InsertResult(torch.where(want, slots, -1), found, empty, empty)
        nf = self._n_free
        fresh = self._high + (rank - nf)
        if nf:
            reused = self._free[(nf - 1 - rank).clamp(min=0, max=nf - 1)]
            slot_new = torch.where(rank < nf, reused, fresh)
        else:
            slot_new = fresh
        high = self._high + max(0, n_new - nf)
        self._ensure_slots(high)
        if self._size + n_new > MAX_LOAD * self.capacity:
            self._rehash(1 << math.ceil(math.log2((self._size + n_new) / (WAYS * MAX_LOAD))))
            placed = False
        if placed:  # (the overflow rule may have dropped new keys: their entries go to the spare)
            self._write_entries(torch.where(is_new, at, self.n_buckets * WAYS), keys, slot_new)
        else:
            while not self._place(keys, is_new, slot_new):
                self._rehash(2 * self.n_buckets)
        at = torch.where(is_new, slot_new, self.slot_capacity)
        self.slot_keys[at] = keys
        self.live[at] = True
        self.counts[at] = 0
        self.last_steps[at] = 0
        self.live[-1] = False
        self._n_free, self._high, self._size = max(0, nf - n_new), high, self._size + n_new
        slots = torch.where(want, torch.where(is_new, slot_new, -1)[rep], slots)
        new_at = torch.nonzero_static(is_new, size=n_new).squeeze(1)
        return InsertResult(slots, found, slot_new[new_at], keys[new_at])

    # --- eviction ---------------------------------------------------------------------------------

    def on_evict(self, sink: Callable[[EvictedSlots], None]) -> None:
        """Call `sink(EvictedSlots)` for every eviction, before the evicted slots are reused."""
        if not callable(sink):
            raise TypeError(f"sink must be callable, got {type(sink).__name__}")
        self._sinks.append(sink)

    def _require_policy(self, what: str) -> None:
        if self.config.eviction is None:
            raise TypeError(f"{what}: this index has no eviction policy; build it from a StoreConfig with "
                            "eviction=cncore.LRU(), LFU() or TTL(steps)")

    def _make_room(self, slots: torch.Tensor, found: torch.Tensor, n_new: int, overflow: bool) -> int:
        """The core's cn_table_make_room: evict the rows the call does not use, down to the low
        water mark after the inserts. Returns how many new keys get a slot: all of them, or with
        `overflow` (a training lookup whose distinct keys exceed the budget) as many as fit after
        one round of eviction, the first ones in order of first occurrence."""
        if self._size + n_new <= self.max_rows:
            return n_new
        pinned = torch.zeros_like(self.live)
        pinned[torch.where(found, slots, self.slot_capacity)] = True
        pinned[-1] = False
        n_pinned = int(pinned.sum())
        if overflow and n_pinned + n_new > self.max_rows:
            # One round of eviction, down to the low water mark and at least one row (never the
            # call's own rows): a batch too big for the table does not flush the rows the policy
            # ranks above its new keys; those take the freed rows, first occurrences first.
            k = max(0, min(max(self._size - self.low_water, self._size + 1 - self.max_rows), self._size - n_pinned))
            self._evict_lowest(k, pinned)
            return max(0, min(n_new, self.max_rows - self._size))
        if n_pinned + n_new > self.max_rows:
            raise ValueError(f"the call's distinct keys exceed the table's max_rows ({self.max_rows}): its own rows "
                             "cannot all be kept; the table is unchanged")
        k = min(self._size + n_new - self.low_water, self._size - n_pinned)
        self._evict_lowest(k, pinned)
        return n_new

    def eviction_order(self, exclude: torch.Tensor | None = None) -> torch.Tensor:
        """Every live slot (not in `exclude`) in the policy's eviction order: ascending (score,
        key), as `cn_evict.h` states it. Returns a (size,) int64 tensor of slots."""
        cap = self.slot_capacity
        candidate = self.live[:cap] if exclude is None else self.live[:cap] & ~exclude[:cap]
        order = torch.sort(self.slot_keys[:cap], stable=True).indices
        last = self.last_steps[:cap]
        order = order[torch.sort(last[order], stable=True).indices]
        ev = self.config.eviction
        if isinstance(ev, cncore.LFU):
            count = self.counts[:cap]
            if ev.halve_every is not None:
                idle = self._step - last
                shift = ev.halve_shift if ev.halve_every != "auto" else cncore.policies.auto_halve_shift(
                    self._step, self.max_rows, self._size, self.evicted_count)  # cn_evict_auto_shift
                halvings = torch.where(idle > 0, idle >> shift, 0)
                count = torch.where(halvings >= 32, 0, count >> halvings.clamp(max=32))
            order = order[torch.sort(count[order], stable=True).indices]
        order = order[torch.sort((~candidate[order]).to(torch.uint8), stable=True).indices]
        return order[: int(candidate.sum())]

    def _evict_lowest(self, k: int, exclude: torch.Tensor | None = None) -> int:
        if k <= 0:
            return 0
        victims = self.eviction_order(exclude)[:k]
        self._release(victims)
        self.evicted_count += len(victims)
        return len(victims)

    def _release(self, slots: torch.Tensor, *, evicted: bool = True) -> None:
        """Remove the keys of live `slots` (in this order) and push the slots on the free stack."""
        keys = self.slot_keys[slots]
        if evicted:
            batch = EvictedSlots(keys, slots, self.counts[slots], self.last_steps[slots])
            for sink in list(self._sinks):
                sink(batch)
        entry, _ = self._probe(keys)
        self.bucket_slots[entry] = -1
        self.live[slots] = False
        self._push_free(slots)
        self._size -= len(slots)

    def evict(self, n: int) -> int:
        """Evict the `n` lowest-scoring rows now (all if n >= size); returns how many."""
        self._require_policy("evict")
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise ValueError(f"n must be an int >= 0, got {n!r}")
        return self._evict_lowest(min(int(n), self._size))

    def evict_expired(self) -> int:
        """TTL: evict every row with step - last_step > ttl (oldest first); returns how many."""
        ev = self.config.eviction
        if not isinstance(ev, cncore.TTL):
            raise TypeError(f"evict_expired: this index's eviction is {ev!r}, not cncore.TTL(steps)")
        expired = self.live[:-1] & (self._step - self.last_steps[:-1] > ev.steps)
        return self._evict_lowest(int(expired.sum()))

    # --- erasing, metadata, export ---------------------------------------------------------------

    def erase(self, keys) -> torch.Tensor:
        """Remove keys; returns (N,) bool, True where this call removed keys[i] (a key given twice
        is removed by its first occurrence). Their slots are reused first, newest first."""
        keys = self._keys(keys)
        entry, found = self._probe(keys)
        first = found & (_first_occurrence(keys) == torch.arange(len(keys), device=self.device))
        at = torch.nonzero(first).squeeze(1)
        if len(at):
            self._release(self.bucket_slots[entry[at]], evicted=False)
        return first

    def record_access(self, slots: torch.Tensor, occurrences: torch.Tensor, step: int | None = None) -> None:
        """A training backward's accesses: count += occurrences (saturating at 2**32 - 1) and
        last step = `step` (default: the index's step) for each distinct slot."""
        step = self._step if step is None else int(step)
        self.counts[slots] = (self.counts[slots] + occurrences).clamp(max=_COUNT_MAX)
        self.last_steps[slots] = step

    def set_metadata(self, slots: torch.Tensor, counts: torch.Tensor, last_steps: torch.Tensor) -> None:
        """Replace the access metadata of slots (a load)."""
        self.counts[slots] = counts.to(self.device, torch.int64)
        self.last_steps[slots] = last_steps.to(self.device, torch.int64)

    def export_slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, slots) of every live row, in slot order."""
        slots = torch.nonzero(self.live[:-1]).squeeze(1)
        return self.slot_keys[slots], slots

    def clear(self) -> None:
        """Remove every key (the eviction count and the step stay)."""
        self._reset(self.slot_capacity)

    def reserve(self, n_rows: int) -> None:
        """Room for n_rows keys without growth."""
        self._ensure_slots(n_rows)
        if n_rows > MAX_LOAD * self.capacity:
            self._rehash(1 << math.ceil(math.log2(n_rows / (WAYS * MAX_LOAD))))

"""Fault-in: the rows a call needs, brought from disk into the tier's memory cache."""
from __future__ import annotations

import numpy as np

from cncore import _core
from cncore._interchange import as_keys
from cncore.tier import background, heap

_FIND_ON_DISK_HERE = 256  # prefetch: at most this many IDs missing from memory are found on disk by the caller
_ERASE_BEHIND_AT = 256  # a one-round fault-in of at least this many disk rows leaves their disk-index erase behind


class FaultIn:
    """Part of TieredStore: the rows of a call's keys into the cache, a round at a time."""

    def _fault_in(self, keys, insert: bool) -> np.ndarray | None:
        """_fault_in_rows; whatever happens, the running prefetch is no longer the call's own
        after it (_prefetch.is_this_calls: later spills wait for the job again). Then the heap is
        trimmed if the process's tiered stores have spilled enough since the last trim
        (_HeapTrim: every verb's spills count, and every verb faults in first)."""
        try:
            found = self._fault_in_rows(keys, insert)
        finally:
            self._prefetch.is_this_calls = False
        if heap._HEAP_TRIM.due():
            heap._trim()
        return found

    def _fault_in_rows(self, keys, insert: bool) -> np.ndarray | None:
        """Bring the keys on disk into the cache (and, with insert, give the absent ones their
        initial rows), evicting only rows the call does not use. Returns, when every key has a
        row in memory now, its find's slots (-1 for the keys it brought in): the call's lookup
        pools them without finding the cached keys again (_core.grouped_forward's found_slots;
        valid while the store's lock is held). Else None (keys the call's own lookup inserts, or
        not admitted).

        The common case, every key in memory, costs one batched find over the keys as given
        (duplicates and all): np.unique over a step's 16k IDs took 1.3 ms, more than the
        in-memory step's whole lookup, so only the keys missing from memory are made unique."""
        keys = as_keys(keys)
        if not len(keys):
            return None
        cache_slots, cached = self._cache_find(keys)
        n_cached = int(np.count_nonzero(cached))
        self.stats["hits"] += n_cached
        if n_cached == len(keys):
            return cache_slots
        n_disk = self._own_plan()
        if n_disk is None:
            disk_keys, slots, absent_new, misses = self._missing_rows(keys, cached)
            n_disk = len(disk_keys)
        else:  # every ID missing from memory is on disk, and this call's prefetch reads them
            disk_keys = slots = None  # its keys and slots, taken after its reads
            absent_new, misses = keys[:0], len(keys) - n_cached
        self.stats["misses"] += misses
        if insert:
            self.stats["new"] += len(absent_new)
            if len(keys) > self.cache_rows:
                self._check_fits(keys)
        # New keys take room too; with admission they may not be admitted (find_or_insert is
        # not gated, so making their rows here would give a row that admission may refuse): the
        # call's own training lookup counts them in the sketch, each once as in memory, and
        # makes room for those admitted.
        new_keys = absent_new if insert and self._tier_config.admission is None else absent_new[:0]
        if not n_disk and len(new_keys) <= self._evict_chunk:
            return None  # the call's own find_or_insert makes the new rows (one round)
        if n_cached + n_disk + len(new_keys) > self.cache_rows:  # (IDs, not keys: a cheap bound first)
            if disk_keys is None:
                disk_keys, slots, _, _ = self._missing_rows(keys, cached)
            self._check_fits(np.concatenate([keys[cached], disk_keys, new_keys]))
        # The disk rows go straight into the cache (RecordWriter / Table.load_records, one C call
        # a round: cn_tier.h), which makes their room as an insert does, evicting only rows the
        # call does not use (the call's cached rows and the rounds before are pinned, by the
        # slots found above, so no round finds the call's keys again). In rounds
        # of `_evict_chunk` rows: the core evicts what one call needs in one batch, so a step
        # bringing in 16k rows held 8.6 MiB of evicted rows at once at dim 64, most of a 32 MiB
        # cache's peak RSS overshoot; a round of 1/64 of the cache holds 3% of it. With room
        # for them (the cache evicts in rounds of `headroom` rows, so most steps find room)
        # nothing is pinned.
        step = self._evict_chunk
        if n_disk:
            room = len(self.cache) + n_disk <= self.cache_rows  # then nothing is evicted
            if not room and n_disk <= step and self._prefetch.is_this_calls:
                # One round, and the running prefetch is this call's: its room is made now, before
                # waiting for the job's reads, which go on meanwhile (the spill needs not wait for
                # the job: _spill_slots). An eviction round is ~1.3 ms of the training thread's
                # (a 3x Zipf 1.05 step, one in ~3.5), during which the job read what the training
                # thread otherwise read beside it after the wait (_take_staged).
                self.cache._table.make_room(n_disk, cache_slots[cached])
                room = True
            staged = self._take_staged()
            if disk_keys is None:  # the plan's: the keys the job read, in key order, and their slots
                if staged is not None and len(staged[0]) == n_disk:
                    disk_keys, slots = staged[0], staged[1]
                else:  # its records are no longer current (a flush since): found here
                    disk_keys, slots, _, _ = self._missing_rows(keys, cached)
            pin = cache_slots[:0] if room else cache_slots[cached]
            # Read and loaded a round at a time: a uniform step at 10x brings in 14.7k rows, and
            # its records read at once held 4 MiB beside the cache (half the store's peak over
            # cache + disk index). A round's keys leave the disk index once loaded, so that an
            # error in a later round leaves every row in one tier (a fault-in of one round leaves
            # that erase to the background thread: EraseBehind).
            for a in range(0, len(disk_keys), step):
                k, at = disk_keys[a:a + step], slots[a:a + step]
                rec = self._read_current(k, at, staged)
                if staged is not None and a + step < len(disk_keys) and k[-1] >= staged[0][-1]:
                    # Past the prefetch's keys (sorted, as the rounds are): its buffer serves the
                    # later rounds' reads (_buffer) rather than staying beside a new one.
                    self._keep_spare(staged[2])
                    staged = None
                raw = rec.view(np.uint8).reshape(len(rec), -1)
                self._check_records(raw, k, at)
                loaded = self.cache._table.load_records(self._writer, raw, k, pin)
                if len(disk_keys) <= step and len(k) >= self._erase_behind_at:
                    self._erases.leave(k, at)
                else:
                    self._disk.erase(k)
                self._allocator.release(at)
                if a + step < len(disk_keys) and not room:
                    pin = np.concatenate([pin, loaded])
                if staged is None:
                    self._keep_spare(rec)
                del rec, raw
            if staged is not None:
                self._keep_spare(staged[2])
            del staged
            self.cache._writes += 1
        # New keys (more than one round of them): their room in rounds too, by find_or_insert of
        # the call's cached keys, its disk rows and the new keys so far (their initial rows).
        if len(new_keys) > step and len(self.cache) + len(new_keys) > self.cache_rows:
            base = np.concatenate([keys[cached], disk_keys])
            for end in range(step, len(new_keys) + step, step):
                self.cache.find_or_insert(np.concatenate([base, new_keys[:end]]))
        if len(absent_new):
            return None  # keys with no row yet: the call's lookup finds (and makes) them
        # Every key has a row in memory now: the cached ones where the find above gave it (pinned,
        # or nothing was evicted); the loaded ones keep -1, which the core lookup finds (mapping
        # the loaded slots back to the IDs here took 0.13 ms a 3x Zipf 1.05 step).
        return cache_slots

    def _missing_rows(self, keys: np.ndarray, cached: np.ndarray):
        """Of the keys missing from memory (~cached): those on disk (distinct, in key order),
        their slots, the distinct others, and how many of the IDs are disk keys (with repeats)."""
        return self._disk.missing(keys, cached.view(np.uint8))

    def _own_plan(self) -> int | None:
        """The rows on disk of a fault-in whose running prefetch is its own, from that prefetch's
        find, so that it does not find them itself (np.unique and the disk index's find of its
        ~1.5k missing IDs: 0.13-0.16 ms of a 3x Zipf 1.05 step). Only when the job was handed
        every ID missing from memory (more than _FIND_ON_DISK_HERE of them), has found them
        (StageJob.plan: never waits), found every distinct one on disk (no new keys), reads all
        of them (within its cap), and the disk index is unchanged since its find (its version:
        an erase, say, of a key it found; a spill since would have changed the cache's keys,
        and the find would not have matched). Else None."""
        job = self._prefetch.job
        if not (self._prefetch.is_this_calls and self._prefetch.has_all) or job is None:
            return None
        plan = job.plan()
        if plan is None:
            return None
        n_distinct, n_found, m, version = plan
        if n_found != n_distinct or m != n_found or version != self._disk.version:
            return None
        return m

    def _cache_find(self, keys: np.ndarray):
        """(slots, found) of keys in the cache: the prefetch's find of the same keys when the
        cache's keys have not changed since (the table's version: a fresh stamp at every insert,
        eviction, erase or rehash), else a find now. Taken once; kept across calls with other
        keys that leave the cache's keys as they are."""
        pre = self._prefetch.prefound
        if pre is not None and pre[0] != self.cache._table.version:
            pre = self._prefetch.prefound = None
        if pre is not None and _core.same_int64(pre[1], keys):
            self._prefetch.prefound = None
            self._prefetch.is_this_calls = True  # (until the fault-in ends: _fault_in)
            return pre[2], pre[3]
        return self.cache.find(keys)


class EraseBehind:
    """The disk index's erase of keys a one-round fault-in just loaded into memory, left to the
    background thread: the next prefetch hands it over after its read job, so it never delays
    the reads a call waits for (0.16-0.19 ms of the training thread's 3x Zipf 1.05 step, 1.4k
    keys, each a cache miss in the disk index).

    Until it runs, such a key is in memory and still indexed at its old slot. Nothing looks a
    key in memory up on disk except the verbs over the whole table (len, export, flush, erase,
    clear, close), which first wait for it (`settle`). A key evicted meanwhile is indexed anew
    at another slot (a slot is never reused before a flush), which erase_at leaves in place. At
    most two batches are outstanding (the last one handed over, and one not yet handed): the
    disk index's reservation allows for them (TieredStore.disk_keys_at_most).

    Attributes:
        disk: the store's disk index (_core.SlotIndex).
        batch: (keys, slots) loaded into memory and still indexed on disk, not yet handed over.
        task: the Future of the batch handed over to the background thread, or None.
    """

    def __init__(self, disk):
        self.disk = disk
        self.batch: tuple | None = None
        self.task = None

    @property
    def outstanding(self) -> bool:
        return self.task is not None or self.batch is not None

    def leave(self, keys: np.ndarray, slots: np.ndarray) -> None:
        """Leave the erase of `keys` (loaded from `slots`) for later."""
        if self.batch is not None:  # no prefetch since the last batch: it goes here
            self.disk.erase_at(*self.batch)
        self.batch = (keys, slots)

    def hand_over(self) -> None:
        """Queue the batch on the background thread (after the prefetch's read job, just handed
        in). The batch before it, handed over at the previous prefetch, ran after that
        prefetch's reads, which the call since waited for: waited for here (almost never still
        running), so that at most one batch is queued."""
        batch, self.batch = self.batch, None
        if batch is None:
            return
        if self.task is not None:
            self.task.result()
        try:
            self.task = background._prefetcher().submit(self.disk.erase_at, *batch)
        except RuntimeError:  # the executor is shut down (interpreter exit): here, then
            self.task = None
            self.disk.erase_at(*batch)

    def settle(self) -> None:
        """Every erase left behind done (before a verb that reads the whole disk index)."""
        task, self.task = self.task, None
        if task is not None:
            task.result()
        batch, self.batch = self.batch, None
        if batch is not None:
            self.disk.erase_at(*batch)

    def forget(self) -> None:
        """In a forked child: the task handed over is the parent's thread's."""
        self.task = None

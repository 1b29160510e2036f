"""Where a tier's spills write: the slot allocator of rows.dat (log-structured)."""
from __future__ import annotations

import numpy as np


class SlotAllocator:
    """Part of TieredStore: slots for spilled records."""


    # Log-structured: a spill's records go to whole free pages (in order) and then to the end of
    # the file, so that they form long runs, one pwritev each. Reusing single free slots scattered
    # over the file cost 10x per record (2,500 records of 320 bytes: 3.4 ms scattered, 0.3 ms in a
    # run, page cache, this machine). The holes that leaves (slots freed in pages still partly in
    # use) are closed by compaction, which flush() runs when the file exceeds compact_ratio x the rows it
    # holds, and compact() on demand.

    def _take_slots(self, n: int) -> np.ndarray:
        """n slots no live row and no row of the last flush uses, as contiguous as can be."""
        i = np.arange(self._page_cursor, min(self._page_cursor + n, len(self._free_pages) * self._per_page))
        got = self._free_pages[i // self._per_page] * self._per_page + i % self._per_page
        self._page_cursor += len(got)
        fresh = n - len(got)
        out = np.concatenate([got, np.arange(self._high_water, self._high_water + fresh, dtype=np.int64)])
        self._high_water += fresh
        return out

    def _release(self, slots: np.ndarray) -> None:
        """Slots of rows that left the disk: free for the allocation after the next flush (a
        slot the last flush refers to must not be written before the next one)."""

    def _plan_free(self, slots: np.ndarray) -> None:
        """After a flush (slots: every slot its index refers to): the whole pages below the high
        water that no row uses become the next spills' slots. Kept as pages (8 bytes a page):
        a list of free slots with its masks took 8-16 bytes a slot of the file, which made a
        flush's peak memory grow with the file rather than with the index."""
        full_pages = self._high_water // self._per_page
        used = np.bincount(slots // self._per_page, minlength=full_pages)[:full_pages]
        self._free_pages = np.flatnonzero(used == 0).astype(np.int64)
        self._page_cursor = 0

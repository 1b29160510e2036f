# The SSD tier's disk index: int64 key -> record slot (cn_slotindex.h).


cdef class SlotIndex:
    """A map int64 key -> int64 slot (cn_slotindex.h): the SSD tier's index of the rows on disk.
    Every int64 is a valid key; slots are >= 0. Batch verbs only; each holds the index's mutex,
    which the tier's prefetch job (RecordWriter.stage, run without the GIL on the prefetch
    thread) holds too, so the two threads never race in here.

    >>> import numpy as np
    >>> ix = SlotIndex()
    >>> ix.put(np.array([5, -1, 2**63 - 1]), np.array([0, 7, 3]))
    >>> ix.find(np.array([-1, 4, 2**63 - 1])).tolist(), len(ix)
    ([7, -1, 3], 3)
    >>> ix.erase(np.array([5, 5, 6])).tolist(), len(ix)
    ([0, -1, -1], 2)
    """
    cdef cn_index ix
    cdef int64_t _nbytes
    cdef pthread_mutex_t mu
    cdef uint64_t _version  # bumped, under mu, by every put, erase and clear (not erase_at)

    def __cinit__(self):
        self._nbytes = 0
        self._version = 0
        pthread_mutex_init(&self.mu, NULL)
        if cn_index_init(&self.ix, 16, &self._nbytes) != 0:
            raise MemoryError("SlotIndex: no memory for 16 buckets")

    def __dealloc__(self):
        if self.ix.n_buckets:
            cn_index_free(&self.ix, &self._nbytes)
        pthread_mutex_destroy(&self.mu)

    def __len__(self):
        return self.ix.size

    @property
    def nbytes(self):
        """Bytes its buckets take (16 a bucket, the load factor at most 0.7)."""
        return self._nbytes

    @property
    def version(self):
        """A count of the puts, erases and clears so far (erase_at does not count: the tier
        erases that way only keys that are also in its memory cache, which no disk lookup of keys
        missing from memory concerns). A prefetch job records it at its find (StageJob.plan)."""
        return self._version

    def find(self, const int64_t[::1] keys):
        """The slot of each key, -1 where absent (int64 array)."""
        return self._slots_of(keys, False)

    cdef _slots_of(self, const int64_t[::1] keys, bint erase):
        """find() (erase False) or erase(): each key's slot, under the mutex, keeping the GIL
        under _NOGIL_FROM keys."""
        cdef int64_t n = keys.shape[0]
        out = np.empty(n, dtype=np.int64)
        cdef int64_t[::1] o = out
        if n >= _NOGIL_FROM:
            with nogil:
                self._locked_slots_of(&keys[0], n, &o[0], erase)
        elif n:
            self._locked_slots_of(&keys[0], n, &o[0], erase)
        return out

    cdef void _locked_slots_of(self, const int64_t *keys, int64_t n, int64_t *slots, bint erase) noexcept nogil:
        pthread_mutex_lock(&self.mu)
        if erase:
            cn_slotindex_erase(&self.ix, keys, n, slots)
            self._version += 1
        else:
            cn_index_find_batch(&self.ix, keys, n, slots, 1)
        pthread_mutex_unlock(&self.mu)

    def missing(self, const int64_t[::1] keys, const uint8_t[::1] cached):
        """Of the IDs not cached (cached[i] == 0): (their distinct keys on disk, in ascending
        order; those keys' slots; their distinct keys not on disk, ascending; how many of the IDs
        are keys on disk, repeats counted). What np.unique(..., return_counts=True) and find()
        gave, in one call (cn_tier_distinct_counted). Under _NOGIL_FROM IDs it keeps the GIL.

        >>> import numpy as np
        >>> ix = SlotIndex(); ix.put(np.array([4, 9]), np.array([0, 1]))
        >>> ix.missing(np.array([9, 3, 9, 4, 5]), np.array([0, 0, 0, 1, 0], np.uint8))
        (array([9]), array([1]), array([3, 5]), 2)
        """
        cdef int64_t n = keys.shape[0]
        cdef int64_t counts[4]  # distinct, on disk, not on disk, IDs on disk
        if cached.shape[0] != n:
            raise ValueError(f"cached: expected {n} flags, got {cached.shape[0]}")
        m = max(n, 1)
        pairs = np.empty((m, 2), dtype=np.int64)
        on_keys = np.empty(m, dtype=np.int64)
        on_slots = np.empty(m, dtype=np.int64)
        off_keys = np.empty(m, dtype=np.int64)
        cdef int64_t[:, ::1] pv = pairs
        cdef int64_t[::1] ok = on_keys, osl = on_slots, fk = off_keys
        counts[0] = counts[1] = counts[2] = counts[3] = 0
        if n >= _NOGIL_FROM:
            with nogil:
                self._missing(&keys[0], &cached[0], n, &pv[0, 0], &ok[0], &osl[0], &fk[0], counts)
        elif n:
            self._missing(&keys[0], &cached[0], n, &pv[0, 0], &ok[0], &osl[0], &fk[0], counts)
        if counts[0] < 0:
            raise MemoryError("SlotIndex.missing: no memory for the set of missing keys")
        return on_keys[:counts[1]], on_slots[:counts[1]], off_keys[:counts[2]], counts[3]

    cdef void _missing(self, const int64_t *keys, const uint8_t *cached, int64_t n, int64_t *pairs,
                       int64_t *on_keys, int64_t *on_slots, int64_t *off_keys, int64_t *counts) noexcept nogil:
        """missing()'s C part: the distinct uncached keys into pairs (key, count), their slots
        found (into on_slots, then compacted), split into on_keys/on_slots and off_keys."""
        cdef int64_t d = cn_tier_distinct_counted(keys, cached, n, <cn_tier_kv*> pairs), i, s
        counts[0] = d
        if d <= 0:
            return
        for i in range(d):
            on_keys[i] = pairs[2 * i]
        self._locked_slots_of(on_keys, d, on_slots, False)
        for i in range(d):
            s = on_slots[i]
            if s >= 0:
                on_keys[counts[1]] = pairs[2 * i]
                on_slots[counts[1]] = s
                counts[1] += 1
                counts[3] += pairs[2 * i + 1]
            else:
                off_keys[counts[2]] = pairs[2 * i]
                counts[2] += 1

    @staticmethod
    def buckets_for(int64_t n_keys):
        """Buckets (16 bytes each) that hold n_keys at the index's maximum load (0.7): what
        reserve(n_keys) of an empty index allocates (at least 16).

        >>> SlotIndex.buckets_for(700), SlotIndex.buckets_for(1)   # 700 / 0.7 rounds up in floating point
        (1001, 16)
        """
        return cn_slotindex_buckets_for(n_keys)

    def reserve(self, int64_t extra):
        """Grow now, to exactly the buckets they need, so that `extra` more keys go in without a
        rehash (a rehash holds the old and the new buckets at once: 48 MiB for a moment at 1M
        keys). Growth by put() beyond that follows cn_index.h's rule (x1.25 at least). Raises
        MemoryError with the index unchanged if it cannot grow."""
        if extra < 0:
            raise ValueError(f"extra: must be >= 0, got {extra}")
        cdef int rc = 0
        if extra:
            with nogil:
                pthread_mutex_lock(&self.mu)
                rc = cn_slotindex_reserve(&self.ix, extra, 1, &self._nbytes)
                pthread_mutex_unlock(&self.mu)
        if rc != 0:
            raise MemoryError(f"SlotIndex: no memory to grow past {self.ix.size + extra} keys; the index is unchanged")

    def put(self, const int64_t[::1] keys, const int64_t[::1] slots):
        """keys[i] -> slots[i] (inserted or reassigned, in order). Raises MemoryError with the
        index unchanged if it cannot grow."""
        cdef int64_t n = keys.shape[0]
        if slots.shape[0] != n:
            raise ValueError(f"slots: expected {n}, got {slots.shape[0]}")
        if n == 0:
            return
        cdef int rc
        with nogil:
            rc = self._put(&keys[0], &slots[0], n)
        if rc != 0:
            raise MemoryError(f"SlotIndex: no memory to grow past {self.ix.size + n} keys; the index is unchanged")

    cdef int _put(self, const int64_t *keys, const int64_t *slots, int64_t n) noexcept nogil:
        """put() under the mutex, counted in the version (also a spill's, RecordWriter.spill):
        0, or -1 with the index unchanged (no memory to grow)."""
        pthread_mutex_lock(&self.mu)
        cdef int rc = cn_slotindex_reserve(&self.ix, n, 0, &self._nbytes)
        if rc == 0:
            cn_slotindex_put(&self.ix, keys, slots, n)
            self._version += 1
        pthread_mutex_unlock(&self.mu)
        return rc

    def erase(self, const int64_t[::1] keys):
        """Remove keys; returns the slot each had (-1: absent, or a repeat of an earlier key)."""
        return self._slots_of(keys, True)

    def erase_at(self, const int64_t[::1] keys, const int64_t[::1] slots):
        """Remove each keys[i] whose slot is still slots[i] (one indexed anew at another slot
        stays); returns how many were removed. Without the GIL."""
        cdef int64_t n = keys.shape[0], removed = 0
        if slots.shape[0] != n:
            raise ValueError(f"slots: expected {n}, got {slots.shape[0]}")
        if n:
            with nogil:
                pthread_mutex_lock(&self.mu)
                removed = cn_slotindex_erase_at(&self.ix, &keys[0], &slots[0], n)
                pthread_mutex_unlock(&self.mu)
        return removed

    def clear(self):
        cdef int rc
        with nogil:
            pthread_mutex_lock(&self.mu)
            cn_index_free(&self.ix, &self._nbytes)
            rc = cn_index_init(&self.ix, 16, &self._nbytes)
            self._version += 1
            pthread_mutex_unlock(&self.mu)
        if rc != 0:
            raise MemoryError("SlotIndex: no memory for 16 buckets")

    def items(self, int64_t batch_size=65536):
        """Yields (keys, slots) arrays of at most batch_size entries, every entry once (in bucket
        order). The index must not change during the walk (the tier walks it while flushing)."""
        cdef int64_t pos = 0, got
        cdef int64_t[::1] k, s
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        while pos < self.ix.n_buckets:
            keys = np.empty(min(batch_size, self.ix.size), dtype=np.int64)
            slots = np.empty(len(keys), dtype=np.int64)
            if len(keys) == 0:
                return
            k, s = keys, slots
            with nogil:
                pthread_mutex_lock(&self.mu)
                got = cn_slotindex_items(&self.ix, &pos, k.shape[0], &k[0], &s[0])
                pthread_mutex_unlock(&self.mu)
            if got:
                yield keys[:got], slots[:got]

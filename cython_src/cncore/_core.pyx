# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The extension layer: owns the C tables and turns Python calls into single nogil sections.

Arguments arrive already validated and converted by the `cncore` package (dtype, shape,
contiguity, writability); this layer checks what only the C side can check cheaply (offsets),
takes the table's lock, runs one nogil section, and turns return codes into exceptions.
"""
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport malloc, calloc, free
from libc.string cimport memcmp, memcpy, memset
from cncore._typedefs cimport key_t, slot_t, offset_t, weight_t, count_t
from cncore._ctable cimport *
cimport numpy as cnp

import numpy as np

cnp.import_array()


def traced_bytes():
    """Bytes currently held by every table of this process (the allocation tracer)."""
    return cn_traced_bytes()


# libgomp exits the process at 32768 threads and crashes at 65536; no CPU needs more than this.
MAX_THREADS = 1024


def set_thread_setting(int n):
    if not 0 <= n <= MAX_THREADS:
        raise ValueError(f"n must be in [1, {MAX_THREADS}] (0: the default), got {n}")
    cn_set_thread_setting(n)


def set_evict_sample_rows(int64_t n):
    """Rows the victim selection samples to guess its threshold (0: the radix select alone);
    returns the previous value. For tests, which run both paths (cn_evict.h)."""
    cdef int64_t before = cn_evict_sample_rows
    global cn_evict_sample_rows
    cn_evict_sample_rows = max(n, 0)
    return before


def machine_bytes():
    """Physical memory of this machine: the core refuses to allocate past it."""
    return cn_machine_bytes()


def max_threads():
    return cn_max_threads()


def has_threads():
    return bool(cn_has_threads())


cdef inline cn_init _make_init(int kind, uint64_t seed, float p0, float p1, float p2, float p3):
    cdef cn_init init
    init.kind = kind
    init.seed = seed
    init.p0 = p0
    init.p1 = p1
    init.p2 = p2
    init.p3 = p3
    return init


def init_rows(int init_kind, uint64_t seed, float p0, float p1, float p2, float p3, const key_t[::1] keys,
              weight_t[:, ::1] out):
    """The initial rows of keys (what a store inserts for them), without storing anything."""
    cdef cn_init init = _make_init(init_kind, seed, p0, p1, p2, p3)
    cdef int64_t n = keys.shape[0], dim = out.shape[1]
    if n == 0:
        return
    with nogil:
        cn_init_rows_of(&init, &keys[0], n, &out[0, 0], dim, cn_threads_for(n * dim // 16))


# SlotIndex calls over fewer keys than this keep the GIL: their C part takes microseconds, and a
# call that lets the GIL go waits, to take it back, for whatever Python the tier's background
# thread runs meanwhile. Safe because the index's mutex is only ever held inside C, never while
# waiting for the GIL. SlotIndex.missing of 512 IDs (a cn-dlrm table's step): 4.3 -> 3.5 us alone
# (timeit), 20.5-22 -> 11.4 us a call under line_profiler in a loop of lookups with a prefetch a
# step. cn-dlrm's samples/s did not move beyond its noise (two alternated pairs).
# Table.find too (the table's rwlock is likewise only held inside C: nothing in this module runs
# `with gil`): the tier's cache find of a cn-dlrm table's 512 IDs, twice a table a step (the
# prefetch's and the fault-in's), took 0.51-0.60 ms of wall time a step over 26 tables, 0.36-0.39
# after (three alternated runs of `cn-dlrm --batch-size 512 --zipf-alpha 1.05 --cache-mb 15`
# with the call timed); its CPU time is the same, the difference was the wait for the GIL.
cdef enum: _NOGIL_FROM = 4096


def same_int64(const int64_t[::1] a, const int64_t[::1] b):
    """Whether a and b hold the same values (one memcmp). The tier compares a prefetch's keys
    with the lookup's, and staged records' keys and slots, at every fault-in: np.array_equal
    took 2.1 us for 512 keys (a cn-dlrm table's batch) and 7.7 for 16k.

    >>> import numpy as np
    >>> same_int64(np.array([1, 2]), np.array([1, 2])), same_int64(np.array([1, 2]), np.array([1, 3]))
    (True, False)
    """
    cdef int64_t n = a.shape[0]
    if b.shape[0] != n:
        return False
    return n == 0 or memcmp(&a[0], &b[0], <size_t> n * 8) == 0


def block_io(int fd, const int64_t[::1] offsets, uint8_t[:, ::1] buf, bint write, int threads=0):
    """Read (write=False) or write the records buf[i] (each buf.shape[1] bytes) at file offsets[i],
    in one nogil call with several I/Os in flight (cn_blockio.h) on up to `threads` threads (0:
    the core's thread setting). Raises OSError."""
    cdef int64_t n = offsets.shape[0], rec = buf.shape[1]
    cdef int err = 0
    if buf.shape[0] != n:
        raise ValueError(f"buf: expected {n} records, got {buf.shape[0]}")
    if n == 0 or rec == 0:
        return
    with nogil:
        err = cn_blockio(fd, &offsets[0], n, rec, &buf[0, 0], write, threads)
    if err:
        import os
        raise OSError(err, f"{'writing' if write else 'reading'} records: {os.strerror(err)}")


def record_offsets(slots, int64_t rec, int64_t per_page):
    """File offsets (int64 array) of the SSD tier's records at `slots`: records of `rec` bytes,
    `per_page` to a 4 KiB page, never straddling one (a record of a page or more: whole pages
    each). cn_tier_offset (cn_tier.h) is the one formula: the writer's spills use it in C, and
    the tier's reads (cncore.tiered.record_offsets) through this.

    >>> record_offsets([0, 13, 14, 15], 280, 14).tolist()   # 14 records of 280 bytes a page
    [0, 3640, 4096, 4376]
    """
    cdef const int64_t[::1] s = np.ascontiguousarray(slots, dtype=np.int64).reshape(-1)
    cdef int64_t n = s.shape[0], i
    cdef cn_tier_layout L
    if rec < 1 or per_page < 1 or (rec < CN_TIER_PAGE and per_page != CN_TIER_PAGE // rec) \
            or (rec >= CN_TIER_PAGE and per_page != 1):
        raise ValueError(f"rec, per_page: a layout has per_page = 4096 // rec records a page (or 1 for records of "
                         f"a page or more), got rec={rec}, per_page={per_page}")
    L.rec, L.per_page = rec, per_page
    out = np.empty(n, dtype=np.int64)
    cdef int64_t[::1] o = out
    with nogil:
        for i in range(n):
            o[i] = cn_tier_offset(&L, s[i])
    return out


def check_records(const uint8_t[:, ::1] buf, const int64_t[::1] keys, int64_t off_check):
    """Index of the first of the SSD tier's records in buf (one a row, record bytes wide) whose
    key is not keys[i], or whose checksum (cn_tier_sum, at `off_check`; 0: records without one)
    does not match, or -1. The check of tiered.TierFile's reads; the store's go through
    RecordWriter.check_keys, the same C."""
    cdef cn_tier_layout L
    cdef int64_t n = buf.shape[0], bad = -1
    if keys.shape[0] != n:
        raise ValueError(f"check_records: {n} records and {keys.shape[0]} keys")
    memset(&L, 0, sizeof(L))
    L.rec, L.off_check = buf.shape[1], off_check
    if n == 0:
        return -1
    if L.rec < 8 or (off_check and (off_check != L.rec - 4 or off_check % 4)):
        raise ValueError(f"check_records: records of {L.rec} bytes with the checksum at {off_check}")
    with nogil:
        bad = cn_tier_check_keys(&L, &buf[0, 0], &keys[0], n)
    return bad


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


cdef class RecordWriter


cdef class SpillJob:
    """The rows one eviction sent to disk, on their way there (write-behind, cncore/tiered.py):
    it owns the eviction's buffer (rows, state, metadata, as the cache copied them out) and the
    slots the allocator gave; `run()` packs and writes them (nogil, through the writer's
    background buffer) and frees the rows once written. Until then a read of those keys must
    wait for it. A failed write keeps the rows (`err`, `written` False) so that it can be run
    again: nothing evicted is dropped while the process lives."""
    cdef RecordWriter writer
    cdef cn_evicted ev
    cdef object slots  # int64 array
    cdef readonly int err
    cdef readonly bint written

    def __dealloc__(self):
        cn_evicted_free(&self.ev)

    def __len__(self):
        return self.ev.n

    def run(self, int64_t upto=-1):
        """Write the records (nogil) through the writer's buffer (no other call of the writer may
        run meanwhile: the tier writes through it itself only once its queued jobs are over, and
        one job runs at a time); sets `written`, or `err` (an errno) and keeps the rows.
        `upto` (tests: a crash in the middle of a write) writes only the first `upto` records
        and leaves the job unwritten."""
        cdef int64_t n = self.ev.n if upto < 0 else min(upto, self.ev.n)
        cdef int err = 0
        cdef const int64_t[::1] slots = self.slots
        cdef RecordWriter w = self.writer
        if self.written:
            return
        if n:
            with nogil:
                err = w._write_through(w.buf, w.offs, w.behind_threads, &slots[0], n, self.ev.keys, self.ev.counts,
                                       self.ev.last_steps, self.ev.rows,
                                       self.ev.state if w.L.state_floats else NULL)
        self.err = err
        if err == 0 and n == self.ev.n:
            self.written = True
            cn_evicted_free(&self.ev)  # the records are in the file (page cache): the rows' memory goes now


cdef class StageJob:
    """The shared state of one prefetch job (cn_tier_share): RecordWriter.stage(..., job) runs it
    on the background thread; `help()`, from another thread, reads unclaimed chunks of its
    records meanwhile (one thread, nogil) and returns when none is left to claim (the job may
    still be finishing a chunk: wait for its result as usual)."""
    cdef cn_tier_share share
    cdef object buf

    def help(self):
        with nogil:
            cn_tier_share_help(&self.share)

    @property
    def state(self):
        """0: finding the keys on disk, 1: reading, 2: over."""
        return self.share.state

    def plan(self):
        """Once the job has found its keys (else None: still finding, or ended by an error;
        never waits): (distinct keys handed in, distinct keys found on disk, records it reads,
        the disk index's version at its find)."""
        cdef int64_t n_distinct = 0, n_found = 0, m = 0
        cdef uint64_t version = 0
        if not cn_tier_share_plan(&self.share, &n_distinct, &n_found, &m, &version):
            return None
        return n_distinct, n_found, m, version


cdef class RecordWriter:
    """Moves rows between a tiered store's memory cache and its record file (cn_tier.h): packs
    the rows the cache evicts straight into records and writes them (set it as the cache
    table's `evict_sink`: the table hands it its eviction buffer, no NumPy copies), writes
    given rows (a flush), and loads records read from the file into the cache
    (`Table.load_records`). `take_slots(n)` is the tier's slot allocator (its free pages and the
    file's end; it also counts the rows written). The spilled keys go into `disk`. One buffer of
    `io_rows` records is reused, so calls must not run at once: the tier holds its lock around
    every verb.

    layout: (record bytes, records a page, dim, state floats, row dtype code, offset of count,
    of last step, of row, of state, of the checksum (0: none))."""
    cdef cn_tier_layout L
    cdef int fd, threads
    cdef int64_t io_rows
    cdef uint8_t *buf
    cdef int64_t *offs
    cdef SlotIndex disk
    cdef object take_slots
    cdef public object behind  # None: a spill is written before it returns; else behind(job) queues it
    cdef public int behind_threads  # I/O threads of a queued spill's write (its own thread: 1)

    def __cinit__(self, int fd, tuple layout, SlotIndex disk, take_slots, int threads, int64_t io_rows):
        (self.L.rec, self.L.per_page, self.L.dim, self.L.state_floats, self.L.row_dtype, self.L.off_count,
         self.L.off_step, self.L.off_row, self.L.off_state, self.L.off_check) = layout
        if self.L.off_check and (self.L.off_check != self.L.rec - 4 or self.L.off_check % 4):
            raise ValueError(f"layout: the checksum sits in a record's last 4 bytes ({self.L.rec - 4}), "
                             f"got offset {self.L.off_check}")
        self.fd, self.threads, self.io_rows = fd, threads, max(io_rows, 1)
        self.disk, self.take_slots = disk, take_slots
        self.behind, self.behind_threads = None, 1
        self.buf = <uint8_t*> malloc(<size_t> (self.io_rows * self.L.rec))
        self.offs = <int64_t*> malloc(<size_t> self.io_rows * sizeof(int64_t))
        if self.buf == NULL or self.offs == NULL:
            raise MemoryError("RecordWriter: no memory for its buffer")

    def __dealloc__(self):
        free(self.buf)
        free(self.offs)

    @property
    def io_rows(self):
        """Records packed and written at a time (the buffer's size)."""
        return self.io_rows

    @io_rows.setter
    def io_rows(self, int64_t n):
        """(The tier's queued writes must have ended: they use this buffer.)"""
        cdef uint8_t *buf = <uint8_t*> malloc(<size_t> (max(n, 1) * self.L.rec))
        cdef int64_t *offs = <int64_t*> malloc(<size_t> max(n, 1) * sizeof(int64_t))
        if buf == NULL or offs == NULL:
            free(buf)
            free(offs)
            raise MemoryError("RecordWriter: no memory for its buffer")
        free(self.buf)
        free(self.offs)
        self.buf, self.offs, self.io_rows = buf, offs, max(n, 1)

    @property
    def fd(self):
        return self.fd

    @fd.setter
    def fd(self, int value):
        self.fd = value

    cdef int _write(self, const int64_t *slots, int64_t n, const int64_t *keys, const uint32_t *counts,
                    const uint32_t *steps, const weight_t *rows, const weight_t *state) noexcept nogil:
        """Pack and write n rows at slots, io_rows at a time; 0 or an errno."""
        return self._write_through(self.buf, self.offs, self.threads, slots, n, keys, counts, steps, rows, state)

    cdef int _write_through(self, uint8_t *buf, int64_t *offs, int threads, const int64_t *slots, int64_t n,
                            const int64_t *keys, const uint32_t *counts, const uint32_t *steps, const weight_t *rows,
                            const weight_t *state) noexcept nogil:
        cdef int64_t a, m, i
        cdef int err = 0
        cdef int64_t dim = self.L.dim, sf = self.L.state_floats
        a = 0
        while a < n and err == 0:
            m = min(self.io_rows, n - a)
            cn_tier_pack(&self.L, m, keys + a, counts + a, steps + a, rows + a * dim, dim,
                         state + a * sf if state != NULL else NULL, sf, buf)
            for i in range(m):
                offs[i] = cn_tier_offset(&self.L, slots[a + i])
            err = cn_blockio(self.fd, offs, m, self.L.rec, buf, 1, threads)
            a += m
        return err

    cdef spill(self, cn_evicted *ev):
        """Write an eviction's rows to slots the allocator gives, and index them on disk. With
        `behind` set, the rows are not written here: the keys are indexed, then a SpillJob takes the
        rows over (the eviction's buffer itself, no copy) and behind(job) queues its write (a read
        of one of those keys must first wait for the queued writes: the tier's _wait_writes;
        take_slots must see that no read of the disk index is under way on another thread)."""
        cdef int64_t n = ev.n
        cdef int err = 0
        cdef SpillJob job
        cdef const int64_t *keys = ev.keys
        slots_arr = np.ascontiguousarray(self.take_slots(n), dtype=np.int64)
        cdef const int64_t[::1] slots = slots_arr
        if slots.shape[0] != n:
            raise RuntimeError(f"take_slots gave {slots.shape[0]} slots for {n} rows")
        if self.behind is None:
            with nogil:
                err = self._write(&slots[0], n, ev.keys, ev.counts, ev.last_steps, ev.rows,
                                  ev.state if self.L.state_floats else NULL)
            if err:
                import os
                raise OSError(err, f"writing evicted records: {os.strerror(err)}")
        with nogil:
            err = self.disk._put(keys, &slots[0], n)
        if err != 0:
            raise MemoryError(f"SlotIndex: no memory to grow past {self.disk.ix.size + n} keys")
        if self.behind is not None:
            # Queued only now: the job frees the rows (and so `keys`) once written, which the
            # background thread may do before this thread would have indexed them.
            job = SpillJob.__new__(SpillJob)
            job.writer, job.slots, job.ev = self, slots_arr, ev[0]
            memset(ev, 0, sizeof(cn_evicted))  # the job frees them, once written
            self.behind(job)

    def write(self, const int64_t[::1] slots, const int64_t[::1] keys, const uint32_t[::1] counts,
              const uint32_t[::1] last_steps, const weight_t[:, ::1] rows, state):
        """Write rows (N, dim) with their state (N, state floats), counts and last steps as
        records at slots (a flush's cached rows). Raises OSError."""
        cdef int64_t n = slots.shape[0]
        cdef int err
        cdef const weight_t* sp = NULL
        cdef const weight_t[:, ::1] sv
        if keys.shape[0] != n or counts.shape[0] != n or last_steps.shape[0] != n or rows.shape[0] != n \
                or rows.shape[1] != self.L.dim:
            raise ValueError(f"write: expected {n} keys, counts, steps and rows of {self.L.dim}")
        if n == 0:
            return
        if self.L.state_floats:
            sv = state
            if sv.shape[0] != n or sv.shape[1] != self.L.state_floats:
                raise ValueError(f"write: expected state of shape ({n}, {self.L.state_floats})")
            sp = &sv[0, 0]
        with nogil:
            err = self._write(&slots[0], n, &keys[0], &counts[0], &last_steps[0], &rows[0, 0], sp)
        if err:
            import os
            raise OSError(err, f"writing records: {os.strerror(err)}")

    def stage(self, const int64_t[::1] keys, int64_t cap, uint8_t[:, ::1] buf, int threads, StageJob job=None):
        """The prefetch job (cn_tier_stage), without the GIL: of `keys`, those on disk (distinct,
        sorted, the first `cap`) and their records read into buf (at least min(len(keys), cap)
        records). Returns (keys, slots) of the records read, buf's first rows. Raises OSError.
        With `job`, another thread may read part of the records meanwhile (job.help())."""
        cdef int64_t n = keys.shape[0], room = min(n, max(cap, 0)), m = 0
        cdef cn_tier_share *share = &job.share if job is not None else NULL
        if buf.shape[0] < room or (room and buf.shape[1] != self.L.rec):
            raise ValueError(f"buf: expected at least ({room}, {self.L.rec})")
        if job is not None:
            job.buf = buf  # the helper writes into it: kept alive by the job too
        out_keys = np.empty(room, dtype=np.int64)
        out_slots = np.empty(room, dtype=np.int64)
        cdef int64_t[::1] ok = out_keys, os_ = out_slots
        if room:
            with nogil:
                m = cn_tier_stage(&self.L, self.fd, threads, &self.disk.ix, &self.disk.mu, &self.disk._version,
                                  &keys[0], n, room,
                                  &ok[0], &os_[0], &buf[0, 0], share)
        elif job is not None:
            job.share.state = 2
        if m < 0:
            import os
            raise OSError(-m, f"reading prefetched records: {os.strerror(-m)}")
        return out_keys[:m], out_slots[:m]

    def check_keys(self, const uint8_t[:, ::1] buf, const int64_t[::1] keys):
        """Index of the first record in buf whose key is not keys[i] or whose checksum does not
        match (a layout with checksums), or -1."""
        if buf.shape[0] != keys.shape[0] or buf.shape[1] != self.L.rec:
            raise ValueError("check_keys: buf must be (len(keys), record bytes)")
        if keys.shape[0] == 0:
            return -1
        return cn_tier_check_keys(&self.L, &buf[0, 0], &keys[0], keys.shape[0])


# Steps. A row records the table's step at its last training lookup in 32 bits (cn_meta), so a
# table's step stops at 2^32 - 1: the setter refuses more, a training lookup at it is refused
# (its backward would pass it) and so is a backward that would advance past it, each before
# anything changes. Widening last_step instead would cost every row without a scalar optimizer
# state 8 more bytes (its metadata line is 8 bytes), LFU's (count, last_step) score its 64-bit
# key, and the table file, exchange and tier records their uint32 last_steps; the limit is
# reached after 4.29e9 steps (50 days at 1,000 steps a second), and moving every step back by
# one amount (the remedy below) keeps every policy's order.
cdef int64_t _STEP_MAX = 0xFFFFFFFF
STEP_MAX = _STEP_MAX  # for Python: front ends that keep their own step (cncore_torch's device rows)
STEP_REMEDY = ("To train further, move every step back by one amount d: load each row again with last_steps - d "
               "(at least 0), then set step -= d")


def raise_first(errors):
    """Raise errors[0] (an exception) with the others attached to it as notes (PEP 678)."""
    first = errors[0]
    for other in errors[1:]:
        note = f"also raised: {type(other).__name__}: {other}"
        if hasattr(first, "add_note"):
            first.add_note(note)
        else:  # Python 3.10: the attribute tracebacks show from 3.11 on
            first.__notes__ = getattr(first, "__notes__", []) + [note]
    raise first


cdef inline int _sink_want(Table t):
    """What an eviction of t hands over (cn_table.h's want_rows): 0, keys and metadata only (no
    sink); 1, rows too, in eviction order (a callback sees the order, cn_evict.h); 2, rows in any
    order (a tier's RecordWriter: the order is not observable, and sorting a round's ~4,900
    victims was 0.07 ms of a 3x Zipf 1.05 step's training thread)."""
    if t.evict_sink is None:
        return 0
    return 2 if isinstance(t.evict_sink, RecordWriter) else 1


cdef inline void _rdlock(Table t) noexcept nogil:
    pthread_rwlock_rdlock(&t.t.lock)


cdef inline void _wrlock(Table t) noexcept nogil:
    pthread_rwlock_wrlock(&t.t.lock)


cdef inline void _unlock(Table t) noexcept nogil:
    pthread_rwlock_unlock(&t.t.lock)


cdef inline void _find_locked(Table t, const key_t *keys, int64_t n, slot_t *slots) noexcept nogil:
    _rdlock(t)
    cn_table_find(&t.t, keys, n, slots)
    _unlock(t)


cdef _check_len(object arr, int64_t n, int64_t width, str name):
    """arr (if given) has n rows (and `width` columns when width >= 0): the C side writes or
    reads n of them through a raw pointer."""
    if arr is None:
        return
    if arr.shape[0] != n or (width >= 0 and (arr.ndim != 2 or arr.shape[1] != width)):
        raise ValueError(f"{name}: expected {n} rows" + (f" of {width}" if width >= 0 else "") +
                         f", got shape {arr.shape}")


cdef inline const weight_t* _opt_ptr(object arr):
    """Data pointer of an optional float32 NumPy array (NULL for None)."""
    cdef const weight_t[:, ::1] view
    if arr is None:
        return NULL
    view = arr
    return &view[0, 0] if view.shape[0] > 0 else NULL


cdef _raise_tier_load(int rc, Table tab, int64_t n):
    """The error of a tier's load or room (cn_tier_load, cn_tier_make_room), if any."""
    if rc == CN_EBADSLOT:
        raise ValueError("pin: a slot outside the table")
    _raise_insert(rc, tab, n)


cdef _raise_insert(int rc, Table tab, int64_t n):
    if rc == CN_EFULL:
        raise ValueError(f"the call's distinct keys exceed the table's max_rows ({tab.t.bound.max_rows}): its own rows "
                         "cannot all be kept; the table is unchanged")
    if rc != CN_OK:
        raise MemoryError(f"cannot grow the table to {tab.t.index.size + n} rows; the table is unchanged")


cdef class Table:
    """One C table (index + arena). Use `cncore.EmbeddingStore`, not this class."""

    def __cinit__(self, int64_t dim, int optimizer_kind, float state_init, int init_kind, uint64_t seed,
                  float p0, float p1, float p2, float p3, double max_load, int64_t capacity_hint,
                  int policy=0, int64_t max_rows=0, int64_t low_water=0, int64_t ttl=0, uint32_t min_count=0,
                  int64_t sketch_width=0, int64_t sketch_depth=0, bint absent_initial=False, int row_dtype=0,
                  uint64_t admit_threshold=0, uint64_t admit_seed=0, int lfu_halve_shift=-1):
        cdef cn_init init = _make_init(init_kind, seed, p0, p1, p2, p3)
        cdef cn_bound bound
        cdef int rc
        bound.policy = policy
        bound.max_rows = max_rows
        bound.low_water = low_water
        bound.ttl = ttl
        bound.lfu_halve_shift = lfu_halve_shift
        bound.min_count = min_count
        bound.sketch_width = sketch_width
        bound.sketch_depth = sketch_depth
        bound.absent_initial = absent_initial
        bound.admit_threshold = admit_threshold
        bound.admit_seed = admit_seed
        self.alive = False
        self.evict_sink = None
        with nogil:
            rc = cn_table_create(&self.t, dim, optimizer_kind, state_init, init, max_load, capacity_hint, bound,
                                 row_dtype)
        if rc != CN_OK:
            raise MemoryError(f"capacity: cannot allocate a table for {capacity_hint} rows of dim {dim} (this "
                              f"machine has {cn_machine_bytes() / 2**30:.1f} GiB of memory)")
        self.alive = True
        self.optimizer_kind = optimizer_kind

    def __dealloc__(self):
        if self.alive:
            cn_table_destroy(&self.t)
            self.alive = False

    @property
    def size(self):
        return self.t.index.size

    @property
    def capacity(self):
        return cn_table_capacity(&self.t)

    @property
    def n_buckets(self):
        return self.t.index.n_buckets

    @property
    def nbytes(self):
        return self.t.nbytes

    @property
    def evicted_count(self):
        return self.t.n_evicted

    @evicted_count.setter
    def evicted_count(self, int64_t value):
        _wrlock(self)
        self.t.n_evicted = value
        _unlock(self)

    @property
    def erase_epoch(self):
        return self.t.erase_epoch

    @property
    def version(self):
        return self.t.version

    @property
    def step(self):
        return self.t.step

    @step.setter
    def step(self, int64_t value):
        if value < 0 or value > _STEP_MAX:
            raise ValueError(f"step: {value} is outside [0, {_STEP_MAX}]; {_STEP_MAX} (2**32 - 1) is the last step a "
                             f"row's 32-bit last_step records; the table is unchanged. {STEP_REMEDY}")
        with nogil:
            _wrlock(self)
            self.t.step = value
            _unlock(self)

    @property
    def admission_counters(self):
        """A copy of the admission sketch's counters (depth, width) uint32 (MinCount), or None."""
        cdef int64_t depth = self.t.admit.depth, width = self.t.admit.width
        if self.t.admit.counters == NULL:
            return None
        out = np.empty((depth, width), dtype=np.uint32)
        cdef uint32_t[:, ::1] view = out
        _rdlock(self)
        memcpy(&view[0, 0], self.t.admit.counters, depth * width * sizeof(uint32_t))
        _unlock(self)
        return out

    @admission_counters.setter
    def admission_counters(self, const uint32_t[:, ::1] counters):
        """Set every counter of the sketch (an array of admission_counters' shape)."""
        cdef int64_t depth = self.t.admit.depth, width = self.t.admit.width
        if self.t.admit.counters == NULL:
            raise TypeError("admission_counters: this table has no admission sketch (MinCount)")
        if counters.shape[0] != depth or counters.shape[1] != width:
            raise ValueError(f"admission_counters: expected shape ({depth}, {width}), got "
                             f"({counters.shape[0]}, {counters.shape[1]}); the table is unchanged")
        _wrlock(self)
        memcpy(self.t.admit.counters, &counters[0, 0], depth * width * sizeof(uint32_t))
        _unlock(self)

    def find(self, const key_t[::1] keys, slot_t[::1] slots):
        cdef int64_t n = keys.shape[0]
        _check_len(slots, n, -1, "slots")
        if n and <const char*> &slots[0] < <const char*> (&keys[0] + n) \
                and <const char*> &keys[0] < <const char*> (&slots[0] + n):
            raise ValueError("slots: must not overlap keys (the find parks bucket positions in slots ahead of "
                             "reading those keys)")
        if n >= _NOGIL_FROM:
            with nogil:
                _find_locked(self, &keys[0], n, &slots[0])
        elif n:  # keeps the GIL (as SlotIndex's small calls: _NOGIL_FROM); the table's lock is only held in C
            _find_locked(self, &keys[0], n, &slots[0])

    def find_or_insert(self, const key_t[::1] keys, slot_t[::1] slots, uint8_t[::1] found):
        cdef int64_t n = keys.shape[0], n_new = 0
        cdef int rc = CN_OK
        cdef cn_evicted ev
        cdef int want = _sink_want(self)
        _check_len(slots, n, -1, "slots")
        _check_len(found, n, -1, "found")
        if n == 0:
            return 0
        with nogil:
            _wrlock(self)
            rc = cn_table_resolve(&self.t, &keys[0], n, &slots[0], &found[0], 1, 0, want, &ev, &n_new)
            _unlock(self)
        self._deliver(&ev)
        _raise_insert(rc, self, n)
        return n_new

    cdef _deliver(self, cn_evicted *ev):
        """Hand the rows a call evicted to the store's sink (outside the lock), then free them."""
        cdef int64_t n = ev.n, dim = self.t.dim, sf = self.t.state_floats
        if n == 0:
            cn_evicted_free(ev)
            return
        if isinstance(self.evict_sink, RecordWriter):  # a tier: packed straight from the buffer, no copies
            try:
                (<RecordWriter> self.evict_sink).spill(ev)
            finally:
                cn_evicted_free(ev)
            return
        try:
            keys = np.asarray(<key_t[:n]> ev.keys).copy()
            counts = np.asarray(<count_t[:n]> ev.counts).copy()
            steps = np.asarray(<count_t[:n]> ev.last_steps).copy()
            rows = np.asarray(<weight_t[:n * dim]> ev.rows).reshape(n, dim).copy() if ev.rows != NULL else None
            state = np.empty((n, sf), dtype=np.float32)
            if ev.state != NULL and sf:
                state[:] = np.asarray(<weight_t[:n * sf]> ev.state).reshape(n, sf)
        finally:
            cn_evicted_free(ev)
        if self.evict_sink is not None:
            self.evict_sink(keys, rows, state, counts, steps)

    def decay_admission(self):
        with nogil:
            _wrlock(self)
            cn_table_decay_admission(&self.t)
            _unlock(self)

    def evict(self, int64_t k):
        """Evict the k lowest-scoring rows (k <= 0: none); returns how many were evicted."""
        return self._evict(0, k, None)

    def evict_expired(self):
        return self._evict(1, 0, None)

    def evict_keys(self, const key_t[::1] keys):
        return self._evict(2, keys.shape[0], keys)

    def _evict(self, int what, int64_t k, keys):
        cdef cn_evicted ev
        cdef int rc = CN_OK
        cdef int want = _sink_want(self)
        cdef const key_t[::1] kv
        cdef const key_t* kp = NULL
        if keys is not None:
            kv = keys
            kp = &kv[0] if kv.shape[0] else NULL
        ev.n = 0
        with nogil:
            _wrlock(self)
            if what == 0:
                rc = cn_table_evict(&self.t, k if k > 0 else 0, want, &ev)
            elif what == 1:
                rc = cn_table_evict_expired(&self.t, want, &ev)
            else:
                rc = cn_table_evict_keys(&self.t, kp, k, want, &ev)
            _unlock(self)
        n = ev.n
        self._deliver(&ev)
        if rc != CN_OK:
            raise MemoryError("out of memory choosing the rows to evict; the table is unchanged")
        return n

    def upsert(self, const key_t[::1] keys, rows, state, counts, last_steps, uint8_t[::1] found, bint insert):
        """Write rows (and optionally state / metadata) for keys; with insert, add missing keys
        first. found[i] = 1 where the key existed before. Duplicates: the last one wins."""
        cdef int64_t n = keys.shape[0], n_new = 0, i
        cdef int rc = CN_OK
        _check_len(rows, n, self.t.dim, "rows")
        _check_len(state, n, self.t.state_floats, "optimizer_state")
        _check_len(counts, n, -1, "counts")
        _check_len(last_steps, n, -1, "last_steps")
        _check_len(found, n, -1, "found")
        if not self.t.state_floats:
            state = None
        cdef const weight_t[:, ::1] rows_v = rows
        cdef const weight_t* state_p = _opt_ptr(state)
        cdef const count_t[::1] counts_v
        cdef const count_t[::1] steps_v
        cdef const count_t* counts_p = NULL
        cdef const count_t* steps_p = NULL
        if counts is not None:
            counts_v = counts
            counts_p = &counts_v[0] if n else NULL
        if last_steps is not None:
            steps_v = last_steps
            steps_p = &steps_v[0] if n else NULL
        if n == 0:
            return 0
        slots_arr = np.empty(n, dtype=np.int64)
        cdef slot_t[::1] slots = slots_arr
        cdef cn_evicted ev
        cdef int want = _sink_want(self)
        with nogil:
            _wrlock(self)
            rc = cn_table_resolve(&self.t, &keys[0], n, &slots[0], &found[0], insert, 0, want, &ev, &n_new)
            if rc == CN_OK:
                cn_table_write_rows(&self.t, &slots[0], n, &rows_v[0, 0], self.t.dim, state_p, self.t.state_floats)
                cn_table_write_meta(&self.t, &slots[0], n, counts_p, steps_p)
            _unlock(self)
        self._deliver(&ev)
        _raise_insert(rc, self, n)
        return n_new

    def make_room(self, int64_t n, const slot_t[::1] pin):
        """Room for n more rows in this bounded table now (cn_tier_make_room): evict down to the
        low-water mark after them, keeping the live rows at slots `pin` out of the choice; the
        evicted rows go to the evict sink. Returns how many were evicted. A tier's fault-in
        makes the room of the rows it will load before it waits for their reads."""
        cdef int64_t n_pin = pin.shape[0], evicted = 0
        cdef int rc = CN_OK
        cdef cn_evicted ev
        cdef int want = _sink_want(self)
        ev.n = 0
        if n <= 0:
            return 0
        with nogil:
            _wrlock(self)
            rc = cn_tier_make_room(&self.t, n, &pin[0] if n_pin else NULL, n_pin, want, &ev)
            _unlock(self)
        evicted = ev.n
        self._deliver(&ev)
        _raise_tier_load(rc, self, n)
        return evicted

    def load_records(self, RecordWriter layout_of, const uint8_t[:, ::1] records, const key_t[::1] keys,
                     const slot_t[::1] pin):
        """Load records (their keys: keys, distinct, none in the table) into this bounded table in
        one nogil section (cn_tier_load), keeping the live rows at slots `pin` out of the eviction
        that makes their room; evicted rows go to the evict sink. Returns the loaded keys' slots.
        `layout_of`: the tier's writer (its record layout)."""
        cdef int64_t n = keys.shape[0], n_pin = pin.shape[0]
        cdef int rc = CN_OK
        cdef cn_evicted ev
        cdef int want = _sink_want(self)
        if records.shape[0] != n or records.shape[1] != layout_of.L.rec:
            raise ValueError(f"records: expected ({n}, {layout_of.L.rec}), got {records.shape}")
        if layout_of.L.dim != self.t.dim or layout_of.L.state_floats != self.t.state_floats:
            raise ValueError("load_records: the records' layout is not this table's")
        out = np.empty(n, dtype=np.int64)
        if n == 0:
            return out
        cdef slot_t[::1] o = out
        ev.n = 0
        with nogil:
            _wrlock(self)
            rc = cn_tier_load(&self.t, &layout_of.L, &records[0, 0], &keys[0], n, &pin[0] if n_pin else NULL,
                              n_pin, want, &ev, &o[0])
            _unlock(self)
        self._deliver(&ev)
        _raise_tier_load(rc, self, n)
        return out

    def erase(self, const key_t[::1] keys, uint8_t[::1] erased):
        cdef int64_t n = keys.shape[0], count = 0
        cdef int rc
        _check_len(erased, n, -1, "erased")
        if n == 0:
            return 0
        with nogil:
            _wrlock(self)
            rc = cn_table_erase(&self.t, &keys[0], n, &erased[0], &count)
            _unlock(self)
        if rc != CN_OK:
            raise MemoryError(f"cannot allocate room to erase {n} keys; the table is unchanged")
        return count

    def clear(self):
        with nogil:
            _wrlock(self)
            cn_table_clear(&self.t)
            _unlock(self)

    def reserve(self, int64_t total):
        cdef int rc
        with nogil:
            _wrlock(self)
            rc = cn_table_reserve(&self.t, total)
            _unlock(self)
        if rc != CN_OK:
            raise MemoryError(f"n_rows: cannot reserve room for {total} rows (this machine has "
                              f"{cn_machine_bytes() / 2**30:.1f} GiB of memory); the table is unchanged")

    def read(self, const key_t[::1] keys, rows, state, counts, last_steps, uint8_t[::1] found):
        """Rows / state / metadata of keys (zeros where absent); found[i] = key present."""
        cdef int64_t n = keys.shape[0], i
        _check_len(rows, n, self.t.dim, "rows")
        _check_len(state, n, self.t.state_floats, "optimizer_state")
        _check_len(counts, n, -1, "counts")
        _check_len(last_steps, n, -1, "last_steps")
        _check_len(found, n, -1, "found")
        if n == 0:
            return
        slots_arr = np.empty(n, dtype=np.int64)
        cdef slot_t[::1] slots = slots_arr
        cdef weight_t* rows_p = NULL
        cdef weight_t* state_p = NULL
        cdef count_t* counts_p = NULL
        cdef count_t* steps_p = NULL
        cdef weight_t[:, ::1] rv
        cdef weight_t[:, ::1] sv
        cdef count_t[::1] cv
        cdef count_t[::1] lv
        if rows is not None:
            rv = rows
            rows_p = &rv[0, 0]
        if state is not None and self.t.state_floats:
            sv = state
            state_p = &sv[0, 0]
        if counts is not None:
            cv = counts
            counts_p = &cv[0]
        if last_steps is not None:
            lv = last_steps
            steps_p = &lv[0]
        with nogil:
            _rdlock(self)
            cn_table_find(&self.t, &keys[0], n, &slots[0])
            cn_table_gather(&self.t, &slots[0], n, rows_p, state_p, counts_p, steps_p)
            _unlock(self)
            for i in range(n):
                found[i] = slots[i] >= 0

    def export(self, int64_t cursor, int64_t max_rows, uint64_t expected_version, bint with_rows=True,
               bint fresh=False, bint whole=False):
        """Up to max_rows entries from bucket `cursor` on: (next_cursor, done, version, keys,
        rows, state, counts, last_steps). `fresh`: the first batch of a walk, whose version is
        read under the lock (returned for the next batches to check) rather than checked;
        otherwise RuntimeError if the table changed since the walk began. `whole`: every row in
        one batch, atomically: when writers grew the table between sizing the arrays and
        taking the lock, the arrays are sized again (a whole export sized outside the lock
        returned part of the table, or refused a walk it had just begun). ValueError for a
        position outside the index (checked under the lock). Without with_rows, rows and state
        are (n, 0): keys and metadata only, for scans."""
        cdef int64_t n_out = 0, next_cursor = 0, n_buckets = 0, cap, margin = 64
        cdef uint64_t version = expected_version
        cdef bint out_of_range = False, stale = False, grown = True
        cdef key_t[::1] kv
        cdef slot_t[::1] sv
        cdef weight_t* rows_p
        cdef weight_t* state_p
        cdef count_t* counts_p
        cdef count_t* steps_p
        while grown:
            grown = False
            cap = self.t.index.size
            # Room for what writers may insert before the lock is taken; doubled at every retry,
            # so a writer that keeps inserting cannot keep a whole export out for long.
            cap = cap + cap // 16 + margin if whole else max(0, min(max_rows, cap))
            margin *= 2
            keys_arr = np.empty(cap, dtype=np.int64)
            slots_arr = np.empty(cap, dtype=np.int64)
            rows_arr = np.empty((cap, self.t.dim if with_rows else 0), dtype=np.float32)
            state_arr = np.empty((cap, self.t.state_floats if with_rows else 0), dtype=np.float32)
            counts_arr = np.empty(cap, dtype=np.uint32)
            steps_arr = np.empty(cap, dtype=np.uint32)
            kv = keys_arr
            sv = slots_arr
            rows_p = <weight_t*> <size_t> rows_arr.ctypes.data
            state_p = <weight_t*> <size_t> state_arr.ctypes.data
            counts_p = <count_t*> <size_t> counts_arr.ctypes.data
            steps_p = <count_t*> <size_t> steps_arr.ctypes.data
            with nogil:
                _rdlock(self)
                n_buckets = self.t.index.n_buckets
                if whole and self.t.index.size > cap:
                    grown = True
                elif not fresh and self.t.version != expected_version:
                    stale = True
                elif cursor < 0 or cursor > n_buckets:
                    out_of_range = True
                else:
                    version = self.t.version
                    next_cursor = cn_table_scan(&self.t, cursor, cap, &kv[0] if cap else NULL,
                                                &sv[0] if cap else NULL, &n_out)
                    cn_table_gather(&self.t, &sv[0] if cap else NULL, n_out, rows_p if with_rows else NULL,
                                    state_p if self.t.state_floats and with_rows else NULL, counts_p, steps_p)
                    if cap == 0:  # an empty table: the walk is over
                        next_cursor = n_buckets
                _unlock(self)
        if stale:
            raise RuntimeError("the store changed (keys inserted or erased) since this export began; "
                               "restart the export")
        if out_of_range:
            raise ValueError(f"cursor: position {cursor} is outside this store's index [0, {n_buckets}]; "
                             "pass the next_cursor of a previous export")
        return (next_cursor, next_cursor >= n_buckets, version, keys_arr[:n_out], rows_arr[:n_out],
                state_arr[:n_out], counts_arr[:n_out], steps_arr[:n_out])


# The checks and pointers below use NumPy's C API: `arr.ctypes.data` built a ctypes object per
# call (3.4 us warm, 6 of them in a one-feature lookup) and `arr.dtype != np.int64` converted the
# type each time; with the caches cold (forward_large.py flushes them before every call) these
# Python-level steps cost ~100 us of a 4096-ID evaluation lookup that EmbeddingBag does in ~600.

cdef inline int64_t _ptr(object arr):
    """The address of an array's first element (0 for None). Read from the array object
    itself: `arr.ctypes.data` built a ctypes object each time, 1.3 us a call, 4-5 calls a
    forward and 3-4 a backward (~9 us of a training step at any batch size)."""
    if arr is None:
        return 0
    if not cnp.PyArray_Check(arr):
        raise TypeError(f"expected a NumPy array, got {type(arr).__name__}")
    return <int64_t> <size_t> cnp.PyArray_DATA(<cnp.ndarray> arr)


cdef inline int _typenum(object dtype):
    return cnp.NPY_INT64 if dtype is np.int64 else cnp.NPY_FLOAT32 if dtype is np.float32 else \
        (<cnp.dtype> np.dtype(dtype)).type_num


cdef _check_vector(object arr, object dtype, int64_t n, str name):
    """The core reads `arr` through a raw pointer: it must be a C-contiguous 1-D `dtype` array
    of n entries (n < 0: any length). The `cncore` package converts user input before it gets
    here; this is what keeps a front end's (or a forged context's) arrays from reaching C
    unchecked."""
    if not isinstance(arr, np.ndarray) or not cnp.PyArray_EquivTypenums(cnp.PyArray_TYPE(<cnp.ndarray> arr), _typenum(dtype)) or \
            cnp.PyArray_NDIM(<cnp.ndarray> arr) != 1 or not cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray> arr):
        raise TypeError(f"{name}: expected a C-contiguous 1-D {np.dtype(dtype)} NumPy array")
    if n >= 0 and cnp.PyArray_DIM(<cnp.ndarray> arr, 0) != n:
        raise ValueError(f"{name}: expected {n} entries, got {arr.shape[0]}")


cdef _check_rows(object arr, object dtype, int64_t n_rows, int64_t dim, str name, bint writable):
    """A 2-D (n_rows, dim) array whose rows may be strided but whose values within a row are
    contiguous (a column block of a wider array)."""
    if not isinstance(arr, np.ndarray) or not cnp.PyArray_EquivTypenums(cnp.PyArray_TYPE(<cnp.ndarray> arr), _typenum(dtype)) or \
            cnp.PyArray_NDIM(<cnp.ndarray> arr) != 2:
        raise TypeError(f"{name}: expected a 2-D {np.dtype(dtype)} NumPy array")
    cdef cnp.ndarray a = <cnp.ndarray> arr
    if cnp.PyArray_DIM(a, 0) != n_rows or cnp.PyArray_DIM(a, 1) != dim:
        raise ValueError(f"{name}: expected shape ({n_rows}, {dim}), got {arr.shape}")
    cdef int64_t item = cnp.PyArray_ITEMSIZE(a), s0 = cnp.PyArray_STRIDE(a, 0), s1 = cnp.PyArray_STRIDE(a, 1)
    if n_rows > 1 and (s0 < item * dim or s0 % item) or n_rows > 0 and dim > 1 and s1 != item:
        raise BufferError(f"{name}: each row must be contiguous with rows not overlapping (strides {arr.strides})")
    if writable and not cnp.PyArray_ISWRITEABLE(a):
        raise BufferError(f"{name}: is read-only; the core writes its result there")


cdef inline uint32_t _saturate_u32(object value):
    """A lookup's step as the uint32 the rows' metadata keeps. A table's step never passes
    2^32 - 1 (_STEP_MAX), so this is exact for every lookup's step; the clamp keeps a value
    from a damaged record from wrapping to a small step that eviction would read as old."""
    return <uint32_t> min(max(int(value), 0), 0xFFFFFFFF)


def grouped_forward(list tables, list keys, list offsets, list weights, list modes, list outs,
                    bint insert_missing, list found_slots=None):
    """Pooled lookup for F (table, keys, offsets) triples in one nogil section.

    outs[f] is a float32 (B, dim) view whose rows may be strided (a column block of one
    shared output). Returns, per feature, [slots, argmax or None, n_new, erase_epoch], the
    epoch read under the table's lock together with the lookup (the backward checks it under
    the lock again). Offsets are checked for every feature before any table changes. Raises
    ValueError naming the first bad feature, MemoryError when a table cannot grow.

    Each distinct table is handled once, under one hold of its lock, with the keys of all its
    features: find them all, make room (a bounded table evicts rows none of them uses), insert,
    pool each feature, read the epoch. Handling a shared table per feature let the second
    feature's eviction free rows the first had just resolved. n_new is the table's count,
    reported on its first feature (0 on the others). Rows a table evicted go to its
    `evict_sink` after every lock is released.

    found_slots (a tier's fault-in, cncore/tiered.py): per feature None, or the slot of every
    one of its keys, found by the caller under a lock it still holds: the lookup pools those
    rows without finding the keys again (16k IDs: 0.19 ms of a 3x Zipf 1.05 tier step found
    twice); -1 for a key to find here (one the caller brought in since its find). Only for a
    feature alone on its table; every slot must be live and every -1 key present (ValueError,
    the table unchanged: a slot not handed out by it, or freed since).
    """
    cdef int64_t F = len(tables), f, u, U
    cdef Table tab
    if not (len(keys) == len(offsets) == len(weights) == len(modes) == len(outs) == F):
        raise ValueError("grouped_forward: one keys, offsets, weights, mode and out per table")
    if found_slots is not None and len(found_slots) != F:
        raise ValueError(f"found_slots: one entry (slots or None) per table, got {len(found_slots)} for {F}")
    # Distinct tables in order of first appearance, and each feature's place in its table's keys.
    unit_of, members = {}, []
    for f in range(F):
        if not isinstance(tables[f], Table):
            raise TypeError(f"tables[{f}]: expected a cncore._core.Table")
        u = unit_of.setdefault(id(tables[f]), len(members))
        if u == len(members):
            members.append([])
        members[u].append(f)
    U = len(members)
    cdef cn_table** tp = <cn_table**> malloc(max(U, 1) * sizeof(cn_table*))
    cdef cn_evicted* evs = <cn_evicted*> calloc(max(U, 1), sizeof(cn_evicted))
    cdef int64_t* ip = <int64_t*> malloc(max(F, 1) * 10 * sizeof(int64_t))
    cdef int64_t* up = <int64_t*> malloc(max(U, 1) * 8 * sizeof(int64_t))
    if tp == NULL or ip == NULL or up == NULL or evs == NULL:
        free(tp)
        free(ip)
        free(up)
        free(evs)
        raise MemoryError("cannot allocate the call's scratch")
    # one column of ip per per-feature value (pointers are stored as int64)
    cdef int64_t* p_nkeys = ip
    cdef int64_t* p_off = ip + F
    cdef int64_t* p_nbags = ip + 2 * F
    cdef int64_t* p_w = ip + 3 * F
    cdef int64_t* p_mode = ip + 4 * F
    cdef int64_t* p_out = ip + 5 * F
    cdef int64_t* p_ld = ip + 6 * F
    cdef int64_t* p_slots = ip + 7 * F
    cdef int64_t* p_argmax = ip + 8 * F
    cdef int64_t* p_unit = ip + 9 * F
    # and of up per table
    cdef int64_t* u_keys = up
    cdef int64_t* u_n = up + U
    cdef int64_t* u_slots = up + 2 * U
    cdef int64_t* u_nnew = up + 3 * U
    cdef int64_t* u_want = up + 4 * U
    cdef int64_t* u_rc = up + 5 * U
    cdef uint64_t* u_epoch = <uint64_t*> (up + 6 * U)
    cdef int64_t* u_found = up + 7 * U  # the caller's slots (found_slots), or 0
    results = [None] * F
    cdef int64_t bad_feature = -1, bad_pos = -1, failed = -1, g, start
    cdef int rc
    try:
        for f in range(F):
            tab = <Table> tables[f]
            k = keys[f]
            o = offsets[f]
            out = outs[f]
            _check_vector(k, np.int64, -1, f"keys[{f}]")
            _check_vector(o, np.int64, -1, f"offsets[{f}]")
            if o.shape[0] < 1:
                raise ValueError(f"offsets[{f}]: needs B+1 >= 1 entries (the last is len(keys))")
            if weights[f] is not None:
                _check_vector(weights[f], np.float32, k.shape[0], f"per_sample_weights[{f}]")
            if modes[f] not in (0, 1, 2):
                raise ValueError(f"modes[{f}]: expected 0 (sum), 1 (mean) or 2 (max), got {modes[f]!r}")
            _check_rows(out, np.float32, o.shape[0] - 1, tab.t.dim, f"out[{f}]", True)
            p_nkeys[f] = k.shape[0]
            p_off[f] = _ptr(o)
            p_nbags[f] = o.shape[0] - 1
            p_w[f] = _ptr(weights[f])
            p_mode[f] = modes[f]
            p_out[f] = _ptr(out)
            p_ld[f] = cnp.PyArray_STRIDE(<cnp.ndarray> out, 0) // 4 if p_nbags[f] > 1 else tab.t.dim
            p_unit[f] = unit_of[id(tables[f])]
        for u in range(U):
            fs = members[u]
            tab = <Table> tables[fs[0]]
            if insert_missing and tab.t.step >= _STEP_MAX:
                raise ValueError(f"feature {fs[0]}: its table's step is {tab.t.step}, the last step a row's 32-bit "
                                 f"last_step records ({_STEP_MAX}, 2**32 - 1), and the backward of a training lookup "
                                 f"would pass it; every table is unchanged. {STEP_REMEDY}")
            tp[u] = &tab.t
            u_want[u] = _sink_want(tab)
            u_found[u] = 0
            if found_slots is not None and found_slots[fs[0]] is not None:
                if len(fs) != 1:
                    raise ValueError(f"found_slots[{fs[0]}]: only for a feature alone on its table")
                _check_vector(found_slots[fs[0]], np.int64, keys[fs[0]].shape[0], f"found_slots[{fs[0]}]")
                u_found[u] = _ptr(found_slots[fs[0]])
            if len(fs) == 1:
                unit_keys = keys[fs[0]]
            else:
                unit_keys = np.concatenate([keys[f] for f in fs])
            unit_slots = np.empty(unit_keys.shape[0], dtype=np.int64)
            u_keys[u] = _ptr(unit_keys)
            u_n[u] = unit_keys.shape[0]
            u_slots[u] = _ptr(unit_slots)
            u_rc[u] = CN_OK
            start = 0
            for f in fs:
                slots = unit_slots[start:start + p_nkeys[f]] if len(fs) > 1 else unit_slots
                p_slots[f] = u_slots[u] + 8 * start
                start += p_nkeys[f]
                argmax = None
                if modes[f] == 2:
                    argmax = np.empty((p_nbags[f], tab.t.dim), dtype=np.int64)
                p_argmax[f] = _ptr(argmax)
                results[f] = [slots, argmax, 0, 0, unit_keys]  # unit_keys: alive until the call returns
        with nogil:
            for f in range(F):
                bad_pos = cn_check_offsets(<offset_t*> p_off[f], p_nbags[f], p_nkeys[f])
                if bad_pos >= 0:
                    bad_feature = f
                    break
            if bad_feature < 0:
                for u in range(U):
                    if insert_missing:
                        pthread_rwlock_wrlock(&tp[u].lock)
                    else:
                        pthread_rwlock_rdlock(&tp[u].lock)
                    if u_found[u]:
                        u_nnew[u] = 0
                        rc = cn_table_take_found(tp[u], <key_t*> u_keys[u], <slot_t*> u_found[u], u_n[u],
                                                 <slot_t*> u_slots[u])
                    else:
                        rc = cn_table_resolve(tp[u], <key_t*> u_keys[u], u_n[u], <slot_t*> u_slots[u], NULL,
                                              insert_missing, insert_missing, <int> u_want[u], &evs[u],
                                              &u_nnew[u])
                    if rc == CN_OK:
                        for f in range(F):
                            if p_unit[f] == u:
                                cn_table_pool(tp[u], <key_t*> (u_keys[u] + (p_slots[f] - u_slots[u])),
                                              <offset_t*> p_off[f], p_nbags[f], <weight_t*> p_w[f],
                                              <int> p_mode[f], <weight_t*> p_out[f], p_ld[f],
                                              <int64_t*> p_argmax[f], <slot_t*> p_slots[f])
                    u_epoch[u] = tp[u].erase_epoch
                    pthread_rwlock_unlock(&tp[u].lock)
                    if rc != CN_OK:
                        u_rc[u] = rc
                        failed = u
                        break
        # Evicted rows first: they left their tables whatever happens next. Every table's rows
        # reach its own sink, whatever an earlier table's sink raised; the first error is raised
        # once all are delivered, the others (and the call's own) attached to it.
        errors = []
        for u in range(U):
            try:
                (<Table> tables[members[u][0]])._deliver(&evs[u])
            except BaseException as e:
                errors.append(e)
        try:
            if bad_feature >= 0:
                raise ValueError(
                    f"offsets[{bad_feature}]: must start at 0, never decrease and end at the number of "
                    f"keys ({p_nkeys[bad_feature]}); position {bad_pos} breaks this")
            if failed >= 0:
                f = members[failed][0]
                done = " (the tables of features before it were looked up)" if failed else ""
                if u_rc[failed] == CN_EBADSLOT:
                    raise ValueError(f"found_slots[{f}]: a slot that holds no row of its table; the table is "
                                     "unchanged" + done)
                if u_rc[failed] == CN_EFULL:
                    raise ValueError(f"feature {f}: the distinct keys its table is looked up with exceed its "
                                     f"max_rows ({tp[failed].bound.max_rows}); its table is unchanged" + done)
                raise MemoryError(f"cannot grow the table of feature {f}; it is unchanged" + done)
        except BaseException as e:
            errors.append(e)
        if errors:
            raise_first(errors)
        for f in range(F):
            u = p_unit[f]
            results[f][2] = u_nnew[u] if members[u][0] == f else 0
            results[f][3] = u_epoch[u]
            del results[f][4]
        return results
    finally:
        for u in range(U):
            cn_evicted_free(&evs[u])
        free(tp)
        free(ip)
        free(up)
        free(evs)


cdef _check_backward_inputs(Table tab, object slots, object offsets, object weights, int mode, object argmax,
                            object grad, int f):
    """What the backward of one lookup reads through raw pointers, checked against each other
    (shapes, dtypes, strides); the offsets' values and the slots are checked under the lock."""
    _check_vector(slots, np.int64, -1, f"slots[{f}]")
    _check_vector(offsets, np.int64, -1, f"offsets[{f}]")
    if offsets.shape[0] < 1:
        raise ValueError(f"offsets[{f}]: needs B+1 >= 1 entries")
    cdef int64_t n_bags = offsets.shape[0] - 1
    if weights is not None:
        _check_vector(weights, np.float32, slots.shape[0], f"weights[{f}]")
    if mode not in (0, 1, 2):
        raise ValueError(f"mode of feature {f}: expected 0 (sum), 1 (mean) or 2 (max), got {mode!r}")
    if mode == 2:
        if not isinstance(argmax, np.ndarray) or argmax.dtype != np.int64 or not argmax.flags.c_contiguous \
                or argmax.shape != (n_bags, tab.t.dim):
            raise ValueError(f"argmax[{f}]: expected a C-contiguous int64 array of shape ({n_bags}, {tab.t.dim})")
    _check_rows(grad, np.float32, n_bags, tab.t.dim, f"grad_output (feature {f})", False)


cdef str _nonfinite_message(int f):
    return (f"grad_output: holds NaN or inf (feature {f}); applied, it would overwrite every row it touches "
            "for good, so nothing was updated")


cdef str _stale_message(int f, int rc):
    if rc == CN_ESTALE:
        return (f"feature {f}: keys were erased (or the store cleared) since this lookup, or the lookup was made "
                "on another store; its rows may be gone, so its gradient cannot be applied. Nothing was updated")
    return (f"feature {f}: the lookup context holds slots this store never handed out (a forged or damaged "
            "context); nothing was updated")


def grouped_backward(list tables, list slots, list offsets, list weights, list modes, list argmaxes,
                     list grads, list optims, list metas, list epochs):
    """Fused backward + optimizer update for F lookups in one nogil section.

    grads[f] is a float32 (B, dim) view (rows may be strided). optims[f] is a tuple
    (kind, lr, eps, beta1, beta2). metas[f] is (record_access, step_of_the_lookup). epochs[f]
    is the erase epoch grouped_forward returned. Every table's write lock is taken (in address
    order, so two backwards cannot deadlock), every lookup is checked against its table
    (epoch, offsets, slots), and only then is any row updated: a stale lookup raises
    RuntimeError with every table unchanged. Each table's step advances by one before its
    update. A table may appear once (the caller merges features sharing a table).
    """
    cdef int64_t F = len(tables), f, i
    cdef Table tab
    if not (len(slots) == len(offsets) == len(weights) == len(modes) == len(argmaxes) == len(grads)
            == len(optims) == len(metas) == len(epochs) == F):
        raise ValueError("grouped_backward: one entry per table in every list")
    if len({id(t) for t in tables}) != F:
        raise ValueError("grouped_backward: a table appears twice; merge its lookups first")
    cdef cn_table** tp = <cn_table**> malloc(max(F, 1) * sizeof(cn_table*))
    cdef cn_table** locked = <cn_table**> malloc(max(F, 1) * sizeof(cn_table*))
    cdef cn_optim* opts = <cn_optim*> malloc(max(F, 1) * sizeof(cn_optim))
    cdef int64_t* ip = <int64_t*> malloc(max(F, 1) * 12 * sizeof(int64_t))
    cdef int64_t oom_feature = -1, bad_feature = -1, bad_pos = -1, stale_feature = -1, nonfinite_feature = -1
    cdef int64_t step_feature = -1
    cdef int rc = 0, stale_rc = 0
    if tp == NULL or opts == NULL or ip == NULL or locked == NULL:
        free(tp)
        free(locked)
        free(opts)
        free(ip)
        raise MemoryError("cannot allocate the call's scratch")
    cdef int64_t* p_slots = ip
    cdef int64_t* p_off = ip + F
    cdef int64_t* p_nbags = ip + 2 * F
    cdef int64_t* p_w = ip + 3 * F
    cdef int64_t* p_mode = ip + 4 * F
    cdef int64_t* p_argmax = ip + 5 * F
    cdef int64_t* p_grad = ip + 6 * F
    cdef int64_t* p_ld = ip + 7 * F
    cdef int64_t* p_touch = ip + 8 * F
    cdef int64_t* p_step = ip + 9 * F
    cdef int64_t* p_nkeys = ip + 10 * F
    cdef uint64_t* p_epoch = <uint64_t*> (ip + 11 * F)
    try:
        for f in range(F):
            tab = <Table> tables[f]
            _check_backward_inputs(tab, slots[f], offsets[f], weights[f], modes[f], argmaxes[f], grads[f], f)
            tp[f] = &tab.t
            p_slots[f] = _ptr(slots[f])
            p_nkeys[f] = slots[f].shape[0]
            p_off[f] = _ptr(offsets[f])
            p_nbags[f] = offsets[f].shape[0] - 1
            p_w[f] = _ptr(weights[f])
            p_mode[f] = modes[f]
            p_argmax[f] = _ptr(argmaxes[f]) if modes[f] == 2 else 0
            p_grad[f] = _ptr(grads[f])
            p_ld[f] = grads[f].strides[0] // 4 if p_nbags[f] > 1 else tab.t.dim
            p_touch[f] = bool(metas[f][0])
            p_step[f] = _saturate_u32(metas[f][1])
            p_epoch[f] = epochs[f]
            kind, lr, eps, beta1, beta2 = optims[f]
            opts[f].kind = kind
            opts[f].lr = lr
            opts[f].eps = eps
            opts[f].beta1 = beta1
            opts[f].beta2 = beta2
        # Lock order: by address, so concurrent grouped backwards never wait on each other in a cycle.
        order = sorted((<size_t> tp[f], f) for f in range(F))
        for i in range(F):
            locked[i] = tp[<int64_t> order[i][1]]
        with nogil:
            for f in range(F):
                bad_pos = cn_check_offsets(<offset_t*> p_off[f], p_nbags[f], p_nkeys[f])
                if bad_pos >= 0:
                    bad_feature = f
                    break
                if not cn_all_finite(<weight_t*> p_grad[f], p_nbags[f], tp[f].dim, p_ld[f]):
                    nonfinite_feature = f
                    break
            if bad_feature < 0 and nonfinite_feature < 0:
                for i in range(F):
                    pthread_rwlock_wrlock(&locked[i].lock)
                for f in range(F):
                    stale_rc = cn_table_check_slots(tp[f], p_epoch[f], <slot_t*> p_slots[f], p_nkeys[f])
                    if stale_rc != CN_OK:
                        stale_feature = f
                        break
                    if tp[f].step >= _STEP_MAX:
                        step_feature = f
                        break
                if stale_feature < 0 and step_feature < 0:
                    for f in range(F):
                        tp[f].step += 1
                        cn_optim_set_step(&opts[f], tp[f].step)
                        rc = cn_grad_apply(&tp[f].arena, tp[f].dim, tp[f].row_dtype, <slot_t*> p_slots[f],
                                           <offset_t*> p_off[f],
                                           p_nbags[f], <weight_t*> p_w[f], <int> p_mode[f], <int64_t*> p_argmax[f],
                                           <weight_t*> p_grad[f], p_ld[f], &opts[f], <int> p_touch[f],
                                           <uint32_t> p_step[f], cn_threads_for(p_nkeys[f] * 4))
                        if rc != 0:
                            tp[f].step -= 1
                            oom_feature = f
                            break
                for i in range(F - 1, -1, -1):
                    pthread_rwlock_unlock(&locked[i].lock)
        if bad_feature >= 0:
            raise ValueError(f"offsets[{bad_feature}]: must start at 0, never decrease and end at the number of "
                             f"slots ({p_nkeys[bad_feature]}); position {bad_pos} breaks this")
        if nonfinite_feature >= 0:
            raise ValueError(_nonfinite_message(nonfinite_feature))
        if stale_feature >= 0:
            raise RuntimeError(_stale_message(stale_feature, stale_rc))
        if step_feature >= 0:
            raise ValueError(f"feature {step_feature}: its table's step is {_STEP_MAX} (2**32 - 1), the last step a "
                             "row's 32-bit last_step records, and this update would pass it; nothing was updated. "
                             + STEP_REMEDY)
        if oom_feature >= 0:
            raise MemoryError(f"out of memory in the backward of feature {oom_feature}; "
                              f"its table is unchanged, earlier features were updated")
    finally:
        free(tp)
        free(locked)
        free(opts)
        free(ip)


def unique_gradients(Table table, slots, offsets, weights, int mode, argmax, grad,
                     bint record_access, step, uint64_t erase_epoch):
    """Non-fused backward for one lookup: (first key position of each unique row,
    gradient rows (U, dim)), unique rows in first-occurrence order. The lookup is checked
    against the table under its lock (as in grouped_backward); with record_access, the rows'
    access metadata is updated (the write lock is taken)."""
    _check_backward_inputs(table, slots, offsets, weights, mode, argmax, grad, 0)
    cdef cn_groups groups
    cdef int rc = 0, stale_rc = 0
    cdef const slot_t[::1] sl = slots
    cdef const offset_t[::1] off = offsets
    cdef int64_t n_bags = off.shape[0] - 1, n = sl.shape[0], bad_pos
    cdef int64_t dim = table.t.dim
    cdef const weight_t* w = <const weight_t*> <size_t> _ptr(weights)
    cdef const int64_t* am = <const int64_t*> <size_t> (_ptr(argmax) if mode == 2 else 0)
    cdef const weight_t* g = <const weight_t*> <size_t> _ptr(grad)
    cdef int64_t ld = grad.strides[0] // 4 if n_bags > 1 else dim
    cdef uint32_t step32 = _saturate_u32(step)
    cdef weight_t* out_p
    cdef int64_t* bag_of = NULL
    cdef const slot_t* slots_p = &sl[0] if n else NULL
    cdef bint finite
    with nogil:
        bad_pos = cn_check_offsets(&off[0], n_bags, n)
        finite = cn_all_finite(g, n_bags, dim, ld)
    if bad_pos >= 0:
        raise ValueError(f"offsets: must start at 0, never decrease and end at the number of slots ({n}); "
                         f"position {bad_pos} breaks this")
    if not finite:
        raise ValueError(_nonfinite_message(0))
    with nogil:
        bag_of = cn_bag_of(&off[0], n_bags, cn_threads_for(n))
        rc = -1 if bag_of == NULL else cn_groups_build(slots_p, NULL, n, &groups)
    if rc != 0:
        free(bag_of)
        raise MemoryError("out of memory building the gradient groups")
    try:
        positions = np.empty(groups.n_unique, dtype=np.int64)
        out = np.empty((groups.n_unique, dim), dtype=np.float32)
        out_p = <weight_t*> <size_t> _ptr(out)
        with nogil:
            if record_access:
                pthread_rwlock_wrlock(&table.t.lock)
            else:
                pthread_rwlock_rdlock(&table.t.lock)
            stale_rc = cn_table_check_slots(&table.t, erase_epoch, slots_p, n)
            if stale_rc == CN_OK and groups.n_unique:
                cn_grad_unique(&groups, bag_of, &table.t.arena, dim, slots_p, &off[0], w, mode, am, g, ld,
                               out_p, record_access, step32, cn_threads_for(groups.n_unique * 4))
            pthread_rwlock_unlock(&table.t.lock)
        if stale_rc != CN_OK:
            raise RuntimeError(_stale_message(0, stale_rc))
        if groups.n_unique:
            positions[:] = <int64_t[:groups.n_unique]> groups.unique_pos
        return positions, out
    finally:
        cn_groups_free(&groups)
        free(bag_of)

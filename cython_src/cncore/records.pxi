# The SSD tier's records (cn_tier.h, cn_blockio.h): their file offsets and checks, block I/O,
# and the RecordWriter that moves rows between a table and the record file, with its jobs.


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
    the tier's reads (cncore.tier.records.record_offsets) through this.

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


cdef class RecordWriter


cdef class SpillJob:
    """The rows one eviction sent to disk, on their way there (write-behind, cncore/tier/):
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

# One C table (cn_table.h): the initialiser's rows, the table's lock and eviction sink, its
# errors, and the Table class with its batch verbs.


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
        cn_kernel_init_rows_of(&init, &keys[0], n, &out[0, 0], dim, cn_threads_for(n * dim // 16))


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
                  uint64_t admit_threshold=0, uint64_t admit_seed=0, int lfu_halve_shift=-1,
                  int64_t fallback_rows=0, bint fallback_copy=True, bint fallback_residual=False):
        cdef cn_init init = _make_init(init_kind, seed, p0, p1, p2, p3)
        cdef cn_bound bound
        cdef int rc
        memset(&bound, 0, sizeof(bound))
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
        bound.fallback_rows = fallback_rows
        bound.fallback_copy = fallback_copy
        bound.fallback_residual = fallback_residual
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
    def fallback_rows(self):
        return self.t.bound.fallback_rows

    @property
    def fallback_residual(self):
        return bool(self.t.bound.fallback_residual)

    def read_fallback(self, weight_t[:, ::1] rows, weight_t[:, ::1] state):
        """Copy the fallback rows (slots [0, N), cn_table_core.h) and their optimizer state into
        rows (N, dim) and state (N, state_floats)."""
        cdef int64_t n = self.t.bound.fallback_rows
        _check_len(rows, n, self.t.dim, "rows")
        _check_len(state, n, self.t.state_floats, "optimizer_state")
        if n == 0:
            return
        slots_arr = np.arange(n, dtype=np.int64)
        cdef slot_t[::1] slots = slots_arr
        with nogil:
            _rdlock(self)
            cn_table_gather(&self.t, &slots[0], n, &rows[0, 0], &state[0, 0] if self.t.state_floats else NULL,
                            NULL, NULL)
            _unlock(self)

    def write_fallback(self, const weight_t[:, ::1] rows, const weight_t[:, ::1] state):
        """Overwrite the fallback rows and their optimizer state (shapes as read_fallback's)."""
        cdef int64_t n = self.t.bound.fallback_rows
        _check_len(rows, n, self.t.dim, "rows")
        _check_len(state, n, self.t.state_floats, "optimizer_state")
        if n == 0:
            return
        slots_arr = np.arange(n, dtype=np.int64)
        cdef slot_t[::1] slots = slots_arr
        with nogil:
            _wrlock(self)
            cn_table_write_rows(&self.t, &slots[0], n, &rows[0, 0], self.t.dim,
                                &state[0, 0] if self.t.state_floats else NULL, self.t.state_floats)
            _unlock(self)

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
    def arena_slots(self):
        """Row slots the arena's pages hold (handed out or not): pages x rows a page."""
        return self.t.arena.n_pages << self.t.arena.page_shift

    @property
    def slot_bytes(self):
        """Bytes one slot takes in a page: its row, its metadata and, in a bounded table, its key
        (the live bit and the alignment between a page's parts are left out)."""
        return self.t.arena.row_bytes + self.t.arena.meta_bytes + (8 if self.t.arena.key_offset else 0)

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
            rows_p = <weight_t*> _ptr(rows_arr)
            state_p = <weight_t*> _ptr(state_arr)
            counts_p = <count_t*> _ptr(counts_arr)
            steps_p = <count_t*> _ptr(steps_arr)
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

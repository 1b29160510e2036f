# The grouped pooled lookup: every feature's (table, keys, offsets) in one nogil section, its
# distinct tables as parallel tasks (_lookup_units; grouped_backward's tables too).
from cncore._grouped cimport LookupCall, UpdateCall, cn_parallel_for, cn_threads_unless_asleep, CN_LOOKUP_MIN_TO_WAKE


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

    The distinct tables are independent tasks of one parallel loop (_lookup_units), on the
    threads one lookup of the call's total keys would take (_unit_threads); each is done
    exactly as alone, so the result does not depend on the thread count. Every table is
    looked up whether or not another fails: a table that fails (budget overflow, out of
    memory, a bad found slot) is unchanged, the error names the first such feature, and the
    rows every other table evicted still reach its sink.

    found_slots (a tier's fault-in, cncore/tier/): per feature None, or the slot of every
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
    # One record a feature and one a distinct table (_grouped.pxd), filled here with the GIL and
    # read in the nogil section.
    cdef LookupFeature* feats = NULL
    cdef LookupTable* units = NULL
    cdef LookupFeature* ft
    cdef LookupTable* ut
    results = [None] * F
    cdef int64_t bad_feature = -1, bad_pos = -1, failed = -1, start, total, largest
    cdef LookupCall call
    try:
        feats = <LookupFeature*> _scratch(F, sizeof(LookupFeature))
        units = <LookupTable*> _scratch(U, sizeof(LookupTable))
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
            ft = &feats[f]
            ft.n_keys = k.shape[0]
            ft.offsets = <const offset_t*> _ptr(o)
            ft.n_bags = o.shape[0] - 1
            ft.weights = <const weight_t*> _ptr(weights[f])
            ft.mode = modes[f]
            ft.out = <weight_t*> _ptr(out)
            ft.ld_out = cnp.PyArray_STRIDE(<cnp.ndarray> out, 0) // 4 if ft.n_bags > 1 else tab.t.dim
            ft.table = unit_of[id(tables[f])]
        for u in range(U):
            fs = members[u]
            tab = <Table> tables[fs[0]]
            if insert_missing and tab.t.step >= _STEP_MAX:
                raise ValueError(f"feature {fs[0]}: its table's step is {tab.t.step}, the last step a row's 32-bit "
                                 f"last_step records ({_STEP_MAX}, 2**32 - 1), and the backward of a training lookup "
                                 f"would pass it; every table is unchanged. {STEP_REMEDY}")
            ut = &units[u]
            ut.t = &tab.t
            ut.want = _sink_want(tab)
            ut.found = NULL
            if found_slots is not None and found_slots[fs[0]] is not None:
                if len(fs) != 1:
                    raise ValueError(f"found_slots[{fs[0]}]: only for a feature alone on its table")
                _check_vector(found_slots[fs[0]], np.int64, keys[fs[0]].shape[0], f"found_slots[{fs[0]}]")
                ut.found = <const slot_t*> _ptr(found_slots[fs[0]])
            if len(fs) == 1:
                unit_keys = keys[fs[0]]
            else:
                unit_keys = np.concatenate([keys[f] for f in fs])
            unit_slots = np.empty(unit_keys.shape[0], dtype=np.int64)
            ut.keys = <const key_t*> _ptr(unit_keys)
            ut.n = unit_keys.shape[0]
            ut.slots = <slot_t*> _ptr(unit_slots)
            ut.rc = CN_OK
            start = 0
            for f in fs:
                ft = &feats[f]
                slots = unit_slots[start:start + ft.n_keys] if len(fs) > 1 else unit_slots
                ft.keys = ut.keys + start
                ft.slots = ut.slots + start
                start += ft.n_keys
                argmax = None
                if modes[f] == 2:
                    argmax = np.empty((ft.n_bags, tab.t.dim), dtype=np.int64)
                ft.argmax = <int64_t*> _ptr(argmax)
                ft.own = NULL
                residual = None
                if tab.t.bound.fallback_residual:
                    slots, residual = _residual_feature(ft, f, keys[f], offsets[f], weights[f], modes[f])
                # unit_keys and unit_slots (the table's resolved slots, which a residual feature
                # does not return): alive until the call returns.
                results[f] = [slots, argmax, 0, 0, (unit_keys, unit_slots), residual]
        with nogil:
            for f in range(F):
                bad_pos = cn_check_offsets(feats[f].offsets, feats[f].n_bags, feats[f].n_keys)
                if bad_pos >= 0:
                    bad_feature = f
                    break
            if bad_feature < 0:
                call.units = units
                call.feats = feats
                call.n_feats = F
                call.insert_missing = insert_missing
                total = largest = 0
                for u in range(U):
                    total += units[u].n
                    largest = max(largest, units[u].n)
                cn_parallel_for(_lookup_units, &call, U, _unit_threads(U, total, largest))
                for u in range(U):
                    if units[u].rc != CN_OK:
                        failed = u
                        break
        # Evicted rows first: they left their tables whatever happens next. Every table's rows
        # reach its own sink, whatever an earlier table's sink raised; the first error is raised
        # once all are delivered, the others (and the call's own) attached to it.
        errors = []
        for u in range(U):
            try:
                (<Table> tables[members[u][0]])._deliver(&units[u].ev)
            except BaseException as e:
                errors.append(e)
        try:
            if bad_feature >= 0:
                raise ValueError(
                    f"offsets[{bad_feature}]: must start at 0, never decrease and end at the number of "
                    f"keys ({feats[bad_feature].n_keys // (2 if feats[bad_feature].own != NULL else 1)}); "
                    f"position {bad_pos} breaks this")
            if failed >= 0:
                f = members[failed][0]
                done = ("; the other features' tables were looked up (any that failed as well are unchanged)"
                        if U > 1 else "")
                if units[failed].rc == CN_EBADSLOT:
                    raise ValueError(f"found_slots[{f}]: a slot that holds no row of its table; the table is "
                                     "unchanged" + done)
                if units[failed].rc == CN_EFULL:
                    raise ValueError(f"feature {f}: the distinct keys its table is looked up with exceed its "
                                     f"max_rows ({units[failed].t.bound.max_rows}); its table is unchanged" + done)
                raise MemoryError(f"cannot grow the table of feature {f}; it is unchanged" + done)
        except BaseException as e:
            errors.append(e)
        if errors:
            raise_first(errors)
        for f in range(F):
            u = feats[f].table
            results[f][2] = units[u].n_new if members[u][0] == f else 0
            results[f][3] = units[u].epoch
            del results[f][4]
        return results
    finally:
        if units != NULL:
            for u in range(U):
                cn_evicted_free(&units[u].ev)
        free(feats)
        free(units)


# Distinct tables of a grouped call run as tasks of one parallel loop (cn_parallel_for): inside
# a task the pool is busy, so each table's own loops (find, pool, update) run on the task's
# thread. _set_serial_units(True) runs them one after another instead, each table's loops on
# its own threads (for tests and benchmarks: the results are the same). Why: the cn-dlrm job's
# 26 tables of 2,048 IDs each stayed under the keys that wake the workers, so its grouped calls
# ran on one thread. Measured (Intel Xeon 2-core guest, load 1.0-1.4, cn-dlrm alone, runs
# alternated): 89.0 / 94.2 / 97.5 k samples/s serial, 104.0 / 101.4 / 115.8 k in parallel; the
# calls alone, back to back, forward 1.75 -> 1.51 ms, backward 1.63 -> 1.25 ms (after a 2 ms
# pause, workers asleep: 1.86 -> 2.03 and 1.59 -> 1.57). Rejected: waking the workers at the
# start of the call's preparation (a futex wake, no loop): cn-dlrm 103.0 / 99.8 k against
# 100.7 / 99.5 k without it, and the paused backward 0.15-0.3 ms slower.
cdef int _serial_units = 0


def _set_serial_units(bint on):
    """Run the distinct tables of grouped_forward / grouped_backward one after another (True)
    or as parallel tasks (False, the default); returns the previous setting."""
    global _serial_units
    cdef bint before = _serial_units
    _serial_units = on
    return before


cdef int _unit_threads(int64_t n_units, int64_t total, int64_t largest) noexcept nogil:
    """Threads for the loop over a grouped call's distinct tables: the rule of one lookup
    (cn_threads_unless_asleep) on the call's total keys. One table, or one that would wake the
    workers on its own (CN_LOOKUP_MIN_TO_WAKE keys), keeps the serial loop, where each table's
    loops use the threads themselves: a parallel task runs them on one thread."""
    if _serial_units or n_units < 2 or largest >= CN_LOOKUP_MIN_TO_WAKE:
        return 1
    return cn_threads_unless_asleep(total, CN_LOOKUP_MIN_TO_WAKE)


cdef void _lookup_units(void *ctx, int64_t begin, int64_t end) noexcept nogil:
    """Tables [begin, end) of a grouped_forward (a cn_range_fn): each under one hold of its
    lock, its keys resolved (or its found slots taken), then its features pooled. A table that
    fails (ut.rc) is unchanged; the others go on."""
    cdef LookupCall *c = <LookupCall*> ctx
    cdef LookupTable *ut
    cdef LookupFeature *ft
    cdef int64_t u, f
    cdef int rc
    for u in range(begin, end):
        ut = &c.units[u]
        if c.insert_missing:
            pthread_rwlock_wrlock(&ut.t.lock)
        else:
            pthread_rwlock_rdlock(&ut.t.lock)
        if ut.found != NULL:
            ut.n_new = 0
            rc = cn_table_take_found(ut.t, ut.keys, ut.found, ut.n, ut.slots)
        else:
            rc = cn_table_resolve(ut.t, ut.keys, ut.n, ut.slots, NULL, c.insert_missing, c.insert_missing,
                                  ut.want, &ut.ev, &ut.n_new)
            if rc == CN_OK:
                cn_table_use_fallback(ut.t, ut.keys, ut.n, ut.slots)
        if rc == CN_OK:
            for f in range(c.n_feats):
                ft = &c.feats[f]
                if ft.table == u:
                    if ft.own != NULL:
                        cn_table_residual_slots(ut.t, ut.keys + (ft.own - ut.slots), ft.own,
                                                ft.n_keys // 2, ft.slots)
                    cn_kernel_table_pool(ut.t, ft.keys, ft.offsets, ft.n_bags, ft.weights, ft.mode, ft.out,
                                         ft.ld_out, ft.argmax, ft.slots)
        ut.epoch = ut.t.erase_epoch
        pthread_rwlock_unlock(&ut.t.lock)
        ut.rc = rc


cdef tuple _residual_feature(LookupFeature* ft, int64_t f, object k, object o, object w, int mode):
    """A feature on a table with residual fallback rows (cn_table_core.h) as the pool and the
    backward read it: each key two occurrences of its bag, its own slot then its fallback slot
    (filled under the lock by cn_table_residual_slots), so each row gets its share of the
    bag's gradient and its own optimizer update. Offsets double; weights repeat; mean pooling
    gets weights 2 (2w), so a bag's mean over its 2L occurrences is the mean over its L keys of
    own + fallback, exactly (scaling by 2 rounds nothing). Points ft at the new arrays and
    returns (slots, (keys, offsets, weights)), what the backward reads in their place."""
    if mode == 2:
        raise ValueError(f"modes[{f}]: 'max' pooling of a table with fallback_mode='residual' is not supported (a "
                         "key's value is the sum of two rows, which a per-row max cannot pool exactly); use 'sum' or "
                         "'mean', or fallback_mode='miss'")
    cdef int64_t n = ft.n_keys
    ft.own = ft.slots
    rkeys = np.repeat(k, 2)
    rslots = np.empty(2 * n, dtype=np.int64)
    # Out-of-range offsets clipped first, so doubling cannot wrap; clipping keeps a bad offsets
    # array bad at the same position (the core checks the doubled one).
    roffsets = np.clip(o, -1, n + 1) * 2
    if mode == 1:
        rweights = np.repeat(w if w is not None else np.ones(n, dtype=np.float32), 2) * np.float32(2)
    else:
        rweights = None if w is None else np.repeat(w, 2)
    ft.keys = <const key_t*> _ptr(rkeys)
    ft.slots = <slot_t*> _ptr(rslots)
    ft.n_keys = 2 * n
    ft.offsets = <const offset_t*> _ptr(roffsets)
    ft.weights = <const weight_t*> _ptr(rweights)
    return rslots, (rkeys, roffsets, rweights)

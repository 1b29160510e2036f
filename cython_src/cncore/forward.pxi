# The grouped pooled lookup: every feature's (table, keys, offsets) in one nogil section.


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

# The backward of a lookup: the fused gradient and optimizer update of grouped lookups, and
# the per-row gradients of one lookup (unique_gradients).


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

    The tables' updates are independent tasks of one parallel loop (_update_units), on the
    threads one lookup of the call's total keys would take (_unit_threads, forward.pxi); each
    is done exactly as alone (a row's keys in key order, cn_grad.h), so the result does not
    depend on the thread count. A table that runs out of memory is unchanged (its step too);
    the others are updated all the same, and the MemoryError names the first such feature.
    """
    cdef int64_t F = len(tables), f, i
    cdef Table tab
    if not (len(slots) == len(offsets) == len(weights) == len(modes) == len(argmaxes) == len(grads)
            == len(optims) == len(metas) == len(epochs) == F):
        raise ValueError("grouped_backward: one entry per table in every list")
    if len({id(t) for t in tables}) != F:
        raise ValueError("grouped_backward: a table appears twice; merge its lookups first")
    # One record a lookup (_grouped.pxd), filled here with the GIL and read in the nogil section.
    cdef UpdateFeature* feats = NULL
    cdef UpdateFeature* ft
    cdef cn_table** locked = NULL
    cdef int64_t oom_feature = -1, bad_feature = -1, bad_pos = -1, stale_feature = -1, nonfinite_feature = -1
    cdef int64_t step_feature = -1, total, largest
    cdef int stale_rc = 0, threads
    cdef UpdateCall call
    try:
        feats = <UpdateFeature*> _scratch(F, sizeof(UpdateFeature))
        locked = <cn_table**> _scratch(F, sizeof(cn_table*))
        for f in range(F):
            tab = <Table> tables[f]
            _check_backward_inputs(tab, slots[f], offsets[f], weights[f], modes[f], argmaxes[f], grads[f], f)
            ft = &feats[f]
            ft.t = &tab.t
            ft.slots = <const slot_t*> _ptr(slots[f])
            ft.n_keys = slots[f].shape[0]
            ft.offsets = <const offset_t*> _ptr(offsets[f])
            ft.n_bags = offsets[f].shape[0] - 1
            ft.weights = <const weight_t*> _ptr(weights[f])
            ft.mode = modes[f]
            ft.argmax = <const int64_t*> _ptr(argmaxes[f]) if modes[f] == 2 else NULL
            ft.grad = <const weight_t*> _ptr(grads[f])
            ft.ld_grad = grads[f].strides[0] // 4 if ft.n_bags > 1 else tab.t.dim
            ft.touch = bool(metas[f][0])
            ft.step = _saturate_u32(metas[f][1])
            ft.epoch = epochs[f]
            kind, lr, eps, beta1, beta2 = optims[f]
            ft.opt.kind = kind
            ft.opt.lr = lr
            ft.opt.eps = eps
            ft.opt.beta1 = beta1
            ft.opt.beta2 = beta2
        # Lock order: by address, so concurrent grouped backwards never wait on each other in a cycle.
        order = sorted((<size_t> feats[f].t, f) for f in range(F))
        for i in range(F):
            locked[i] = feats[<int64_t> order[i][1]].t
        with nogil:
            for f in range(F):
                ft = &feats[f]
                bad_pos = cn_check_offsets(ft.offsets, ft.n_bags, ft.n_keys)
                if bad_pos >= 0:
                    bad_feature = f
                    break
                if not cn_all_finite(ft.grad, ft.n_bags, ft.t.dim, ft.ld_grad):
                    nonfinite_feature = f
                    break
            if bad_feature < 0 and nonfinite_feature < 0:
                for i in range(F):
                    pthread_rwlock_wrlock(&locked[i].lock)
                for f in range(F):
                    ft = &feats[f]
                    stale_rc = cn_table_check_slots(ft.t, ft.epoch, ft.slots, ft.n_keys)
                    if stale_rc != CN_OK:
                        stale_feature = f
                        break
                    if ft.t.step >= _STEP_MAX:
                        step_feature = f
                        break
                if stale_feature < 0 and step_feature < 0:
                    total = largest = 0
                    for f in range(F):
                        total += feats[f].n_keys
                        largest = max(largest, feats[f].n_keys)
                    threads = _unit_threads(F, total, largest)
                    call.feats = feats
                    call.inner_threads = 1 if threads > 1 else 0
                    cn_parallel_for(_update_units, &call, F, threads)
                    for f in range(F):
                        if feats[f].rc != 0:
                            oom_feature = f
                            break
                for i in range(F - 1, -1, -1):
                    pthread_rwlock_unlock(&locked[i].lock)
        if bad_feature >= 0:
            raise ValueError(f"offsets[{bad_feature}]: must start at 0, never decrease and end at the number of "
                             f"slots ({feats[bad_feature].n_keys}); position {bad_pos} breaks this")
        if nonfinite_feature >= 0:
            raise ValueError(_nonfinite_message(nonfinite_feature))
        if stale_feature >= 0:
            raise RuntimeError(_stale_message(stale_feature, stale_rc))
        if step_feature >= 0:
            raise ValueError(f"feature {step_feature}: its table's step is {_STEP_MAX} (2**32 - 1), the last step a "
                             "row's 32-bit last_step records, and this update would pass it; nothing was updated. "
                             + STEP_REMEDY)
        if oom_feature >= 0:
            raise MemoryError(f"out of memory in the backward of feature {oom_feature}; its table is unchanged"
                              + ("; the other features' tables were updated (any that failed as well are unchanged)"
                                 if F > 1 else ""))
    finally:
        free(feats)
        free(locked)


cdef void _update_units(void *ctx, int64_t begin, int64_t end) noexcept nogil:
    """Lookups [begin, end) of a grouped_backward (a cn_range_fn; their tables distinct and
    write-locked by the caller): each table's step advances and its rows are updated. One that
    runs out of memory (ft.rc = -1) is unchanged, its step restored; the others go on."""
    cdef UpdateCall *c = <UpdateCall*> ctx
    cdef UpdateFeature *ft
    cdef int64_t f
    for f in range(begin, end):
        ft = &c.feats[f]
        ft.t.step += 1
        cn_optim_set_step(&ft.opt, ft.t.step)
        ft.rc = cn_kernel_grad_apply(&ft.t.arena, ft.t.dim, ft.t.row_dtype, ft.slots, ft.offsets, ft.n_bags, ft.weights,
                                     ft.mode, ft.argmax, ft.grad, ft.ld_grad, &ft.opt, ft.touch, ft.step,
                                     c.inner_threads if c.inner_threads > 0 else cn_grad_threads(ft.n_keys))
        if ft.rc != 0:
            ft.t.step -= 1


def unique_gradients(Table table, slots, offsets, weights, int mode, argmax, grad,
                     bint record_access, step, uint64_t erase_epoch):
    """Non-fused backward for one lookup: (first key position of each unique row,
    gradient rows (U, dim)), unique rows in first-occurrence order. The lookup is checked
    against the table under its lock (as in grouped_backward); with record_access, the rows'
    access metadata is updated (the write lock is taken)."""
    if table.t.bound.fallback_residual:
        raise ValueError("accumulate_gradients: a table with fallback_mode='residual' trains two rows a key (its own "
                         "and its shared fallback row), which per-key gradients cannot name; use the fused update "
                         "(apply_gradients, or a fused optimizer in torch) or fallback_mode='miss'")
    _check_backward_inputs(table, slots, offsets, weights, mode, argmax, grad, 0)
    cdef cn_groups groups
    cdef int rc = 0, stale_rc = 0
    cdef const slot_t[::1] sl = slots
    cdef const offset_t[::1] off = offsets
    cdef int64_t n_bags = off.shape[0] - 1, n = sl.shape[0], bad_pos
    cdef int64_t dim = table.t.dim
    cdef const weight_t* w = <const weight_t*> _ptr(weights)
    cdef const int64_t* am = <const int64_t*> _ptr(argmax) if mode == 2 else NULL
    cdef const weight_t* g = <const weight_t*> _ptr(grad)
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
        out_p = <weight_t*> _ptr(out)
        with nogil:
            if record_access:
                pthread_rwlock_wrlock(&table.t.lock)
            else:
                pthread_rwlock_rdlock(&table.t.lock)
            stale_rc = cn_table_check_slots(&table.t, erase_epoch, slots_p, n)
            if stale_rc == CN_OK and groups.n_unique:
                cn_kernel_grad_unique(&groups, bag_of, &table.t.arena, dim, slots_p, &off[0], w, mode, am, g, ld,
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

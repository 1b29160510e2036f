/* cn_table_bounded.h: a bounded table's eviction (policies and their exact order: cn_evict.h).
 * The rows an eviction chooses are handed over (copied out for the sinks) and freed; an insert
 * that would pass max_rows first makes room, down to the low-water mark, never evicting a row
 * the call itself uses; a training lookup with more distinct new keys than the room overflows
 * (its extra keys read as unadmitted ones); and the explicit verbs (evict, evict_expired,
 * evict_keys) evict on demand. Every function here runs without the GIL, under the table's
 * write lock.
 */
#ifndef CN_TABLE_BOUNDED_H
#define CN_TABLE_BOUNDED_H

#include "cn_table_core.h"

/* Hand over the k rows of `victims` (live slots): copy them out into ev (rows and state only
 * with want_rows), then remove them from the index and free their slots. All allocation comes
 * first: CN_ENOMEM leaves the table unchanged. `reserve_total` >= 0 also reserves room for that
 * many rows after the eviction (the inserts that follow it), before anything changes. */
static inline int cn_table_take_victims(cn_table *t, const cn_victim *victims, int64_t k, int want_rows,
                                        cn_evicted *ev, int64_t reserve_total) {
    memset(ev, 0, sizeof(*ev));
    if (k == 0) return reserve_total >= 0 ? cn_table_reserve(t, reserve_total) : CN_OK;
    const size_t nk = (size_t)k;
    ev->keys = (int64_t *)malloc(nk * sizeof(int64_t));
    ev->counts = (uint32_t *)malloc(nk * sizeof(uint32_t));
    ev->last_steps = (uint32_t *)malloc(nk * sizeof(uint32_t));
    int ok = ev->keys && ev->counts && ev->last_steps;
    if (ok && want_rows) {
        ev->rows = (float *)malloc(nk * (size_t)t->dim * sizeof(float));
        ev->state = (float *)malloc(nk * (size_t)(t->state_floats ? t->state_floats : 1) * sizeof(float));
        ok = ev->rows && ev->state;
    }
    if (!ok || cn_arena_reserve_free(&t->arena, k, &t->nbytes) != 0 ||
        (reserve_total >= 0 && cn_table_reserve(t, reserve_total) != CN_OK)) {
        cn_evicted_free(ev);
        return CN_ENOMEM;
    }
    /* Two passes, each prefetching ahead: the victims' slots are scattered (score order), so
     * one pass that read a row and then probed the index stalled on two misses per row. */
    for (int64_t j = 0; j < k; j++) {
        if (j + CN_PREFETCH_DISTANCE < k) {
            const int64_t ahead = victims[j + CN_PREFETCH_DISTANCE].slot;
            __builtin_prefetch(cn_arena_meta(&t->arena, ahead), 0, 3);
            __builtin_prefetch(cn_arena_key(&t->arena, ahead), 0, 3);
            if (want_rows) cn_prefetch_read(cn_arena_row(&t->arena, ahead), t->arena.row_bytes);
        }
        const int64_t s = victims[j].slot;
        const cn_meta *m = cn_arena_meta(&t->arena, s);
        ev->keys[j] = *cn_arena_key(&t->arena, s);
        ev->counts[j] = m->count;
        ev->last_steps[j] = m->last_step;
        if (want_rows) {
            cn_row_load_of_level(t->row_dtype, cn_arena_row(&t->arena, s), ev->rows + j * t->dim, t->dim);
            if (t->state_floats)
                memcpy(ev->state + j * t->state_floats, cn_table_state(t, s), (size_t)t->state_floats * sizeof(float));
        }
    }
    for (int64_t j = 0; j < k; j++) {
        if (j + CN_PREFETCH_DISTANCE < k) cn_index_prefetch(&t->index, ev->keys[j + CN_PREFETCH_DISTANCE]);
        const int64_t s = victims[j].slot;
        cn_index_erase(&t->index, ev->keys[j]);
        cn_arena_release_slot(&t->arena, s);
        cn_arena_set_live(&t->arena, s, 0);
    }
    ev->n = k;
    /* Saturating: a count set near 2^63 (a restored checkpoint) never wraps negative. */
    t->n_evicted = t->n_evicted > INT64_MAX - k ? INT64_MAX : t->n_evicted + k;
    t->erase_epoch = cn_next_stamp();
    t->version = cn_next_stamp();
    return CN_OK;
}

/* Evict the k live rows (live bit set) with the lowest (score, key) (cn_evict.h). want_rows:
 * 0, keys and metadata only; 1, rows and state too, in eviction order; 2, rows and state in
 * any order (the caller's sink does not observe it: the tier's record writer). */
static inline int cn_table_evict_lowest(cn_table *t, int64_t k, int64_t n_live, int want_rows, cn_evicted *ev,
                                        int64_t reserve_total) {
    memset(ev, 0, sizeof(*ev));
    cn_victim *victims = (cn_victim *)malloc((size_t)(k > 0 ? k : 1) * sizeof(cn_victim));
    /* want_rows 2: the rows in any order (a tier's writer), so the victims are not sorted. */
    int shift = t->bound.lfu_halve_shift;
    if (shift <= CN_LFU_AUTO(0))
        shift = cn_evict_auto_shift(t->step, t->bound.max_rows, t->index.size, t->n_evicted, CN_LFU_AUTO(0) - shift);
    const cn_evict_rule rule = {t->bound.policy, shift, t->step};
    if (victims == NULL || cn_evict_select(&t->arena, rule, k, n_live, victims, want_rows == 1) != 0) {
        free(victims);
        return CN_ENOMEM;
    }
    int rc = cn_table_take_victims(t, victims, k, want_rows, ev, reserve_total);
    free(victims);
    return rc;
}

/* Scratch bytes of cn_distinct_keys over up to n keys: an open-addressing set of at least 2n
 * entries (8 bytes each and an occupancy byte). */
static inline size_t cn_distinct_scratch(int64_t n) { return (size_t)cn_pow2_at_least(2 * n) * 9; }

/* The distinct keys among keys[0..n) (only those with slots[i] == -1 when slots is given) into
 * out when given (first seen first); returns how many. scratch: cn_distinct_scratch(m) bytes for
 * the m keys considered (the caller's, so that a caller can reuse it afterwards). A batch-sized
 * set that stays in L2, where an index of the whole table would not. */
static inline int64_t cn_distinct_keys(const int64_t *keys, const int64_t *slots, int64_t n, int64_t m,
                                       int64_t *out, void *scratch) {
    const uint64_t cap = (uint64_t)cn_pow2_at_least(2 * m), mask = cap - 1;
    int64_t *set = (int64_t *)scratch;
    uint8_t *used = (uint8_t *)(set + cap);
    memset(used, 0, cap);
    int64_t distinct = 0;
    for (int64_t i = 0; i < n; i++) {
        if (slots != NULL && slots[i] != -1) continue;
        uint64_t h = cn_hash_key(keys[i]) & mask;
        while (used[h] && set[h] != keys[i]) h = (h + 1) & mask;
        if (!used[h]) {
            used[h] = 1;
            set[h] = keys[i];
            if (out != NULL) out[distinct] = keys[i];
            distinct++;
        }
    }
    return distinct;
}

/* Distinct keys among those with slots[i] == -1; -1 when out of memory. */
static inline int64_t cn_count_distinct_missing(const int64_t *keys, const int64_t *slots, int64_t n) {
    int64_t n_missing = 0;
    for (int64_t i = 0; i < n; i++) n_missing += slots[i] == -1;
    if (n_missing <= 1) return n_missing;
    void *scratch = malloc(cn_distinct_scratch(n_missing));
    if (scratch == NULL) return -1;
    const int64_t distinct = cn_distinct_keys(keys, slots, n, n_missing, NULL, scratch);
    free(scratch);
    return distinct;
}

/* Overflow of a training lookup whose distinct keys exceed the budget: of the call's distinct
 * keys without a row (slots -1), the first `room` in order of first occurrence keep -1 (they
 * get rows); every occurrence of the others becomes -2 (the caller turns them back into -1
 * after the inserts: they read as keys without a row and take no update, as keys admission
 * refuses do). Returns the keys kept, or -1 when out of memory (slots unchanged). First
 * occurrence, not frequency in the batch, decides: one pass, and the same keys whatever the
 * policy, so a model of the table can say which. */
static inline int64_t cn_table_mark_overflow(const int64_t *keys, int64_t *slots, int64_t n, int64_t room) {
    int64_t m = 0;
    for (int64_t i = 0; i < n; i++) m += slots[i] == -1;
    const uint64_t cap = (uint64_t)cn_pow2_at_least(2 * (m > 0 ? m : 1)), mask = cap - 1;
    int64_t *set = (int64_t *)malloc((size_t)cap * (2 * sizeof(int64_t) + 1));
    if (set == NULL) return -1;
    int64_t *ordinal = set + cap;
    uint8_t *used = (uint8_t *)(ordinal + cap);
    memset(used, 0, cap);
    int64_t distinct = 0;
    for (int64_t i = 0; i < n; i++) {
        if (slots[i] != -1) continue;
        uint64_t h = cn_hash_key(keys[i]) & mask;
        while (used[h] && set[h] != keys[i]) h = (h + 1) & mask;
        if (!used[h]) {
            used[h] = 1;
            set[h] = keys[i];
            ordinal[h] = distinct++;
        }
        if (ordinal[h] >= room) slots[i] = -2;
    }
    free(set);
    return distinct < room ? distinct : room;
}

/* Before inserting the absent keys of a call (slots < 0 after a find) into a table with a row
 * budget: if they would take it past max_rows, evict the lowest-scoring rows the call does not
 * use, down to the low-water mark after the inserts (fewer when the call's own rows leave too
 * few candidates). The call's rows are kept out of the selection by clearing their live bits
 * for its duration. When the call's distinct keys alone exceed max_rows: with overflow (a
 * training lookup), one round of eviction frees rows down to the low-water mark and at least
 * one row (fewer when the call's own rows leave too few candidates), the new keys take the free rows in order of
 * first occurrence and the rest get no row (cn_table_mark_overflow), so training never stops
 * on the budget; without it (an explicit insert, whose rows the caller means to keep),
 * CN_EFULL. A table with fallback rows (cn_table_core.h) takes that one round whenever a
 * training lookup must evict, however few its new keys: the keys left without a row still
 * learn, in their fallback rows, so one round a call bounds the churn (rows inserted to be
 * evicted a call later, their training lost) where evicting room for every new key let a
 * batch's tail flush the table each call. CN_EFULL and CN_ENOMEM leave the table unchanged. */
static inline int cn_table_make_room(cn_table *t, const int64_t *keys, int64_t n, int64_t *slots,
                                     int want_rows, cn_evicted *ev, int overflow) {
    memset(ev, 0, sizeof(*ev));
    if (t->bound.max_rows <= 0) return CN_OK;
    int64_t n_new = cn_count_distinct_missing(keys, slots, n);
    if (n_new < 0) return CN_ENOMEM;
    const int64_t size = t->index.size;
    if (size + n_new <= t->bound.max_rows) return CN_OK;
    int64_t pinned = 0;
    for (int64_t i = 0; i < n; i++)
        if (slots[i] >= 0) pinned += cn_arena_set_live(&t->arena, slots[i], 0);
    int rc = CN_EFULL;
    int64_t k = -1;
    if (overflow && (pinned + n_new > t->bound.max_rows || t->bound.fallback_rows > 0)) {
        /* One round of eviction, down to the low-water mark and at least one row (never the
         * call's own rows), as a call within the budget makes it: a batch too big for the table
         * does not flush the rows the policy ranks above its new keys (LFU's popular rows), and
         * with headroom 0 new keys still get in. */
        k = size - t->bound.low_water;
        if (k < size + 1 - t->bound.max_rows) k = size + 1 - t->bound.max_rows;
        if (k > size - pinned) k = size - pinned;
        if (k < 0) k = 0;
        n_new = cn_table_mark_overflow(keys, slots, n, t->bound.max_rows - size + k);
        if (n_new < 0) rc = CN_ENOMEM;
        else if (k == 0) rc = CN_OK;
    }
    if (n_new >= 0 && k != 0 && pinned + n_new <= t->bound.max_rows) {
        if (k < 0) {
            k = size + n_new - t->bound.low_water;
            if (k > size - pinned) k = size - pinned;
        }
        rc = cn_table_evict_lowest(t, k, size - pinned, want_rows, ev, size + n_new - k);
    }
    for (int64_t i = 0; i < n; i++)
        if (slots[i] >= 0) cn_arena_set_live(&t->arena, slots[i], 1);
    return rc;
}

/* Explicit evictions: the k lowest-scoring rows (all rows are candidates), or, for TTL, every
 * expired row. */
static inline int cn_table_evict(cn_table *t, int64_t k, int want_rows, cn_evicted *ev) {
    if (k > t->index.size) k = t->index.size;
    return cn_table_evict_lowest(t, k, t->index.size, want_rows, ev, -1);
}

static inline int cn_table_evict_expired(cn_table *t, int want_rows, cn_evicted *ev) {
    return cn_table_evict(t, cn_evict_count_expired(&t->arena, t->step, t->bound.ttl), want_rows, ev);
}

/* Evict the given keys (those present; duplicates once), in the order given: evict_if's verb. */
static inline int cn_table_evict_keys(cn_table *t, const int64_t *keys, int64_t n, int want_rows, cn_evicted *ev) {
    memset(ev, 0, sizeof(*ev));
    cn_victim *victims = (cn_victim *)malloc((size_t)(n > 0 ? n : 1) * sizeof(cn_victim));
    if (victims == NULL) return CN_ENOMEM;
    int64_t k = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t s = cn_index_find(&t->index, keys[i]);
        if (s >= 0 && cn_arena_set_live(&t->arena, s, 0)) victims[k++].slot = s;
    }
    for (int64_t j = 0; j < k; j++) cn_arena_set_live(&t->arena, victims[j].slot, 1);
    int rc = cn_table_take_victims(t, victims, k, want_rows, ev, -1);
    free(victims);
    return rc;
}

#endif /* CN_TABLE_BOUNDED_H */

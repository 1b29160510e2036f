/* cn_table.h: one embedding table = key index + row arena + initialiser + optimizer state,
 * and the batch verbs over it (its parts and inserts: cn_table_core.h; eviction:
 * cn_table_bounded.h). Every function here runs without the GIL.
 *
 * Errors are return codes (CN_OK, CN_ENOMEM); a verb that fails leaves the table as it was:
 * all allocation (index rehash, new pages) happens before the first entry changes.
 *
 * Thread safety: the caller holds `lock` for reading (find, contains, export, lookups that do
 * not insert) or for writing (everything that inserts, erases, assigns or updates rows).
 */
#ifndef CN_TABLE_H
#define CN_TABLE_H

#include "cn_table_bounded.h"

/* The slots a caller found (under a lock it holds since: a tier's fault-in) as a lookup's
 * slots: copied into slots after checking that each is a live slot; a key given -1 (one the
 * caller brought in after its find: a tier's disk rows, ~9% of a Zipf 1.05 step's IDs) is found
 * here. CN_EBADSLOT when a slot is not live or such a key has no row. A live-bit test reads 1
 * bit a slot (14 KiB for 109k rows); checking the key stored at the slot instead would be a
 * cache miss an ID, as costly as the find it replaces. Finding the -1 keys here replaced a map
 * from the loaded rows back to the IDs in NumPy (searchsorted, gather, scatter: 0.13 ms a 3x
 * Zipf 1.05 step). */
/* cn_table_take_found's cursor: prefetch the bucket of the next key from *ahead on whose found
 * slot is -1, and move *ahead past it (to n when there is none). */
static inline void cn_take_found_prefetch_next(const cn_table *t, const int64_t *keys, const int64_t *found,
                                               int64_t n, int64_t *ahead) {
    for (int64_t i = *ahead; i < n; i++)
        if (found[i] == -1) {
            cn_index_prefetch(&t->index, keys[i]);
            *ahead = i + 1;
            return;
        }
    *ahead = n;
}

static inline int cn_table_take_found(const cn_table *t, const int64_t *keys, const int64_t *found, int64_t n,
                                      int64_t *slots) {
    /* The -1 keys' buckets are prefetched CN_PREFETCH_DISTANCE such keys ahead: a cursor runs
     * ahead over found[] to the next -1 key each time one is found. A pooled lookup of 16k Zipf
     * 1.05 IDs of a 109k-row table, 9% of them -1, 8 MiB written between calls (one thread,
     * minimum of 15 rounds of 20 batches, three alternated runs): 0.230-0.241 -> 0.224-0.225 ms. */
    /* An unbounded table keeps no live bits (cn_arena.h: key_offset 0): its live slots are those
     * below the high-water mark, past its fallback rows and not on the free stack, which a bitmap
     * of the free slots answers (none is needed while nothing was erased). */
    const int64_t hw = t->arena.high_water;
    const int has_bits = t->arena.key_offset != 0;
    uint64_t *freed = NULL;
    if (!has_bits && t->arena.n_free > 0) {
        freed = (uint64_t *)calloc((size_t)((hw + 63) / 64), sizeof(uint64_t));
        if (freed == NULL) return CN_ENOMEM;
        for (int64_t k = 0; k < t->arena.n_free; k++) {
            const int64_t f = t->arena.free_slots[k];
            freed[f >> 6] |= (uint64_t)1 << (f & 63);
        }
    }
    int rc = CN_OK;
    int64_t ahead = 0;
    for (int primed = 0; primed < CN_PREFETCH_DISTANCE; primed++) cn_take_found_prefetch_next(t, keys, found, n, &ahead);
    for (int64_t i = 0; i < n && rc == CN_OK; i++) {
        int64_t s = found[i];
        if (s == -1) {
            cn_take_found_prefetch_next(t, keys, found, n, &ahead);
            s = cn_index_find(&t->index, keys[i]);
            if (s < 0) rc = CN_EBADSLOT;
        } else if (s < 0 || s >= hw) {
            rc = CN_EBADSLOT;
        } else if (has_bits ? !(*cn_arena_live_word(&t->arena, s) >> (s & 63) & 1)
                            : s < t->bound.fallback_rows || (freed && (freed[s >> 6] >> (s & 63) & 1))) {
            rc = CN_EBADSLOT;
        }
        if (rc == CN_OK) slots[i] = s;
    }
    free(freed);
    return rc;
}

/* slots[i] = the slot of keys[i]; with insert, the keys not yet present are inserted (and
 * initialised), after making room in a bounded table (rows evicted into ev). With admit (a
 * training lookup) and admission configured, only the keys admitted by the sketch are
 * inserted (cn_admit.h), and in a bounded table the keys past the budget's room overflow
 * (cn_table_make_room); the others keep slot -1. found[i] (may be NULL) = 1 if keys[i] was
 * present before the call. Duplicate keys in one batch share one new row. *n_new receives the
 * number of rows inserted. */
static inline int cn_table_resolve(cn_table *t, const int64_t *keys, int64_t n, int64_t *slots, uint8_t *found,
                                   int insert, int admit, int want_rows, cn_evicted *ev, int64_t *n_new) {
    *n_new = 0;
    memset(ev, 0, sizeof(*ev));
    cn_table_find(t, keys, n, slots);
    if (found)
        for (int64_t i = 0; i < n; i++) found[i] = slots[i] >= 0;
    if (!insert) return CN_OK;
    const int gate = admit && t->admit.min_count > 0;
    const int draw = admit && t->bound.admit_threshold > 0;
    if (draw)
        for (int64_t i = 0; i < n; i++)
            if (slots[i] < 0 && !cn_admit_draw(t->bound.admit_seed, t->bound.admit_threshold, keys[i])) slots[i] = -2;
    if (gate) {
        for (int64_t i = 0; i < n; i++) { /* counters are random lines of a table of MiBs: prefetch */
            if (i + CN_PREFETCH_DISTANCE < n && slots[i + CN_PREFETCH_DISTANCE] < 0)
                cn_admit_prefetch(&t->admit, keys[i + CN_PREFETCH_DISTANCE]);
            if (slots[i] < 0) cn_admit_add(&t->admit, keys[i], 1);
        }
        for (int64_t i = 0; i < n; i++)
            if (slots[i] < 0 && cn_admit_estimate(&t->admit, keys[i]) < t->admit.min_count) slots[i] = -2;
    }
    int rc = cn_table_make_room(t, keys, n, slots, want_rows, ev, admit);
    if (rc == CN_OK) rc = cn_table_insert_missing(t, keys, n, slots, n_new);
    if (gate || draw || (admit && t->bound.max_rows > 0))
        for (int64_t i = 0; i < n; i++) {
            if (gate && rc != CN_OK && slots[i] < 0) cn_admit_add(&t->admit, keys[i], -1);
            if (slots[i] == -2) slots[i] = -1;
        }
    return rc;
}

/* A pooled lookup's keys without a row of their own (slots < 0 after cn_table_resolve) take
 * their fallback rows (cn_table_core.h, Fallback Rows); nothing changes without them. */
static inline void cn_table_use_fallback(const cn_table *t, const int64_t *keys, int64_t n, int64_t *slots) {
    if (t->bound.fallback_rows <= 0 || t->bound.fallback_residual) return;
    for (int64_t i = 0; i < n; i++)
        if (slots[i] < 0) slots[i] = cn_table_fallback_slot(t, keys[i]);
}

/* Residual fallback rows (cn_table_core.h): a key's two occurrences, its own slot (< 0: none,
 * read as zeros) at 2i and its fallback slot at 2i + 1, from the n slots cn_table_resolve gave. */
static inline void cn_table_residual_slots(const cn_table *t, const int64_t *keys, const int64_t *own, int64_t n,
                                           int64_t *out) {
    for (int64_t i = 0; i < n; i++) {
        out[2 * i] = own[i];
        out[2 * i + 1] = cn_table_fallback_slot(t, keys[i]);
    }
}

/* Pool one feature's bags over slots resolved by cn_table_resolve; slots < 0 read as zero
 * rows, or as the key's initial row with the bound's absent_initial. Access counts are recorded by the backward (cn_grad.h), once per distinct row, not
 * here once per key. */
static inline void cn_table_pool(const cn_table *t, const int64_t *keys, const int64_t *offsets, int64_t n_bags,
                                 const float *weights, int mode, float *out, int64_t ld_out, int64_t *argmax,
                                 const int64_t *slots) {
    cn_pool_args p = {&t->arena, t->dim, offsets, weights, mode, out, ld_out, argmax,
                      t->bound.absent_initial ? &t->init : NULL, keys, t->row_dtype};
    const int64_t work = offsets[n_bags] + n_bags;
    cn_pool_forward(&p, n_bags, slots, cn_threads_unless_asleep(work, CN_LOOKUP_MIN_TO_WAKE));
}

/* Threads for the fused backward (cn_grad_apply) of a lookup of n_keys keys: cn_threads_for(4 n)
 * (its passes do about four times a find's work a key), except that under CN_LOOKUP_MIN_TO_WAKE
 * keys it stays on the calling thread while the workers sleep, as the lookup itself does. A
 * training step of 4096 IDs at pooling 1 ran its forward on the calling thread and then woke a
 * worker for the backward's four passes. Measured (Intel Xeon guest, 2 cores, other jobs at
 * load 4.7-5.4; backward alone, 4096 Zipf 1.05 IDs, row-wise Adagrad, runs alternated in one
 * process, medians of 25 / 190): 8M x 64 after a flushed forward, 1420 us on one thread against
 * 6861 on two; a 1,000-row store (rows cached) 182 against 628 (p10 163 against 206). With the
 * workers already awake (a 40,000-key find just before), two threads took what one does: 8M x 64
 * row-wise Adagrad 1221 against 1207 us, Adagrad 1289 against 1266 (load 4.4-4.8, medians of 21):
 * at 4096 keys the split saves nothing the wake-up does not cost. The result is the same on any
 * thread count (cn_grad.h). */
static inline int cn_grad_threads(int64_t n_keys) {
    return cn_threads_unless_asleep(n_keys * 4, (int64_t)CN_LOOKUP_MIN_TO_WAKE * 4);
}

/* Remove keys; erased[i] (may be NULL) = 1 where keys[i] was removed by this call, *count the
 * number removed. Room on the free stack for every key is taken first: CN_ENOMEM leaves the
 * table unchanged. */
static inline int cn_table_erase(cn_table *t, const int64_t *keys, int64_t n, uint8_t *erased, int64_t *count) {
    *count = 0;
    if (cn_arena_reserve_free(&t->arena, n, &t->nbytes) != 0) return CN_ENOMEM;
    for (int64_t i = 0; i < n; i++) {
        int64_t s = cn_index_erase(&t->index, keys[i]);
        if (s >= 0) {
            cn_arena_release_slot(&t->arena, s);
            if (t->arena.key_offset) cn_arena_set_live(&t->arena, s, 0);
            (*count)++;
        }
        if (erased) erased[i] = s >= 0;
    }
    if (*count) {
        t->erase_epoch = cn_next_stamp();
        t->version = cn_next_stamp();
    }
    return CN_OK;
}

/* Halve every admission counter (cn_admit.h). */
static inline void cn_table_decay_admission(cn_table *t) {
    if (t->admit.min_count) cn_admit_decay(&t->admit);
}

static inline void cn_table_clear(cn_table *t) {
    memset(t->index.buckets, 0xff, (size_t)t->index.n_buckets * sizeof(cn_bucket));
    t->index.size = 0;
    cn_arena_reset(&t->arena);
    cn_table_reset_fallback(t); /* the fallback rows start over too, at their initial values */
    t->erase_epoch = cn_next_stamp();
    t->version = cn_next_stamp();
}

/* Whether the slots of a lookup may still be used on this table; the caller holds the lock
 * and keeps holding it while it uses them (a check made before taking the lock raced an
 * erase). CN_ESTALE: keys were erased (or the table cleared) since the lookup, or the lookup
 * was made on another table. CN_EBADSLOT: a slot this table never handed out (a forged or
 * damaged context); -1 (a key an evaluation lookup did not find) is allowed. */
static inline int cn_table_check_slots(const cn_table *t, uint64_t erase_epoch, const int64_t *slots, int64_t n) {
    if (erase_epoch != t->erase_epoch) return CN_ESTALE;
    const int64_t hw = t->arena.high_water;
    int bad = 0;
    for (int64_t i = 0; i < n; i++) bad |= (slots[i] < -1) | (slots[i] >= hw);
    return bad ? CN_EBADSLOT : CN_OK;
}

/* Copy rows (dim floats each, row stride ld_rows) and, if given, optimizer state
 * (state_floats each) into the rows at `slots`, in order: for duplicate slots the last wins. */
static inline void cn_table_write_rows(cn_table *t, const int64_t *slots, int64_t n, const float *rows,
                                       int64_t ld_rows, const float *state, int64_t ld_state) {
    for (int64_t i = 0; i < n; i++) {
        if (slots[i] < 0) continue;
        cn_row_store_of_level(t->row_dtype, rows + i * ld_rows, cn_arena_row(&t->arena, slots[i]), t->dim);
        if (state && t->state_floats)
            memcpy(cn_table_state(t, slots[i]), state + i * ld_state, (size_t)t->state_floats * sizeof(float));
    }
}

static inline void cn_table_write_meta(cn_table *t, const int64_t *slots, int64_t n, const uint32_t *counts,
                                       const uint32_t *last_steps) {
    for (int64_t i = 0; i < n; i++) {
        if (slots[i] < 0) continue;
        cn_meta *m = cn_arena_meta(&t->arena, slots[i]);
        if (counts) m->count = counts[i];
        if (last_steps) m->last_step = last_steps[i];
    }
}

typedef struct {
    const cn_table *t;
    const int64_t *slots;
    float *rows, *state;
    uint32_t *counts, *last_steps;
} cn_gather_job;

static void cn_table_gather_range(void *ctx, int64_t begin, int64_t end) {
    const cn_gather_job *j = (const cn_gather_job *)ctx;
    const cn_table *t = j->t;
    const int64_t *slots = j->slots;
    float *rows = j->rows, *state = j->state;
    uint32_t *counts = j->counts, *last_steps = j->last_steps;
    const int64_t dim = t->dim, sf = t->state_floats;
    for (int64_t i = begin; i < end; i++) {
        const int64_t s = slots[i];
        if (s < 0) {
            if (rows) memset(rows + i * dim, 0, (size_t)dim * sizeof(float));
            if (state && sf) memset(state + i * sf, 0, (size_t)sf * sizeof(float));
            if (counts) counts[i] = 0;
            if (last_steps) last_steps[i] = 0;
            continue;
        }
        if (rows) cn_row_load_of_level(t->row_dtype, cn_arena_row(&t->arena, s), rows + i * dim, dim);
        if (state && sf) memcpy(state + i * sf, cn_table_state(t, s), (size_t)sf * sizeof(float));
        const cn_meta *m = cn_arena_meta(&t->arena, s);
        if (counts) counts[i] = m->count;
        if (last_steps) last_steps[i] = m->last_step;
    }
}

/* Gather rows / state / metadata of `slots` (slot < 0 gives zeros). Any output may be NULL. */
static inline void cn_table_gather(const cn_table *t, const int64_t *slots, int64_t n, float *rows,
                                   float *state, uint32_t *counts, uint32_t *last_steps) {
    cn_gather_job job = {t, slots, rows, state, counts, last_steps};
    cn_parallel_for(cn_table_gather_range, &job, n, cn_threads_for(n * t->dim / 16));
}

/* -1 if offsets[0..n_bags] is a valid CSR over n_keys keys (starts at 0, never decreases,
 * ends at n_keys), else the first position that breaks it. */
static inline int64_t cn_check_offsets(const int64_t *offsets, int64_t n_bags, int64_t n_keys) {
    if (offsets[0] != 0) return 0;
    for (int64_t b = 0; b < n_bags; b++)
        if (offsets[b + 1] < offsets[b]) return b + 1;
    if (offsets[n_bags] != n_keys) return n_bags;
    return -1;
}

/* Walk the index from bucket `cursor`, collecting up to max_n (key, slot) pairs. Returns the
 * cursor to continue from (n_buckets when done). */
static inline int64_t cn_table_scan(const cn_table *t, int64_t cursor, int64_t max_n, int64_t *keys,
                                    int64_t *slots, int64_t *n_out) {
    int64_t k = 0;
    const cn_bucket *b = t->index.buckets;
    while (cursor < t->index.n_buckets && k < max_n) {
        if (b[cursor].slot >= 0) {
            keys[k] = b[cursor].key;
            slots[k] = b[cursor].slot;
            k++;
        }
        cursor++;
    }
    *n_out = k;
    return cursor;
}

#endif

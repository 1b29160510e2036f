/* cn_table.h: one embedding table = key index + row arena + initialiser + optimizer state,
 * and the batch verbs over it. Every function here runs without the GIL.
 *
 * Errors are return codes (CN_OK, CN_ENOMEM); a verb that fails leaves the table as it was:
 * all allocation (index rehash, new pages) happens before the first entry changes.
 *
 * Thread safety: the caller holds `lock` for reading (find, contains, export, lookups that do
 * not insert) or for writing (everything that inserts, erases, assigns or updates rows).
 */
#ifndef CN_TABLE_H
#define CN_TABLE_H

#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include "cn_alloc.h"
#include "cn_arena.h"
#include "cn_grad.h"
#include "cn_index.h"
#include "cn_init.h"
#include "cn_optim.h"
#include "cn_parallel.h"
#include "cn_pool.h"

enum { CN_OK = 0, CN_ENOMEM = -1, CN_ESTALE = -2, CN_EBADSLOT = -3 };

/* Process-wide stamps for erase epochs and versions. A table takes a fresh stamp whenever
 * its epoch or version changes, so no two tables ever share a value: a lookup context made on
 * one table (or on the same module's table before a move between devices, which builds a new
 * one) can never pass the check on another, which equal per-table counters allowed. */
static uint64_t cn_stamp_counter = 0;

static inline uint64_t cn_next_stamp(void) { return __atomic_add_fetch(&cn_stamp_counter, 1, __ATOMIC_RELAXED); }

typedef struct {
    cn_index index;
    cn_arena arena;
    int64_t dim;
    int64_t state_floats; /* optimizer-state floats per row */
    int state_in_meta;    /* 1: the (single) state float lives in the row's metadata */
    float state_init; /* initial value of every optimizer-state float of a new row */
    cn_init init;
    double max_load;
    int64_t nbytes;
    int64_t step;
    uint64_t erase_epoch; /* a fresh stamp whenever a slot may have been freed: stale slots are refused */
    uint64_t version;     /* a fresh stamp whenever the set of keys or their bucket order changes */
    pthread_rwlock_t lock;
} cn_table;

static inline int cn_table_create(cn_table *t, int64_t dim, int optimizer_kind, float state_init,
                                  cn_init init, double max_load, int64_t capacity_hint) {
    memset(t, 0, sizeof(*t));
    t->dim = dim;
    t->state_floats = cn_optim_state_floats(optimizer_kind, dim);
    t->state_in_meta = cn_optim_state_in_meta(optimizer_kind);
    t->state_init = state_init;
    t->init = init;
    t->max_load = max_load;
    t->erase_epoch = cn_next_stamp();
    t->version = cn_next_stamp();
    if (capacity_hint < 0 || capacity_hint > CN_INDEX_MAX_BUCKETS ||
        (double)capacity_hint * (4.0 * (double)(dim + t->state_floats) + 16.0 + 16.0 / max_load) > cn_machine_bytes())
        return CN_ENOMEM;
    cn_arena_init(&t->arena, dim + (t->state_in_meta ? 0 : t->state_floats), t->state_in_meta, capacity_hint);
    if (cn_index_init(&t->index, cn_index_buckets_for(capacity_hint, max_load), &t->nbytes) != 0) return CN_ENOMEM;
    if (cn_arena_reserve(&t->arena, capacity_hint, &t->nbytes) != 0) {
        cn_arena_free(&t->arena, &t->nbytes);
        cn_index_free(&t->index, &t->nbytes);
        return CN_ENOMEM;
    }
    pthread_rwlock_init(&t->lock, NULL);
    return CN_OK;
}

static inline void cn_table_destroy(cn_table *t) {
    cn_arena_free(&t->arena, &t->nbytes);
    cn_index_free(&t->index, &t->nbytes);
    pthread_rwlock_destroy(&t->lock);
}

/* Rows the table holds before its index must grow. */
static inline int64_t cn_table_capacity(const cn_table *t) {
    return (int64_t)(t->max_load * (double)t->index.n_buckets);
}

/* Bytes that growing from the current size to `total` rows would allocate at most (new rows
 * with their metadata, and a new index if the current one is too small). */
static inline double cn_table_growth_bytes(const cn_table *t, int64_t total) {
    double more = (double)(total - t->index.size);
    double rows = more > 0 ? more * (double)(t->arena.row_bytes + t->arena.meta_bytes) : 0.0;
    double index = total > cn_table_capacity(t) ? 16.0 * ((double)total / t->max_load) : 0.0;
    return rows + index;
}

/* Room for `total` rows in all, allocated now. The rows come first and the index second, and
 * a failed index rehash gives the new pages back: a refused reserve leaves the table exactly
 * as it was (capacity included), where the reverse order left a grown index behind. */
static inline int cn_table_reserve(cn_table *t, int64_t total) {
    if (total < 0 || total > CN_INDEX_MAX_BUCKETS || cn_table_growth_bytes(t, total) > cn_machine_bytes())
        return CN_ENOMEM;
    const int64_t pages_before = t->arena.n_pages;
    int64_t more = total - t->index.size;
    if (more > 0 && cn_arena_reserve(&t->arena, more, &t->nbytes) != 0) return CN_ENOMEM;
    if (total > cn_table_capacity(t)) {
        int64_t n_buckets = cn_index_buckets_for(total, t->max_load);
        if (n_buckets < 0 || cn_index_rehash(&t->index, n_buckets, &t->nbytes) != 0) {
            cn_arena_trim(&t->arena, pages_before, &t->nbytes);
            return CN_ENOMEM;
        }
        t->version = cn_next_stamp();
    }
    return CN_OK;
}

/* The optimizer state of a row: after the embedding, or in the metadata (cn_optim.h). */
static inline float *cn_table_state(const cn_table *t, int64_t slot) {
    return t->state_in_meta ? &cn_arena_meta(&t->arena, slot)->scalar_state : cn_arena_row(&t->arena, slot) + t->dim;
}

static inline void cn_table_init_row(const cn_table *t, int64_t slot, int64_t key) {
    float *row = cn_arena_row(&t->arena, slot);
    cn_init_row(&t->init, key, row, t->dim);
    cn_meta *m = cn_arena_meta(&t->arena, slot);
    m->count = 0;
    m->last_step = 0;
    float *st = cn_table_state(t, slot);
    for (int64_t j = 0; j < t->state_floats; j++) st[j] = t->state_init;
}

static inline void cn_table_find(const cn_table *t, const int64_t *keys, int64_t n, int64_t *slots) {
    cn_index_find_batch(&t->index, keys, n, slots, cn_threads_for(n));
}

/* Insert the keys whose slots[i] < 0 (after a find), initialise their rows, and fill in their
 * slots. Duplicates share one new row. *n_new = rows inserted.
 * All allocation happens first: on CN_ENOMEM the table is unchanged. */
static inline int cn_table_insert_missing(cn_table *t, const int64_t *keys, int64_t n, int64_t *slots,
                                          int64_t *n_new) {
    *n_new = 0;
    int64_t n_missing = 0;
    for (int64_t i = 0; i < n; i++) n_missing += slots[i] < 0;
    if (n_missing == 0) return CN_OK;
    int64_t *missing = (int64_t *)malloc((size_t)n_missing * sizeof(int64_t));
    int64_t *new_pos = (int64_t *)malloc((size_t)n_missing * sizeof(int64_t));
    if (missing == NULL || new_pos == NULL || cn_table_reserve(t, t->index.size + n_missing) != CN_OK) {
        free(missing);
        free(new_pos);
        return CN_ENOMEM;
    }
    int64_t m = 0;
    for (int64_t i = 0; i < n; i++)
        if (slots[i] < 0) missing[m++] = i;

    /* Serial insertion: the index is not a concurrent structure. Buckets are prefetched ahead. */
    int64_t inserted = 0;
    for (int64_t j = 0; j < n_missing; j++) {
        if (j + CN_PREFETCH_DISTANCE < n_missing) cn_index_prefetch(&t->index, keys[missing[j + CN_PREFETCH_DISTANCE]]);
        const int64_t i = missing[j];
        int64_t pos;
        int64_t s = cn_index_probe(&t->index, keys[i], &pos);
        if (s < 0) { /* not a duplicate of a key inserted earlier in this batch */
            s = cn_arena_take_slot(&t->arena);
            cn_index_put_at(&t->index, pos, keys[i], s);
            new_pos[inserted++] = i;
        }
        slots[i] = s;
    }
    const int nthreads = cn_threads_for(inserted * t->dim / 16);
    CN_PARALLEL_FOR(nthreads)
    for (int64_t j = 0; j < inserted; j++) cn_table_init_row(t, slots[new_pos[j]], keys[new_pos[j]]);
    free(new_pos);
    free(missing);
    if (inserted) t->version = cn_next_stamp();
    *n_new = inserted;
    return CN_OK;
}

/* slots[i] = the slot of keys[i], inserting (and initialising) the keys not yet present.
 * found[i] (may be NULL) = 1 if keys[i] was present before the call. Duplicate keys in one
 * batch share one new row. *n_new receives the number of rows inserted. */
static inline int cn_table_find_or_insert(cn_table *t, const int64_t *keys, int64_t n, int64_t *slots,
                                          uint8_t *found, int64_t *n_new) {
    cn_table_find(t, keys, n, slots);
    if (found)
        for (int64_t i = 0; i < n; i++) found[i] = slots[i] >= 0;
    return cn_table_insert_missing(t, keys, n, slots, n_new);
}

/* The pooled lookup of one table. slots[] receives every key's slot. Training
 * (insert_missing) inserts absent keys first; evaluation reads absent keys (slot -1) as zero
 * rows and changes nothing. Access counts are recorded by the backward (cn_grad.h), once per
 * distinct row, not here once per key. */
static inline int cn_table_pooled_forward(cn_table *t, const int64_t *keys, const int64_t *offsets, int64_t n_bags,
                                          const float *weights, int mode, float *out, int64_t ld_out,
                                          int64_t *argmax, int64_t *slots, int insert_missing, int64_t *n_new) {
    const int64_t n = offsets[n_bags];
    *n_new = 0;
    cn_table_find(t, keys, n, slots);
    if (insert_missing) {
        int rc = cn_table_insert_missing(t, keys, n, slots, n_new);
        if (rc != CN_OK) return rc;
    }
    cn_pool_args p = {&t->arena, t->dim, offsets, weights, mode, out, ld_out, argmax};
    cn_pool_forward(&p, n_bags, slots, cn_threads_for(n + n_bags));
    return CN_OK;
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

static inline void cn_table_clear(cn_table *t) {
    memset(t->index.buckets, 0xff, (size_t)t->index.n_buckets * sizeof(cn_bucket));
    t->index.size = 0;
    cn_arena_reset(&t->arena);
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
        float *r = cn_arena_row(&t->arena, slots[i]);
        memcpy(r, rows + i * ld_rows, (size_t)t->dim * sizeof(float));
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

/* Gather rows / state / metadata of `slots` (slot < 0 gives zeros). Any output may be NULL. */
static inline void cn_table_gather(const cn_table *t, const int64_t *slots, int64_t n, float *rows,
                                   float *state, uint32_t *counts, uint32_t *last_steps) {
    const int64_t dim = t->dim, sf = t->state_floats;
    const int nthreads = cn_threads_for(n * dim / 16);
    CN_PARALLEL_FOR(nthreads)
    for (int64_t i = 0; i < n; i++) {
        const int64_t s = slots[i];
        if (s < 0) {
            if (rows) memset(rows + i * dim, 0, (size_t)dim * sizeof(float));
            if (state && sf) memset(state + i * sf, 0, (size_t)sf * sizeof(float));
            if (counts) counts[i] = 0;
            if (last_steps) last_steps[i] = 0;
            continue;
        }
        const float *r = cn_arena_row(&t->arena, s);
        if (rows) memcpy(rows + i * dim, r, (size_t)dim * sizeof(float));
        if (state && sf) memcpy(state + i * sf, cn_table_state(t, s), (size_t)sf * sizeof(float));
        const cn_meta *m = cn_arena_meta(&t->arena, s);
        if (counts) counts[i] = m->count;
        if (last_steps) last_steps[i] = m->last_step;
    }
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

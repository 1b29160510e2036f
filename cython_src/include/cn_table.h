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
#include "cn_admit.h"
#include "cn_alloc.h"
#include "cn_arena.h"
#include "cn_evict.h"
#include "cn_dtype.h"
#include "cn_global.h"
#include "cn_grad.h"
#include "cn_index.h"
#include "cn_init.h"
#include "cn_optim.h"
#include "cn_parallel.h"
#include "cn_pool.h"

enum { CN_OK = 0, CN_ENOMEM = -1, CN_ESTALE = -2, CN_EBADSLOT = -3, CN_EFULL = -4 };

/* A table's bound (cn_evict.h): policy NONE keeps no keys and never evicts; with a policy the
 * arena keeps keys and live bits, and with max_rows > 0 inserts evict down to low_water when
 * they would pass max_rows. Admission (cn_admit.h): min_count > 0 gates training inserts by
 * count, admit_threshold > 0 by a per-(seed, key) draw;
 * absent_initial: keys without a row read as their initial row in pooled lookups. */
typedef struct {
    int policy;
    int64_t max_rows;
    int64_t low_water;
    int64_t ttl;
    int lfu_halve_shift; /* LFU's aging: counts halve every 2^shift steps unused (cn_evict.h); -1: never */
    uint32_t min_count;
    int64_t sketch_width;
    int64_t sketch_depth;
    int absent_initial;
    uint64_t admit_threshold; /* admission by probability (cn_admit.h, cn_admit_draw): 0 = off */
    uint64_t admit_seed;
} cn_bound;

/* Rows a call evicted, copied out before their slots were reused (malloc'd; the caller frees
 * them with cn_evicted_free once it has handed them on). rows/state only when asked for. */
typedef struct {
    int64_t n;
    int64_t *keys;
    float *rows;
    float *state;
    uint32_t *counts;
    uint32_t *last_steps;
} cn_evicted;

static inline void cn_evicted_free(cn_evicted *ev) {
    free(ev->keys);
    free(ev->rows);
    free(ev->state);
    free(ev->counts);
    free(ev->last_steps);
    memset(ev, 0, sizeof(*ev));
}

/* Process-wide stamps for erase epochs and versions. A table takes a fresh stamp whenever
 * its epoch or version changes, so no two tables ever share a value: a lookup context made on
 * one table (or on the same module's table before a move between devices, which builds a new
 * one) can never pass the check on another, which equal per-table counters allowed. */
CN_GLOBAL uint64_t cn_stamp_counter; /* src/cn_globals.c */

static inline uint64_t cn_next_stamp(void) { return __atomic_add_fetch(&cn_stamp_counter, 1, __ATOMIC_RELAXED); }

typedef struct {
    cn_index index;
    cn_arena arena;
    int64_t dim;
    int row_dtype;        /* CN_ROW_F32, F16 or BF16 (cn_dtype.h): the embedding values' storage */
    int64_t emb_floats;   /* float32 slots the embedding values take in a row (dim for float32) */
    int64_t state_floats; /* optimizer-state floats per row */
    int state_in_meta;    /* 1: the (single) state float lives in the row's metadata */
    float state_init; /* initial value of every optimizer-state float of a new row */
    cn_init init;
    double max_load;
    int64_t nbytes;
    int64_t step;
    uint64_t erase_epoch; /* a fresh stamp whenever a slot may have been freed: stale slots are refused */
    uint64_t version;     /* a fresh stamp whenever the set of keys or their bucket order changes */
    cn_bound bound;
    cn_admit admit;
    int64_t n_evicted;    /* rows evicted so far (not erased: erase is the caller's own removal) */
    pthread_rwlock_t lock;
} cn_table;

static inline int cn_table_create(cn_table *t, int64_t dim, int optimizer_kind, float state_init,
                                  cn_init init, double max_load, int64_t capacity_hint, cn_bound bound,
                                  int row_dtype) {
    memset(t, 0, sizeof(*t));
    t->bound = bound;
    t->dim = dim;
    t->row_dtype = row_dtype;
    t->emb_floats = cn_dtype_row_floats(row_dtype, dim);
    t->state_floats = cn_optim_state_floats(optimizer_kind, dim);
    t->state_in_meta = cn_optim_state_in_meta(optimizer_kind);
    t->state_init = state_init;
    t->init = init;
    t->max_load = max_load;
    t->erase_epoch = cn_next_stamp();
    t->version = cn_next_stamp();
    if (capacity_hint < 0 || capacity_hint > CN_INDEX_MAX_BUCKETS ||
        (double)capacity_hint * (4.0 * (double)(t->emb_floats + t->state_floats) + 16.0 + 16.0 / max_load) >
            cn_machine_bytes())
        return CN_ENOMEM;
    cn_arena_init(&t->arena, t->emb_floats + (t->state_in_meta ? 0 : t->state_floats), t->state_in_meta, capacity_hint,
                  bound.policy != CN_EVICT_NONE);
    if (cn_index_init(&t->index, cn_index_buckets_for(capacity_hint, max_load), &t->nbytes) != 0) return CN_ENOMEM;
    if (cn_arena_reserve(&t->arena, capacity_hint, &t->nbytes) != 0 ||
        cn_admit_init(&t->admit, bound.min_count, bound.sketch_width, bound.sketch_depth, &t->nbytes) != 0) {
        cn_arena_free(&t->arena, &t->nbytes);
        cn_index_free(&t->index, &t->nbytes);
        return CN_ENOMEM;
    }
    pthread_rwlock_init(&t->lock, NULL);
    return CN_OK;
}

static inline void cn_table_destroy(cn_table *t) {
    cn_admit_free(&t->admit, &t->nbytes);
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
    double index = total > cn_table_capacity(t)
                       ? (double)sizeof(cn_bucket) * (double)cn_index_growth_buckets(&t->index, total, t->max_load,
                                                                                     t->bound.max_rows)
                       : 0.0;
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
        /* A table with a row budget grows its index to the budget's buckets at most: once full
         * it is exactly at its maximum load and never rehashes again (cn_index.h). */
        int64_t n_buckets = cn_index_growth_buckets(&t->index, total, t->max_load, t->bound.max_rows);
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
    return t->state_in_meta ? &cn_arena_meta(&t->arena, slot)->scalar_state
                            : cn_arena_row(&t->arena, slot) + t->emb_floats;
}

static inline void cn_table_init_row(const cn_table *t, int64_t slot, int64_t key) {
    float *row = cn_arena_row(&t->arena, slot);
    if (t->row_dtype == CN_ROW_F32) {
        cn_init_row(&t->init, key, row, t->dim);
    } else { /* drawn in float32, then rounded: a key's initial row is still a function of (seed, key) */
        float buf[256];
        float *tmp = t->dim <= 256 ? buf : (float *)malloc((size_t)t->dim * sizeof(float));
        if (tmp == NULL) { /* (dim > 256 and out of memory: zeros rather than garbage) */
            memset(row, 0, (size_t)t->emb_floats * sizeof(float));
        } else {
            cn_init_row(&t->init, key, tmp, t->dim);
            cn_row_store(t->row_dtype, tmp, row, t->dim);
            if (tmp != buf) free(tmp);
        }
    }
    cn_meta *m = cn_arena_meta(&t->arena, slot);
    m->count = 0;
    m->last_step = 0;
    float *st = cn_table_state(t, slot);
    for (int64_t j = 0; j < t->state_floats; j++) st[j] = t->state_init;
}

/* Keys (of a find) or keys + bags (of a pool) under which a lookup does not wake sleeping
 * workers (cn_threads_unless_asleep): a batch of 4096 IDs at pooling 1 or 2 runs on the calling
 * thread unless the workers are awake anyway. */
#ifndef CN_LOOKUP_MIN_TO_WAKE
#define CN_LOOKUP_MIN_TO_WAKE 16384
#endif

static inline void cn_table_find(const cn_table *t, const int64_t *keys, int64_t n, int64_t *slots) {
    cn_index_find_batch(&t->index, keys, n, slots, cn_threads_unless_asleep(n, CN_LOOKUP_MIN_TO_WAKE));
}

typedef struct {
    const cn_table *t;
    const int64_t *slots, *keys, *new_pos;
} cn_init_rows_job;

/* New rows are written where freed or fresh slots happen to be: a bounded table under a uniform
 * stream refills the slots its evictions freed, in score order, so every row (and its meta
 * line) is a cold line, read for ownership before it is written. Prefetching them for writing
 * CN_PREFETCH_DISTANCE rows ahead (and, in the insert loop, the key and live-bit lines of the
 * slots about to be taken) took a uniform bounded step from 17.0 to 12.5 ms (200k rows of dim 64,
 * 2M distinct IDs, 32k IDs a step, one thread; perf: row initialisation 17 % -> 12 % of it). */
static void cn_table_init_rows_range(void *ctx, int64_t begin, int64_t end) {
    const cn_init_rows_job *j = (const cn_init_rows_job *)ctx;
    const cn_arena *a = &j->t->arena;
    for (int64_t k = begin; k < end; k++) {
        if (k + CN_PREFETCH_DISTANCE < end) {
            const int64_t ahead = j->slots[j->new_pos[k + CN_PREFETCH_DISTANCE]];
            cn_prefetch_write(cn_arena_row(a, ahead), a->row_bytes);
            __builtin_prefetch(cn_arena_meta(a, ahead), 1, 3);
        }
        cn_table_init_row(j->t, j->slots[j->new_pos[k]], j->keys[j->new_pos[k]]);
    }
}

/* Insert the keys whose slots[i] == -1 (after a find; -2 marks a key admission held back),
 * initialise their rows, and fill in their slots. Duplicates share one new row. *n_new = rows inserted.
 * All allocation happens first: on CN_ENOMEM the table is unchanged. */
static inline int cn_table_insert_missing(cn_table *t, const int64_t *keys, int64_t n, int64_t *slots,
                                          int64_t *n_new) {
    *n_new = 0;
    int64_t n_missing = 0;
    for (int64_t i = 0; i < n; i++) n_missing += slots[i] == -1;
    if (n_missing == 0) return CN_OK;
    int64_t *missing = (int64_t *)malloc((size_t)n_missing * sizeof(int64_t));
    int64_t *new_pos = (int64_t *)malloc((size_t)n_missing * sizeof(int64_t));
    /* n_missing counts a key given twice twice; with a row budget the room is capped at it, which
     * holds the call's distinct keys (cn_table_make_room made sure or refused), so a batch of
     * duplicates does not grow the index past the budget's buckets. */
    int64_t total = t->index.size + n_missing;
    if (t->bound.max_rows > 0 && total > t->bound.max_rows)
        total = t->index.size > t->bound.max_rows ? t->index.size : t->bound.max_rows;
    if (missing == NULL || new_pos == NULL || cn_table_reserve(t, total) != CN_OK) {
        free(missing);
        free(new_pos);
        return CN_ENOMEM;
    }
    int64_t m = 0;
    for (int64_t i = 0; i < n; i++)
        if (slots[i] == -1) missing[m++] = i;

    /* Serial insertion: the index is not a concurrent structure. Buckets are prefetched ahead. */
    int64_t inserted = 0;
    for (int64_t j = 0; j < n_missing; j++) {
        if (j + CN_PREFETCH_DISTANCE < n_missing) {
            cn_index_prefetch(&t->index, keys[missing[j + CN_PREFETCH_DISTANCE]]);
            /* The key and live-bit lines of the slot taken that many inserts on (exact unless
             * a duplicate key comes between: then a line too far, harmless). */
            const int64_t later = t->arena.n_free - 1 - CN_PREFETCH_DISTANCE;
            if (t->arena.key_offset && later >= 0) {
                const int64_t slot = t->arena.free_slots[later];
                __builtin_prefetch(cn_arena_key(&t->arena, slot), 1, 3);
                __builtin_prefetch(cn_arena_live_word(&t->arena, slot), 1, 3);
            }
        }
        const int64_t i = missing[j];
        int64_t pos;
        int64_t s = cn_index_probe(&t->index, keys[i], &pos);
        if (s < 0) { /* not a duplicate of a key inserted earlier in this batch */
            s = cn_arena_take_slot(&t->arena);
            cn_index_put_at(&t->index, pos, keys[i], s);
            if (t->arena.key_offset) {
                *cn_arena_key(&t->arena, s) = keys[i];
                cn_arena_set_live(&t->arena, s, 1);
            }
            new_pos[inserted++] = i;
        }
        slots[i] = s;
    }
    cn_init_rows_job job = {t, slots, keys, new_pos};
    cn_parallel_for(cn_table_init_rows_range, &job, inserted, cn_threads_for(inserted * t->dim / 16));
    free(new_pos);
    free(missing);
    if (inserted) t->version = cn_next_stamp();
    *n_new = inserted;
    return CN_OK;
}

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
            cn_row_load(t->row_dtype, cn_arena_row(&t->arena, s), ev->rows + j * t->dim, t->dim);
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
    const cn_evict_rule rule = {t->bound.policy, t->bound.lfu_halve_shift, t->step};
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
 * CN_EFULL. CN_EFULL and CN_ENOMEM leave the table unchanged. */
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
    if (overflow && pinned + n_new > t->bound.max_rows) {
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
    int64_t ahead = 0;
    for (int primed = 0; primed < CN_PREFETCH_DISTANCE; primed++) cn_take_found_prefetch_next(t, keys, found, n, &ahead);
    for (int64_t i = 0; i < n; i++) {
        int64_t s = found[i];
        if (s == -1) {
            cn_take_found_prefetch_next(t, keys, found, n, &ahead);
            s = cn_index_find(&t->index, keys[i]);
            if (s < 0) return CN_EBADSLOT;
        } else if (s < 0 || s >= t->arena.high_water || !(*cn_arena_live_word(&t->arena, s) >> (s & 63) & 1)) {
            return CN_EBADSLOT;
        }
        slots[i] = s;
    }
    return CN_OK;
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
        cn_row_store(t->row_dtype, rows + i * ld_rows, cn_arena_row(&t->arena, slots[i]), t->dim);
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
        if (rows) cn_row_load(t->row_dtype, cn_arena_row(&t->arena, s), rows + i * dim, dim);
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

/* cn_table_core.h: one embedding table's parts and the verbs that bound nothing: the table
 * (key index + row arena + initialiser + optimizer state + bound), its creation, growth, the
 * initial rows, find, and the insert of missing keys. cn_table_bounded.h adds eviction on top;
 * cn_table.h the lookups, erase, gather and scan. Every function here runs without the GIL.
 *
 * Errors are return codes (CN_OK, CN_ENOMEM); a verb that fails leaves the table as it was:
 * all allocation (index rehash, new pages) happens before the first entry changes.
 *
 * Thread safety: the caller holds `lock` for reading (find, contains, export, lookups that do
 * not insert) or for writing (everything that inserts, erases, assigns or updates rows).
 */
#ifndef CN_TABLE_CORE_H
#define CN_TABLE_CORE_H

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
 * absent_initial: keys without a row read as their initial row in pooled lookups.
 * fallback_rows > 0 (Fallback Rows, below): that many shared rows outside the index, read and
 * trained by pooled lookups of keys without a row of their own; fallback_copy: a key's new row
 * starts as a copy of its fallback row's values rather than its initial row. */
typedef struct {
    int policy;
    int64_t max_rows;
    int64_t low_water;
    int64_t ttl;
    int lfu_halve_shift; /* LFU's aging: counts halve every 2^shift steps unused (cn_evict.h); -1: never;
                          * CN_LFU_AUTO(s) <= -2: every 2^s turnovers (cn_evict_auto_shift) */
    uint32_t min_count;
    int64_t sketch_width;
    int64_t sketch_depth;
    int absent_initial;
    uint64_t admit_threshold; /* admission by probability (cn_admit.h, cn_admit_draw): 0 = off */
    uint64_t admit_seed;
    int64_t fallback_rows;
    int fallback_copy;
    int fallback_residual; /* every key reads its own row (if any) plus its fallback row */
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

static inline void cn_table_reset_fallback(cn_table *t); /* Fallback Rows, below */

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
    if (capacity_hint < 0 || capacity_hint > CN_INDEX_MAX_BUCKETS || bound.fallback_rows < 0 ||
        bound.fallback_rows > CN_INDEX_MAX_BUCKETS ||
        (double)capacity_hint * (4.0 * (double)(t->emb_floats + t->state_floats) + 16.0 + 16.0 / max_load) +
                (double)bound.fallback_rows * (4.0 * (double)(t->emb_floats + t->state_floats) + 16.0) >
            cn_machine_bytes())
        return CN_ENOMEM;
    cn_arena_init(&t->arena, t->emb_floats + (t->state_in_meta ? 0 : t->state_floats), t->state_in_meta, capacity_hint,
                  bound.policy != CN_EVICT_NONE,
                  bound.policy != CN_EVICT_NONE && bound.max_rows > 0 ? bound.max_rows + bound.fallback_rows : 0);
    if (cn_index_init(&t->index, cn_index_buckets_for(capacity_hint, max_load), &t->nbytes) != 0) return CN_ENOMEM;
    if (cn_arena_reserve(&t->arena, capacity_hint + bound.fallback_rows, &t->nbytes) != 0 ||
        cn_admit_init(&t->admit, bound.min_count, bound.sketch_width, bound.sketch_depth, &t->nbytes) != 0) {
        cn_arena_free(&t->arena, &t->nbytes);
        cn_index_free(&t->index, &t->nbytes);
        return CN_ENOMEM;
    }
    cn_table_reset_fallback(t);
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

/* A row's values drawn by the initialiser for `key` (its metadata and state are left alone). */
static inline void cn_table_draw_row(const cn_table *t, int64_t slot, int64_t key) {
    float *row = cn_arena_row(&t->arena, slot);
    if (t->row_dtype == CN_ROW_F32) {
        cn_init_row_of_level(&t->init, key, row, t->dim);
    } else { /* drawn in float32, then rounded: a key's initial row is still a function of (seed, key) */
        float buf[256];
        float *tmp = t->dim <= 256 ? buf : (float *)malloc((size_t)t->dim * sizeof(float));
        if (tmp == NULL) { /* (dim > 256 and out of memory: zeros rather than garbage) */
            memset(row, 0, (size_t)t->emb_floats * sizeof(float));
        } else {
            cn_init_row_of_level(&t->init, key, tmp, t->dim);
            cn_row_store_of_level(t->row_dtype, tmp, row, t->dim);
            if (tmp != buf) free(tmp);
        }
    }
}

static inline void cn_table_fresh_meta(const cn_table *t, int64_t slot) {
    cn_meta *m = cn_arena_meta(&t->arena, slot);
    m->count = 0;
    m->last_step = 0;
    float *st = cn_table_state(t, slot);
    for (int64_t j = 0; j < t->state_floats; j++) st[j] = t->state_init;
}

/* Fallback Rows
 *
 * A table with bound.fallback_rows = N > 0 keeps N shared rows in slots [0, N) of its arena,
 * taken at creation (and again by clear), never in the index: no key owns them, eviction never
 * picks them (their live bit stays clear), size counts only keyed rows and the arena's bytes
 * include them. A pooled lookup gives every key without a row of its own (not admitted,
 * overflowed, evicted and not back, or unseen in evaluation) the slot
 * cn_hash_key(key) mod N, so the pooled read, the backward and the fused optimizer update
 * treat it as any row: keys that share a fallback row share its value, its gradient sum and its
 * optimizer state, as a table hashed into N rows does. Fallback row j starts as the initial
 * row of key j. With fallback_copy, a key's new row starts with its fallback row's values
 * (what the key has been reading) and fresh optimizer state; without it, from the initialiser.
 * The explicit verbs (find, read, assign, export) see keyed rows only.
 * With fallback_residual, every key of a pooled lookup reads two rows: its own (zeros if it
 * has none) and its fallback row, as two occurrences of one bag (cn_table_residual_slots), so
 * the backward and the fused optimizer update each with its own state; a new row starts at
 * zero (the key's value does not change when it gets one). */
static inline int64_t cn_table_fallback_slot(const cn_table *t, int64_t key) {
    return (int64_t)(cn_hash_key(key) % (uint64_t)t->bound.fallback_rows);
}

/* Slots [0, N) become the fallback rows, at their initial values (the arena has room for them
 * and holds no other row: creation, clear). */
static inline void cn_table_reset_fallback(cn_table *t) {
    const int64_t n = t->bound.fallback_rows;
    if (n <= 0) return;
    t->arena.high_water = n;
    for (int64_t j = 0; j < n; j++) {
        cn_table_draw_row(t, j, j);
        cn_table_fresh_meta(t, j);
    }
}

static inline void cn_table_init_row(const cn_table *t, int64_t slot, int64_t key) {
    if (t->bound.fallback_rows > 0 && t->bound.fallback_residual)
        /* Residual: the key keeps reading its fallback row plus its own, so its own starts at
         * zero and the key's value is unchanged by its admission. */
        memset(cn_arena_row(&t->arena, slot), 0, (size_t)t->emb_floats * sizeof(float));
    else if (t->bound.fallback_rows > 0 && t->bound.fallback_copy)
        memcpy(cn_arena_row(&t->arena, slot), cn_arena_row(&t->arena, cn_table_fallback_slot(t, key)),
               (size_t)t->emb_floats * sizeof(float));
    else
        cn_table_draw_row(t, slot, key);
    cn_table_fresh_meta(t, slot);
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

#endif /* CN_TABLE_CORE_H */

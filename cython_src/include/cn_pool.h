/* cn_pool.h: the pooled forward pass over resolved slots.
 *
 * Bags are split statically between threads, each bag is reduced by exactly one thread in key
 * order, so the result does not depend on the thread count. Rows are prefetched
 * cn_prefetch_keys keys ahead: the loop is bound by memory latency, not arithmetic.
 */
#ifndef CN_POOL_H
#define CN_POOL_H

#include <stdint.h>
#include <stdlib.h>
#include "cn_arena.h"
#include "cn_init.h"
#include "cn_dtype.h"
#include "cn_parallel.h"

enum { CN_POOL_SUM = 0, CN_POOL_MEAN = 1, CN_POOL_MAX = 2 };

typedef struct {
    const cn_arena *arena;
    int64_t dim;
    const int64_t *offsets;
    const float *weights; /* may be NULL */
    int mode;
    float *out;           /* row b at out + b * ld_out */
    int64_t ld_out;
    int64_t *argmax;      /* max mode: [n_bags, dim] key positions, -1 for an empty bag */
    const cn_init *absent_init; /* NULL: keys without a row read as zeros; else as their initial row */
    const int64_t *keys;        /* the keys, with absent_init */
    int row_dtype;              /* cn_dtype.h */
} cn_pool_args;

#define CN_ROW(s) ((const void *)(pages[(s) >> shift] + ((s) & mask) * row_bytes))

/* Pool bag b; rows are prefetched cn_prefetch_keys(row) keys ahead (up to key `limit`).
 * (Resolving slots inside this loop, so that index and row misses overlap in one pass,
 * measured slower than a separate prefetched find pass: 0.5x against 0.8x of EmbeddingBag.) */
static inline void cn_pool_bag(const cn_pool_args *p, int64_t b, const int64_t *restrict slots, int64_t limit) {
    const cn_arena *a = p->arena;
    /* Arena fields in locals: the compiler must otherwise reload them after every store. */
    char *const *const pages = a->pages;
    const int64_t shift = a->page_shift, mask = a->page_mask, row_bytes = a->row_bytes;
    const int dtype = p->row_dtype;
    const int64_t dim = p->dim, pf_bytes = dim * cn_dtype_bytes(dtype), pf_keys = cn_prefetch_keys(pf_bytes);
    const int64_t start = p->offsets[b], end = p->offsets[b + 1];
    float *restrict o = p->out + b * p->ld_out;
    int64_t *restrict am = p->mode == CN_POOL_MAX ? p->argmax + b * dim : NULL;
    for (int64_t d = 0; d < dim; d++) o[d] = 0.0f;
    if (am)
        for (int64_t d = 0; d < dim; d++) am[d] = -1;
    float *absent_row = NULL; /* a key without a row, read as its initial row (bounded tables) */
    for (int64_t i = start; i < end; i++) {
        const int64_t ahead = i + pf_keys;
        if (ahead < limit) {
            const int64_t sa = slots[ahead];
            if (sa >= 0) cn_prefetch_read(CN_ROW(sa), pf_bytes);
        }
        const int64_t s = slots[i];
        const void *r = s >= 0 ? CN_ROW(s) : NULL;
        int r_dtype = dtype;
        if (s < 0 && p->absent_init) {
            if (absent_row == NULL) absent_row = (float *)malloc((size_t)dim * sizeof(float) + 64);
            if (absent_row) { /* (out of memory for one row: it reads as zeros) */
                cn_init_row(p->absent_init, p->keys[i], absent_row, dim);
                if (dtype != CN_ROW_F32) /* as the row would be stored */
                    for (int64_t d = 0; d < dim; d++) absent_row[d] = cn_round_trip(dtype, absent_row[d]);
                r = absent_row;
                r_dtype = CN_ROW_F32;
            }
        }
        if (am) {
            /* The first key of the bag seeds the maximum; later keys win only when strictly
             * greater, so ties go to the earliest key, as in torch.nn.EmbeddingBag. */
            for (int64_t d = 0; d < dim; d++) {
                float v = r ? cn_row_get(r_dtype, r, d) : 0.0f;
                if (i == start || v > o[d]) {
                    o[d] = v;
                    am[d] = i;
                }
            }
        } else if (r) {
            cn_row_axpy(r_dtype, p->weights ? p->weights[i] : 1.0f, r, o, dim);
        }
    }
    free(absent_row);
    if (p->mode == CN_POOL_MEAN && end > start) {
        const float inv = 1.0f / (float)(end - start);
        for (int64_t d = 0; d < dim; d++) o[d] *= inv;
    }
}

/* Pool every bag (slots < 0 read as zero rows). Bags are split statically between threads and
 * each bag is reduced by one thread in key order: the result does not depend on the thread count. */
typedef struct {
    const cn_pool_args *p;
    const int64_t *slots;
    int64_t n_keys;
} cn_pool_job;

static void cn_pool_range(void *ctx, int64_t begin, int64_t end) {
    const cn_pool_job *j = (const cn_pool_job *)ctx;
    for (int64_t b = begin; b < end; b++) cn_pool_bag(j->p, b, j->slots, j->n_keys);
}

static inline void cn_pool_forward(const cn_pool_args *p, int64_t n_bags, const int64_t *slots, int nthreads) {
    cn_pool_job job = {p, slots, p->offsets[n_bags]};
    cn_parallel_for(cn_pool_range, &job, n_bags, nthreads);
}

#undef CN_ROW

#endif

/* cn_pool.h: the pooled forward pass over resolved slots.
 *
 * Bags are split statically between threads, each bag is reduced by exactly one thread in key
 * order, so the result does not depend on the thread count. Rows are prefetched
 * CN_PREFETCH_DISTANCE keys ahead: the loop is bound by memory latency, not arithmetic.
 */
#ifndef CN_POOL_H
#define CN_POOL_H

#include <stdint.h>
#include "cn_arena.h"
#include "cn_parallel.h"

enum { CN_POOL_SUM = 0, CN_POOL_MEAN = 1, CN_POOL_MAX = 2 };

/* Count a training lookup: saturating increment (an atomic add, restored to the maximum if it
 * wrapped) and the step of the access. */
static inline void cn_meta_touch(cn_meta *m, uint32_t step) {
    uint32_t old = __atomic_fetch_add(&m->count, 1u, __ATOMIC_RELAXED);
    if (old == UINT32_MAX) __atomic_store_n(&m->count, UINT32_MAX, __ATOMIC_RELAXED);
    __atomic_store_n(&m->last_step, step, __ATOMIC_RELAXED);
}

/* out[b, 0:dim] (row stride ld_out) = pool over keys offsets[b]..offsets[b+1] of rows[slots[i]].
 * slots[i] < 0 reads as a zero row. For max, argmax[b*dim + d] receives the key position that
 * won column d (-1 for an empty bag). weights may be NULL. */
static inline void cn_pool_forward(const cn_arena *a, int64_t dim, const int64_t *restrict slots,
                                   const int64_t *restrict offsets, int64_t n_bags,
                                   const float *restrict weights, int mode, float *out, int64_t ld_out,
                                   int64_t *restrict argmax, int touch_meta, uint32_t step, int nthreads) {
    const int64_t n_keys = offsets[n_bags];
    const int64_t row_bytes = dim * (int64_t)sizeof(float);
    CN_PARALLEL_FOR(nthreads)
    for (int64_t b = 0; b < n_bags; b++) {
        float *restrict o = out + b * ld_out;
        const int64_t start = offsets[b], end = offsets[b + 1];
        if (mode == CN_POOL_MAX) {
            int64_t *restrict am = argmax + b * dim;
            for (int64_t d = 0; d < dim; d++) {
                o[d] = 0.0f;
                am[d] = -1;
            }
        } else {
            for (int64_t d = 0; d < dim; d++) o[d] = 0.0f;
        }
        for (int64_t i = start; i < end; i++) {
            int64_t ahead = i + CN_PREFETCH_DISTANCE;
            if (ahead < n_keys && slots[ahead] >= 0) {
                cn_prefetch_read(cn_arena_row(a, slots[ahead]), row_bytes);
                if (touch_meta) __builtin_prefetch(cn_arena_meta(a, slots[ahead]), 1, 3);
            }
            const int64_t s = slots[i];
            if (mode == CN_POOL_MAX) {
                /* The first key of the bag seeds the maximum; later keys win only when strictly
                 * greater, so ties go to the earliest key, as in torch.nn.EmbeddingBag. */
                int64_t *restrict am = argmax + b * dim;
                const float *restrict r = s >= 0 ? cn_arena_row(a, s) : NULL;
                for (int64_t d = 0; d < dim; d++) {
                    float v = r ? r[d] : 0.0f;
                    if (i == start || v > o[d]) { o[d] = v; am[d] = i; }
                }
            } else if (s >= 0) {
                const float *restrict r = cn_arena_row(a, s);
                const float w = weights ? weights[i] : 1.0f;
                for (int64_t d = 0; d < dim; d++) o[d] += w * r[d];
            }
            if (touch_meta && s >= 0) cn_meta_touch(cn_arena_meta(a, s), step);
        }
        if (mode == CN_POOL_MEAN && end > start) {
            const float inv = 1.0f / (float)(end - start);
            for (int64_t d = 0; d < dim; d++) o[d] *= inv;
        }
    }
}

#endif

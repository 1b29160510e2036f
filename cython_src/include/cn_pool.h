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
    /* Arena fields in locals: the compiler must otherwise reload them after every store. */
    char *const *const pages = a->pages;
    const int64_t shift = a->page_shift, mask = a->page_mask, row_bytes = a->row_bytes;
    const int64_t meta_offset = a->meta_offset;
    const int64_t pf_bytes = dim * (int64_t)sizeof(float);
#define CN_ROW(s) ((const float *)(pages[(s) >> shift] + ((s) & mask) * row_bytes))
#define CN_META(s) ((cn_meta *)(pages[(s) >> shift] + meta_offset) + ((s) & mask))
    CN_PARALLEL_FOR(nthreads)
    for (int64_t b = 0; b < n_bags; b++) {
        float *restrict o = out + b * ld_out;
        const int64_t start = offsets[b], end = offsets[b + 1];
        for (int64_t d = 0; d < dim; d++) o[d] = 0.0f;
        if (mode == CN_POOL_MAX) {
            int64_t *restrict am = argmax + b * dim;
            for (int64_t d = 0; d < dim; d++) am[d] = -1;
            for (int64_t i = start; i < end; i++) {
                const int64_t ahead = i + CN_PREFETCH_DISTANCE;
                if (ahead < n_keys && slots[ahead] >= 0) cn_prefetch_read(CN_ROW(slots[ahead]), pf_bytes);
                const int64_t s = slots[i];
                /* The first key of the bag seeds the maximum; later keys win only when strictly
                 * greater, so ties go to the earliest key, as in torch.nn.EmbeddingBag. */
                const float *restrict r = s >= 0 ? CN_ROW(s) : NULL;
                for (int64_t d = 0; d < dim; d++) {
                    float v = r ? r[d] : 0.0f;
                    if (i == start || v > o[d]) {
                        o[d] = v;
                        am[d] = i;
                    }
                }
                if (touch_meta && s >= 0) cn_meta_touch(CN_META(s), step);
            }
            continue;
        }
        for (int64_t i = start; i < end; i++) {
            const int64_t ahead = i + CN_PREFETCH_DISTANCE;
            if (ahead < n_keys && slots[ahead] >= 0) {
                cn_prefetch_read(CN_ROW(slots[ahead]), pf_bytes);
                if (touch_meta) __builtin_prefetch(CN_META(slots[ahead]), 1, 3);
            }
            const int64_t s = slots[i];
            if (s < 0) continue;
            const float *restrict r = CN_ROW(s);
            const float w = weights ? weights[i] : 1.0f;
            for (int64_t d = 0; d < dim; d++) o[d] += w * r[d];
            if (touch_meta) cn_meta_touch(CN_META(s), step);
        }
        if (mode == CN_POOL_MEAN && end > start) {
            const float inv = 1.0f / (float)(end - start);
            for (int64_t d = 0; d < dim; d++) o[d] *= inv;
        }
    }
#undef CN_ROW
#undef CN_META
}

#endif

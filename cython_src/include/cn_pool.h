/* cn_pool.h: the pooled forward pass over resolved slots.
 *
 * Bags are split statically between threads, each bag is reduced by exactly one thread in key
 * order, so the result does not depend on the thread count. Rows are prefetched
 * cn_pool_prefetch_keys keys ahead: the loop is bound by memory latency, not arithmetic.
 *
 * Sum and mean over dims that are a multiple of 16 (up to 128; AVX-512 builds, see
 * CN_POOL_FIXED_MAX_NV) keep the bag's sum in registers
 * (cn_pool_bag_fixed) instead of loading, adding and storing the output row for every key.
 * Measured with a C driver over this header (one thread, batch 4096, the IDs of
 * forward_large.py, a 64 MiB flush before every call; find + pool; medians of 22 calls, runs
 * alternated with the previous code): 1M rows x dim 64, pooling 20, Zipf 1.05: 3240 -> 2760 us;
 * uniform 4900 -> 4500-4700 us; dim 16 Zipf 1630-1690 -> 1500-1590 us; 8M x 64 pooling 1
 * uniform 559 -> 375-417 us (that one also gains from prefetching the first rows of a range
 * before its first key, which the loop before did not).
 *
 * Rejected, with the same driver:
 *  - Resolving slots inside the pooling loop, software-pipelined (hash the key 16 + d_row keys
 *    ahead and prefetch its bucket, probe the key d_row ahead and prefetch its row, pool the
 *    key at hand), instead of a separate prefetched find pass: no better, sometimes worse. 1M x
 *    64 pooling 20: Zipf 2740-3470 us against 2740-3430 separate, uniform 4490-4560 against
 *    4410-4510; 8M x 64 uniform 6060-10040 against 5430-6260; pooling 1 360-383 against
 *    382-407; dim 16 Zipf 1460-1490 against 1500-1520 (bucket distances 8, 16 and 32 alike).
 *    The separate find pass keeps ~32 bucket misses in flight with a few instructions per key,
 *    and the pooling pass as many row lines: fused, the two share the same miss buffers and the
 *    dependent probe sits in the pooling loop. Measured again once both passes prefetched into
 *    L2 (below; buckets 32, 64 or 128 keys beyond the rows): within a few per cent either way,
 *    medians 1M x 64 Zipf 2350-2980 us against 2230-2410 separate, uniform 2920-3420 against
 *    3210-3380, 8M x 64 pooling 1 334-366 against 348-380.
 *  - With the find pass still prefetching into L1: prefetching rows with locality 2 or 0 instead
 *    of 3, or 16 or 64 lines ahead instead of 32, was within the noise (1M x 64 Zipf 2590-2760 us
 *    for all five; uniform 4710-4950). Both passes into L2, further ahead, is what paid (below).
 *  - A second prefetch of each row into L1, 4 or 8 keys ahead, besides the one into L2 (as the
 *    find does for buckets, cn_index.h): slower. Pooling pass alone, best of three: 1M x 64
 *    uniform 1360 us without, 2150 (4 keys) and 2040 (8 keys) with; 8M x 128 uniform 3500
 *    against 5180 and 5180; Zipf 985 against 1110-1380.
 *  - Every 128 bytes of a row prefetched (or its first line only), for the L2's adjacent-line
 *    prefetcher to bring the rest: slower (1M x 64 uniform 3020-3520 us for whole rows, 3670-4300
 *    and 4010-4680; 8M x 128 5350-7950 against 6560-6790 and 9340-9420).
 *  - Find and pool in one parallel loop, each thread finding the keys of a run of its bags (512,
 *    1024, 4096 keys, or all of its share) and then pooling that run, so that its slots stay in
 *    its cache and one loop dispatch is saved: no better. One thread, best of three, 1M x 64
 *    Zipf 1800-2060 us as two passes against 1950-2370 in runs; uniform 2720-3000 against
 *    2710-3340; two threads (the machine loaded) 1805-1845 against 1980-2370.
 *  - Prefetching the output row for writing 8, 16 or 32 bags ahead (at pooling 1 each bag's
 *    output line is a cold write): no gain (1M x 64 pooling 1 uniform 210-322 us without,
 *    230-366 with; 8M x 128 Zipf 337-495 against 347-420).
 *  - No row prefetch at all: 1M x 64 Zipf 2545-2620 us (a little faster: its hot rows are in
 *    the cache), but uniform 4750-4770 and dim 16 Zipf 1740-1900 (slower); kept.
 *  - Waking the core's sleeping workers at the start of a lookup (before the Python layer's
 *    checks), so that the futex wake-up overlaps them: slower on the shared 2-core VM of issue
 *    12 (load 2.5): with 50-150 us of work between the wake and the find, 4096 IDs at pooling 1,
 *    1M x 16, find + pool took 780-1300 us against 590-740 without, the woken worker spinning on
 *    a core the caller needed. What was kept instead: a lookup of fewer than 16384 keys does not
 *    wake them at all (cn_table.h, CN_LOOKUP_MIN_TO_WAKE).
 *
 * Where the forward's time goes against nn.EmbeddingBag (issue 12; C driver over these headers,
 * 81,920 IDs, flushed, one thread): the pool pass alone runs as fast as the same kernel over a
 * flat array addressed by row position (direct addressing, the layout EmbeddingBag has) on huge
 * pages: 1M x 16 uniform 1203 against 1243 us, Zipf 905 against 882; with 4 KiB pages (as torch
 * allocates its weight) the direct pool took 2687 and 2032. What the hash index adds is the
 * find pass (2606 and 1629 us there), more than the pool pass itself at dim 16.
 *
 * Rejected, measured (AMD EPYC Zen 4 guest, a C driver, one thread, pooling 20, 81,920 IDs, a
 * 96 MiB flush before each call, medians of 9): rows inline in the index's buckets ({key,
 * occupied, row} in one open-addressed array, linear probing, the home bucket and the next
 * hashed and prefetched 64 keys ahead, one pass that probes and pools), the layout the previous
 * round proposed to remove the find's separate miss. Against a flat array read by row position
 * (EmbeddingBag's layout) and against this header's find pass + pool pass:
 *  - 1M x 16 uniform: flat 11-14 ns an ID; index + arena 33-41; inline 61-101 at load 0.7, 31
 *    at 0.5.
 *  - Zipf 1.05: 11.5, 30.4, and 36.0 at 0.7.
 *  - 1M x 64 uniform at 0.5: 31.4, 51.9, 67.3. 8M x 16 uniform at 0.5: 16.3, 43.1, 47.9.
 * At 0.7 a probe crosses 2.17 buckets of 80-272 bytes, so its next lines are fresh misses, and
 * at 0.5 it only ties the separate index while every empty bucket holds a row's bytes. The
 * remaining gap is one dependent random access per ID, which a hash table pays and a
 * direct-addressed array of pre-hashed IDs does not.
 */
#ifndef CN_POOL_H
#define CN_POOL_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
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

/* Rows are prefetched into L2 only (locality 2), 128 lines ahead (at most 64 keys, at least 4),
 * for the reason and with the measurements in cn_index.h (CN_FIND_PREFETCH_LOCALITY): into L1
 * (cn_parallel.h's cn_prefetch_read, 32 lines) the prefetches waited for L1 miss buffers. */
#ifndef CN_POOL_PREFETCH_LINES
#define CN_POOL_PREFETCH_LINES 128
#endif
#ifndef CN_POOL_PREFETCH_MAX_KEYS
#define CN_POOL_PREFETCH_MAX_KEYS 64
#endif
#ifndef CN_POOL_PREFETCH_LOCALITY
#define CN_POOL_PREFETCH_LOCALITY 2
#endif

static inline int64_t cn_pool_prefetch_keys(int64_t row_bytes) {
    const int64_t lines = (row_bytes + 63) / 64;
    const int64_t keys = CN_POOL_PREFETCH_LINES / (lines > 0 ? lines : 1);
    return keys < 4 ? 4 : keys > CN_POOL_PREFETCH_MAX_KEYS ? CN_POOL_PREFETCH_MAX_KEYS : keys;
}

/* What the per-key loop of one range of bags reads: the slots, and where rows live. Rows are
 * prefetched d_row keys ahead of the key being pooled, up to the range's last key `end`. */
typedef struct {
    const int64_t *slots;
    char *const *pages;
    int64_t shift, mask, row_bytes, pf_bytes;
    int64_t end, d_row;
} cn_pool_range_ctx;

/* always_inline, and the prefetches written out here: GCC counts __builtin_prefetch as free of
 * side effects, so a helper that only prefetches is "const" to it, and a call of it that is not
 * inlined early is deleted as dead code (it was: no prefetch was left in the pooling loop). */
static inline __attribute__((always_inline)) void cn_pool_prefetch(const cn_pool_range_ctx *q, int64_t j) {
    const int64_t s = q->slots[j];
    if (s >= 0) {
        const char *r = q->pages[s >> q->shift] + (s & q->mask) * q->row_bytes;
        for (int64_t off = 0; off < q->pf_bytes; off += 64) __builtin_prefetch(r + off, 0, CN_POOL_PREFETCH_LOCALITY);
    }
}

/* Before pooling key i: prefetch the row d_row keys on. */
static inline __attribute__((always_inline)) void cn_pool_step(const cn_pool_range_ctx *q, int64_t i) {
    if (i + q->d_row < q->end) cn_pool_prefetch(q, i + q->d_row);
}

/* Pool bag b, any mode, dtype and dim (the general path). */
static inline void cn_pool_bag(const cn_pool_args *p, const cn_pool_range_ctx *range, int64_t b) {
    const cn_pool_range_ctx local = *range, *q = &local; /* a copy that the stores to o cannot alias */
    const cn_arena *a = p->arena;
    /* Arena fields in locals: the compiler must otherwise reload them after every store. */
    char *const *const pages = a->pages;
    const int64_t shift = a->page_shift, mask = a->page_mask, row_bytes = a->row_bytes;
    const int dtype = p->row_dtype;
    const int64_t dim = p->dim;
    const int64_t *restrict slots = q->slots;
    const int64_t start = p->offsets[b], end = p->offsets[b + 1];
    float *restrict o = p->out + b * p->ld_out;
    int64_t *restrict am = p->mode == CN_POOL_MAX ? p->argmax + b * dim : NULL;
    for (int64_t d = 0; d < dim; d++) o[d] = 0.0f;
    if (am)
        for (int64_t d = 0; d < dim; d++) am[d] = -1;
    float *absent_row = NULL; /* a key without a row, read as its initial row (bounded tables) */
    for (int64_t i = start; i < end; i++) {
        cn_pool_step(q, i);
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

/* Sum and mean over dims that are a multiple of 16 up to CN_POOL_FIXED_MAX_NV * 16, absent keys as
 * zeros: the bag's sum stays in nv vector registers (cn_v16x) and is stored once, where the general path loads,
 * adds and stores the output row for every key. The additions are the same, in the same order
 * (each a fused multiply-add where the target has one, as the compiler contracts the general
 * path's o += w * r), so the results are bit for bit those of the general path. */
static inline __attribute__((always_inline)) void cn_pool_bag_fixed(const cn_pool_args *p,
                                                                    const cn_pool_range_ctx *range, int64_t b,
                                                                    const int nv, const int dtype) {
    const cn_pool_range_ctx local = *range, *q = &local;
    char *const *const pages = q->pages;
    const int64_t shift = q->shift, mask = q->mask, row_bytes = q->row_bytes;
    const int64_t *restrict slots = q->slots;
    const float *restrict weights = p->weights;
    const int64_t start = p->offsets[b], end = p->offsets[b + 1];
    /* Only the nv sums in use are zeroed, one register each. memset(acc, 0, sizeof(acc)) zeroed all
     * 512 bytes in memory, which generic tuning (the portable build's v4 kernels) compiles to a
     * `rep stosq` per bag: at pooling 1, a microcoded store loop for every row pooled. */
    cn_v16x acc[8];
    for (int k = 0; k < nv; k++) acc[k] = (cn_v16x){0};
    for (int64_t i = start; i < end; i++) {
        cn_pool_step(q, i);
        const int64_t s = slots[i];
        if (s < 0) continue;
        const void *r = CN_ROW(s);
        const float w = weights ? weights[i] : 1.0f;
        for (int k = 0; k < nv; k++) {
            cn_v16x x;
            cn_v16x_load_row(dtype, r, k, &x);
            acc[k] += w * x; /* one fused multiply-add where the target has it, as in cn_row_axpy */
        }
    }
    if (p->mode == CN_POOL_MEAN && end > start) {
        const float inv = 1.0f / (float)(end - start);
        for (int k = 0; k < nv; k++) acc[k] *= inv;
    }
    float *o = p->out + b * p->ld_out;
    for (int k = 0; k < nv; k++) memcpy(o + 16 * k, &acc[k], sizeof(acc[k]));
}

typedef struct {
    const cn_pool_args *p;
    const int64_t *slots;
} cn_pool_job;

/* The register path is built for AVX-512 targets only: the v4 kernels of every build (cn_isa.h),
 * and a -march=native build's own code on such a CPU (cn_v16x is one zmm register there; dim 128
 * takes 8 of the 32). Elsewhere GCC splits each 64-byte vector into 2 ymm or 4 xmm pieces and kept
 * the bag's sum on the stack, and the path was slower than the general one: 1M rows Zipf pooling
 * 20, one thread, dim 32: 3970 against 1810 us with AVX2 (x86-64-v3), 3600 against 2460 in the
 * portable build (x86-64, SSE2); dim 64 portable 5570 against 3790. */
#if defined(__AVX512F__)
#define CN_POOL_FIXED_MAX_NV 8
#else
#define CN_POOL_FIXED_MAX_NV 0
#endif

#define CN_POOL_FIXED_CASE(NV, DT)                                                 \
    case (NV) * 3 + (DT):                                                         \
        for (int64_t b = begin; b < end; b++) cn_pool_bag_fixed(p, &q, b, NV, DT); \
        return;

static void cn_pool_range(void *ctx, int64_t begin, int64_t end) {
    const cn_pool_job *j = (const cn_pool_job *)ctx;
    const cn_pool_args *p = j->p;
    const cn_arena *a = p->arena;
    const int64_t pf_bytes = p->dim * cn_dtype_bytes(p->row_dtype);
    const cn_pool_range_ctx q = {j->slots, a->pages, a->page_shift, a->page_mask, a->row_bytes, pf_bytes,
                                 p->offsets[end], cn_pool_prefetch_keys(pf_bytes)};
    /* The first rows of the range, before its first key is pooled. */
    for (int64_t i = p->offsets[begin]; i < p->offsets[begin] + q.d_row && i < q.end; i++) cn_pool_prefetch(&q, i);
    const int64_t nv = p->dim / 16;
    if (p->mode != CN_POOL_MAX && p->absent_init == NULL && p->dim % 16 == 0 && nv >= 1 && nv <= CN_POOL_FIXED_MAX_NV) {
        switch (nv * 3 + p->row_dtype) {
            CN_POOL_FIXED_CASE(1, CN_ROW_F32) CN_POOL_FIXED_CASE(1, CN_ROW_F16) CN_POOL_FIXED_CASE(1, CN_ROW_BF16)
            CN_POOL_FIXED_CASE(2, CN_ROW_F32) CN_POOL_FIXED_CASE(2, CN_ROW_F16) CN_POOL_FIXED_CASE(2, CN_ROW_BF16)
            CN_POOL_FIXED_CASE(3, CN_ROW_F32) CN_POOL_FIXED_CASE(3, CN_ROW_F16) CN_POOL_FIXED_CASE(3, CN_ROW_BF16)
            CN_POOL_FIXED_CASE(4, CN_ROW_F32) CN_POOL_FIXED_CASE(4, CN_ROW_F16) CN_POOL_FIXED_CASE(4, CN_ROW_BF16)
            CN_POOL_FIXED_CASE(5, CN_ROW_F32) CN_POOL_FIXED_CASE(5, CN_ROW_F16) CN_POOL_FIXED_CASE(5, CN_ROW_BF16)
            CN_POOL_FIXED_CASE(6, CN_ROW_F32) CN_POOL_FIXED_CASE(6, CN_ROW_F16) CN_POOL_FIXED_CASE(6, CN_ROW_BF16)
            CN_POOL_FIXED_CASE(7, CN_ROW_F32) CN_POOL_FIXED_CASE(7, CN_ROW_F16) CN_POOL_FIXED_CASE(7, CN_ROW_BF16)
            CN_POOL_FIXED_CASE(8, CN_ROW_F32) CN_POOL_FIXED_CASE(8, CN_ROW_F16) CN_POOL_FIXED_CASE(8, CN_ROW_BF16)
            default: break;
        }
    }
    for (int64_t b = begin; b < end; b++) cn_pool_bag(p, &q, b);
}

#undef CN_POOL_FIXED_CASE

/* Pool every bag (slots < 0 read as zero rows). Bags are split statically between threads and
 * each bag is reduced by one thread in key order: the result does not depend on the thread count. */
static inline void cn_pool_forward(const cn_pool_args *p, int64_t n_bags, const int64_t *slots, int nthreads) {
    cn_pool_job job = {p, slots};
    cn_parallel_for(cn_pool_range, &job, n_bags, nthreads);
}

#undef CN_ROW

#endif

/* cn_grad.h: backward of the pooled lookup: gradient per unique row, then (optionally) the
 * fused optimizer update of that row in the same pass.
 *
 * Steps, all O(number of keys):
 *   1. group: the key positions of each unique row, in key order. The non-fused path
 *      (cn_groups_build_in) dedups with a small open-addressing map slot -> unique id, so that
 *      unique rows follow first occurrence (its output order is part of its contract), then
 *      places the positions by a counting sort. The fused path (cn_groups_sort_in) sorts
 *      (slot, position) pairs by slot with a stable LSD radix sort: unique rows come in slot
 *      order, which no result depends on (every row is updated once, by its owner).
 *   2. per unique row: sum its occurrences' gradient contributions (sum / mean / max /
 *      per-sample weights, exactly as nn.EmbeddingBag) in key order into a scratch row, then
 *      write it out or apply the optimizer to the row in place.
 * The fused path runs both in parallel without a serial dedup: each thread owns the rows
 * whose slot hashes to it, groups only the keys of its rows, and updates only those rows. A row
 * is summed in key order whoever owns it, so there are no atomics and the result does not
 * depend on the thread count. The non-fused path needs one global first-occurrence order, so
 * it dedups serially and accumulates in parallel.
 *
 * Why the fused path sorts (AMD EPYC guest, 2 cores, 1 MiB L2 per core, 32 MiB L3; 8M rows x
 * dim 16, row-wise Adagrad, 81,920 Zipf 1.05 IDs, pooling 20; medians of alternated runs, the
 * machine shared, results bit for bit the same): the map's 16-byte entries for 2m slots take
 * 2 MiB a share at two threads (4 MiB at one), past the L2, and its probes, memset and
 * counting-sort scatter (perf: ~50 %, ~11 % and ~16 % of the grouping) went to L3. Grouping took
 * 16.9 ns an ID on one thread (CPU time) and 27.0 on two (wall) with the map, 9.7 and 12.9 with
 * the sort; the update loop after it is the same speed in slot order as in first-occurrence
 * order (38.1 against 38.3 ns an ID, one thread). Filling each share's positions without a
 * branch (at two threads ownership is a coin toss per key) is part of the 27.0 -> 12.9: with
 * the map it gives 18.9 on its own. Rejected, measured the same way:
 *  - 11-bit digits (three passes over 23 slot bits) instead of 12 (two): 11.6 ns an ID on one
 *    thread against 9.7, 14.3 against 12.9 on two.
 *  - The map kept, filled branch-free: 16.3 ns an ID on one thread, 18.9 on two (above).
 *  - The row's summed gradient kept in vector registers for dims that are a multiple of 16 (as
 *    cn_pool_bag_fixed does): update loop on one thread 8M x 64 Zipf 59.2 -> 64.7 ns an ID,
 *    8M x 16 uniform 73.0 -> 79.7, 8M x 16 Zipf 37.4 -> 31.7: no consistent gain. The loop
 *    waits on memory (perf: ~40 % of its samples on its row and metadata prefetches), not on
 *    the scratch row.
 *  - The update loop's prefetch distance scaled to the row's lines plus its metadata line
 *    (cn_prefetch_keys, 6 rows at dim 64) instead of 16 rows: 8M x 64 Zipf 55.2 -> 56.7 ns an
 *    ID, uniform 100.7 -> 96.8: within the noise.
 * The groups keep each unique row's slot (unique_slot) beside its first position: in slot order
 * the first positions are scattered, and the update loop's slots[unique_pos[u]] was a random
 * read a row; read in sequence, the update loop took 68.1 -> 55.3 ns an ID at 8M x 16 uniform,
 * 35.5 -> 34.0 Zipf, 55.0 -> 50.7 at 8M x 64 Zipf (one thread, CPU time, three alternated
 * runs each).
 * Not tried: a map of 8-byte entries sized to the L2 (at two threads a share's 40,960 keys
 * need 512 KiB at load 0.6, half the L2), which keeps the counting sort's random scatter. Still
 * not tried after the changes below: perf puts the grouping (cn_grad_build_range) at 7-17 % of
 * the core's samples in a dim-16 step, and its time relative to the forward's (0.26 uniform,
 * 0.33 Zipf) did not change with them; the row updates were the cost.
 *
 * The dim-16 step against FBGEMM's TBE (AMD EPYC Zen 4 guest, 2 cores, 1 MiB L2 a core, 32 MiB
 * L3; 8M x 16 float32, row-wise Adagrad, 81,920 IDs in bags of 20, THP on). TBE's CPU backward
 * (fbgemm_gpu 1.8, embedding_backward_split_cpu_template.cpp) sorts (row, bag) int32 pairs once
 * (fbgemm::radix_sort_parallel, 8-bit digits) into a CSC of bags per row, then per block of 64
 * distinct rows sums their gradient rows with an asmjit SpMDM kernel (prefetch 16) and applies
 * an asmjit row-wise Adagrad kernel whose momentum is a flat float array (4 bytes a row). So it
 * too touches a row line and a state line per distinct row; two things it had that we did not:
 *  - its state array is on huge pages: ours (cn_arena.h) sat in the 512 KiB tail of each 2.5 MiB
 *    page mapping, which madvise cannot put on a huge page (smaps: 122 MiB of metadata, none on
 *    huge pages), so each distinct row's metadata was a TLB miss beside its row miss. Metadata
 *    now lies in 2 MiB chunks of its own (cn_arena.h).
 *  - its sorted values are bags: ours were key positions, and the update loop read bag_of[pos]
 *    before the gradient row, a random read into a 640 KiB array (perf: 25 % of the update
 *    loop's samples on that load). The groups now hold bags (cn_grad_by_bag).
 * perf of the whole step (forward + backward, two threads, the flush excluded): the update loop
 * was 67 % of the core's samples at uniform IDs (find 17 %, pool 9 %, grouping 7 %) and 54 % at
 * Zipf; after both changes 49 % and 31 %; against the forward (find + pool, unchanged code) the
 * update loop takes 0.47x (uniform) and 0.40x (Zipf) its time before. Each change timed with
 * the builds in one process (asv_bench/scripts/step_two_builds.py's method: the same rows,
 * steps interleaved, each call after a flush; medians of 30 steps; run in both build orders,
 * since with one build loaded twice the backward ratio came out 0.73-1.14 at load 10;
 * backward time new/old, old store made first / new first, load 18-20, bits the same):
 *  - metadata chunks: uniform 0.74 / 0.55, Zipf 1.05 0.71 / 0.70.
 *  - bags in the groups: uniform 0.73 / 0.85, Zipf 1.14 / 0.79.
 * Both against the old core, TBE in the same rounds (load 5-10): 0.34 / 0.46 uniform, 0.35 /
 * 0.26 Zipf; the step 0.92x / 0.79x TBE's uniform (old core 0.48x / 0.52x), 1.32x / 1.45x Zipf
 * (old 0.93x / 0.82x). docs/benchmarks.md has the tables.
 * Rejected, measured the same way: prefetching the gradient rows of the grouped keys 16 keys
 * ahead of the update (with bags the address is known a row early): uniform 1.03 / 1.18, Zipf
 * 1.58 / 1.03 (slower; the 256 KiB gradient mostly sits in L2 already, and a hot row's
 * thousands of keys prefetch past the L1).
 *
 * The access metadata of a training lookup is recorded here too: count += occurrences,
 * last_step = the step of the lookup. Done per distinct row by its owning thread, it is exact
 * and costs one write per row; done in the forward it would cost one atomic per key, and a
 * locked increment drains the store buffer under the row loads the pooling keeps in flight.
 *
 * Where the fused backward's time goes (perf, one thread, 2M rows x 64 float32, row-wise
 * Adagrad, 81,920 Zipf 1.05 IDs, pooling 20): the update loop (cn_grad_update_range) takes about
 * twice the grouping (cn_grad_build_range), and half of the update loop's samples sit on its
 * row prefetches, a quarter on reading each key's gradient row: it waits for the rows it
 * reads and writes back. Rejected, measured (Intel Xeon guest, 2 cores, shared with other
 * jobs at load 12-14: CPU time of one call, medians of 10, two alternated runs each; results
 * bit for bit the same in all of them):
 *  - A share per 2,048 keys (up to 64) instead of one per thread, from one stable counting
 *    sort of the keys by share, each share grouped just before its rows are updated (smaller
 *    maps, and a running thread takes over the shares of a preempted one): slower, 2M x 64
 *    uniform 22.9-23.3 ms against 16.0-17.2, Zipf 11.6-14.7 against 10.4-10.8. A bag's keys
 *    spread over many shares, so nearly every key reads a gradient row that is no longer in L1;
 *    with one share per thread a bag's keys mostly follow one another.
 *  - The update loops' rows prefetched into L2 (read prefetches, 25-32 rows ahead, as the
 *    pooled forward does) instead of written into L1 16 rows ahead: no better, uniform
 *    17.8-18.6 ms against 17.0-17.5, Zipf 12.0-12.1 against 10.5-10.7.
 */
#ifndef CN_GRAD_H
#define CN_GRAD_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "cn_arena.h"
#include "cn_dtype.h"
#include "cn_index.h"
#include "cn_optim.h"
#include "cn_parallel.h"
#include "cn_pool.h"

typedef struct {
    int64_t n_unique;
    int64_t *unique_pos;  /* [n_unique] the first key position of each unique row */
    int64_t *unique_slot; /* [n_unique] its slot (the update loops read it in sequence) */
    int64_t *group_start; /* [n_unique + 1] */
    int64_t *group_pos;   /* [n] key positions grouped by unique row, in key order */
    void *block;          /* the allocation behind them (cn_groups_build); NULL in a caller's scratch */
} cn_groups;

static inline void cn_groups_free(cn_groups *g) {
    free(g->block);
    memset(g, 0, sizeof(*g));
}

/* slot -> unique id; one 16-byte entry, so a probe touches one cache line */
typedef struct {
    int64_t slot;
    int64_t uid;
} cn_groups_entry;

/* Bytes of scratch that grouping m positions uses: the map (first, so it is 16-byte aligned in
 * a malloc'd block), its temporaries uid_of and cursor, and the kept arrays. */
static inline size_t cn_groups_scratch_bytes(int64_t m) {
    const size_t mm = (size_t)(m ? m : 1);
    return (size_t)cn_pow2_at_least(2 * m + 1) * sizeof(cn_groups_entry) + (6 * mm + 2) * sizeof(int64_t);
}

/* Group the key positions `positions[0..m)` (NULL: 0..m-1, which must be increasing) by slot,
 * in `scratch` (cn_groups_scratch_bytes(m), 16-byte aligned; g's arrays point into it). Keys
 * with slot < 0 (unseen in evaluation) take no gradient. */
static inline void cn_groups_build_in(const int64_t *restrict slots, const int64_t *restrict positions, int64_t m,
                                      cn_groups *g, void *scratch) {
    typedef cn_groups_entry entry;
    memset(g, 0, sizeof(*g));
    const int64_t cap = cn_pow2_at_least(2 * m + 1);
    const size_t mm = (size_t)(m ? m : 1);
    entry *map = (entry *)scratch;
    int64_t *uid_of = (int64_t *)(map + cap);
    int64_t *cursor = uid_of + mm;
    g->unique_pos = cursor + mm;
    g->unique_slot = g->unique_pos + mm;
    g->group_start = g->unique_slot + mm;
    g->group_pos = g->group_start + mm + 2;
    for (int64_t h = 0; h < cap; h++) map[h].slot = -1;
    const uint64_t mask = (uint64_t)cap - 1;
    int64_t n_unique = 0;
    for (int64_t j = 0; j < m; j++) {
        if (j + CN_PREFETCH_DISTANCE < m) {
            const int64_t ahead = slots[positions ? positions[j + CN_PREFETCH_DISTANCE] : j + CN_PREFETCH_DISTANCE];
            __builtin_prefetch(&map[cn_hash_key(ahead) & mask], 1, 3);
        }
        const int64_t i = positions ? positions[j] : j;
        const int64_t s = slots[i];
        if (s < 0) {
            uid_of[j] = -1;
            continue;
        }
        uint64_t h = cn_hash_key(s) & mask;
        while (map[h].slot >= 0 && map[h].slot != s) h = (h + 1) & mask;
        if (map[h].slot < 0) {
            map[h].slot = s;
            map[h].uid = n_unique;
            g->unique_pos[n_unique] = i;
            g->unique_slot[n_unique] = s;
            g->group_start[n_unique + 1] = 0;
            n_unique++;
        }
        uid_of[j] = map[h].uid;
        g->group_start[map[h].uid + 1]++;
    }
    g->group_start[0] = 0;
    for (int64_t u = 0; u < n_unique; u++) g->group_start[u + 1] += g->group_start[u];
    /* Fill positions in key order. */
    for (int64_t u = 0; u < n_unique; u++) cursor[u] = g->group_start[u];
    for (int64_t j = 0; j < m; j++)
        if (uid_of[j] >= 0) g->group_pos[cursor[uid_of[j]]++] = positions ? positions[j] : j;
    g->n_unique = n_unique;
}

/* Grouping by a stable LSD radix sort, for the fused backward, whose rows may be updated in
 * any order. Each kept key becomes one uint64, (slot << pos_bits) | position, so sorting by the
 * slot bits alone orders the keys by (slot, position): a row's keys stay in key order, and its
 * summed gradient is the same bits as with the map above. The digits are at most
 * CN_RADIX_BITS wide (their histograms, 4 bytes a bucket, stay in L1), all histograms are
 * counted in one pass, and a digit that every key shares skips its pass. */
#ifndef CN_RADIX_BITS
#define CN_RADIX_BITS 12
#endif
#define CN_RADIX_MAX_PASSES ((64 + CN_RADIX_BITS - 1) / CN_RADIX_BITS)

/* Bits needed to write x (0 for 0). */
static inline int cn_bits_for(uint64_t x) { return x ? 64 - __builtin_clzll(x) : 0; }

/* Bytes of scratch that cn_groups_sort_in uses for m positions: two key buffers, the kept
 * arrays and the histograms (16-byte aligned throughout). */
static inline size_t cn_groups_sort_scratch_bytes(int64_t m) {
    const size_t mm = (size_t)(m ? m : 1);
    return (6 * mm + 2) * sizeof(int64_t) +
           (size_t)CN_RADIX_MAX_PASSES * ((size_t)1 << CN_RADIX_BITS) * sizeof(uint32_t);
}

/* Group positions[0..m) (increasing) by slot, the slots < 2^slot_bits, slot_bits + pos_bits
 * <= 64 and m < 2^32, in `scratch` (cn_groups_sort_scratch_bytes(m)). Unique rows come in slot
 * order; each row's positions in key order. With `labels` (non-decreasing in the position,
 * each < 2^pos_bits), the groups hold labels[position] instead of the position (the fused
 * backward's bags, see cn_grad_by_bag); else each position < 2^pos_bits. Keys with slot < 0
 * take no gradient. */
static inline void cn_groups_sort_in(const int64_t *restrict slots, const int64_t *restrict positions, int64_t m,
                                     const int64_t *restrict labels, int slot_bits, int pos_bits, cn_groups *g,
                                     void *scratch) {
    memset(g, 0, sizeof(*g));
    const size_t mm = (size_t)(m ? m : 1);
    uint64_t *keys = (uint64_t *)scratch, *other = keys + mm;
    g->unique_pos = (int64_t *)(other + mm);
    g->unique_slot = g->unique_pos + mm;
    g->group_start = g->unique_slot + mm;
    g->group_pos = g->group_start + mm + 2;
    uint32_t *hist = (uint32_t *)(g->group_pos + mm);
    const int passes = (slot_bits + CN_RADIX_BITS - 1) / CN_RADIX_BITS;
    const int width = passes ? (slot_bits + passes - 1) / passes : 0;
    const uint64_t radix = (uint64_t)1 << width, digit_mask = radix - 1;
    memset(hist, 0, (size_t)passes * radix * sizeof(uint32_t));
    int64_t k = 0;
    for (int64_t j = 0; j < m; j++) {
        const int64_t i = positions[j], s = slots[i];
        if (s < 0) continue;
        keys[k++] = ((uint64_t)s << pos_bits) | (uint64_t)(labels ? labels[i] : i);
        for (int p = 0; p < passes; p++) hist[(uint64_t)p * radix + (((uint64_t)s >> (p * width)) & digit_mask)]++;
    }
    for (int p = 0; p < passes && k > 0; p++) {
        uint32_t *h = hist + (uint64_t)p * radix;
        const int shift = pos_bits + p * width;
        if (h[(keys[0] >> shift) & digit_mask] == (uint32_t)k) continue; /* one digit for all */
        uint32_t sum = 0;
        for (uint64_t d = 0; d < radix; d++) {
            const uint32_t c = h[d];
            h[d] = sum;
            sum += c;
        }
        for (int64_t t = 0; t < k; t++) {
            const uint64_t key = keys[t];
            other[h[(key >> shift) & digit_mask]++] = key;
        }
        uint64_t *swap = keys;
        keys = other;
        other = swap;
    }
    const uint64_t pos_mask = ((uint64_t)1 << pos_bits) - 1; /* pos_bits < 64: positions fit int64 */
    int64_t n_unique = 0;
    uint64_t prev = 0;
    for (int64_t t = 0; t < k; t++) {
        const uint64_t slot = keys[t] >> pos_bits;
        const int64_t i = (int64_t)(keys[t] & pos_mask);
        if (t == 0 || slot != prev) {
            g->unique_pos[n_unique] = i;
            g->unique_slot[n_unique] = (int64_t)slot;
            g->group_start[n_unique++] = t;
            prev = slot;
        }
        g->group_pos[t] = i;
    }
    g->group_start[n_unique] = k;
    g->n_unique = n_unique;
}

/* cn_groups_build_in in a block of its own (cn_groups_free frees it). Returns 0, or -1 when out
 * of memory (nothing allocated). */
static inline int cn_groups_build(const int64_t *restrict slots, const int64_t *restrict positions, int64_t m,
                                  cn_groups *g) {
    void *block = malloc(cn_groups_scratch_bytes(m));
    if (block == NULL) {
        memset(g, 0, sizeof(*g));
        return -1;
    }
    cn_groups_build_in(slots, positions, m, g, block);
    g->block = block;
    return 0;
}

/* Whether every value of the (rows, dim) gradient with row stride ld is finite: a NaN or inf
 * gradient would overwrite every row it touches for good, so the backward refuses it before
 * any row changes. A float is not finite exactly when its exponent bits are all ones; testing
 * the bits is an integer OR-reduction, which vectorises (a float sum of x - x would be a serial
 * chain of dependent adds without -ffast-math), so the pass runs at memory speed. */
static inline int cn_all_finite(const float *g, int64_t rows, int64_t dim, int64_t ld) {
    uint32_t bad = 0;
    for (int64_t r = 0; r < rows; r++) {
        const uint32_t *restrict x = (const uint32_t *)(const void *)(g + r * ld);
        for (int64_t d = 0; d < dim; d++) bad |= (uint32_t)((x[d] & 0x7f800000u) == 0x7f800000u);
    }
    return bad == 0;
}

/* bag_of[i] = the bag of key position i; NULL when out of memory. */
typedef struct {
    const int64_t *offsets;
    int64_t *bag_of;
} cn_bag_of_job;

static void cn_bag_of_range(void *ctx, int64_t begin, int64_t end) {
    const cn_bag_of_job *j = (const cn_bag_of_job *)ctx;
    for (int64_t b = begin; b < end; b++)
        for (int64_t i = j->offsets[b]; i < j->offsets[b + 1]; i++) j->bag_of[i] = b;
}

static inline int64_t *cn_bag_of(const int64_t *offsets, int64_t n_bags, int nthreads) {
    const int64_t n = offsets[n_bags];
    int64_t *bag_of = (int64_t *)malloc((size_t)(n ? n : 1) * sizeof(int64_t));
    if (bag_of == NULL) return NULL;
    cn_bag_of_job job = {offsets, bag_of};
    cn_parallel_for(cn_bag_of_range, &job, n_bags, nthreads);
    return bag_of;
}

/* Sum the gradient contributions of unique row u into acc[0:dim]. With by_bag the groups hold
 * each key's bag, not its position (cn_grad_by_bag: sum or mean pooling, no per-sample weights). */
static inline void cn_grad_accumulate(const cn_groups *g, int64_t u, const int64_t *restrict bag_of, int by_bag,
                                      int64_t dim, const int64_t *restrict offsets, const float *restrict weights,
                                      int mode, const int64_t *restrict argmax,
                                      const float *restrict grad, int64_t ld_grad, float *restrict acc) {
    for (int64_t d = 0; d < dim; d++) acc[d] = 0.0f;
    for (int64_t j = g->group_start[u]; j < g->group_start[u + 1]; j++) {
        const int64_t i = g->group_pos[j];
        const int64_t b = by_bag ? i : bag_of[i];
        const float *restrict gb = grad + b * ld_grad;
        if (mode == CN_POOL_MAX) {
            const int64_t *restrict am = argmax + b * dim;
            for (int64_t d = 0; d < dim; d++) acc[d] += am[d] == i ? gb[d] : 0.0f;
        } else {
            float scale = weights ? weights[i] : 1.0f;
            if (mode == CN_POOL_MEAN) scale /= (float)(offsets[b + 1] - offsets[b]);
            for (int64_t d = 0; d < dim; d++) acc[d] += scale * gb[d];
        }
    }
}

static inline void cn_meta_record(const cn_arena *a, int64_t slot, int64_t occurrences, uint32_t step) {
    cn_meta *m = cn_arena_meta(a, slot);
    uint64_t c = (uint64_t)m->count + (uint64_t)occurrences;
    m->count = c > UINT32_MAX ? UINT32_MAX : (uint32_t)c;
    m->last_step = step;
}

/* Gradient of every unique row: grads_out[u, 0:dim] (u in first-occurrence order). With
 * touch_meta, records the accesses (see above). */
typedef struct {
    const cn_groups *g;
    const int64_t *bag_of;
    const cn_arena *a;
    int64_t dim;
    const int64_t *slots, *offsets;
    const float *weights;
    int mode;
    const int64_t *argmax;
    const float *grad;
    int64_t ld_grad;
    float *grads_out;
    int touch_meta;
    uint32_t step;
} cn_grad_unique_job;

static void cn_grad_unique_range(void *ctx, int64_t begin, int64_t end) {
    const cn_grad_unique_job *j = (const cn_grad_unique_job *)ctx;
    const cn_groups *g = j->g;
    for (int64_t u = begin; u < end; u++) {
        cn_grad_accumulate(g, u, j->bag_of, 0, j->dim, j->offsets, j->weights, j->mode, j->argmax, j->grad, j->ld_grad,
                           j->grads_out + u * j->dim);
        if (j->touch_meta)
            cn_meta_record(j->a, g->unique_slot[u], g->group_start[u + 1] - g->group_start[u], j->step);
    }
}

static inline void cn_grad_unique(const cn_groups *g, const int64_t *bag_of, const cn_arena *a, int64_t dim,
                                  const int64_t *slots, const int64_t *offsets, const float *weights, int mode,
                                  const int64_t *argmax, const float *grad, int64_t ld_grad, float *grads_out,
                                  int touch_meta, uint32_t step, int nthreads) {
    cn_grad_unique_job job = {g, bag_of, a, dim, slots, offsets, weights, mode, argmax, grad, ld_grad, grads_out,
                              touch_meta, step};
    cn_parallel_for(cn_grad_unique_range, &job, g->n_unique, nthreads);
}

/* Whether the fused backward's groups hold each key's bag instead of its position: for sum and
 * mean pooling without per-sample weights a key's contribution depends on its bag alone, and
 * a row's keys in key order have non-decreasing bags, so the sums are the same bits; the
 * update loop then reads the gradient row at once instead of bag_of[position] first, a
 * random read into an 8-byte-a-key array (at 81,920 keys, 640 KiB) that perf put 25 % of the
 * update loop's samples on (8M x 16, row-wise Adagrad, uniform IDs). Max pooling compares the
 * position with the argmax, and weights are per position: those keep positions. */
static inline int cn_grad_by_bag(int mode, const float *weights) { return mode != CN_POOL_MAX && weights == NULL; }

/* The thread (of nt) that owns a row in the fused backward: a multiplicative hash of the
 * slot scaled to [0, nt), so no division. */
static inline int cn_row_owner(int64_t slot, int nt) {
    return (int)(((uint64_t)((uint32_t)slot * 0x9E3779B9u) * (uint64_t)nt) >> 32);
}

/* SGD is linear in the gradient, so a row needs no grouping: its owner applies each
 * occurrence's share in key order (w -= lr * scale * g_i), which skips the dedup map. The
 * rounding differs from one update with the summed gradient only in the last bits, and is
 * the same for every thread count (each row still sees its keys in key order). */
static inline void cn_grad_apply_sgd_direct(const cn_arena *a, int64_t dim, const int64_t *slots,
                                            const int64_t *mine, int64_t m, const int64_t *bag_of,
                                            const int64_t *offsets, const float *weights, int mode,
                                            const float *grad, int64_t ld_grad, float lr, int touch_meta,
                                            uint32_t step) {
    const int64_t row_bytes = dim * (int64_t)sizeof(float);
    for (int64_t j = 0; j < m; j++) {
        if (j + CN_PREFETCH_DISTANCE < m) {
            const int64_t ahead = slots[mine[j + CN_PREFETCH_DISTANCE]];
            cn_prefetch_write(cn_arena_row(a, ahead), row_bytes);
            if (touch_meta) __builtin_prefetch(cn_arena_meta(a, ahead), 1, 3);
        }
        const int64_t i = mine[j], b = bag_of[i], s = slots[i];
        float scale = weights ? weights[i] : 1.0f;
        if (mode == CN_POOL_MEAN) scale /= (float)(offsets[b + 1] - offsets[b]);
        const float step_size = lr * scale;
        float *restrict w = cn_arena_row(a, s);
        const float *restrict gb = grad + b * ld_grad;
        for (int64_t d = 0; d < dim; d++) w[d] -= step_size * gb[d];
        if (touch_meta) cn_meta_record(a, s, 1, step);
    }
}

/* The fused backward's work for one share of the rows (the rows cn_row_owner gives to `share`
 * of n_shares): the share's key positions in key order, and for the non-SGD optimizers their
 * grouping by row.
 *
 * Memory: every share's arrays lie in one block that the calling thread allocates once the
 * shares have counted their keys, so none is malloc'd on a pool worker. A worker's malloc
 * comes from that thread's own glibc arena, which keeps the freed bytes resident: glibc raises
 * its trim threshold with its mmap threshold (to twice a freed mapped block, up to 64 MiB; see
 * cn_alloc.h), so an arena is returned only by malloc_trim. Each worker's arena then held its
 * largest backward's scratch (n positions per share, whatever its count, and a grouping map
 * of 16 bytes per 2m slots: ~1 MiB a share at 16k IDs) between trims, beside the caller's.
 * The SSD tier's 3x uniform benchmark step (32 MiB cache, the core on 2 threads) held
 * 1.19-1.21x of cache + disk index between steps; one arena for all threads
 * (MALLOC_ARENA_MAX=1, which a library must not set) gave 1.11. The count is one more pass
 * over the slots per share (a multiply and a shift a key, and an OR for the slots' bits); the
 * backward of 16k IDs on a 2M-row table, one thread, took 2.94 ms before and 2.90 after
 * (medians of eight alternated runs, CPU time). Built for every share before any is applied,
 * so that running out of memory changes no row. */
typedef struct {
    cn_groups g;
    int64_t *mine;
    int64_t m;
    int slot_bits;    /* bits of the share's largest slot */
    int sorted;       /* grouped by cn_groups_sort_in (else by the map, cn_groups_build_in) */
    float *acc; /* the summed gradient of one row (not for direct SGD) */
    void *scratch; /* the grouping's scratch */
} cn_grad_share;

typedef struct {
    const cn_arena *a;
    int64_t dim, n;
    int row_dtype;
    const int64_t *slots, *offsets, *bag_of, *argmax;
    const float *weights, *grad;
    int mode, touch_meta, direct, n_shares;
    int by_bag; /* the groups hold bags (cn_grad_by_bag) */
    int64_t n_bags;
    int64_t ld_grad;
    const cn_optim *opt;
    uint32_t step;
    cn_grad_share *shares;
} cn_grad_apply_job;

/* Whether key position i has a row, of share sh. */
static inline int cn_grad_owns(const cn_grad_apply_job *j, int64_t i, int64_t sh) {
    const int64_t s = j->slots[i];
    return (s >= 0) & (cn_row_owner(s, j->n_shares) == sh);
}

static void cn_grad_count_range(void *ctx, int64_t begin, int64_t end) {
    const cn_grad_apply_job *j = (const cn_grad_apply_job *)ctx;
    for (int64_t sh = begin; sh < end; sh++) {
        int64_t m = 0;
        uint64_t slot_bits = 0; /* the OR of the share's slots: as many bits as the largest */
        for (int64_t i = 0; i < j->n; i++) {
            const int owns = cn_grad_owns(j, i, sh);
            m += owns;
            slot_bits |= (uint64_t)j->slots[i] & (0 - (uint64_t)owns);
        }
        j->shares[sh].m = m;
        j->shares[sh].slot_bits = cn_bits_for(slot_bits);
    }
}

/* Bits of the labels the sorted groups hold: bags or key positions. */
static inline int cn_grad_label_bits(const cn_grad_apply_job *j) {
    return cn_bits_for((uint64_t)((j->by_bag ? j->n_bags : j->n) - 1));
}

static void cn_grad_build_range(void *ctx, int64_t begin, int64_t end) {
    const cn_grad_apply_job *j = (const cn_grad_apply_job *)ctx;
    for (int64_t sh = begin; sh < end; sh++) {
        cn_grad_share *share = &j->shares[sh];
        int64_t m = 0;
        for (int64_t i = 0; i < j->n; i++) { /* branch-free: ownership is a coin toss per key */
            share->mine[m] = i;
            m += cn_grad_owns(j, i, sh);
        }
        if (j->direct) continue;
        if (share->sorted)
            cn_groups_sort_in(j->slots, share->mine, m, j->by_bag ? j->bag_of : NULL, share->slot_bits,
                              cn_grad_label_bits(j), &share->g, share->scratch);
        else
            cn_groups_build_in(j->slots, share->mine, m, &share->g, share->scratch);
    }
}

/* Bytes rounded up to 16, so that each share's arrays in the block start 16-byte aligned. */
static inline size_t cn_round16(size_t bytes) { return (bytes + 15) & ~(size_t)15; }

/* The shares' arrays (their counts m set) laid out one after another from `block`, each 16-byte
 * aligned: the positions, and unless direct the grouping's scratch and the gradient with a
 * widened row. Returns the bytes they take; with block NULL it only counts them. */
static inline size_t cn_grad_layout(cn_grad_share *shares, int n_shares, int64_t dim, int label_bits, int direct,
                                    char *block) {
    size_t at = 0;
    for (int sh = 0; sh < n_shares; sh++) {
        cn_grad_share *share = &shares[sh];
        if (block) share->mine = (int64_t *)(block + at);
        at += cn_round16((size_t)(share->m + 1) * sizeof(int64_t)); /* + 1: filled branch-free */
        if (direct) continue;
        share->sorted = share->slot_bits + label_bits <= 64 && share->m < ((int64_t)1 << 32);
        if (block) share->scratch = block + at;
        at += cn_round16(share->sorted ? cn_groups_sort_scratch_bytes(share->m) : cn_groups_scratch_bytes(share->m));
        if (block) share->acc = (float *)(block + at);
        at += cn_round16((size_t)(2 * dim + 16) * sizeof(float));
    }
    return at;
}

static void cn_grad_update_range(void *ctx, int64_t begin, int64_t end) {
    const cn_grad_apply_job *j = (const cn_grad_apply_job *)ctx;
    const cn_arena *a = j->a;
    const int64_t dim = j->dim, row_bytes = a->row_bytes, emb_floats = cn_dtype_row_floats(j->row_dtype, dim);
    const int dtype = j->row_dtype;
    const int state_in_meta = cn_optim_state_in_meta(j->opt->kind);
    const int use_meta = j->touch_meta || state_in_meta;
    const int64_t *slots = j->slots;
    for (int64_t sh = begin; sh < end; sh++) {
        const cn_grad_share *share = &j->shares[sh];
        if (j->direct) {
            cn_grad_apply_sgd_direct(a, dim, slots, share->mine, share->m, j->bag_of, j->offsets, j->weights, j->mode,
                                     j->grad, j->ld_grad, j->opt->lr, j->touch_meta, j->step);
            continue;
        }
        float *acc = share->acc;
        const cn_groups *g = &share->g;
        const int64_t n_unique = g->n_unique;
        const int by_bag = j->by_bag && share->sorted;
        for (int64_t u = 0; u < n_unique; u++) {
            if (u + CN_PREFETCH_DISTANCE < n_unique) {
                const int64_t ahead = g->unique_slot[u + CN_PREFETCH_DISTANCE];
                cn_prefetch_write(cn_arena_row(a, ahead), row_bytes);
                if (use_meta) __builtin_prefetch(cn_arena_meta(a, ahead), 1, 3);
            }
            const int64_t s = g->unique_slot[u];
            float *row = cn_arena_row(a, s);
            float *state = state_in_meta ? &cn_arena_meta(a, s)->scalar_state : row + emb_floats;
            cn_grad_accumulate(g, u, j->bag_of, by_bag, dim, j->offsets, j->weights, j->mode, j->argmax, j->grad,
                               j->ld_grad, acc);
            if (dtype == CN_ROW_F32) {
                cn_optim_apply(j->opt, row, state, acc, dim);
            } else { /* widen, update in float32, round once (cn_dtype.h) */
                float *wide = acc + dim;
                cn_row_load(dtype, row, wide, dim);
                cn_optim_apply(j->opt, wide, state, acc, dim);
                cn_row_store(dtype, wide, row, dim);
            }
            if (j->touch_meta) cn_meta_record(a, s, g->group_start[u + 1] - g->group_start[u], j->step);
        }
    }
}

/* Fused backward: accumulate each distinct row's gradient and apply the optimizer to the row
 * in place (see the top of this file). Rows are split into n_shares = nthreads shares by
 * cn_row_owner, so no two threads touch one row and each row sees its keys in key order: the
 * result does not depend on the thread count. Returns -1 when out of memory, before any row
 * changed. */
static inline int cn_grad_apply(const cn_arena *a, int64_t dim, int row_dtype, const int64_t *slots,
                                const int64_t *offsets,
                                int64_t n_bags, const float *weights, int mode, const int64_t *argmax,
                                const float *grad, int64_t ld_grad, const cn_optim *opt, int touch_meta,
                                uint32_t step, int nthreads) {
    const int64_t n = offsets[n_bags];
    if (n == 0) return 0;
    if (nthreads < 1) nthreads = 1;
    int64_t *bag_of = cn_bag_of(offsets, n_bags, nthreads);
    cn_grad_share *shares = (cn_grad_share *)calloc((size_t)nthreads, sizeof(cn_grad_share));
    if (bag_of == NULL || shares == NULL) {
        free(bag_of);
        free(shares);
        return -1;
    }
    /* Direct SGD applies each key's share on its own: for low-precision rows that would round
     * once per key, so they take the grouped path (one update with the summed gradient). */
    const int direct = opt->kind == CN_OPT_SGD && mode != CN_POOL_MAX && row_dtype == CN_ROW_F32;
    cn_grad_apply_job job = {a, dim, n, row_dtype, slots, offsets, bag_of, argmax, weights, grad, mode, touch_meta,
                             direct, nthreads, cn_grad_by_bag(mode, weights), n_bags, ld_grad, opt, step, shares};
    cn_parallel_for(cn_grad_count_range, &job, nthreads, nthreads);
    const int label_bits = cn_grad_label_bits(&job);
    char *block = (char *)malloc(cn_grad_layout(shares, nthreads, dim, label_bits, direct, NULL));
    if (block != NULL) {
        cn_grad_layout(shares, nthreads, dim, label_bits, direct, block);
        cn_parallel_for(cn_grad_build_range, &job, nthreads, nthreads);
        cn_parallel_for(cn_grad_update_range, &job, nthreads, nthreads);
    }
    free(block);
    free(shares);
    free(bag_of);
    return block == NULL ? -1 : 0;
}

#endif

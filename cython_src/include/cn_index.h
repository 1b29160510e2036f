/* cn_index.h: the key index, a map from int64 key to int64 slot.
 *
 * Design
 * ------
 * Open addressing with linear probing over an array of 16-byte buckets {key, slot} of any
 * length n >= CN_INDEX_MIN_BUCKETS (4: one cache line; see "Why a minimum of 4" below).
 * Occupancy lives in the slot field (slot < 0 means empty), never in the key, so every int64
 * value, 0, -1, INT64_MIN and INT64_MAX included, is a valid key: no key is reserved.
 *
 * A key's home bucket is (h * n) >> 64 on the 128-bit product ("fastrange"), h = mix64(key ^
 * salt) (cn_mix.h), whose avalanche makes linear probing behave well even on sequential or strided
 * IDs; probes run on from the home and wrap from n - 1 to 0. Four buckets share a cache line, so
 * a probe sequence at the default load factor (<= 0.7) usually touches one line.
 *
 * Why any n and not a power of two (home = h & (n - 1), which this index used until now): the
 * index is what a row costs beyond its values, and a power of two can only be 0.35..0.7 full at
 * a maximum load of 0.7, i.e. 23..46 bytes a key depending on where the size falls. A bounded
 * table (cn_evict.h) at 140,872 rows, the cn-dlrm job's 50 % budget, sat at load 0.54 (29.8
 * bytes a key) and 8M rows at 0.48 (33.6). Now n is what the load needs, and growth multiplies n
 * by CN_INDEX_GROWTH = 1.25 (not 2): an unbounded table is 0.56..0.7 full (23..29 bytes a key),
 * and a table with a row budget stops growing at exactly ceil(max_rows / max_load) buckets, so at
 * its budget it costs 16 / 0.7 = 22.9 bytes a key and never rehashes again. What it costs:
 *  - the higher load itself. A find at the same load is as fast as before (C, one thread, 8M
 *    keys, batch 81,920, p25 of 21 rounds on a loaded 2-core machine: 17.9 ns a key with the
 *    power of two and the AND, 18.0 with fastrange and the salt, both 0.48 full; 28.0 against
 *    28.1 at 0.68), but probes run longer as the load rises: 18.0 ns at 0.48, 23.6 at 0.60, 28.3
 *    at 0.70. So where a power of two happened to leave an index half empty (1M and 8M keys),
 *    finds are 10-35 % slower now; where it had just filled up, no slower. Prefetching the next
 *    line as well when the home is in the second half of its line did not help (25.1 against
 *    25.4 ns at 0.70). Who needs the speed more than the bytes sets max_load_factor lower.
 *  - growth: 5 moves a key in rehashes over a table's growth instead of 2 (n/(1 - 1/1.25)
 *    against n/(1 - 1/2)), each a random write (below). Filling 8M keys from empty, 81,920 a
 *    call, in C: about 300 ns a key against 100-130 with doubling; growth 1.5 (bytes a key
 *    23-34) took 120-250. A bounded table stops growing at its budget; `capacity` or
 *    `reserve` sizes any table once.
 *
 * Why a minimum of 4 buckets (one 64-byte line, cn_alloc's unit) and not 16 as until now: a
 * bounded table's index is what a row costs beyond its values, and a DLRM has tiny tables. On
 * the synthetic stream at the 25 % budget with --budget-floor none, 11 tables got budgets of 1-2
 * rows; each held a 16-bucket index (256 B) for 1-2 keys, and a 1-row table was charged 344 B
 * (a fixed row of hashing: 68 B), so hashing "of the same memory" had 5-6 rows there
 * (docs/bounded-tables.md, 2026-12-08). 4 buckets hold 2 keys at the default max_load 0.7; fewer
 * would save nothing (cn_alloc rounds every block up to 64 bytes). Every loop here needs only
 * one empty bucket to stop, which max_load < 1 guarantees at any n >= 2 (capacity is
 * floor(max_load * n) < n); growth by 1.25 from 4 gives 5, 6, 7, 8, ... (each step adds at
 * least one bucket: cn_index_growth_buckets also takes at least n + 1). Table files store keys,
 * not buckets, so a table saved with a 16-bucket index loads into whatever size its rows need.
 * Big tables are unaffected: the minimum only acts below 12 keys at load 0.7.
 *
 * Why the salt, a function of n: with fastrange a bucket's position is monotone in h, so walking
 * the buckets in order (export, table files, cn_table_scan) yields keys sorted by h. Inserting
 * such a run a chunk at a time into a table with the same hash and a different n (loading a saved
 * table in chunks, merging shards) put the first chunk's keys, whose h all lie in a narrow range,
 * into a narrow range of buckets: one cluster, quadratic inserts. A power of two hid this (the
 * low bits order keys the same way at every size, so a prefix never crowds). salt = mix64(n)
 * makes the order of any other size unrelated to this one's, at the cost of one XOR a key.
 * Sharded routing (cncore/routing.py) salts its own hash the same way.
 *
 * Erase uses backward-shift deletion (no tombstones), so lookups never slow down after many
 * erases and the load factor is exactly size / buckets.
 *
 * Slots are stable: the index may rehash freely, the rows it points to (cn_arena.h) never move.
 *
 * Batch lookups issue a software prefetch for the bucket of the key CN_PREFETCH_DISTANCE
 * positions ahead; on a table larger than the caches this turns one dependent cache miss per
 * key into many misses in flight, which is what decides the speed (memory-level parallelism).
 */
#ifndef CN_INDEX_H
#define CN_INDEX_H

#include <stdint.h>
#include <string.h>
#include "cn_alloc.h"
#include "cn_mix.h"
#include "cn_parallel.h"

typedef struct {
    int64_t key;
    int64_t slot; /* < 0: empty */
} cn_bucket;

typedef struct {
    cn_bucket *buckets;
    int64_t n_buckets; /* any count >= CN_INDEX_MIN_BUCKETS */
    uint64_t salt;     /* mix64(n_buckets): see the design note */
    int64_t size;
} cn_index;

/* The unsalted key hash; the index's own is cn_index_hash. */
static inline uint64_t cn_hash_key(int64_t key) { return cn_mix64((uint64_t)key); }

/* The fewest buckets an index has: one cache line (design note). */
#define CN_INDEX_MIN_BUCKETS ((int64_t)4)

static inline int64_t cn_pow2_at_least(int64_t n) {
    int64_t p = 16;
    while (p < n) p <<= 1;
    return p;
}

/* A key's home bucket in an index of n buckets with this salt. */
static inline uint64_t cn_index_home_of(uint64_t salt, uint64_t n, int64_t key) {
    return (uint64_t)(((unsigned __int128)cn_mix64((uint64_t)key ^ salt) * n) >> 64);
}

static inline uint64_t cn_index_home(const cn_index *ix, int64_t key) {
    return cn_index_home_of(ix->salt, (uint64_t)ix->n_buckets, key);
}

/* The bucket after i, wrapping at n. */
static inline uint64_t cn_index_next(uint64_t i, uint64_t n) {
    i += 1;
    return i == n ? 0 : i;
}

/* The most buckets an index may have: 2^56 buckets are 1 EiB, far past any machine, and the
 * bound keeps n_buckets * sizeof(cn_bucket) and every growth below it free of overflow. */
#define CN_INDEX_MAX_BUCKETS ((int64_t)1 << 56)

/* Growth multiplies the bucket count by this much (at least): see the design note. */
#ifndef CN_INDEX_GROWTH
#define CN_INDEX_GROWTH 1.25
#endif

/* The fewest buckets (>= CN_INDEX_MIN_BUCKETS) that hold n_keys keys at or under max_load, or -1
 * when that is more than CN_INDEX_MAX_BUCKETS (a request no machine can hold: the caller refuses
 * it). Without the bound, n_keys near 2^59 wrapped n_buckets * 16 to 0 bytes. The capacity test is
 * the one cn_table_capacity makes, so the count returned always passes it despite rounding. */
static inline int64_t cn_index_buckets_for(int64_t n_keys, double max_load) {
    double need = (double)n_keys / max_load;
    if (!(need <= (double)CN_INDEX_MAX_BUCKETS)) return -1;
    int64_t n = (int64_t)need;
    if ((double)n < need) n++; /* ceil: 700 keys at 0.7 take 1001 buckets, as 700 / 0.7 rounds up */
    if (n < CN_INDEX_MIN_BUCKETS) n = CN_INDEX_MIN_BUCKETS;
    while ((int64_t)(max_load * (double)n) < n_keys) n++;
    return n <= CN_INDEX_MAX_BUCKETS ? n : -1;
}

/* The bucket count to grow an index of `ix` to so that it holds n_keys keys at max_load: at
 * least CN_INDEX_GROWTH times the present count (amortised rehashes), but no more than
 * `limit_keys` need (a table's row budget; <= 0: none), and never fewer than n_keys need. -1
 * when n_keys need more than CN_INDEX_MAX_BUCKETS. */
static inline int64_t cn_index_growth_buckets(const cn_index *ix, int64_t n_keys, double max_load,
                                              int64_t limit_keys) {
    const int64_t need = cn_index_buckets_for(n_keys, max_load);
    if (need < 0) return -1;
    double grown = (double)ix->n_buckets * CN_INDEX_GROWTH;
    int64_t n = grown < (double)CN_INDEX_MAX_BUCKETS ? (int64_t)grown : CN_INDEX_MAX_BUCKETS;
    if (n <= ix->n_buckets && ix->n_buckets < CN_INDEX_MAX_BUCKETS) n = ix->n_buckets + 1; /* a small n: 1.25 x 3 is 3 */
    if (limit_keys > 0) {
        const int64_t cap = cn_index_buckets_for(limit_keys, max_load);
        if (cap > 0 && n > cap) n = cap;
    }
    return n > need ? n : need;
}

static inline int cn_index_init(cn_index *ix, int64_t n_buckets, int64_t *nbytes) {
    if (n_buckets < CN_INDEX_MIN_BUCKETS || n_buckets > CN_INDEX_MAX_BUCKETS) return -1;
    ix->buckets = (cn_bucket *)cn_alloc((size_t)n_buckets * sizeof(cn_bucket), nbytes);
    if (ix->buckets == NULL) return -1;
    memset(ix->buckets, 0xff, (size_t)n_buckets * sizeof(cn_bucket)); /* slot = -1 everywhere */
    ix->n_buckets = n_buckets;
    ix->salt = cn_mix64((uint64_t)n_buckets);
    ix->size = 0;
    return 0;
}

static inline void cn_index_free(cn_index *ix, int64_t *nbytes) {
    cn_free(ix->buckets, (size_t)ix->n_buckets * sizeof(cn_bucket), nbytes);
    ix->buckets = NULL;
    ix->n_buckets = 0;
    ix->salt = 0;
    ix->size = 0;
}

static inline void cn_index_prefetch(const cn_index *ix, int64_t key) {
    __builtin_prefetch(&ix->buckets[cn_index_home(ix, key)], 0, 3);
}

/* The slot of `key`, or -1, probing from bucket i = its home (computed by the caller). */
static inline int64_t cn_index_find_from(const cn_bucket *b, uint64_t n, uint64_t i, int64_t key) {
    for (;;) {
        int64_t s = b[i].slot;
        if (s < 0) return -1;
        if (b[i].key == key) return s;
        i = cn_index_next(i, n);
    }
}

/* The slot of `key`, or -1. */
static inline int64_t cn_index_find(const cn_index *ix, int64_t key) {
    return cn_index_find_from(ix->buckets, (uint64_t)ix->n_buckets, cn_index_home(ix, key), key);
}

/* The slot of `key` and *pos its bucket if present; otherwise -1 and *pos is the empty bucket
 * where it would go. */
static inline int64_t cn_index_probe(const cn_index *ix, int64_t key, int64_t *pos) {
    const uint64_t n = (uint64_t)ix->n_buckets;
    uint64_t i = cn_index_home(ix, key);
    const cn_bucket *b = ix->buckets;
    for (;;) {
        int64_t s = b[i].slot;
        if (s < 0 || b[i].key == key) {
            *pos = (int64_t)i;
            return s < 0 ? -1 : s;
        }
        i = cn_index_next(i, n);
    }
}

static inline void cn_index_put_at(cn_index *ix, int64_t pos, int64_t key, int64_t slot) {
    ix->buckets[pos].key = key;
    ix->buckets[pos].slot = slot;
    ix->size += 1;
}

/* The batch find prefetches the bucket of the key 128 keys ahead into the L2 cache only
 * (locality 2: prefetcht1), not into L1 (prefetcht0). A prefetch into L1 holds one of the core's
 * few L1 miss buffers until its line arrives; into L2 it does not, so more misses are in flight.
 * A C loop of random 64-byte reads from 1 GiB on this machine (Zen 4, one thread): prefetcht0
 * 9.2-9.9 ns a line at any distance from 4 to 128 lines; prefetcht1 8.0 at 16, 6.1 at 32, 5.9 at
 * 64 and 128. Find + pool (cn_pool.h, rows prefetched the same way), best of three alternated
 * runs (the machine was loaded): 1M x 64 pooling 20 uniform 4430 -> 3080 us, Zipf 2500 -> 2200 us,
 * 8M x 128 uniform 8080 -> 5640-5960 us (distances 64 to 256 alike; 32 in L1 before). */
#ifndef CN_FIND_PREFETCH_DISTANCE
#define CN_FIND_PREFETCH_DISTANCE 128
#endif
#ifndef CN_FIND_PREFETCH_LOCALITY
#define CN_FIND_PREFETCH_LOCALITY 2
#endif
/* And once more into L1, 16 keys ahead, from the position parked in slots[] (no second hash): the
 * probe then finds its line in L1 rather than L2. Find pass alone, best of three: 1M rows Zipf
 * 893-914 -> 764-831 us, uniform 1267-1312 -> 1065-1169, 8M rows dim 16 uniform 1380-1435 ->
 * 1273-1524 (8 and 32 keys about the same). */
#ifndef CN_FIND_L1_DISTANCE
#define CN_FIND_L1_DISTANCE 16
#endif
/* Measured again on a 2-core Xeon VM (Ice Lake class, L2 1.25 MiB a core, L3 48 MiB; issue 12),
 * with the C driver of cn_pool.h (1M rows x 16, 81,920 IDs at pooling 20, a 96 MiB flush before
 * each pass, one thread, medians of 12):
 *  - Distances and localities: 128/L2 + 16/L1 (these) 2480-2720 us; 16, 32 or 64 into L1 with no
 *    second prefetch 2160-2770; 128/L2 alone 2610-2700; 32/L2 + 8/L1 2100-2620: all within the
 *    noise. The find pass is not bound by its misses there: run again with its lines in the
 *    cache it took as long (2250 us cold, 2250 warm), and on a 10,000-key index (L2-resident)
 *    still 980-1150 us, 12-14 ns a key, against 7.5 for the pool pass over the same IDs.
 *  - Prefetching the next line too (a probe runs into it for 19 % of the keys at load 0.7: mean
 *    probe 2.17 buckets, 35 % of keys need more than one): when the home is in the last one,
 *    two or three buckets of its line, 2280-2740 us against 2250-2630 without. Rejected.
 *  - Probing the home line with AVX-512 (one compare of the 4 keys and 4 slots, the first hit or
 *    empty bucket from the home by a bit scan; the next line only when the home line has
 *    neither), which takes the probe loop's mispredicted exit branch from 35 % of keys to 19 %:
 *    Zipf 1790-1930 us against 1340-1710 for this loop, uniform 3250 against 2780, 10,000 keys
 *    1122 against 1123. Rejected: the branch is not what the pass waits on.
 * On this machine random reads cost more the larger the region they fall in, prefetched or not
 * (C loop, one thread, 81,920 random lines, huge pages: 24 MiB 9.5 ns a line, 64 MiB 12.5,
 * 183 MiB 22.7, 512 MiB 36.8, 2 GiB 72.5; a guest on host pages, so translation misses): the
 * 8M-key index (183 MiB) costs about a third of what a row line of a 2 GiB table does.
 * Measured again on an AMD EPYC (Zen 4) 2-core VM (L2 1 MiB a core, L3 32 MiB), a C driver over
 * this header, one thread, 81,920 uniform keys, a 96 MiB flush before the first of two passes
 * over the same keys ("cold" / "warm"), ns a key, three to six runs:
 *  - This loop: 10,000 keys (L2-resident) 9.4-10.5; 1M keys 20-28 cold, 14-18 warm; 8M 27-32 /
 *    24-29. The hash alone is 1.7. A plain loop without prefetches: 11 / 11, 38-57 / 35-41.
 *  - Branch-free probes, rejected: the home line's four buckets compared with conditional moves
 *    (a hit anywhere in the line is the key's bucket, keys being unique; the loop only when the
 *    line has neither the key nor an empty bucket at or after the home) 15-16 / 15-16 at 10,000
 *    keys, 31-35 / 24-26 at 1M, 39-43 / 37-40 at 8M; the home bucket alone branch-free and the
 *    rest in a second pass over the unresolved keys 13-14, 24-26 / 19-22, 32-33 / 27-29; a window
 *    of 4 or 8 buckets from the home 13-30 and 46-70. The mispredicted exit of this loop is not
 *    what a find waits on.
 *  - Probing in bucket order (a counting sort of the batch by home, 65,536 bins, then the
 *    probes in that order, prefetched 32 ahead), for the hardware prefetcher and the TLB: 27-38
 *    ns a key at 1M and 35-48 at 8M, against 21-29 and 27-38 for this loop. Rejected.
 *  - What does move it is the load: the same driver at max_load 0.5 took 7.1-7.7 at 10,000 keys,
 *    15-20 / 8.5-13.6 at 1M, 18-35 / 11-23 at 8M; at 0.4, 6.0-7.3, 13-16 / 7-10, 14.5-18 / 8.5-16
 *    (probes are shorter: 1.5 buckets on average for a key present at 0.5, 2.17 at 0.7). That is
 *    the table's max_load_factor, the user's choice between speed and 16 / load bytes a key.
 * Measured again on an Intel Xeon guest (2 cores, L2 2 MiB a core, L3 reported 480 MiB; other
 * jobs kept the load at 4.0-4.7; issue 34), where the forward trails nn.EmbeddingBag most at
 * dim 16 with Zipf IDs:
 *  - Where that forward goes (asv_bench/scripts/step_large.py's rows, 8M x 16, 4096 bags of 20,
 *    one thread, torch on huge pages, a 960 MiB flush before each call, 15 rounds interleaved,
 *    medians): Zipf 1.05, this find pass 2272 us (1311 when run again with its lines cached:
 *    16 ns a key that is not spent waiting on memory), the whole forward 4958, so the pool pass
 *    and the call about 2690, against the flat-array gather 2248 and EmbeddingBag 2375; uniform
 *    (minima, the medians too noisy) find 2587, forward 5831, gather 2528, EmbeddingBag 2717.
 *    The find is half of the forward; the pool pass is 1.2x the gather.
 *  - Deduplicating the batch before the find, so that each distinct key is probed once (81,920
 *    Zipf 1.05 IDs of 8M keys are 37.8 % distinct), rejected. A C driver over this header, one
 *    thread, a 960 MiB flush before each call, the loops alternated over the same 20 batches,
 *    slots checked equal, two runs, medians (p25-p75): this loop 2102-2160 us (2024-2218); an
 *    exact dedup first (a batch-sized open-addressing map of int32 positions under the same
 *    hash, kept between calls; the distinct keys then probed in this loop's pipeline, each
 *    repeat copying its first occurrence's slot) 2612-2615 (2495-2778); a lossy one inside this
 *    loop's own pass (a 4096-entry direct-mapped table of the call's key positions at the
 *    prefetch stage: a key found there copies the earlier one's slot instead of probing)
 *    2857-2888 (2789-2971). Uniform IDs (1 % repeats): 7047, 7659, 7399 median. A repeated key's
 *    bucket is already in L1 when it is probed, so its probe costs what the dedup's own lookup
 *    costs, and the dedup adds an unpredictable branch for every key. */
#if CN_FIND_L1_DISTANCE >= CN_FIND_PREFETCH_DISTANCE
#error "CN_FIND_L1_DISTANCE must be under CN_FIND_PREFETCH_DISTANCE (it reads the positions parked that far ahead)"
#endif

/* Slots of keys[0..n) (-1 where absent); read-only, safe for concurrent readers. slots must not
 * overlap keys (positions are parked in slots ahead of the probe, cn_index_find_range). */
typedef struct {
    const cn_index *ix;
    const int64_t *keys;
    int64_t *slots;
} cn_find_job;

static void cn_index_find_range(void *ctx, int64_t begin, int64_t end) {
    const cn_find_job *j = (const cn_find_job *)ctx;
    const cn_bucket *b = j->ix->buckets;
    const uint64_t n = (uint64_t)j->ix->n_buckets, salt = j->ix->salt;
    const int64_t *keys = j->keys;
    int64_t *slots = j->slots;
    /* Each key is hashed once: its bucket position waits in slots[] from its prefetch to its probe.
     * Hashing it again for the probe cost 15-20 % of the pass (one thread, batch 81920, best of
     * three: 1M rows Zipf 1015 -> 873 us, uniform 1467 -> 1206; 8M rows uniform 1806 -> 1411).
     * Rejected: hashing runs of 8, 16 or 32 keys in a loop of their own, which GCC vectorises
     * (vpmullq with AVX-512): 6-7 % faster here (1M rows Zipf 852-882 -> 790-826 us, uniform
     * 1211-1227 -> 1116-1160), but 10 % slower in the portable build, which has no 64-bit vector
     * multiply (Zipf 709-747 -> 796-819 us, uniform 1092-1130 -> 1215-1238). */
    for (int64_t i = begin; i < end && i < begin + CN_FIND_PREFETCH_DISTANCE; i++) {
        const uint64_t pos = cn_index_home_of(salt, n, keys[i]);
        slots[i] = (int64_t)pos;
        __builtin_prefetch(&b[pos], 0, CN_FIND_PREFETCH_LOCALITY);
    }
    for (int64_t i = begin; i < end; i++) {
        if (i + CN_FIND_PREFETCH_DISTANCE < end) {
            const uint64_t pos = cn_index_home_of(salt, n, keys[i + CN_FIND_PREFETCH_DISTANCE]);
            slots[i + CN_FIND_PREFETCH_DISTANCE] = (int64_t)pos;
            __builtin_prefetch(&b[pos], 0, CN_FIND_PREFETCH_LOCALITY);
        }
#if CN_FIND_L1_DISTANCE
        if (i + CN_FIND_L1_DISTANCE < end) __builtin_prefetch(&b[slots[i + CN_FIND_L1_DISTANCE]], 0, 3);
#endif
        slots[i] = cn_index_find_from(b, n, (uint64_t)slots[i], keys[i]);
    }
}

static inline void cn_index_find_batch(const cn_index *ix, const int64_t *keys, int64_t n,
                                       int64_t *slots, int nthreads) {
    cn_find_job job = {ix, keys, slots};
    cn_parallel_for(cn_index_find_range, &job, n, nthreads);
}

/* Remove `key`; returns its slot or -1. Backward-shift deletion keeps probe chains intact. */
static inline int64_t cn_index_erase(cn_index *ix, int64_t key) {
    const uint64_t n = (uint64_t)ix->n_buckets;
    cn_bucket *b = ix->buckets;
    uint64_t i = cn_index_home(ix, key);
    for (;;) {
        if (b[i].slot < 0) return -1;
        if (b[i].key == key) break;
        i = cn_index_next(i, n);
    }
    int64_t slot = b[i].slot;
    uint64_t hole = i;
    uint64_t j = i;
    for (;;) {
        j = cn_index_next(j, n);
        if (b[j].slot < 0) break;
        uint64_t home = cn_index_home(ix, b[j].key);
        /* b[j] may move into the hole only if its home is not in (hole, j] cyclically. */
        int in_between = (hole <= j) ? (home > hole && home <= j) : (home > hole || home <= j);
        if (!in_between) {
            b[hole] = b[j];
            hole = j;
        }
    }
    b[hole].slot = -1;
    ix->size -= 1;
    return slot;
}

/* Place `e` (a key not in the index) at the first empty bucket from its home. */
static inline void cn_index_place(cn_index *ix, cn_bucket e) {
    const uint64_t n = (uint64_t)ix->n_buckets;
    uint64_t j = cn_index_home(ix, e.key);
    while (ix->buckets[j].slot >= 0) j = cn_index_next(j, n);
    ix->buckets[j] = e;
}

/* Move every entry into a new array of n_buckets. On allocation failure returns -1 and the
 * index is unchanged. The new index has another salt, so the old buckets' order is a random
 * order of the new homes: each entry's new home is prefetched CN_REHASH_AHEAD buckets ahead.
 * Rejected: scattering the entries first into runs by the top bits of their new hash (each run
 * one stretch of the new array, 256 KiB, so placing a run stays in L2), through a temporary
 * array of 16 bytes a key: 49-125 ns an entry against 42-105 for this loop, one rehash of 8M
 * keys (C, 1.25x, this shared machine); the new array's TLB misses, not its cache misses, seem
 * to be what costs. A salt that stays with the index through growth made the old order the
 * new one and the rehash sequential (21-30 ns an entry), but brings back the crowding the salt
 * exists to prevent (design note). */
#ifndef CN_REHASH_AHEAD
#define CN_REHASH_AHEAD 16
#endif
static inline int cn_index_rehash(cn_index *ix, int64_t n_buckets, int64_t *nbytes) {
    cn_index fresh;
    if (cn_index_init(&fresh, n_buckets, nbytes) != 0) return -1;
    const cn_bucket *old = ix->buckets;
    const int64_t n_old = ix->n_buckets;
    for (int64_t i = 0; i < n_old; i++) {
        if (i + CN_REHASH_AHEAD < n_old && old[i + CN_REHASH_AHEAD].slot >= 0)
            cn_index_prefetch(&fresh, old[i + CN_REHASH_AHEAD].key);
        if (old[i].slot >= 0) cn_index_place(&fresh, old[i]);
    }
    fresh.size = ix->size;
    cn_index_free(ix, nbytes);
    *ix = fresh;
    return 0;
}

#endif

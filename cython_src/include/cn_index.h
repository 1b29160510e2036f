/* cn_index.h: the key index, a map from int64 key to int64 slot.
 *
 * Design
 * ------
 * Open addressing with linear probing over a power-of-two array of 16-byte buckets
 * {key, slot}. Occupancy lives in the slot field (slot < 0 means empty), never in the key, so
 * every int64 value, 0, -1, INT64_MIN and INT64_MAX included, is a valid key: no key is reserved.
 *
 * Keys are spread by a 64-bit finaliser (cn_mix.h), whose avalanche makes linear probing
 * behave well even on sequential or strided IDs. Four buckets share a cache line, so a probe
 * sequence at the default load factor (<= 0.7) usually touches one line.
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
    int64_t n_buckets; /* a power of two */
    int64_t mask;
    int64_t size;
} cn_index;

static inline uint64_t cn_hash_key(int64_t key) { return cn_mix64((uint64_t)key); }

static inline int64_t cn_pow2_at_least(int64_t n) {
    int64_t p = 16;
    while (p < n) p <<= 1;
    return p;
}

/* The most buckets an index may have: 2^56 buckets are 1 EiB, far past any machine, and the
 * bound keeps n_buckets * sizeof(cn_bucket) and every doubling below it free of overflow. */
#define CN_INDEX_MAX_BUCKETS ((int64_t)1 << 56)

/* Buckets needed so that n_keys keys stay at or under max_load, or -1 when that is more than
 * CN_INDEX_MAX_BUCKETS (a request no machine can hold: the caller refuses it). Without the
 * bound, n_keys near 2^62 doubled p past INT64_MAX and looped forever holding the write lock,
 * and n_keys near 2^59 wrapped n_buckets * 16 to 0 bytes. */
static inline int64_t cn_index_buckets_for(int64_t n_keys, double max_load) {
    double need = (double)n_keys / max_load;
    if (!(need <= (double)CN_INDEX_MAX_BUCKETS)) return -1;
    int64_t p = 16;
    while ((double)p < need) p <<= 1;
    return p;
}

static inline int cn_index_init(cn_index *ix, int64_t n_buckets, int64_t *nbytes) {
    if (n_buckets < 16 || n_buckets > CN_INDEX_MAX_BUCKETS) return -1;
    ix->buckets = (cn_bucket *)cn_alloc((size_t)n_buckets * sizeof(cn_bucket), nbytes);
    if (ix->buckets == NULL) return -1;
    memset(ix->buckets, 0xff, (size_t)n_buckets * sizeof(cn_bucket)); /* slot = -1 everywhere */
    ix->n_buckets = n_buckets;
    ix->mask = n_buckets - 1;
    ix->size = 0;
    return 0;
}

static inline void cn_index_free(cn_index *ix, int64_t *nbytes) {
    cn_free(ix->buckets, (size_t)ix->n_buckets * sizeof(cn_bucket), nbytes);
    ix->buckets = NULL;
    ix->n_buckets = 0;
    ix->mask = 0;
    ix->size = 0;
}

static inline void cn_index_prefetch(const cn_index *ix, int64_t key) {
    __builtin_prefetch(&ix->buckets[cn_hash_key(key) & (uint64_t)ix->mask], 0, 3);
}

/* The slot of `key`, or -1, probing from bucket i = its hash & mask (computed by the caller). */
static inline int64_t cn_index_find_from(const cn_bucket *b, uint64_t mask, uint64_t i, int64_t key) {
    for (;;) {
        int64_t s = b[i].slot;
        if (s < 0) return -1;
        if (b[i].key == key) return s;
        i = (i + 1) & mask;
    }
}

/* The slot of `key`, or -1. */
static inline int64_t cn_index_find(const cn_index *ix, int64_t key) {
    return cn_index_find_from(ix->buckets, (uint64_t)ix->mask, cn_hash_key(key) & (uint64_t)ix->mask, key);
}

/* The slot of `key` if present; otherwise -1 and *empty_pos is where it would go. */
static inline int64_t cn_index_probe(const cn_index *ix, int64_t key, int64_t *empty_pos) {
    uint64_t i = cn_hash_key(key) & (uint64_t)ix->mask;
    const cn_bucket *b = ix->buckets;
    for (;;) {
        int64_t s = b[i].slot;
        if (s < 0) {
            *empty_pos = (int64_t)i;
            return -1;
        }
        if (b[i].key == key) return s;
        i = (i + 1) & (uint64_t)ix->mask;
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
    const uint64_t mask = (uint64_t)j->ix->mask;
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
        const uint64_t pos = cn_hash_key(keys[i]) & mask;
        slots[i] = (int64_t)pos;
        __builtin_prefetch(&b[pos], 0, CN_FIND_PREFETCH_LOCALITY);
    }
    for (int64_t i = begin; i < end; i++) {
        if (i + CN_FIND_PREFETCH_DISTANCE < end) {
            const uint64_t pos = cn_hash_key(keys[i + CN_FIND_PREFETCH_DISTANCE]) & mask;
            slots[i + CN_FIND_PREFETCH_DISTANCE] = (int64_t)pos;
            __builtin_prefetch(&b[pos], 0, CN_FIND_PREFETCH_LOCALITY);
        }
#if CN_FIND_L1_DISTANCE
        if (i + CN_FIND_L1_DISTANCE < end) __builtin_prefetch(&b[slots[i + CN_FIND_L1_DISTANCE]], 0, 3);
#endif
        slots[i] = cn_index_find_from(b, mask, (uint64_t)slots[i], keys[i]);
    }
}

static inline void cn_index_find_batch(const cn_index *ix, const int64_t *keys, int64_t n,
                                       int64_t *slots, int nthreads) {
    cn_find_job job = {ix, keys, slots};
    cn_parallel_for(cn_index_find_range, &job, n, nthreads);
}

/* Remove `key`; returns its slot or -1. Backward-shift deletion keeps probe chains intact. */
static inline int64_t cn_index_erase(cn_index *ix, int64_t key) {
    uint64_t mask = (uint64_t)ix->mask;
    cn_bucket *b = ix->buckets;
    uint64_t i = cn_hash_key(key) & mask;
    for (;;) {
        if (b[i].slot < 0) return -1;
        if (b[i].key == key) break;
        i = (i + 1) & mask;
    }
    int64_t slot = b[i].slot;
    uint64_t hole = i;
    uint64_t j = i;
    for (;;) {
        j = (j + 1) & mask;
        if (b[j].slot < 0) break;
        uint64_t home = cn_hash_key(b[j].key) & mask;
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

/* Move every entry into a new array of n_buckets. On allocation failure returns -1 and the
 * index is unchanged. */
static inline int cn_index_rehash(cn_index *ix, int64_t n_buckets, int64_t *nbytes) {
    cn_index fresh;
    if (cn_index_init(&fresh, n_buckets, nbytes) != 0) return -1;
    const cn_bucket *old = ix->buckets;
    for (int64_t i = 0; i < ix->n_buckets; i++) {
        if (old[i].slot < 0) continue;
        int64_t pos;
        cn_index_probe(&fresh, old[i].key, &pos);
        cn_index_put_at(&fresh, pos, old[i].key, old[i].slot);
    }
    cn_index_free(ix, nbytes);
    *ix = fresh;
    return 0;
}

#endif

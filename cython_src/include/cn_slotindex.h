/* cn_slotindex.h: the SSD tier's disk index (cncore/tier/), key -> slot of the record in the
 * tier's file, for every row that is on disk and not in the memory cache.
 *
 * It is cn_index.h itself (open addressing, 16-byte buckets {key, slot}, occupancy in the slot
 * field so every int64 key is valid), with the batch verbs the tier needs. Until this, the disk
 * index was a dim-2 EmbeddingStore holding each slot as two floats: 47 bytes a key (the key and
 * its bucket, an 8-byte row, the metadata line and live bits that eviction needs and a disk
 * index does not), 47 MiB for the 1M disk rows of a table 10x a 32 MiB cache. Here it is the
 * buckets alone: 16 bytes over a load factor kept in (0.35, 0.7], 23-46 bytes a key.
 *
 * Concurrency: the Python class calls these with the GIL held (each call is a short batch), so
 * the tier's prefetch thread and its training thread never run them at once.
 */
#ifndef CN_SLOTINDEX_H
#define CN_SLOTINDEX_H

#include <stdint.h>
#include "cn_index.h"

#define CN_SLOTINDEX_MAX_LOAD 0.7

/* Grow so that `extra` more keys keep the load at or under the maximum: to exactly the buckets
 * they need when `exact` (a reservation: the tier reserves, from StoreConfig.capacity, the most
 * keys its disk can ever hold, cncore/tier/), else by cn_index.h's growth rule (at least
 * CN_INDEX_GROWTH times the present buckets, so that growing key by key rehashes a bounded
 * number of times). 0, or -1 (no memory: the index is unchanged).
 * Until this, every size was rounded up to a power of two, because the tier reserved
 * capacity - cache_rows keys, which a cache evicted down to its low-water mark exceeds (by the
 * headroom and a round of loads), and the power of two's slack kept that from rehashing: up to
 * 2x the buckets needed. asv_bench/scripts/tiered_bench.py --capacity-hint (a 32 MiB cache):
 * the 10x table's disk index took 32 MiB for its at most 0.99M disk keys, exactly 21.6 MiB now;
 * the 3x table's 8 MiB, now 4.9. */
static inline int cn_slotindex_reserve(cn_index *ix, int64_t extra, int exact, int64_t *nbytes) {
    const int64_t need = cn_index_buckets_for(ix->size + extra, CN_SLOTINDEX_MAX_LOAD);
    if (need < 0) return -1;
    if (need <= ix->n_buckets) return 0;
    const int64_t n_buckets = exact ? need : cn_index_growth_buckets(ix, ix->size + extra, CN_SLOTINDEX_MAX_LOAD, 0);
    return n_buckets < 0 ? -1 : cn_index_rehash(ix, n_buckets, nbytes);
}

/* Buckets (16 bytes each) an index reserved for n keys holds: what SlotIndex.reserve(n) of an
 * empty index gives (a test pins the tier's disk index to it). */
static inline int64_t cn_slotindex_buckets_for(int64_t n) {
    return cn_index_buckets_for(n, CN_SLOTINDEX_MAX_LOAD);
}

/* The batch put and erase prefetch the home bucket of the key CN_SLOTINDEX_AHEAD keys ahead (for
 * writing): a tier's batches are keys scattered over an index of megabytes (4.9 MiB at 3x a 32 MiB
 * cache, 21.6 at 10x), so without it every key waited for its bucket's cache miss in turn.
 * Measured (SlotIndex from Python: an index of 220k keys reserved for 330k, as the 3x benchmark's
 * disk index, 1,454 distinct random keys a batch, 8 MiB of other memory written between batches,
 * medians of 200, alternated with the code before): erase 143-169 -> 74 us, put of keys not in
 * the index (a spill's) 62-75 -> 41-43 us; a 3x Zipf 1.05 step does one of each on the training
 * thread. The hint changes no result: erasing earlier keys may shift a later key's bucket, and
 * then the prefetch was only early. */
#define CN_SLOTINDEX_AHEAD 16

/* keys[i] -> slots[i], inserted or reassigned (the caller reserved room); in order, so a key
 * given twice keeps its last slot. */
static inline void cn_slotindex_put(cn_index *ix, const int64_t *keys, const int64_t *slots, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        if (i + CN_SLOTINDEX_AHEAD < n) __builtin_prefetch(&ix->buckets[cn_index_home(ix, keys[i + CN_SLOTINDEX_AHEAD])], 1, 3);
        int64_t pos;
        const int64_t old = cn_index_probe(ix, keys[i], &pos);
        if (old >= 0) {
            ix->buckets[pos].slot = slots[i];
        } else {
            cn_index_put_at(ix, pos, keys[i], slots[i]);
        }
    }
}

/* Remove keys; slots[i] gets the slot keys[i] had, or -1 (absent, or given earlier in keys). */
static inline void cn_slotindex_erase(cn_index *ix, const int64_t *keys, int64_t n, int64_t *slots) {
    for (int64_t i = 0; i < n; i++) {
        if (i + CN_SLOTINDEX_AHEAD < n) __builtin_prefetch(&ix->buckets[cn_index_home(ix, keys[i + CN_SLOTINDEX_AHEAD])], 1, 3);
        slots[i] = cn_index_erase(ix, keys[i]);
    }
}

/* Remove each key whose slot is still slots[i] (a key indexed again at another slot since, by a
 * spill that wrote it there, stays); returns how many were removed. The tier's training thread
 * hands the keys it loaded into memory to its background thread this way (cncore/tier/,
 * TieredStore._erase_behind). */
static inline int64_t cn_slotindex_erase_at(cn_index *ix, const int64_t *keys, const int64_t *slots, int64_t n) {
    int64_t removed = 0;
    for (int64_t i = 0; i < n; i++) {
        if (i + CN_SLOTINDEX_AHEAD < n) __builtin_prefetch(&ix->buckets[cn_index_home(ix, keys[i + CN_SLOTINDEX_AHEAD])], 1, 3);
        int64_t pos;
        if (slots[i] >= 0 && cn_index_probe(ix, keys[i], &pos) == slots[i]) {
            cn_index_erase(ix, keys[i]);
            removed++;
        }
    }
    return removed;
}

/* Copy up to `max` entries from bucket `*pos` on into keys/slots; returns how many, and moves
 * *pos past the last bucket read (n_buckets when done). */
static inline int64_t cn_slotindex_items(const cn_index *ix, int64_t *pos, int64_t max, int64_t *keys,
                                         int64_t *slots) {
    int64_t n = 0, i = *pos;
    for (; i < ix->n_buckets && n < max; i++) {
        if (ix->buckets[i].slot < 0) continue;
        keys[n] = ix->buckets[i].key;
        slots[n] = ix->buckets[i].slot;
        n++;
    }
    *pos = i;
    return n;
}

#endif

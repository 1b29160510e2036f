/* cn_admit.h: admission by count, a count-min sketch of the keys that have no row yet.
 *
 * Policy, stated so that a Python model can replay it literally
 * ------------------------------------------------------------
 * A training lookup first finds its keys. Every occurrence (never a weight) of a key without a
 * row adds 1 to each of the sketch's `depth` counters of that key: counter i of key k is
 * C[i][h_i(k)], h_i(k) = mix64(k + (i + 1) * 0x9E3779B97F4A7C15) mod width (mix64: cn_mix.h;
 * arithmetic mod 2^64; counters saturate at 2^32 - 1). Then, after every occurrence of the
 * batch is counted, a key without a row is admitted (gets a row in this lookup) when its
 * estimate min_i C[i][h_i(k)] >= min_count; otherwise it keeps slot -1: it reads as zeros (or
 * its initial row) and takes no update. Keys with a row are not counted. Only training
 * lookups count and admit; find_or_insert, insert_or_assign and load insert unconditionally.
 * A lookup that fails (a refusal, out of memory) takes its counts back.
 *
 * Why a sketch and what it costs
 * ------------------------------
 * Its memory is fixed (depth * width * 4 bytes; 4 MiB by default) whatever the stream, and
 * every operation is `depth` counter updates with no allocation and no eviction policy of its
 * own to state. A bounded exact counter table would need its own eviction rule (which then
 * decides admission in ways that are hard to predict and to replay). The price is one-sided
 * error: the estimate is never below the true count, so a key may be admitted early (a false
 * admission) when each of its counters was also raised by colliding keys, never late. With N
 * occurrences of unadmitted keys counted since the last decay, a counter carries about
 * N / width foreign counts; the chance that all `depth` of a new key's counters carry at least
 * min_count of them is what admits it early. The counts never decay by themselves:
 * `decay_admission()` halves every counter (run it every so many steps to forget old keys),
 * and a key evicted later is re-admitted on its next occurrence if its counters still say so.
 */
#ifndef CN_ADMIT_H
#define CN_ADMIT_H

#include <stdint.h>
#include <string.h>
#include "cn_alloc.h"
#include "cn_mix.h"

typedef struct {
    uint32_t *counters; /* [depth][width] */
    int64_t width;      /* a power of two */
    int64_t depth;
    uint32_t min_count; /* 0: no admission */
} cn_admit;

static inline int cn_admit_init(cn_admit *s, uint32_t min_count, int64_t width, int64_t depth, int64_t *nbytes) {
    memset(s, 0, sizeof(*s));
    if (min_count == 0) return 0;
    s->counters = (uint32_t *)cn_alloc((size_t)(width * depth) * sizeof(uint32_t), nbytes);
    if (s->counters == NULL) return -1;
    memset(s->counters, 0, (size_t)(width * depth) * sizeof(uint32_t));
    s->width = width;
    s->depth = depth;
    s->min_count = min_count;
    return 0;
}

static inline void cn_admit_free(cn_admit *s, int64_t *nbytes) {
    if (s->counters) cn_free(s->counters, (size_t)(s->width * s->depth) * sizeof(uint32_t), nbytes);
    s->counters = NULL;
}

static inline uint32_t *cn_admit_counter(const cn_admit *s, int64_t i, int64_t key) {
    const uint64_t h = cn_mix64((uint64_t)key + (uint64_t)(i + 1) * 0x9E3779B97F4A7C15ULL);
    return s->counters + i * s->width + (int64_t)(h & (uint64_t)(s->width - 1));
}

/* Add `delta` (+1 or -1) to each counter of key, saturating at 2^32 - 1 (a saturated counter
 * is never taken back). */
static inline void cn_admit_add(cn_admit *s, int64_t key, int delta) {
    for (int64_t i = 0; i < s->depth; i++) {
        uint32_t *c = cn_admit_counter(s, i, key);
        if (*c != UINT32_MAX) *c = delta > 0 ? *c + 1 : *c - 1;
    }
}

static inline void cn_admit_prefetch(const cn_admit *s, int64_t key) {
    for (int64_t i = 0; i < s->depth; i++) __builtin_prefetch(cn_admit_counter(s, i, key), 1, 3);
}

static inline uint32_t cn_admit_estimate(const cn_admit *s, int64_t key) {
    uint32_t m = UINT32_MAX;
    for (int64_t i = 0; i < s->depth; i++) {
        const uint32_t c = *cn_admit_counter(s, i, key);
        m = c < m ? c : m;
    }
    return m;
}

/* Admission by probability (cncore.Probability(p)): a key without a row is admitted in a
 * training lookup when (mix64(key ^ mix64(seed ^ 0xD1B54A32D192ED03)) >> 11) < threshold, with
 * threshold = ceil(p * 2^53), i.e. when a uniform draw u in [0, 1) (53 bits) fixed by (seed, key)
 * is below p. No state: the same keys are admitted whatever the order, batching or history, a
 * key refused once is refused at every sighting (so a fraction p of the distinct keys ever gets a
 * row, as in TFRA's and DeepRec's probability filters, replayable by a Python model), and
 * 2^53 (p = 1) admits every key. */
static inline int cn_admit_draw(uint64_t seed, uint64_t threshold, int64_t key) {
    return (cn_mix64((uint64_t)key ^ cn_mix64(seed ^ 0xD1B54A32D192ED03ULL)) >> 11) < threshold;
}

static inline void cn_admit_decay(cn_admit *s) {
    for (int64_t j = 0; j < s->width * s->depth; j++) s->counters[j] >>= 1;
}

#endif

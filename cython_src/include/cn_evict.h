/* cn_evict.h: choosing the rows a bounded table evicts.
 *
 * Policy, stated so that a Python model can replay it literally
 * ------------------------------------------------------------
 * Each live row has a score, and rows leave in ascending (score, key) order, keys compared as
 * signed int64:
 *   LRU: score = last_step.
 *   LFU: score = (count, last_step), i.e. count * 2^32 + last_step. With aging (LFU(halve_every
 *        = 2^h)), the count counts half for every 2^h steps since the row's last use:
 *        score = (count >> min(32, (step - last_step) >> h), last_step), at the step of the
 *        eviction. A row popular long ago then loses to rows in use now; without aging its
 *        count keeps it forever (the stored counts are never changed: the decay is in the score
 *        alone, so a row on an SSD tier's disk ages while it is there). A power of two, so the
 *        decay is a shift in the scan: a 64-bit division per row costs ~15 cycles over a scan
 *        that takes ~2 ns a row.
 *   TTL: score = last_step (so under pressure the expired rows, the oldest, go first); an
 *        explicit sweep evicts every row with step - last_step > ttl.
 * The rows a call itself uses are not candidates (the caller clears their live bits for the
 * selection and sets them back: cn_table.h).
 *
 * Selection: exact, in one pass when a sample guesses well, else a radix select
 * ---------------------------------------------------------------------------
 * The order is over the 128-bit value c = score * 2^64 + (key XOR 2^63) (the XOR makes
 * unsigned order equal signed key order), unique per row because keys are.
 * Fast path (cn_evict_sampled): a strided sample of 4096 live rows gives a threshold T with
 * somewhat more than k rows at or below it (k's share plus three standard deviations); one
 * pass collects those rows and a quickselect keeps the k smallest. Exact whenever it answers
 * (every row at or below T is collected); when the guess misses (fewer than k rows, or more
 * than the buffer holds) the radix select decides.
 * Radix select: each pass scans the candidates in slot order (metadata and live bits stream
 * from each page, cn_arena.h), histograms the next 16 bits of c among the rows that match the
 * prefix chosen so far (65536 counters, 512 KiB, cache resident), and picks the digit where the
 * running count reaches k: rows below it are victims, rows on it stay in play. Once at most
 * CN_EVICT_TIE_MAX rows are in play, one last pass collects the victims and those rows, which
 * are sorted to take the remaining ones. A first pass takes the min and max score, and the
 * digits start at the highest bit where they differ: with LRU over the last 65536 steps the
 * first histogram already splits by exact step, where fixed digits from bit 127 spent two
 * passes on zeros. LFU's (count, last_step) needs three to six passes; the sampled path one.
 * Measured: a round of evict(6250) on 200k rows (dim 64, random counts and steps, one thread)
 * took 2.3 ms (LRU) and 3.2 ms (LFU) with the radix select alone, 1.2 and 1.0 ms sampled.
 * In training (asv_bench/scripts/bounded_tables.py, budget 200k rows, 2M distinct IDs, 32k IDs
 * per step): a Zipf stream's step is 0.85-0.90x the unbounded table's (which grows to 600k
 * rows), a uniform one's 1.17-1.18x (it evicts as many rows as it inserts, 29k a step), and a
 * stream that fits the budget 0.98-0.99x (the bookkeeping alone).
 * Scratch: the histogram or the sample, the collected rows (about k) and the victims (k);
 * nothing proportional to the table. A full sort of the table's scores needs 16 bytes per row
 * of scratch (16 MiB per million rows) and O(n log n); a bounded max-heap of k needs k entries
 * but O(n log k) with unpredictable branches.
 *
 * Eviction happens in rounds down to a low-water mark (max_rows - headroom), so one scan is
 * paid per `headroom` inserts rather than per insert.
 */
#ifndef CN_EVICT_H
#define CN_EVICT_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "cn_arena.h"
#include "cn_global.h"
#include "cn_sort.h"

enum { CN_EVICT_NONE = 0, CN_EVICT_LRU = 1, CN_EVICT_LFU = 2, CN_EVICT_TTL = 3 };

#define CN_EVICT_TIE_MAX 4096
#define CN_EVICT_KEY_BIAS ((uint64_t)1 << 63)

typedef unsigned __int128 cn_u128;

/* What a selection orders by: the policy, and for LFU's aging the step and the halving period's
 * log2 (halve_shift < 0: no aging). Passed by value (the core builds with -fno-strict-aliasing,
 * so through a pointer the scan would reload it after every victim written). Measured in a C
 * harness (cn_evict_select of 6,250 of 200k rows, random counts and steps, minimum of 300
 * selections, four alternated runs): LRU 0.353-0.356 ms before aging existed, 0.349-0.350 now;
 * LFU 0.409-0.415 -> 0.445-0.450; LFU with aging 0.54-0.55 (the shift per row). Rejected: one
 * copy of the selection per kind of score (a dispatcher over always_inline copies): LRU 0.38,
 * LFU 0.40-0.44 depending on inlining; code layout moved either by +-7%. */
typedef struct {
    int policy;
    int halve_shift;
    int64_t step;
} cn_evict_rule;

/* LFU's aging in the table's own time (LFU(halve_every="auto"), encoded as halve_shift
 * CN_LFU_AUTO(s)): the period is 2^s turnovers, a turnover being the steps the table takes to
 * bring in its budget's worth of rows at its rate so far,
 *     T = (step + 1) * max_rows / (held + evicted),
 * and the shift at an eviction is min(31, s + floor(log2 T)) (0 where T < 2). Integers only, so a
 * Python model replays it exactly: h is the largest in [0, 31] with taken * 2^h <= (step + 1) *
 * max_rows (taken = held + evicted; 31 when nothing was taken). A
 * fixed step count is fitted to a stream's length and batch size; a table that turns over
 * every 3 calls and one that turns over every 3,000 then age alike per turnover. */
#define CN_LFU_AUTO(s) (-2 - (s))

static inline int cn_evict_auto_shift(int64_t step, int64_t max_rows, int64_t held, int64_t evicted, int scale) {
    if (held < 0 || evicted < 0 || (held == 0 && evicted == 0) || max_rows <= 0 || step < 0) return 31;
    const cn_u128 taken = (cn_u128)(uint64_t)held + (uint64_t)evicted;
    const cn_u128 room = ((cn_u128)(uint64_t)step + 1) * (uint64_t)max_rows;
    int h = 0;
    while (h < 31 && (taken << (h + 1)) <= room) h++;
    return h + scale < 31 ? h + scale : 31;
}

static inline uint64_t cn_evict_score(cn_evict_rule r, const cn_meta *m) {
    if (r.policy != CN_EVICT_LFU) return m->last_step;
    uint64_t count = m->count;
    if (r.halve_shift >= 0) {
        const int64_t idle = r.step - (int64_t)m->last_step;
        const int64_t halvings = idle > 0 ? idle >> r.halve_shift : 0;
        count = halvings >= 32 ? 0 : count >> halvings;
    }
    return (count << 32) | m->last_step;
}

static inline cn_u128 cn_evict_order(cn_evict_rule r, const cn_arena *a, int64_t slot) {
    return ((cn_u128)cn_evict_score(r, cn_arena_meta(a, slot)) << 64) |
           ((uint64_t)*cn_arena_key(a, slot) ^ CN_EVICT_KEY_BIAS);
}

static inline cn_u128 cn_u128_shr(cn_u128 v, int p) { return p >= 128 ? 0 : v >> p; }

/* Visit every slot whose live bit is set, in slot order: `body` sees `slot`. */
#define CN_FOR_EACH_LIVE(a, slot, body)                                                               \
    do {                                                                                              \
        const int64_t hw_ = (a)->high_water, rpp_ = (int64_t)1 << (a)->page_shift;                  \
        for (int64_t pg_ = 0; pg_ * rpp_ < hw_; pg_++) {                                               \
            const uint64_t *words_ = (const uint64_t *)((a)->pages[pg_] + (a)->live_offset);          \
            const int64_t base_ = pg_ * rpp_, n_ = hw_ - base_ < rpp_ ? hw_ - base_ : rpp_;           \
            for (int64_t w_ = 0; w_ * 64 < n_; w_++) {                                                \
                uint64_t bits_ = words_[w_];                                                          \
                while (bits_) {                                                                       \
                    const int64_t slot = base_ + w_ * 64 + __builtin_ctzll(bits_);                    \
                    bits_ &= bits_ - 1;                                                               \
                    body                                                                              \
                }                                                                                     \
            }                                                                                         \
        }                                                                                             \
    } while (0)

typedef struct {
    cn_u128 order;
    int64_t slot;
} cn_victim;

static inline void cn_victim_swap(cn_victim *v, int64_t i, int64_t j) {
    const cn_victim t = v[i];
    v[i] = v[j];
    v[j] = t;
}

/* Partition v[lo..hi] around the median of three (orders are unique: keys are); returns the
 * pivot's final place. */
static inline int64_t cn_victim_partition(cn_victim *v, int64_t lo, int64_t hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (v[mid].order < v[lo].order) cn_victim_swap(v, mid, lo);
    if (v[hi].order < v[lo].order) cn_victim_swap(v, hi, lo);
    if (v[hi].order < v[mid].order) cn_victim_swap(v, hi, mid);
    cn_victim_swap(v, mid, hi);
    const cn_u128 pivot = v[hi].order;
    int64_t store = lo;
    for (int64_t i = lo; i < hi; i++)
        if (v[i].order < pivot) cn_victim_swap(v, i, store++);
    cn_victim_swap(v, store, hi);
    return store;
}

/* Ascending by order (cn_sort.h). */
#define CN_VICTIM_LESS(a, b) ((a).order < (b).order)
CN_DEFINE_SORT(cn_victim_sort, cn_victim, CN_VICTIM_LESS)

/* Reorder v so that v[nth] is the nth smallest, with smaller ones before it (quickselect). */
static inline void cn_victim_nth(cn_victim *v, int64_t n, int64_t nth) {
    int64_t lo = 0, hi = n - 1;
    while (hi > lo) {
        const int64_t p = cn_victim_partition(v, lo, hi);
        if (p == nth) return;
        if (p < nth) lo = p + 1;
        else hi = p - 1;
    }
}

/* Rows sampled to guess a threshold (0: radix select only; the tests run both paths). */
CN_GLOBAL int64_t cn_evict_sample_rows; /* 4096 (src/cn_globals.c) */

/* The fast path of cn_evict_select: guess from a strided sample of the live rows an order T
 * below which somewhat more than k rows lie (k's share of the sample plus three standard
 * deviations), collect every row at or below T in one pass, and select the k smallest of
 * those. Exact whenever it answers: the collected set holds every row at or below T, so the
 * k smallest overall are among them. Returns 1 when done, 0 when the guess missed (fewer than
 * k rows at or below T, or more than the buffer holds: the caller runs the radix select), -1
 * when out of memory. One full pass instead of the radix select's three to six. */
static inline int cn_evict_sampled(const cn_arena *a, cn_evict_rule rule, int64_t k, int64_t n_live,
                                   cn_victim *victims) {
    const int64_t hw = a->high_water;
    const int64_t m = cn_evict_sample_rows < n_live ? cn_evict_sample_rows : n_live;
    cn_victim *sample = (cn_victim *)malloc((size_t)(m + 1) * sizeof(cn_victim));
    if (sample == NULL) return -1;
    int64_t got = 0;
    for (int64_t j = 0; j < m; j++) {
        const int64_t slot = (int64_t)((double)j * (double)hw / (double)m);
        if (*cn_arena_live_word(a, slot) >> (slot & 63) & 1) {
            sample[got].order = cn_evict_order(rule, a, slot);
            sample[got++].slot = slot;
        }
    }
    const double r0 = (double)k * (double)got / (double)n_live;
    const int64_t r = (int64_t)(r0 + 3.0 * __builtin_sqrt(r0) + 8.0);
    if (got == 0 || r >= got) {
        free(sample);
        return 0;
    }
    cn_victim_nth(sample, got, r);
    const cn_u128 threshold = sample[r].order;
    free(sample);
    const int64_t cap = 2 * (int64_t)((double)(r + 1) * (double)n_live / (double)got) + 4096;
    cn_victim *buf = (cn_victim *)malloc((size_t)cap * sizeof(cn_victim));
    if (buf == NULL) return -1;
    /* The score decides for every row but those with the threshold's own score: a row's key
     * (another array of the page, cn_arena.h) is read only for the rows at or below it. The C
     * harness above (6,250 of 200k rows, minimum of 300, six alternated runs): LRU 0.348-0.352
     * -> 0.296-0.298 ms, LFU 0.439-0.453 -> 0.379-0.389, the same victims. */
    const uint64_t threshold_score = (uint64_t)(threshold >> 64);
    int64_t n = 0;
    CN_FOR_EACH_LIVE(a, slot, {
        const uint64_t score = cn_evict_score(rule, cn_arena_meta(a, slot));
        if (score <= threshold_score) {
            const cn_u128 c = ((cn_u128)score << 64) | ((uint64_t)*cn_arena_key(a, slot) ^ CN_EVICT_KEY_BIAS);
            if (c <= threshold) {
                if (n < cap) {
                    buf[n].order = c;
                    buf[n].slot = slot;
                }
                n++;
            }
        }
    });
    if (n < k || n > cap) {
        free(buf);
        return 0;
    }
    if (n > k) cn_victim_nth(buf, n, k - 1);
    memcpy(victims, buf, (size_t)k * sizeof(cn_victim));
    free(buf);
    return 1;
}

/* The k live rows with the smallest (score, key), into victims[0..k), in that order when
 * `in_order` (the order is what a sink sees; without one it is not observable, and the sort
 * was a fifth of an eviction round's time). The caller makes sure that at least k rows are
 * live. Returns 0, or -1 when out of memory. */
static inline int cn_evict_select(const cn_arena *a, cn_evict_rule rule, int64_t k, int64_t n_live, cn_victim *victims,
                                  int in_order) {
    if (k <= 0) return 0;
    if (cn_evict_sample_rows > 0 && n_live > 2 * CN_EVICT_TIE_MAX) {
        const int rc = cn_evict_sampled(a, rule, k, n_live, victims);
        if (rc < 0) return -1;
        if (rc == 1) {
            if (in_order) cn_victim_sort(victims, k);
            return 0;
        }
    }
    uint64_t lo = UINT64_MAX, hi = 0;
    n_live = 0;
    CN_FOR_EACH_LIVE(a, slot, {
        const uint64_t s = cn_evict_score(rule, cn_arena_meta(a, slot));
        lo = s < lo ? s : lo;
        hi = s > hi ? s : hi;
        n_live++;
    });
    /* Bits above p are the same for every candidate (the score's shared high bits). */
    int p = 64 + (lo == hi ? 0 : 64 - __builtin_clzll(lo ^ hi));
    cn_u128 prefix = cn_u128_shr((cn_u128)lo << 64, p);
    int64_t below = 0, in_play = n_live;
    int64_t *hist = NULL;
    while (in_play > CN_EVICT_TIE_MAX && p > 0) {
        if (hist == NULL && (hist = (int64_t *)malloc((size_t)65536 * sizeof(int64_t))) == NULL) return -1;
        const int w = p < 16 ? p : 16;
        memset(hist, 0, (size_t)65536 * sizeof(int64_t));
        CN_FOR_EACH_LIVE(a, slot, {
            const cn_u128 c = cn_evict_order(rule, a, slot);
            if (cn_u128_shr(c, p) == prefix) hist[(uint64_t)(c >> (p - w)) & ((1u << w) - 1)]++;
        });
        int64_t d = 0;
        while (below + hist[d] < k) below += hist[d++];
        in_play = hist[d];
        prefix = (prefix << w) | (cn_u128)d;
        p -= w;
    }
    free(hist);
    /* Victims: every row whose prefix is below; the rows on it are the tie set. */
    cn_victim *ties = (cn_victim *)malloc((size_t)(in_play < CN_EVICT_TIE_MAX ? in_play : CN_EVICT_TIE_MAX) *
                                              sizeof(cn_victim) + sizeof(cn_victim));
    if (ties == NULL) return -1;
    int64_t n_below = 0, n_ties = 0;
    CN_FOR_EACH_LIVE(a, slot, {
        const cn_u128 c = cn_evict_order(rule, a, slot);
        const cn_u128 top = cn_u128_shr(c, p);
        if (top < prefix) {
            victims[n_below].order = c;
            victims[n_below++].slot = slot;
        } else if (top == prefix && n_ties < CN_EVICT_TIE_MAX) {
            ties[n_ties].order = c;
            ties[n_ties++].slot = slot;
        }
    });
    cn_victim_sort(ties, n_ties);
    for (int64_t j = 0; n_below < k && j < n_ties; j++) victims[n_below++] = ties[j];
    free(ties);
    if (in_order) cn_victim_sort(victims, k);
    return 0;
}

/* Live rows with step - last_step > ttl (a TTL sweep evicts exactly these: they are also the
 * rows with the smallest last steps, so cn_evict_select with this k picks them). */
static inline int64_t cn_evict_count_expired(const cn_arena *a, int64_t step, int64_t ttl) {
    int64_t n = 0;
    CN_FOR_EACH_LIVE(a, slot, { n += step - (int64_t)cn_arena_meta(a, slot)->last_step > ttl; });
    return n;
}

#endif

/* cn_sort.h: inline sorts: (int64 key, int64 value) pairs by key, and the code for others.
 *
 * The tier sorts a prefetch's found keys (key order, which the caller's lookup of staged
 * records relies on) and every batch of record offsets (so that adjacent records join one
 * preadv/pwritev). glibc's qsort/qsort_r did both: a merge sort through a comparator called per
 * comparison, with a malloc per call. On the 3x Zipf 1.05 benchmark (asv_bench/scripts/
 * tiered_bench.py; ~1,460 keys found a step, read in chunks of 64) `perf` put 0.20 ms of the
 * background thread's ~2.8 ms a step in msort_with_tmp and the two comparators; this sort
 * (CN_DEFINE_SORT below) took them out of the profile. A radix sort would beat it on large
 * inputs only: these are at most a few thousand pairs. The eviction's victims (cn_evict.h) are
 * sorted by the same code.
 */
#ifndef CN_SORT_H
#define CN_SORT_H

#include <stdint.h>

/* NAME(T *v, int64_t n): sort v ascending by LESS(a, b) (a strict order on T values).
 * Median-of-three quicksort (slot order often follows score order in an eviction, which a
 * first-element pivot would turn quadratic), insertion sort below 16, recursion on the smaller
 * side (depth O(log n)); inline, where qsort's comparator call per comparison was a fifth of an
 * eviction round (cn_evict.h) and most of a prefetch job's sort. Equal elements end in no
 * particular order. */
#define CN_DEFINE_SORT(NAME, T, LESS)                                                                   \
    static inline void NAME(T *v, int64_t n) {                                                         \
        int64_t lo = 0, hi = n - 1;                                                                    \
        while (hi - lo >= 16) {                                                                        \
            const int64_t mid = lo + (hi - lo) / 2;                                                    \
            T tmp_;                                                                                    \
            if (LESS(v[mid], v[lo])) { tmp_ = v[mid]; v[mid] = v[lo]; v[lo] = tmp_; }                   \
            if (LESS(v[hi], v[lo])) { tmp_ = v[hi]; v[hi] = v[lo]; v[lo] = tmp_; }                      \
            if (LESS(v[hi], v[mid])) { tmp_ = v[hi]; v[hi] = v[mid]; v[mid] = tmp_; }                   \
            /* the median as pivot, at hi - 1; v[lo] <= it <= v[hi] stop the scans */                 \
            tmp_ = v[mid]; v[mid] = v[hi - 1]; v[hi - 1] = tmp_;                                       \
            const T pivot = v[hi - 1];                                                                 \
            int64_t i = lo, j = hi - 1;                                                                \
            for (;;) {                                                                                 \
                while (LESS(v[++i], pivot)) {}                                                         \
                while (LESS(pivot, v[--j])) {}                                                         \
                if (i >= j) break;                                                                     \
                tmp_ = v[i]; v[i] = v[j]; v[j] = tmp_;                                                 \
            }                                                                                          \
            tmp_ = v[i]; v[i] = v[hi - 1]; v[hi - 1] = tmp_;                                           \
            if (i - lo < hi - i) {                                                                     \
                NAME(v + lo, i - lo);                                                                  \
                lo = i + 1;                                                                            \
            } else {                                                                                   \
                NAME(v + i + 1, hi - i);                                                               \
                hi = i - 1;                                                                            \
            }                                                                                          \
        }                                                                                              \
        for (int64_t i = lo + 1; i <= hi; i++) {                                                       \
            const T x = v[i];                                                                          \
            int64_t j = i - 1;                                                                         \
            while (j >= lo && LESS(x, v[j])) {                                                         \
                v[j + 1] = v[j];                                                                       \
                j--;                                                                                   \
            }                                                                                          \
            v[j + 1] = x;                                                                              \
        }                                                                                              \
    }

typedef struct {
    int64_t key, value;
} cn_pair;

#define CN_PAIR_LESS(a, b) ((a).key < (b).key)
/* Ascending by key (signed). */
CN_DEFINE_SORT(cn_pair_sort, cn_pair, CN_PAIR_LESS)

#endif

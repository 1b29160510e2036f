/* cn_sort.h: sorting (int64 key, int64 value) pairs by key, inline.
 *
 * The tier sorts a prefetch's found keys (key order, which the caller's lookup of staged
 * records relies on) and every batch of record offsets (so that adjacent records join one
 * preadv/pwritev). glibc's qsort/qsort_r did both: a merge sort through a comparator called per
 * comparison, with a malloc per call. On the 3x Zipf 1.05 benchmark (asv_bench/scripts/
 * tiered_bench.py; ~1,460 keys found a step, read in chunks of 64) `perf` put 0.20 ms of the
 * background thread's ~2.8 ms a step in msort_with_tmp and the two comparators; this sort
 * (median-of-three quicksort, insertion sort below 16, recursion on the smaller side) took
 * them out of the profile. A radix sort would beat it on large inputs only: these are at most
 * a few thousand pairs.
 */
#ifndef CN_SORT_H
#define CN_SORT_H

#include <stdint.h>

typedef struct {
    int64_t key, value;
} cn_pair;

static inline void cn_pair_swap(cn_pair *v, int64_t i, int64_t j) {
    const cn_pair t = v[i];
    v[i] = v[j];
    v[j] = t;
}

/* Ascending by key (signed); pairs with equal keys end in no particular order. */
static inline void cn_pair_sort(cn_pair *v, int64_t n) {
    int64_t lo = 0, hi = n - 1;
    while (hi - lo >= 16) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (v[mid].key < v[lo].key) cn_pair_swap(v, mid, lo);
        if (v[hi].key < v[lo].key) cn_pair_swap(v, hi, lo);
        if (v[hi].key < v[mid].key) cn_pair_swap(v, hi, mid);
        cn_pair_swap(v, mid, hi - 1); /* the median as pivot, at hi - 1; v[lo] <= it <= v[hi] */
        const int64_t pivot = v[hi - 1].key;
        int64_t i = lo, j = hi - 1;
        for (;;) {
            while (v[++i].key < pivot) {}
            while (v[--j].key > pivot) {}
            if (i >= j) break;
            cn_pair_swap(v, i, j);
        }
        cn_pair_swap(v, i, hi - 1);
        if (i - lo < hi - i) { /* recurse on the smaller side: depth O(log n) */
            cn_pair_sort(v + lo, i - lo);
            lo = i + 1;
        } else {
            cn_pair_sort(v + i + 1, hi - i);
            hi = i - 1;
        }
    }
    for (int64_t i = lo + 1; i <= hi; i++) {
        const cn_pair x = v[i];
        int64_t j = i - 1;
        while (j >= lo && v[j].key > x.key) {
            v[j + 1] = v[j];
            j--;
        }
        v[j + 1] = x;
    }
}

#endif

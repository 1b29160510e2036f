/* cn_alloc.h: every allocation of the core goes through here.
 *
 * Each table counts the bytes it holds (its `nbytes`), and one process-wide counter adds up
 * all of them, so a test can prove that what a store reports is what it allocated
 * (the pandas idea of traced allocations, without needing the GIL from worker threads).
 */
#ifndef CN_ALLOC_H
#define CN_ALLOC_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "cn_global.h"
#if defined(__linux__)
#include <sys/mman.h>
#endif

/* Blocks of at least this size are aligned to it and marked for transparent huge pages:
 * rows are read at random, and with 4 KiB pages nearly every row access of a large table is
 * also a TLB miss; first-touch page faults also drop 512-fold. */
#define CN_HUGE_PAGE ((size_t)2 << 20)

CN_GLOBAL int64_t cn_traced_bytes_total; /* src/cn_globals.c */

static inline int64_t cn_traced_bytes(void) {
    return __atomic_load_n(&cn_traced_bytes_total, __ATOMIC_RELAXED);
}

/* Physical memory of this machine in bytes. A request for more than this is refused before
 * any allocation: with overcommit, posix_memalign of a petabyte "succeeds" and the first
 * memset of it is what kills the process. */
static inline double cn_machine_bytes(void) {
    long pages = sysconf(_SC_PHYS_PAGES), size = sysconf(_SC_PAGE_SIZE);
    return pages > 0 && size > 0 ? (double)pages * (double)size : 1e30;
}

/* A block of at least CN_HUGE_PAGE bytes is mapped on its own (mmap, 2 MiB aligned), never
 * taken from malloc's heap, and unmapped when freed. malloc serves a block under its mmap
 * threshold from the heap, and glibc raises that threshold to the size of any mapped block the
 * process frees (up to 32 MiB): after a caller freed one 8 MiB NumPy array (a benchmark's key
 * list; torch frees such tensors all the time), a table's 2 MiB row pages and its index came
 * from the heap, among the short-lived buffers of every step, whose holes stayed resident
 * between malloc_trim calls. asv_bench/scripts/tiered_bench.py (its generator frees its 8.7 MB
 * key list before the store is made), uniform IDs, the store's peak RSS over cache + disk index:
 * a table 10x a 32 MiB cache 1.21-1.25 from the heap, 1.12-1.13 mapped (3x: 1.16-1.18 either
 * way). A table of 200k rows after a 16 MiB array was freed grew the heap by 111 MB, now 6.5
 * (tests/test_growth_threads.py). The kernel merges adjacent mappings: a table of 2M rows (547
 * MiB) added 4 to the process's map count (5 before). */
static inline void *cn_map_aligned(size_t rounded) {
#if defined(__linux__)
    const size_t span = rounded + CN_HUGE_PAGE;
    char *m = (char *)mmap(NULL, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) return NULL;
    char *p = (char *)(((uintptr_t)m + CN_HUGE_PAGE - 1) & ~(uintptr_t)(CN_HUGE_PAGE - 1));
    if (p > m) munmap(m, (size_t)(p - m));
    if (m + span > p + rounded) munmap(p + rounded, (size_t)(m + span - (p + rounded)));
#if defined(MADV_HUGEPAGE)
    madvise(p, rounded & ~(CN_HUGE_PAGE - 1), MADV_HUGEPAGE);
#endif
    return p;
#else
    void *p = NULL;
    return posix_memalign(&p, CN_HUGE_PAGE, rounded) == 0 ? p : NULL;
#endif
}

static inline size_t cn_alloc_rounded(size_t nbytes) {
    size_t rounded = (nbytes + 63) & ~(size_t)63;
    return rounded == 0 ? 64 : rounded;
}

/* Cache-line aligned allocation; `*counter` (the owner's byte count) is updated on success. */
static inline void *cn_alloc(size_t nbytes, int64_t *counter) {
    const size_t rounded = cn_alloc_rounded(nbytes);
    void *p = NULL;
    if (rounded >= CN_HUGE_PAGE) {
        p = cn_map_aligned(rounded);
        if (p == NULL) return NULL;
    } else if (posix_memalign(&p, 64, rounded) != 0) {
        return NULL;
    }
    *counter += (int64_t)rounded;
    __atomic_fetch_add(&cn_traced_bytes_total, (int64_t)rounded, __ATOMIC_RELAXED);
    return p;
}

/* Frees what cn_alloc(nbytes) gave (the same nbytes). */
static inline void cn_free(void *p, size_t nbytes, int64_t *counter) {
    if (p == NULL) return;
    const size_t rounded = cn_alloc_rounded(nbytes);
#if defined(__linux__)
    if (rounded >= CN_HUGE_PAGE)
        munmap(p, rounded);
    else
#endif
        free(p);
    *counter -= (int64_t)rounded;
    __atomic_fetch_sub(&cn_traced_bytes_total, (int64_t)rounded, __ATOMIC_RELAXED);
}

#endif

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
#if defined(__linux__)
#include <sys/mman.h>
#endif

/* Blocks of at least this size are aligned to it and marked for transparent huge pages:
 * rows are read at random, and with 4 KiB pages nearly every row access of a large table is
 * also a TLB miss; first-touch page faults also drop 512-fold. */
#define CN_HUGE_PAGE ((size_t)2 << 20)

static int64_t cn_traced_bytes_total = 0;

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

/* Cache-line aligned allocation; `*counter` (the owner's byte count) is updated on success. */
static inline void *cn_alloc(size_t nbytes, int64_t *counter) {
    size_t rounded = (nbytes + 63) & ~(size_t)63;
    if (rounded == 0) rounded = 64;
    void *p = NULL;
    size_t align = rounded >= CN_HUGE_PAGE ? CN_HUGE_PAGE : 64;
    if (posix_memalign(&p, align, rounded) != 0) return NULL;
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (align == CN_HUGE_PAGE) madvise(p, rounded & ~(CN_HUGE_PAGE - 1), MADV_HUGEPAGE);
#endif
    *counter += (int64_t)rounded;
    __atomic_fetch_add(&cn_traced_bytes_total, (int64_t)rounded, __ATOMIC_RELAXED);
    return p;
}

static inline void cn_free(void *p, size_t nbytes, int64_t *counter) {
    if (p == NULL) return;
    size_t rounded = (nbytes + 63) & ~(size_t)63;
    if (rounded == 0) rounded = 64;
    free(p);
    *counter -= (int64_t)rounded;
    __atomic_fetch_sub(&cn_traced_bytes_total, (int64_t)rounded, __ATOMIC_RELAXED);
}

#endif

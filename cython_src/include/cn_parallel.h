/* cn_parallel.h: the OpenMP shim. The build works with and without OpenMP; every parallel loop
 * of the core goes through CN_PARALLEL_FOR, and one setting decides the thread count. */
#ifndef CN_PARALLEL_H
#define CN_PARALLEL_H

#ifdef _OPENMP
#include <omp.h>
#endif

/* 0 means "let the runtime decide" (OMP_NUM_THREADS or the number of cores). */
static int cn_thread_setting = 0;

static inline void cn_set_thread_setting(int n) { cn_thread_setting = n; }

static inline int cn_max_threads(void) {
#ifdef _OPENMP
    return cn_thread_setting > 0 ? cn_thread_setting : omp_get_max_threads();
#else
    return 1;
#endif
}

static inline int cn_has_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* Threads worth starting for `work` items: small batches stay on the calling thread, where
 * starting a team would cost more than it saves. */
static inline int cn_threads_for(int64_t work) {
    int t = cn_max_threads();
    if (work < 2048) return 1;
    return t;
}

#define CN_PRAGMA(x) _Pragma(#x)
#ifdef _OPENMP
#define CN_PARALLEL_FOR(nthreads) CN_PRAGMA(omp parallel for schedule(static) num_threads(nthreads))
#define CN_PARALLEL_FOR_DYNAMIC(nthreads) CN_PRAGMA(omp parallel for schedule(dynamic, 64) num_threads(nthreads))
#else
#define CN_PARALLEL_FOR(nthreads)
#define CN_PARALLEL_FOR_DYNAMIC(nthreads)
#endif

#ifndef CN_PREFETCH_DISTANCE
#define CN_PREFETCH_DISTANCE 16
#endif

#ifndef CN_PREFETCH_LOCALITY
#define CN_PREFETCH_LOCALITY 3
#endif
static inline void cn_prefetch_read(const void *p, int64_t nbytes) {
    const char *c = (const char *)p;
    for (int64_t off = 0; off < nbytes; off += 64) __builtin_prefetch(c + off, 0, CN_PREFETCH_LOCALITY);
}

static inline void cn_prefetch_write(const void *p, int64_t nbytes) {
    const char *c = (const char *)p;
    for (int64_t off = 0; off < nbytes; off += 64) __builtin_prefetch(c + off, 1, 3);
}

#endif

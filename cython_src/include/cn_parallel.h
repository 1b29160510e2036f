/* cn_parallel.h: the core's own worker pool. Every parallel loop of the core goes through
 * cn_parallel_for (a range split into chunks that the calling thread and the pool's workers
 * claim), and one setting decides the thread count.
 *
 * Why not OpenMP (what the core used until issue 12). Measured on a 2-core machine with four
 * busy processes beside the job (load 4-5, as a data loader or a second job make it), `cn-dlrm`
 * ran at 2.2 k samples/s with the core on 2 OpenMP threads, 59 k with everything on 1 thread,
 * 77 k with torch on 2 threads and the core on 1, and 56 k with OMP_WAIT_POLICY=PASSIVE. A
 * training step makes about a hundred short parallel regions (find, pool, group, update, for
 * each of 26 tables), and an OpenMP region ends at a barrier that waits for every thread of the
 * team: a worker that the OS has not scheduled yet, or one spinning out libgomp's 300,000-
 * iteration wait on a core that a busy process also wants, costs the whole region a time slice.
 * There is only one OpenMP runtime in the process (torch ships libgomp.so.1 under the system's
 * soname; /proc/PID/maps shows one of them loaded), so the fix is not "share torch's pool": the
 * wait policy is read once, from the environment, when libgomp loads (usually with torch,
 * before we can set it), and the end-of-region barrier is part of OpenMP's model.
 *
 * This pool differs where that matters:
 *  - The caller never waits for a worker that has not started: work is split into chunks
 *    claimed with one atomic add, the caller claims chunks too, and it waits only for chunks
 *    that a worker claimed and is running. A descheduled worker simply finds nothing left.
 *  - Workers spin briefly (200 us by default, CNCORE_SPIN_US: a training step's loops come
 *    closer together than that, so workers stay awake through a step) and then sleep on a
 *    futex: they do not hold a core that another process wants for longer. Since the caller
 *    never waits for a worker that has not started, the spin length decides only wake-up
 *    latency and CPU taken from other processes, not stragglers (on this shared machine,
 *    DLRM runs with 50, 200, 300 and 1000 us differed by less than their noise).
 *  - One loop at a time: a call that finds the pool busy (another thread of the process is in a
 *    parallel loop, or a loop body calls back in) runs its range on its own thread.
 * Results never depend on the thread count: every item of a range is processed exactly once
 * by one call of the loop body, whichever thread claims its chunk.
 */
#ifndef CN_PARALLEL_H
#define CN_PARALLEL_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE 1
#endif
#include <errno.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#include "cn_global.h"

#define CN_MAX_THREADS 1024

/* 0 means "the default": OMP_NUM_THREADS (read for compatibility) or CNCORE_NUM_THREADS if
 * set, else the CPUs this process may run on. */
CN_GLOBAL int cn_thread_setting; /* src/cn_globals.c */

static inline void cn_set_thread_setting(int n) { cn_thread_setting = n; }

static int cn_env_threads(const char *name) {
    const char *s = getenv(name);
    if (s == NULL || *s == 0) return 0;
    char *end = NULL;
    long v = strtol(s, &end, 10);
    if (end == s || v < 1) return 0;
    return v > CN_MAX_THREADS ? CN_MAX_THREADS : (int)v;
}

static inline int cn_default_threads(void) {
    int n = cn_env_threads("CNCORE_NUM_THREADS");
    if (n == 0) n = cn_env_threads("OMP_NUM_THREADS");
    if (n == 0) {
#ifdef CPU_COUNT /* (glibc with _GNU_SOURCE, which Python.h defines before this header) */
        cpu_set_t set;
        n = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : (int)sysconf(_SC_NPROCESSORS_ONLN);
#else
        n = (int)sysconf(_SC_NPROCESSORS_ONLN);
#endif
    }
    if (n < 1) n = 1;
    return n > CN_MAX_THREADS ? CN_MAX_THREADS : n;
}

static inline int cn_max_threads(void) {
    return cn_thread_setting > 0 ? cn_thread_setting : cn_default_threads();
}

/* Threads worth starting for `work` items: small batches stay on the calling thread, where
 * waking a worker would cost more than it saves. */
static inline int cn_threads_for(int64_t work) {
    if (work < 2048) return 1;
    return cn_max_threads();
}

typedef void (*cn_range_fn)(void *ctx, int64_t begin, int64_t end);

static inline int cn_workers_asleep(void);

/* As cn_threads_for, but a loop of fewer than `min_to_wake` items stays on the calling thread
 * when every worker is asleep (none ran a loop in the last cn_spin_ns): waking one through the
 * futex took 100-250 us on this 2-core VM, more than such a loop saves by being split. When
 * the workers are awake (loops come back to back, as in a training step), nothing changes.
 * Measured on the pooled forward (C driver, one 96 MiB flush before each call, so the workers
 * sleep; find + pool, medians of 20): 4096 IDs at pooling 1, 1M rows x 16, 455-540 us on one
 * thread against 770-960 on two, at load 1.3 and 2.6 alike; 8M x 64, 890-950 against 1120-1130;
 * with workers kept spinning, two threads took 489 us, one 500. */
static inline int cn_threads_unless_asleep(int64_t work, int64_t min_to_wake) {
    const int n = cn_threads_for(work);
    return n > 1 && work < min_to_wake && cn_workers_asleep() ? 1 : n;
}

/* How long an idle worker spins before it sleeps: CNCORE_SPIN_US (microseconds) if set, else
 * CN_SPIN_US_DEFAULT. Read when the first worker starts. */
#ifndef CN_SPIN_US_DEFAULT
#define CN_SPIN_US_DEFAULT 200
#endif
CN_GLOBAL int64_t cn_spin_ns; /* CN_SPIN_US_DEFAULT * 1000 (src/cn_globals.c) */
/* Chunks per thread: more chunks balance better when a thread is slowed (by the OS, or by a
 * bag of many keys); each costs one atomic add. */
#define CN_CHUNKS_PER_THREAD 4

typedef struct {
    /* The loop being run; written by its caller before `active` is set, read by workers only
     * after they see `active` (and while counted in `users`, so it cannot change under them). */
    cn_range_fn fn;
    void *ctx;
    int64_t n, grain, n_chunks;
    int max_helpers;
    _Atomic int64_t next_chunk;
    _Atomic int64_t done_chunks;
    _Atomic int joined;
    _Atomic int active;
    _Atomic int users;     /* workers inside the join section */
    _Atomic uint32_t gen;  /* bumped once per loop: the futex workers sleep on */
    _Atomic int sleepers;
    _Atomic int busy;      /* a caller owns the pool */
    pthread_mutex_t grow_lock;
    int n_workers;
    int atfork_registered;
} cn_team_t;

CN_GLOBAL cn_team_t cn_team; /* the process's one pool (src/cn_globals.c) */

static inline void cn_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static inline int64_t cn_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Run claimed chunks of the current loop until none is left. */
static inline void cn_team_work(cn_team_t *t) {
    const int64_t n_chunks = t->n_chunks, grain = t->grain, n = t->n;
    for (;;) {
        const int64_t c = atomic_fetch_add(&t->next_chunk, 1);
        if (c >= n_chunks) return;
        const int64_t begin = c * grain, end = begin + grain < n ? begin + grain : n;
        t->fn(t->ctx, begin, end);
        atomic_fetch_add(&t->done_chunks, 1);
    }
}

static void *cn_worker_main(void *arg) {
    cn_team_t *t = (cn_team_t *)arg;
    uint32_t seen = atomic_load(&t->gen);
    for (;;) {
        int64_t spin_start = 0;
        uint32_t g;
        while ((g = atomic_load(&t->gen)) == seen) {
            if (spin_start == 0) spin_start = cn_now_ns();
            for (int i = 0; i < 64; i++) cn_cpu_relax();
            if (cn_now_ns() - spin_start < cn_spin_ns) continue;
            atomic_fetch_add(&t->sleepers, 1);
            /* Sleeps only if gen is still `seen`: a caller that bumped it after our load either
             * sees sleepers > 0 and wakes us, or we see the new gen here (both are seq_cst). */
            if (atomic_load(&t->gen) == seen)
                syscall(SYS_futex, (uint32_t *)&t->gen, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
            atomic_fetch_sub(&t->sleepers, 1);
            spin_start = 0;
        }
        seen = g;
        atomic_fetch_add(&t->users, 1);
        if (atomic_load(&t->active) && atomic_fetch_add(&t->joined, 1) < t->max_helpers) cn_team_work(t);
        atomic_fetch_sub(&t->users, 1);
    }
    return NULL;
}

/* After fork() only the forking thread exists in the child: forget the workers. */
static void cn_team_after_fork_child(void) {
    cn_team.n_workers = 0;
    atomic_store(&cn_team.busy, 0);
    atomic_store(&cn_team.active, 0);
    atomic_store(&cn_team.users, 0);
    atomic_store(&cn_team.sleepers, 0);
    pthread_mutex_init(&cn_team.grow_lock, NULL);
}

/* Start workers until there are `want` (fewer if the system refuses threads). */
static inline int cn_team_grow(cn_team_t *t, int want) {
    if (t->n_workers >= want) return t->n_workers;
    pthread_mutex_lock(&t->grow_lock);
    if (!t->atfork_registered) {
        pthread_atfork(NULL, NULL, cn_team_after_fork_child);
        t->atfork_registered = 1;
        const char *spin = getenv("CNCORE_SPIN_US");
        if (spin != NULL && *spin != 0) {
            char *end = NULL;
            const long long us = strtoll(spin, &end, 10);
            if (end != spin && us >= 0 && us <= 1000000) cn_spin_ns = (int64_t)us * 1000;
        }
    }
    while (t->n_workers < want) {
        pthread_attr_t attr;
        pthread_t th;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&attr, (size_t)1 << 20);
        const int rc = pthread_create(&th, &attr, cn_worker_main, t);
        pthread_attr_destroy(&attr);
        if (rc != 0) break;
        t->n_workers++;
    }
    pthread_mutex_unlock(&t->grow_lock);
    return t->n_workers;
}

/* fn(ctx, begin, end) over [0, n) in chunks, on up to `nthreads` threads (the caller's
 * included). Returns when every item is done. */
static inline void cn_parallel_for(cn_range_fn fn, void *ctx, int64_t n, int nthreads) {
    if (n <= 0) return;
    if (nthreads > CN_MAX_THREADS) nthreads = CN_MAX_THREADS;
    if (nthreads > n) nthreads = (int)n;
    cn_team_t *t = &cn_team;
    int expected = 0;
    if (nthreads <= 1 || !atomic_compare_exchange_strong(&t->busy, &expected, 1)) {
        fn(ctx, 0, n);
        return;
    }
    const int helpers = cn_team_grow(t, nthreads - 1) < nthreads - 1 ? t->n_workers : nthreads - 1;
    if (helpers < 1) {
        atomic_store(&t->busy, 0);
        fn(ctx, 0, n);
        return;
    }
    int64_t want = (int64_t)(helpers + 1) * CN_CHUNKS_PER_THREAD;
    if (want > n) want = n;
    t->fn = fn;
    t->ctx = ctx;
    t->n = n;
    t->grain = (n + want - 1) / want;
    t->n_chunks = (n + t->grain - 1) / t->grain;
    t->max_helpers = helpers;
    atomic_store(&t->next_chunk, 0);
    atomic_store(&t->done_chunks, 0);
    atomic_store(&t->joined, 0);
    atomic_store(&t->active, 1);
    atomic_fetch_add(&t->gen, 1);
    if (atomic_load(&t->sleepers) > 0)
        syscall(SYS_futex, (uint32_t *)&t->gen, FUTEX_WAKE_PRIVATE, helpers, NULL, NULL, 0);
    cn_team_work(t);
    /* Only chunks a worker claimed can be outstanding; yield so that a worker preempted on
     * this core gets to finish its chunk. */
    for (int spins = 0; atomic_load(&t->done_chunks) < t->n_chunks; spins++) {
        cn_cpu_relax();
        if (spins > 1000) sched_yield();
    }
    atomic_store(&t->active, 0);
    for (int spins = 0; atomic_load(&t->users) > 0; spins++) {
        cn_cpu_relax();
        if (spins > 1000) sched_yield();
    }
    atomic_store(&t->busy, 0);
}

/* Whether the pool has workers and all of them sleep on the futex (none spinning). */
static inline int cn_workers_asleep(void) {
    return cn_team.n_workers > 0 && atomic_load(&cn_team.sleepers) >= cn_team.n_workers;
}

static inline int cn_has_threads(void) { return 1; }

#ifndef CN_PREFETCH_DISTANCE
#define CN_PREFETCH_DISTANCE 16
#endif

/* Row prefetches in flight, in cache lines: the distance in keys is this over the row's lines
 * (cn_prefetch_keys). A prefetch that finds every miss buffer taken stalls like a load; with a
 * fixed 16 keys, a dim-64 row (4 lines) kept 64 lines in flight and the pooled forward spent
 * 78% of its time on the prefetch instruction (perf, 8M rows, one thread). Measured on 4M rows x
 * dim 64, one thread, three interleaved runs each: uniform IDs 7.5-9.8 M IDs/s at 16 keys
 * against 10.9-12.2 at 8 keys (32 lines); Zipf 1.05 within the noise (12-16 against 11-14). */
#ifndef CN_PREFETCH_LINES
#define CN_PREFETCH_LINES 32
#endif

static inline int64_t cn_prefetch_keys(int64_t row_bytes) {
    const int64_t lines = (row_bytes + 63) / 64;
    const int64_t keys = CN_PREFETCH_LINES / (lines > 0 ? lines : 1);
    return keys < 4 ? 4 : keys > 32 ? 32 : keys;
}

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

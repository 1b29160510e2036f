/* cn_blockio.h: batched reads and writes of fixed-size records at given file offsets, for the
 * SSD tier (cncore/tier/).
 *
 * One call moves every record a batch needs, with the GIL released and the worker pool's
 * threads each issuing blocking pread/pwrite calls on their share: several I/Os are in flight
 * at once, which is what an SSD needs to reach its throughput (one at a time it serves one
 * request per ~80-100 us), and a page-cache hit costs a memcpy. Records never straddle a
 * 4 KiB page (the caller lays them out so), so a record is one device read.
 * Rejected for now: io_uring (not in every kernel CI runs on, and its queue depth beyond the
 * thread count pays only on a real NVMe device, not on this machine's page cache: 1,500 random
 * 320-byte reads from a cached 200 MiB file cost 0.81 us each by pread on one thread, 0.69 on
 * two, 0.75 through one io_uring submission of all of them, kernel 6.18, 2 cores); mmap
 * (mapped pages count in the process's RSS, and the tier promises an RSS near its cache budget).
 * mmap measured again (C, AMD EPYC guest, 1,435 random 280-byte records of a cached 100 MiB
 * file, as a 3x Zipf 1.05 step reads, 60 rounds with a 64 MiB flush between): pread 0.83-0.90
 * us a record; a copy from a mapping 0.39-0.46 where each record's page faults in, but giving
 * the pages back to keep RSS bounded costs more than it saves: madvise(MADV_DONTNEED) a record
 * 1.2-1.3 us, a fresh mapping per batch (mmap, copy, munmap) 0.75-0.84 in all.
 * The thread count is the tier's own (Tiered.io_threads), not the core's compute setting: a
 * job that runs the core on one thread still wants several reads in flight.
 */
#ifndef CN_BLOCKIO_H
#define CN_BLOCKIO_H

#define _GNU_SOURCE 1 /* preadv, pwritev */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/uio.h>
#include <unistd.h>
#include "cn_global.h"
#include "cn_parallel.h"
#include "cn_sort.h"

/* A run: records whose file ranges follow each other (their buffer rows need not), moved by one
 * preadv/pwritev. Spills take free slots in ascending order and fresh slots at the end of the
 * file, so the records a spill writes mostly form long runs: per-record pwrite calls made the
 * kernel's side (page locks, dirtying) most of a spill, 29 of 56 s of system time in
 * asv_bench/scripts/tiered_bench.py before runs were merged.
 * A run also crosses a gap shorter than a record (the padding at a page's end, which no record
 * can occupy): the gap is written as zeros (read into a scratch sink). Until this, a run ended at
 * every page, 14 records at dim 64: a step's 1,460 spilled records took 105 pwritev calls.
 * Measured appending 1,460 records a step (C, page cache, this machine): 0.48-0.53 ms in runs cut
 * at pages. */
#define CN_BLOCKIO_IOV 1024
CN_GLOBAL const uint8_t cn_blockio_zeros[4096]; /* all zero (src/cn_globals.c) */

typedef struct {
    int fd;
    const int64_t *offsets;
    const int64_t *order;  /* records sorted by offset */
    const int64_t *runs;   /* run r covers order[runs[r] .. runs[r + 1]) */
    int64_t rec;
    uint8_t *buf;
    uint8_t *sink;  /* reads: where a run's gaps go */
    int write;
    int err; /* first errno seen (EIO: a record past the end of the file) */
} cn_blockio_job;

static void cn_blockio_fail(cn_blockio_job *j, int err) {
    int expected = 0;
    __atomic_compare_exchange_n(&j->err, &expected, err, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
}

/* One record, the slow path of a short vector transfer. */
static int cn_blockio_one(cn_blockio_job *j, int64_t i) {
    uint8_t *p = j->buf + i * j->rec;
    int64_t done = 0;
    while (done < j->rec) {
        const ssize_t r = j->write ? pwrite(j->fd, p + done, (size_t)(j->rec - done), j->offsets[i] + done)
                                   : pread(j->fd, p + done, (size_t)(j->rec - done), j->offsets[i] + done);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            cn_blockio_fail(j, r < 0 ? errno : EIO);
            return -1;
        }
        done += r;
    }
    return 0;
}

static void cn_blockio_range(void *ctx, int64_t begin, int64_t end) {
    cn_blockio_job *j = (cn_blockio_job *)ctx;
    struct iovec iov[CN_BLOCKIO_IOV];
    for (int64_t r = begin; r < end; r++) {
        const int64_t first = j->runs[r], n = j->runs[r + 1] - first;
        int v = 0;
        for (int64_t k = 0; k < n; k++) {
            if (k) {
                const int64_t gap = j->offsets[j->order[first + k]] - j->offsets[j->order[first + k - 1]] - j->rec;
                if (gap) {
                    iov[v].iov_base = j->write ? (void *)cn_blockio_zeros : (void *)j->sink;
                    iov[v++].iov_len = (size_t)gap;
                }
            }
            iov[v].iov_base = j->buf + j->order[first + k] * j->rec;
            iov[v++].iov_len = (size_t)j->rec;
        }
        const int64_t at = j->offsets[j->order[first]];
        const int64_t span = j->offsets[j->order[first + n - 1]] + j->rec - at;
        ssize_t got;
        do {
            got = j->write ? pwritev(j->fd, iov, v, at) : preadv(j->fd, iov, v, at);
        } while (got < 0 && errno == EINTR);
        if (got == (ssize_t)span) continue;
        for (int64_t k = 0; k < n; k++) /* short or failed: record by record, reporting the error */
            if (cn_blockio_one(j, j->order[first + k]) != 0) return;
    }
}

/* Read (write = 0) or write n records of rec bytes between buf (n x rec) and the file at
 * offsets[i], on up to `threads` threads (0: the core's thread setting). Returns 0 or an errno
 * (ENOMEM: nothing was moved). */
static inline int cn_blockio(int fd, const int64_t *offsets, int64_t n, int64_t rec, uint8_t *buf, int write,
                             int threads) {
    /* The records in offset order: (offset, record) pairs sorted, then the records alone. */
    cn_pair *by_offset = (cn_pair *)malloc((size_t)n * sizeof(cn_pair));
    int64_t *order = (int64_t *)by_offset;
    int64_t *runs = (int64_t *)malloc((size_t)(n + 1) * sizeof(int64_t));
    uint8_t *sink = write || rec >= 4096 ? NULL : (uint8_t *)malloc((size_t)rec);
    if (by_offset == NULL || runs == NULL || (sink == NULL && !write && rec < 4096)) {
        free(by_offset);
        free(runs);
        free(sink);
        return ENOMEM;
    }
    for (int64_t i = 0; i < n; i++) {
        by_offset[i].key = offsets[i];
        by_offset[i].value = i;
    }
    cn_pair_sort(by_offset, n);
    for (int64_t i = 0; i < n; i++) order[i] = by_offset[i].value; /* in place: order[i] is read after */
    int64_t n_runs = 0, iovs = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t gap = i ? offsets[order[i]] - offsets[order[i - 1]] - rec : -1;
        const int joins = gap == 0 || (gap > 0 && gap < rec && gap < 4096);  /* a gap no record fits in */
        iovs += 1 + (gap > 0);
        if (!joins || iovs > CN_BLOCKIO_IOV) {
            runs[n_runs++] = i;
            iovs = 1;
        }
    }
    runs[n_runs] = n;
    cn_blockio_job job = {fd, offsets, order, runs, rec, buf, sink, write, 0};
    if (threads <= 0) threads = cn_max_threads();
    cn_parallel_for(cn_blockio_range, &job, n_runs, n_runs >= 16 ? threads : 1);
    free(order);
    free(runs);
    free(sink);
    return job.err;
}

#endif

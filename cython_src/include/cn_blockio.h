/* cn_blockio.h: batched reads and writes of fixed-size records at given file offsets, for the
 * SSD tier (cncore/tiered.py).
 *
 * One call moves every record a batch needs, with the GIL released and the worker pool's
 * threads each issuing blocking pread/pwrite calls on their share: several I/Os are in flight
 * at once, which is what an SSD needs to reach its throughput (one at a time it serves one
 * request per ~80-100 us), and a page-cache hit costs a memcpy. Records never straddle a
 * 4 KiB page (the caller lays them out so), so a record is one device read.
 * Rejected for now: io_uring (not in every kernel CI runs on, and its queue depth beyond the
 * thread count pays only on a real NVMe device, not on this machine's page cache); mmap
 * (mapped pages count in the process's RSS, and the tier promises an RSS near its cache budget).
 */
#ifndef CN_BLOCKIO_H
#define CN_BLOCKIO_H

#include <errno.h>
#include <stdint.h>
#include <unistd.h>
#include "cn_parallel.h"

typedef struct {
    int fd;
    const int64_t *offsets;
    int64_t rec;
    uint8_t *buf;
    int write;
    int err; /* first errno seen (EIO: a record past the end of the file) */
} cn_blockio_job;

static void cn_blockio_range(void *ctx, int64_t begin, int64_t end) {
    cn_blockio_job *j = (cn_blockio_job *)ctx;
    for (int64_t i = begin; i < end; i++) {
        uint8_t *p = j->buf + i * j->rec;
        int64_t done = 0;
        while (done < j->rec) {
            const ssize_t r = j->write ? pwrite(j->fd, p + done, (size_t)(j->rec - done), j->offsets[i] + done)
                                       : pread(j->fd, p + done, (size_t)(j->rec - done), j->offsets[i] + done);
            if (r < 0 && errno == EINTR) continue;
            if (r <= 0) {
                int expected = 0;
                __atomic_compare_exchange_n(&j->err, &expected, r < 0 ? errno : EIO, 0, __ATOMIC_RELAXED,
                                            __ATOMIC_RELAXED);
                return;
            }
            done += r;
        }
    }
}

/* Read (write = 0) or write n records of rec bytes between buf (n x rec) and the file at
 * offsets[i]. Returns 0 or an errno. */
static inline int cn_blockio(int fd, const int64_t *offsets, int64_t n, int64_t rec, uint8_t *buf, int write) {
    cn_blockio_job job = {fd, offsets, rec, buf, write, 0};
    const int threads = n >= 64 ? cn_max_threads() : 1;
    cn_parallel_for(cn_blockio_range, &job, n, threads);
    return job.err;
}

#endif

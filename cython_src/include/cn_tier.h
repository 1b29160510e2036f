/* cn_tier.h: the SSD tier's records (cncore/tier/) packed and loaded in C, one call a batch.
 *
 * A record is {int64 key, uint32 count, uint32 last step, row (dim values of the record's row
 * dtype), state (state_floats float32)}, then from directory version 4 a uint32 checksum in its
 * last 4 bytes (cn_tier_sum), packed to 8 bytes, zero padding; records never straddle
 * a 4 KiB page (tiered.record_layout decides the layout and hands its field offsets here, so
 * the two cannot disagree). Two paths move rows between the memory cache (a bounded cn_table)
 * and the file:
 *  - spill (cn_tier_pack): the rows the cache evicts (cn_evicted: float32 rows, state,
 *    metadata) are packed straight into the write buffer, then written by cn_blockio;
 *  - fault-in (cn_tier_load): the records read from disk go straight into the table: the
 *    room is made as any insert makes it (cn_table_make_room, with the call's other keys
 *    pinned), then each key takes a slot and its row, state and metadata are copied from
 *    the record, without drawing the initial row it would overwrite.
 *
 * Why here and not in NumPy (measured, asv_bench/scripts/tiered_bench.py, table 3x its 32 MiB
 * cache, Zipf 1.05, ~1,460 rows in and out a step, no prefetch): the Python path copied an
 * evicted row three times (the core's eviction buffer -> NumPy arrays -> a TableBatch's
 * fields -> the structured record buffer, one NumPy pass per field) and a faulted-in row
 * three more (record -> contiguous row and state arrays -> the initial row find_or_insert
 * drew -> the loaded row): the spill and the load cost 0.6 and 0.25 ms a step on top of the
 * eviction itself. Here a row is copied once each way (out of the eviction buffer, in from the
 * read buffer). Measured on the cache of that benchmark (109k rows): evict(4900) of a tiered
 * store, rows spilled to the file, took 6.65 ms through NumPy and 2.4-2.5 ms here, against 0.7
 * for choosing and dropping the rows in memory and 1.2-1.4 with a Python on_evict sink.
 *
 * Write-behind (SpillJob in _core.pyx, TieredStore._write_behind): with a tier's writer in
 * `behind` mode, cn_tier_pack and the pwritev of a spill run on the tier's background thread,
 * from the eviction's own buffer (no copy), after the keys were indexed; the training thread
 * only chooses, copies out and indexes. Measured on the 3x Zipf 1.05 benchmark: the queued
 * writes took 0.22-0.23 us a record there (0.32-0.34 ms a step of 1,440 records).
 * Rejected with it: reusing, before the next flush, pages written since the last one once all
 * their records were read back (crash-safe, as the last flush refers to none of them, and it
 * bounds the file's growth between flushes: high water 509k slots instead of ~658k after 230
 * steps). The same run's writes took 0.28-0.31 us a record instead of 0.22-0.23 (reused pages
 * are scattered, so the runs are short, where appends are one run), and the page bookkeeping
 * (per-page live counts in NumPy) cost the training thread 0.2 ms a step.
 *
 * Rejected: reading records through an mmap of the file instead of pread (cn_blockio.h). On
 * this machine (file in the page cache, 1,460 random 280-byte records): pread 0.75-0.9 us a
 * record; a copy from the mapping 0.35-0.45 us when each record's page faults in, 0.02 us once
 * mapped. But the mapped pages stay in the process's RSS (the whole file, 92 MiB at 3x, where
 * the tier promises RSS near its cache), and dropping them after each batch (MADV_DONTNEED)
 * cost 260-320 us per 1,460 records: 0.6-0.7 us a record in all, no better than pread.
 */
#ifndef CN_TIER_H
#define CN_TIER_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "cn_dtype.h"
#include "cn_table.h"
#include "cn_blockio.h"
#include "cn_mix.h"
#include <errno.h>
#include <sched.h>

#define CN_TIER_PAGE 4096

typedef struct {
    int64_t rec;       /* bytes of a record */
    int64_t per_page;  /* records a 4 KiB page holds (a record of a page or more: whole pages each) */
    int64_t dim, state_floats;
    int row_dtype;     /* of the record's row field (CN_ROW_*): version 2 directories keep float32 */
    int64_t off_count, off_step, off_row, off_state;  /* the key is at 0 */
    int64_t off_check; /* the record's checksum (cn_tier_sum), or 0: none (directories before version 4) */
} cn_tier_layout;

static inline int64_t cn_tier_offset(const cn_tier_layout *L, int64_t slot) {
    if (L->rec >= CN_TIER_PAGE) return slot * L->rec;
    return (slot / L->per_page) * CN_TIER_PAGE + (slot % L->per_page) * L->rec;
}

/* Record checksums
 *
 * From directory version 4 a record's last 4 bytes (off_check = rec - 4, in what was padding
 * where the fields leave 4 bytes of it) hold a 32-bit checksum of the bytes before them: written
 * by every pack, checked by every read (the store's fault-in, export and compaction, and
 * tiered.TierFile), so a flipped byte in rows.dat is refused rather than read back as a row.
 * The sum runs over 8-byte words in four independent lanes (a multiply and a shift each, so the
 * lanes overlap in the pipeline rather than forming one chain of multiplies), then mixes the
 * lanes with SplitMix64's finaliser. Each lane's step is a bijection of its state for a fixed
 * word, so two records that differ in one word (any flipped byte or bit) always differ in their
 * 64-bit sum; the 32 bits kept collide for other damage with odds of about 2^-32.
 * Rejected: zlib's crc32 (a link dependency, and byte-serial without the hardware instruction);
 * SSE4.2's crc32c (not on every architecture the wheels build for). */
static inline uint32_t cn_tier_sum(const cn_tier_layout *L, const uint8_t *p) {
    const uint64_t K = 0x9E3779B97F4A7C15ULL;
    uint64_t h[4] = {(uint64_t)L->rec, K, 2 * K, 3 * K};
    const int64_t words = L->off_check / 8;
    int64_t i = 0;
    for (; i + 4 <= words; i += 4)
        for (int j = 0; j < 4; j++) {
            uint64_t w;
            memcpy(&w, p + 8 * (i + j), 8);
            h[j] = (h[j] ^ w) * K;
            h[j] ^= h[j] >> 29;
        }
    for (; i < words; i++) {
        uint64_t w;
        memcpy(&w, p + 8 * i, 8);
        h[i & 3] = (h[i & 3] ^ w) * K;
        h[i & 3] ^= h[i & 3] >> 29;
    }
    if (L->off_check % 8) { /* the 4 bytes before the checksum */
        uint32_t w;
        memcpy(&w, p + 8 * words, 4);
        h[0] = (h[0] ^ w) * K;
        h[0] ^= h[0] >> 29;
    }
    return (uint32_t)cn_mix64(cn_mix64(h[0] ^ cn_mix64(h[1])) ^ cn_mix64(h[2] ^ cn_mix64(h[3])));
}

/* Pack n rows (float32, row i at rows + i * ld_rows; state likewise, NULL for none) into n
 * records at buf, padding zeroed, each with its checksum where the layout has one. */
static inline void cn_tier_pack(const cn_tier_layout *L, int64_t n, const int64_t *keys, const uint32_t *counts,
                                const uint32_t *steps, const float *rows, int64_t ld_rows, const float *state,
                                int64_t ld_state, uint8_t *buf) {
    memset(buf, 0, (size_t)(n * L->rec));
    for (int64_t i = 0; i < n; i++) {
        uint8_t *p = buf + i * L->rec;
        memcpy(p, &keys[i], 8);
        memcpy(p + L->off_count, &counts[i], 4);
        memcpy(p + L->off_step, &steps[i], 4);
        cn_row_store_of_level(L->row_dtype, rows + i * ld_rows, p + L->off_row, L->dim);
        if (state && L->state_floats)
            memcpy(p + L->off_state, state + i * ld_state, (size_t)L->state_floats * sizeof(float));
        if (L->off_check > 0) {
            const uint32_t sum = cn_tier_sum(L, p);
            memcpy(p + L->off_check, &sum, 4);
        }
    }
}

/* Index of the first of n records whose key is not keys[i], or whose checksum does not match
 * (where the layout has one), or -1. */
static inline int64_t cn_tier_check_keys(const cn_tier_layout *L, const uint8_t *buf, const int64_t *keys,
                                         int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        int64_t k;
        memcpy(&k, buf + i * L->rec, 8);
        if (k != keys[i]) return i;
        if (L->off_check > 0) {
            uint32_t stored;
            memcpy(&stored, buf + i * L->rec + L->off_check, 4);
            if (stored != cn_tier_sum(L, buf + i * L->rec)) return i;
        }
    }
    return -1;
}

/* Room for n more rows in a bounded table (nothing to do when it has it): evict down to the
 * low-water mark after them, keeping the live rows at the n_pin slots `pin` (repeats allowed)
 * out of the choice, as cn_table_make_room does for an insert. Evicted rows go into ev. Returns
 * CN_OK, CN_EBADSLOT (a pin outside the table: setting the live bit of a freed slot would revive
 * it), CN_EFULL (the pinned rows and the n exceed max_rows) or CN_ENOMEM; on an error nothing
 * was evicted. */
static inline int cn_tier_make_room(cn_table *t, int64_t n, const int64_t *pin, int64_t n_pin, int want_rows,
                                    cn_evicted *ev) {
    memset(ev, 0, sizeof(*ev));
    for (int64_t i = 0; i < n_pin; i++)
        if (pin[i] < 0 || pin[i] >= t->arena.high_water) return CN_EBADSLOT;
    const int64_t size = t->index.size;
    if (t->bound.max_rows <= 0 || size + n <= t->bound.max_rows) return CN_OK;
    uint8_t *was = (uint8_t *)malloc((size_t)(n_pin ? n_pin : 1));
    if (was == NULL) return CN_ENOMEM;
    int64_t pinned = 0;
    for (int64_t i = 0; i < n_pin; i++) pinned += was[i] = (uint8_t)cn_arena_set_live(&t->arena, pin[i], 0);
    int rc = CN_EFULL;
    if (pinned + n <= t->bound.max_rows) {
        int64_t k = size + n - t->bound.low_water;
        if (k > size - pinned) k = size - pinned;
        rc = cn_table_evict_lowest(t, k, size - pinned, want_rows, ev, size + n - k);
    }
    for (int64_t i = 0; i < n_pin; i++)  /* only the bits this call cleared (a pin given twice: once) */
        if (was[i]) cn_arena_set_live(&t->arena, pin[i], 1);
    free(was);
    return rc;
}

/* Load n records (distinct keys, keys[i] the key of record i, none in the table) into a bounded
 * table; slots[i] receives the slot of keys[i]. The live rows at the n_pin slots `pin` (the
 * call's other rows; repeats allowed) are kept out of the eviction that makes the room: pinned by
 * slot, not by key, as the caller found them already (a find of a step's 16k keys per round
 * was 0.1-0.2 ms). The room is made as cn_table_make_room makes it for an insert: down to the
 * low-water mark, rows evicted into ev (rows and state with want_rows). Returns CN_OK, CN_EFULL
 * (the pinned and loaded rows exceed max_rows), CN_EBADSLOT (a pin outside the table) or
 * CN_ENOMEM; on an error nothing was loaded (an eviction that had already happened is in ev, to
 * be handed on). */
static inline int cn_tier_load(cn_table *t, const cn_tier_layout *L, const uint8_t *buf, const int64_t *keys,
                               int64_t n, const int64_t *pin, int64_t n_pin, int want_rows, cn_evicted *ev,
                               int64_t *slots) {
    memset(ev, 0, sizeof(*ev));
    if (n == 0) return CN_OK;
    int rc = cn_tier_make_room(t, n, pin, n_pin, want_rows, ev);
    if (rc == CN_OK) rc = cn_table_reserve(t, t->index.size + n);
    if (rc != CN_OK) return rc;
    float tmp[256];
    float *wide = L->row_dtype == t->row_dtype || L->dim <= 256 ? tmp : (float *)malloc((size_t)L->dim * sizeof(float));
    if (wide == NULL) return CN_ENOMEM;
    const int64_t row_bytes = cn_dtype_bytes(t->row_dtype) * L->dim;
    int64_t inserted = 0;
    /* Prefetched CN_PREFETCH_DISTANCE keys ahead: the key's index bucket and the slot it will
     * take (the free stack's, popped in order; its row, metadata and key), all scattered. */
    const int64_t ahead = CN_PREFETCH_DISTANCE;
    for (int64_t i = 0; i < n; i++) {
        if (i + ahead < n) {
            __builtin_prefetch(&t->index.buckets[cn_index_home(&t->index, keys[i + ahead])], 1, 3);
            if (t->arena.n_free > ahead) {
                const int64_t next = t->arena.free_slots[t->arena.n_free - 1 - ahead];
                cn_prefetch_write(cn_arena_row(&t->arena, next), t->arena.row_bytes);
                __builtin_prefetch(cn_arena_meta(&t->arena, next), 1, 3);
                if (t->arena.key_offset) __builtin_prefetch(cn_arena_key(&t->arena, next), 1, 3);
            }
        }
        const uint8_t *p = buf + i * L->rec;
        int64_t pos, s = cn_index_probe(&t->index, keys[i], &pos);
        if (s < 0) {
            s = cn_arena_take_slot(&t->arena);
            cn_index_put_at(&t->index, pos, keys[i], s);
            if (t->arena.key_offset) {
                *cn_arena_key(&t->arena, s) = keys[i];
                cn_arena_set_live(&t->arena, s, 1);
            }
            inserted++;
        }
        slots[i] = s;
        void *row = cn_arena_row(&t->arena, s);
        if (L->row_dtype == t->row_dtype) {
            memcpy(row, p + L->off_row, (size_t)row_bytes);
        } else {
            cn_row_load_of_level(L->row_dtype, p + L->off_row, wide, L->dim);
            cn_row_store_of_level(t->row_dtype, wide, row, L->dim);
        }
        if (t->state_floats)
            memcpy(cn_table_state(t, s), p + L->off_state, (size_t)t->state_floats * sizeof(float));
        cn_meta *meta = cn_arena_meta(&t->arena, s);
        memcpy(&meta->count, p + L->off_count, 4);
        memcpy(&meta->last_step, p + L->off_step, 4);
    }
    if (wide != tmp) free(wide);
    if (inserted) t->version = cn_next_stamp();
    return CN_OK;
}

/* The distinct keys among keys[i] with skip[i] == 0, in ascending (signed) order, each with how
 * many of the IDs it is, into pairs[0..m) as (key, count); returns m, or -1 (no memory). A
 * fault-in's missing IDs (TieredStore._missing_rows, then SlotIndex.missing). np.unique with its
 * counts, a find and NumPy's masks took 14 us for 512 IDs 11% missing (a cn-dlrm table's step;
 * 26 tables a step) and 60 us for 16k IDs 9% missing; this and the find, 4.3 and 27 us (timeit,
 * minimum of 7 repeats of 200, the same results checked). */
static inline int64_t cn_tier_distinct_counted(const int64_t *keys, const uint8_t *skip, int64_t n, cn_pair *pairs) {
    int64_t m = 0;
    for (int64_t i = 0; i < n; i++) m += !skip[i];
    if (m == 0) return 0;
    const uint64_t cap = (uint64_t)cn_pow2_at_least(2 * m), mask = cap - 1;
    int64_t *at = (int64_t *)malloc(cap * sizeof(int64_t)); /* a bucket's pair, or -1 */
    if (at == NULL) return -1;
    memset(at, 0xff, cap * sizeof(int64_t));
    int64_t d = 0;
    for (int64_t i = 0; i < n; i++) {
        if (skip[i]) continue;
        uint64_t h = cn_hash_key(keys[i]) & mask;
        while (at[h] >= 0 && pairs[at[h]].key != keys[i]) h = (h + 1) & mask;
        if (at[h] < 0) {
            at[h] = d;
            pairs[d].key = keys[i];
            pairs[d++].value = 1;
        } else {
            pairs[at[h]].value++;
        }
    }
    free(at);
    cn_pair_sort(pairs, d);
    return d;
}

/* The whole background job of prefetch() (cncore/tier/) in one call, run without the GIL:
 * of n keys, those the disk index `disk` holds (distinct, in key order, the first `cap` of them)
 * go to keys_out / slots_out (room for min(n, cap)) and their records are read into buf (as
 * many records) on `threads` threads. Returns how many, or -errno (-ENOMEM: nothing read). `mu`,
 * the disk index's lock, is held for the find only: the training thread may spill meanwhile,
 * and a record is written before its key is indexed, so every slot found holds its record.
 * Why in C: done in Python on the prefetch thread (SlotIndex.find, np.unique, offsets, then the
 * read), its GIL-holding parts convoyed with the training thread's own Python: the backward
 * of a 3x zipf-1.05 step (tiered_bench) took 2.6-4.4 ms instead of 1.2-1.9 while it ran; done
 * in Python on the training thread (the code before), the find and unique cost the step
 * 0.45-0.65 ms of the ~1.0 ms of reads it hid. Measured on this 2-core machine, shared: the
 * step's main-thread CPU with prefetch (medians of alternated runs) 6.32 ms before and 5.67
 * after (5 each, load 1.8-2.2), 6.74 and 6.38 (6 each, load 4.3-5.3), where the no-prefetch
 * path, unchanged, gave 6.65 / 5.86 and 6.16 / 6.83: the gain is about the noise; wall time did
 * not move beyond it (no idle core for the background thread on a machine this loaded).
 * Measured and rejected in the same round (3x table, 32 MiB cache, --capacity-hint):
 *  - the background read on 1 thread instead of Tiered.io_threads (4): main-thread CPU 6.05
 *    against 5.72 ms a step, wall time within noise;
 *  - prefetching at most 1/64 of the cache instead of 1/32: the uniform run's store peak 44.6
 *    -> 43.9 MiB (1.174 -> 1.156 of cache + disk index), short of the 1.10 goal, while the 10x
 *    zipf-1.05 step's 2,630 reads would no longer fit one prefetch;
 *  - a prefetch buffer of its own kept between calls (the fault-in's rounds keeping theirs):
 *    no change (steady RSS 43.6 -> 44.0 MiB, within run-to-run spread). What the prefetch adds
 *    to the uniform run's steady RSS (2.1 MiB: 43.6 against 41.5 without it) is glibc keeping
 *    freed large blocks in the heap once its dynamic mmap threshold rose past them: with
 *    MALLOC_MMAP_THRESHOLD_=131072 the steady RSS is 41.4 MiB with prefetch too. Not adopted:
 *    a process-wide allocator setting is the user's, not the tier's. */
typedef cn_pair cn_tier_kv; /* key, slot */

/* A prefetch's reads, shared: the background thread (cn_tier_stage) and a helper (the training
 * thread, when its next call needs the records before they are all read: cn_tier_share_help)
 * claim chunks of CN_TIER_SHARE_CHUNK records with one atomic add, so the training thread reads
 * alongside instead of waiting. Why: on the 3x Zipf 1.05 benchmark (asv_bench/scripts/
 * tiered_bench.py) the job (find of 16k IDs, then ~1,460 preads at 1.3 us) took 2.2-2.7 ms from
 * its start, the step gave it ~1.7 (the backward and the next fault-in's finds), and the training
 * thread then waited 0.2-1.3 ms for it with the machine's second core busy on the reads. The
 * record buffer, offsets and counters belong to the job's owner (_core.StageJob), which both
 * threads hold; the background thread frees the offsets only once every claimed chunk is done. */
#define CN_TIER_SHARE_CHUNK 64
typedef struct {
    int64_t m;                 /* records to read, set before `state` becomes 1 */
    const int64_t *offsets;    /* record i's offset, i < m */
    uint8_t *buf;
    int64_t rec;
    int fd;
    int64_t next;              /* next chunk to claim (atomic) */
    int64_t done;              /* records done, read or failed (atomic) */
    int state;                 /* 0: finding, 1: reading (chunks to claim), 2: over (atomic) */
    int err;                   /* first errno (atomic) */
    /* The find's outcome, set before `state` becomes 1 (planned = 1): the distinct keys handed in,
     * the distinct ones found on disk (m of them read: at most the job's cap), and the disk
     * index's version at the find. A fault-in of the same keys uses it instead of finding them
     * itself (cncore/tier/fault_in.py, TieredStore._own_plan). */
    int64_t n_distinct, n_found;
    uint64_t disk_version;
    int planned;
} cn_tier_share;

/* The find's outcome if the job has got past it: 1, else 0 (still finding, or it ended without
 * one: an error). Never waits. */
static inline int cn_tier_share_plan(const cn_tier_share *s, int64_t *n_distinct, int64_t *n_found, int64_t *m,
                                     uint64_t *disk_version) {
    if (__atomic_load_n(&s->state, __ATOMIC_ACQUIRE) == 0 || !s->planned) return 0;
    *n_distinct = s->n_distinct;
    *n_found = s->n_found;
    *m = s->m;
    *disk_version = s->disk_version;
    return 1;
}

static inline void cn_tier_share_work(cn_tier_share *s, int threads) {
    const int64_t n_chunks = (s->m + CN_TIER_SHARE_CHUNK - 1) / CN_TIER_SHARE_CHUNK;
    for (;;) {
        const int64_t c = __atomic_fetch_add(&s->next, 1, __ATOMIC_ACQ_REL);
        if (c >= n_chunks) return;
        const int64_t a = c * CN_TIER_SHARE_CHUNK;
        const int64_t k = s->m - a < CN_TIER_SHARE_CHUNK ? s->m - a : CN_TIER_SHARE_CHUNK;
        const int e = cn_blockio(s->fd, s->offsets + a, k, s->rec, s->buf + a * s->rec, 0, threads);
        if (e) {
            int zero = 0;
            __atomic_compare_exchange_n(&s->err, &zero, e, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
        }
        __atomic_fetch_add(&s->done, k, __ATOMIC_ACQ_REL);
    }
}

/* The training thread's part: read unclaimed chunks of a job that is reading (on one thread, the
 * caller's); returns at once if it is still finding or over. */
static inline void cn_tier_share_help(cn_tier_share *s) {
    if (__atomic_load_n(&s->state, __ATOMIC_ACQUIRE) == 1) cn_tier_share_work(s, 1);
}

static inline int64_t cn_tier_stage(const cn_tier_layout *L, int fd, int threads, const cn_index *disk,
                                    pthread_mutex_t *mu, const uint64_t *disk_version, const int64_t *keys,
                                    int64_t n, int64_t cap,
                                    int64_t *keys_out, int64_t *slots_out, uint8_t *buf, cn_tier_share *share) {
    if (n == 0 || cap <= 0) {
        if (share) __atomic_store_n(&share->state, 2, __ATOMIC_RELEASE);
        return 0;
    }
    int64_t *at = (int64_t *)malloc((size_t)n * sizeof(int64_t));
    const size_t kv_bytes = (size_t)n * sizeof(cn_tier_kv), set_bytes = cn_distinct_scratch(n);
    cn_tier_kv *kv = (cn_tier_kv *)malloc(kv_bytes > set_bytes ? kv_bytes : set_bytes);  /* first the set */
    if (at == NULL || kv == NULL) {
        free(at);
        free(kv);
        if (share) __atomic_store_n(&share->state, 2, __ATOMIC_RELEASE);
        return -ENOMEM;
    }
    /* The distinct keys first (cn_distinct_keys, cn_table.h): a step's IDs repeat (16k Zipf 1.05
     * IDs are ~6.2k keys), and each find in the disk index (megabytes) is a cache miss, where the
     * set stays in L2. Measured on the 3x Zipf 1.05 benchmark's prefetch jobs when they were
     * handed every ID (RecordWriter.stage on 1 thread, medians of 60 jobs, three alternated pairs
     * with the find over every ID): 2.34 / 2.02 / 2.56 ms against 2.98 / 2.37 / 2.95. */
    int64_t *uniq = (int64_t *)malloc((size_t)n * sizeof(int64_t));
    const int64_t n_uniq = uniq == NULL ? -1 : cn_distinct_keys(keys, NULL, n, n, uniq, kv);
    if (n_uniq < 0) {
        free(uniq);
        free(at);
        free(kv);
        if (share) __atomic_store_n(&share->state, 2, __ATOMIC_RELEASE);
        return -ENOMEM;
    }
    pthread_mutex_lock(mu);
    cn_index_find_batch(disk, uniq, n_uniq, at, 1);
    const uint64_t version_found = *disk_version;
    pthread_mutex_unlock(mu);
    int64_t found = 0, m = 0;
    for (int64_t i = 0; i < n_uniq; i++)
        if (at[i] >= 0) {
            kv[found].key = uniq[i];
            kv[found++].value = at[i];
        }
    free(uniq);
    cn_pair_sort(kv, found); /* cn_sort.h: qsort's comparator calls were 0.17 ms a step here */
    for (int64_t i = 0; i < found && m < cap; i++)
        if (m == 0 || kv[i].key != keys_out[m - 1]) {
            keys_out[m] = kv[i].key;
            slots_out[m] = kv[i].value;
            at[m++] = cn_tier_offset(L, kv[i].value);  /* at: now the records' offsets */
        }
    free(kv);
    int err = 0;
    if (share == NULL) {
        err = m ? cn_blockio(fd, at, m, L->rec, buf, 0, threads) : 0;
    } else {
        share->m = m;
        share->n_distinct = n_uniq;
        share->n_found = found;
        share->disk_version = version_found;
        share->planned = 1;
        share->offsets = at;
        share->buf = buf;
        share->rec = L->rec;
        share->fd = fd;
        __atomic_store_n(&share->state, 1, __ATOMIC_RELEASE);  /* a helper may claim chunks from here */
        cn_tier_share_work(share, threads);
        while (__atomic_load_n(&share->done, __ATOMIC_ACQUIRE) < m) sched_yield();  /* a helper's last chunk */
        __atomic_store_n(&share->state, 2, __ATOMIC_RELEASE);
        err = __atomic_load_n(&share->err, __ATOMIC_ACQUIRE);
    }
    free(at);
    return err ? -(int64_t)err : m;
}

#endif

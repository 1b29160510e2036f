/* cn_globals.c: the one definition of every process-wide variable of the core.
 *
 * The headers declare each of them with CN_GLOBAL (cn_global.h) beside the code that uses it;
 * this file gives each its storage and initial value, once for the whole extension. Including
 * the declaring headers here lets the compiler check that every definition matches its
 * declaration.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE 1 /* as Python.h defines it for the extension's own translation unit */
#endif
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include "cn_alloc.h"
#include "cn_blockio.h"
#include "cn_evict.h"
#include "cn_isa.h"
#include "cn_parallel.h"
#include "cn_table.h"

/* cn_alloc.h: bytes held by every table of the process (the allocation tracer). */
int64_t cn_traced_bytes_total = 0;

/* cn_blockio.h: what a run writes into the gaps between its records. */
const uint8_t cn_blockio_zeros[4096] = {0};

/* cn_evict.h: rows sampled to guess a victim threshold (0: radix select only). */
int64_t cn_evict_sample_rows = 4096;

/* cn_isa.h: the kernels in use; module initialisation chooses the level (NULL, baseline x86-64,
 * until then: this file names no kernel, so a C driver can link it without them). */
const cn_kernels *cn_kernels_active = NULL;

/* cn_init.h: the insert path's initialiser (NULL: the including unit's own; cn_isa_use sets it). */
cn_init_row_fn cn_init_row_active = NULL;

/* cn_dtype.h: the 16-bit row conversions outside the kernels (NULL: the including unit's own). */
cn_row_load_fn cn_row_load_active = NULL;
cn_row_store_fn cn_row_store_active = NULL;

/* cn_parallel.h: the thread setting (0: the default), how long an idle worker spins before
 * it sleeps (CNCORE_SPIN_US replaces it when the first worker starts), and the pool. */
int cn_thread_setting = 0;
int64_t cn_spin_ns = CN_SPIN_US_DEFAULT * 1000;
cn_team_t cn_team = {.grow_lock = PTHREAD_MUTEX_INITIALIZER};

/* cn_table.h: stamps for erase epochs and versions, unique across the process's tables. */
uint64_t cn_stamp_counter = 0;

# Declarations of the C core (cython_src/include). No implementation here; all nogil.
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from cncore._typedefs cimport key_t, slot_t, offset_t, weight_t, count_t

cdef extern from "cn_alloc.h" nogil:
    int64_t cn_traced_bytes()
    double cn_machine_bytes()

cdef extern from "cn_parallel.h" nogil:
    int cn_thread_setting
    void cn_set_thread_setting(int n)
    int cn_max_threads()
    int cn_has_threads()
    int cn_threads_for(int64_t work)

cdef extern from "cn_init.h" nogil:
    ctypedef struct cn_init:
        int kind
        uint64_t seed
        float p0, p1, p2, p3
    void cn_init_row(const cn_init *init, int64_t key, weight_t *row, int64_t dim)

cdef extern from "cn_optim.h" nogil:
    ctypedef struct cn_optim:
        int kind
        float lr, eps, beta1, beta2, bias1, bias2_sqrt
    int64_t cn_optim_state_floats(int kind, int64_t dim)
    void cn_optim_set_step(cn_optim *o, int64_t step)

cdef extern from "cn_index.h" nogil:
    ctypedef struct cn_index:
        int64_t n_buckets
        int64_t size
    int cn_index_init(cn_index *ix, int64_t n_buckets, int64_t *nbytes)
    void cn_index_free(cn_index *ix, int64_t *nbytes)
    void cn_index_find_batch(const cn_index *ix, const int64_t *keys, int64_t n, int64_t *slots, int nthreads)

cdef extern from "cn_slotindex.h" nogil:
    int cn_slotindex_reserve(cn_index *ix, int64_t extra, int exact, int64_t *nbytes)
    int64_t cn_slotindex_buckets_for(int64_t n)
    void cn_slotindex_put(cn_index *ix, const int64_t *keys, const int64_t *slots, int64_t n)
    void cn_slotindex_erase(cn_index *ix, const int64_t *keys, int64_t n, int64_t *slots)
    int64_t cn_slotindex_erase_at(cn_index *ix, const int64_t *keys, const int64_t *slots, int64_t n)
    int64_t cn_slotindex_items(const cn_index *ix, int64_t *pos, int64_t max, int64_t *keys, int64_t *slots)

cdef extern from "cn_arena.h" nogil:
    ctypedef struct cn_arena:
        int64_t n_pages
        int64_t page_shift
        int64_t row_bytes
        int64_t meta_bytes
        int64_t key_offset
        int64_t page_bytes
        int64_t high_water

cdef extern from "cn_grad.h" nogil:
    ctypedef struct cn_groups:
        int64_t n_unique
        int64_t *unique_pos
    int cn_groups_build(const slot_t *slots, const int64_t *positions, int64_t m, cn_groups *g)
    void cn_groups_free(cn_groups *g)
    int cn_all_finite(const weight_t *g, int64_t rows, int64_t dim, int64_t ld)
    int64_t *cn_bag_of(const offset_t *offsets, int64_t n_bags, int nthreads)

cdef extern from "cn_evict.h" nogil:
    int64_t cn_evict_sample_rows

cdef extern from "cn_table.h" nogil:
    enum:
        CN_OK
        CN_ENOMEM
        CN_ESTALE
        CN_EBADSLOT
        CN_EFULL
    int cn_grad_threads(int64_t n_keys)
    ctypedef struct cn_bound:
        int policy
        int64_t max_rows
        int64_t low_water
        int64_t ttl
        int lfu_halve_shift
        uint32_t min_count
        int64_t sketch_width
        int64_t sketch_depth
        int absent_initial
        uint64_t admit_threshold
        uint64_t admit_seed
        int64_t fallback_rows
        int fallback_copy
        int fallback_residual
    ctypedef struct cn_evicted:
        int64_t n
        key_t *keys
        weight_t *rows
        weight_t *state
        count_t *counts
        count_t *last_steps
    void cn_evicted_free(cn_evicted *ev)
    ctypedef struct cn_admit:
        uint32_t *counters
        int64_t width
        int64_t depth
        uint32_t min_count
    ctypedef struct pthread_rwlock_t:
        pass
    ctypedef struct cn_table:
        cn_index index
        cn_arena arena
        int64_t dim
        int row_dtype
        int64_t emb_floats
        int64_t state_floats
        double max_load
        int64_t nbytes
        int64_t step
        uint64_t erase_epoch
        uint64_t version
        cn_bound bound
        cn_admit admit
        int64_t n_evicted
        pthread_rwlock_t lock
    int cn_table_create(cn_table *t, int64_t dim, int optimizer_kind, float state_init, cn_init init,
                        double max_load, int64_t capacity_hint, cn_bound bound, int row_dtype)
    void cn_table_destroy(cn_table *t)
    int64_t cn_table_capacity(const cn_table *t)
    int cn_table_reserve(cn_table *t, int64_t total)
    void cn_table_find(const cn_table *t, const key_t *keys, int64_t n, slot_t *slots)
    int cn_table_take_found(const cn_table *t, const key_t *keys, const slot_t *found, int64_t n, slot_t *slots)
    int cn_table_resolve(cn_table *t, const key_t *keys, int64_t n, slot_t *slots, uint8_t *found, int insert,
                         int admit, int want_rows, cn_evicted *ev, int64_t *n_new)
    void cn_table_use_fallback(const cn_table *t, const key_t *keys, int64_t n, slot_t *slots)
    void cn_table_residual_slots(const cn_table *t, const key_t *keys, const slot_t *own, int64_t n, slot_t *out)
    void cn_table_decay_admission(cn_table *t)
    int cn_table_evict(cn_table *t, int64_t k, int want_rows, cn_evicted *ev)
    int cn_table_evict_expired(cn_table *t, int want_rows, cn_evicted *ev)
    int cn_table_evict_keys(cn_table *t, const key_t *keys, int64_t n, int want_rows, cn_evicted *ev)
    int cn_table_erase(cn_table *t, const key_t *keys, int64_t n, uint8_t *erased, int64_t *count)
    int cn_table_check_slots(const cn_table *t, uint64_t erase_epoch, const slot_t *slots, int64_t n)
    void cn_table_clear(cn_table *t)
    void cn_table_write_rows(cn_table *t, const slot_t *slots, int64_t n, const weight_t *rows, int64_t ld_rows,
                             const weight_t *state, int64_t ld_state)
    void cn_table_write_meta(cn_table *t, const slot_t *slots, int64_t n, const count_t *counts,
                             const count_t *last_steps)
    void cn_table_gather(const cn_table *t, const slot_t *slots, int64_t n, weight_t *rows, weight_t *state,
                         count_t *counts, count_t *last_steps)
    int64_t cn_table_scan(const cn_table *t, int64_t cursor, int64_t max_n, key_t *keys, slot_t *slots,
                          int64_t *n_out)
    int64_t cn_check_offsets(const offset_t *offsets, int64_t n_bags, int64_t n_keys)

# The hot kernels, through the instruction-set level chosen at import (cn_isa.h); same arguments
# as cn_table_pool, cn_grad_apply, cn_grad_unique and cn_init_rows_of, which are not declared
# here so that no call bypasses the choice.
cdef extern from "cn_isa.h" nogil:
    enum: CN_ISA_LEVELS
    const char *cn_isa_level_name(int level)
    int cn_isa_runnable(int level)
    int cn_isa_best()
    int cn_isa_use(int level)
    const char *cn_isa_active_name()
    const char *cn_isa_build_name()
    void cn_kernel_table_pool(const cn_table *t, const key_t *keys, const offset_t *offsets, int64_t n_bags,
                              const weight_t *weights, int mode, weight_t *out, int64_t ld_out, int64_t *argmax,
                              const slot_t *slots)
    int cn_kernel_grad_apply(const cn_arena *a, int64_t dim, int row_dtype, const slot_t *slots,
                             const offset_t *offsets, int64_t n_bags, const weight_t *weights, int mode,
                             const int64_t *argmax, const weight_t *grad, int64_t ld_grad, const cn_optim *opt,
                             int touch_meta, uint32_t step, int nthreads)
    void cn_kernel_grad_unique(const cn_groups *g, const int64_t *bag_of, const cn_arena *a, int64_t dim,
                               const slot_t *slots, const offset_t *offsets, const weight_t *weights, int mode,
                               const int64_t *argmax, const weight_t *grad, int64_t ld_grad, weight_t *grads_out,
                               int touch_meta, uint32_t step, int nthreads)
    void cn_kernel_init_rows_of(const cn_init *init, const int64_t *keys, int64_t n, weight_t *out, int64_t dim,
                                int nthreads)

cdef extern from "<pthread.h>" nogil:
    ctypedef struct pthread_mutex_t:
        pass
    int pthread_mutex_init(pthread_mutex_t *mu, const void *attr)
    int pthread_mutex_destroy(pthread_mutex_t *mu)
    int pthread_mutex_lock(pthread_mutex_t *mu)
    int pthread_mutex_unlock(pthread_mutex_t *mu)
    int pthread_rwlock_rdlock(pthread_rwlock_t *lock)
    int pthread_rwlock_wrlock(pthread_rwlock_t *lock)
    int pthread_rwlock_unlock(pthread_rwlock_t *lock)

cdef extern from "cn_blockio.h" nogil:
    int cn_blockio(int fd, const int64_t *offsets, int64_t n, int64_t rec, uint8_t *buf, int write, int threads)

cdef extern from "cn_tier.h" nogil:
    enum: CN_TIER_PAGE
    ctypedef struct cn_tier_layout:
        int64_t rec
        int64_t per_page
        int64_t dim
        int64_t state_floats
        int row_dtype
        int64_t off_count
        int64_t off_step
        int64_t off_row
        int64_t off_state
        int64_t off_check
    int64_t cn_tier_offset(const cn_tier_layout *L, int64_t slot)
    void cn_tier_pack(const cn_tier_layout *L, int64_t n, const int64_t *keys, const uint32_t *counts,
                      const uint32_t *steps, const weight_t *rows, int64_t ld_rows, const weight_t *state,
                      int64_t ld_state, uint8_t *buf)
    int64_t cn_tier_check_keys(const cn_tier_layout *L, const uint8_t *buf, const int64_t *keys, int64_t n)
    ctypedef struct cn_tier_kv:
        int64_t key
        int64_t value
    int64_t cn_tier_distinct_counted(const int64_t *keys, const uint8_t *skip, int64_t n, cn_tier_kv *pairs)
    int cn_tier_make_room(cn_table *t, int64_t n, const int64_t *pin, int64_t n_pin, int want_rows, cn_evicted *ev)
    int cn_tier_load(cn_table *t, const cn_tier_layout *L, const uint8_t *buf, const int64_t *keys, int64_t n,
                     const int64_t *pin, int64_t n_pin, int want_rows, cn_evicted *ev, int64_t *slots)
    ctypedef struct cn_tier_share:
        int64_t m
        int64_t done
        int state
    void cn_tier_share_help(cn_tier_share *s)
    int cn_tier_share_plan(const cn_tier_share *s, int64_t *n_distinct, int64_t *n_found, int64_t *m,
                           uint64_t *disk_version)
    int64_t cn_tier_stage(const cn_tier_layout *L, int fd, int threads, const cn_index *disk, pthread_mutex_t *mu,
                          const uint64_t *disk_version, const int64_t *keys, int64_t n, int64_t cap,
                          int64_t *keys_out, int64_t *slots_out, uint8_t *buf, cn_tier_share *share)

# The records the grouped calls (forward.pxi, backward.pxi) fill with the GIL and read in their
# nogil section: one a feature, one a distinct table, one the whole call (what the parallel loop
# over distinct tables hands its body). Declarations only.
from libc.stdint cimport int64_t, uint32_t, uint64_t
from cncore._typedefs cimport key_t, slot_t, offset_t, weight_t
from cncore._ctable cimport cn_table, cn_evicted, cn_optim

cdef extern from "cn_parallel.h" nogil:
    ctypedef void (*cn_range_fn)(void *ctx, int64_t begin, int64_t end) noexcept nogil
    void cn_parallel_for(cn_range_fn fn, void *ctx, int64_t n, int nthreads)
    int cn_threads_unless_asleep(int64_t work, int64_t min_to_wake)

cdef extern from "cn_table_core.h" nogil:
    enum:
        CN_LOOKUP_MIN_TO_WAKE

cdef struct LookupFeature:
    # one feature of grouped_forward: its bags and where its pooled rows go
    const key_t *keys         # its keys, within its table's key list (LookupTable.keys)
    slot_t *slots             # their slots, within LookupTable.slots
    int64_t n_keys
    const offset_t *offsets   # n_bags + 1 bag offsets
    int64_t n_bags
    const weight_t *weights   # per-sample weights, or NULL
    int mode                  # 0 sum, 1 mean, 2 max
    weight_t *out             # (n_bags, dim) pooled rows, ld_out floats apart
    int64_t ld_out
    int64_t *argmax           # (n_bags, dim) for mode 2, else NULL
    int64_t table             # its entry in the call's LookupTable list
    const slot_t *own         # residual fallback rows: its keys' own slots (n_keys / 2), else NULL

cdef struct LookupTable:
    # one distinct table of grouped_forward, with the keys of all its features
    cn_table *t
    const key_t *keys
    int64_t n
    slot_t *slots
    const slot_t *found       # the caller's slots of the keys (found_slots), or NULL
    int want                  # what its eviction hands over (_sink_want)
    int rc                    # CN_OK, or the error of its lookup
    int64_t n_new             # keys the lookup inserted
    uint64_t epoch            # its erase epoch, read under its lock with the lookup
    cn_evicted ev             # the rows its lookup evicted, for its sink

cdef struct LookupCall:
    # one grouped_forward: what each task of its loop over distinct tables reads
    LookupTable *units
    LookupFeature *feats
    int64_t n_feats
    int insert_missing

cdef struct UpdateFeature:
    # one lookup of grouped_backward: its gradient and the optimizer step applied to its rows
    cn_table *t
    const slot_t *slots       # the lookup's slots (n_keys)
    int64_t n_keys
    const offset_t *offsets
    int64_t n_bags
    const weight_t *weights
    int mode
    const int64_t *argmax     # mode 2 only, else NULL
    const weight_t *grad      # (n_bags, dim), ld_grad floats apart
    int64_t ld_grad
    int touch                 # record the access in the rows' metadata
    uint32_t step             # the lookup's step, as the rows' metadata keeps it
    uint64_t epoch            # the erase epoch grouped_forward returned
    cn_optim opt
    int rc                    # 0, or -1: out of memory (its table unchanged)

cdef struct UpdateCall:
    # one grouped_backward: what each task of its loop over tables reads
    UpdateFeature *feats
    int inner_threads         # threads of each lookup's own update; 0: its own rule (cn_grad_threads)

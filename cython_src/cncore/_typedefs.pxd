# The C scalar types of the core, spelled once; every other Cython file cimports them.
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t

ctypedef int64_t key_t      # a feature ID: every int64 value is valid
ctypedef int64_t slot_t     # a row's stable position in the arena; < 0 means "no row"
ctypedef int64_t offset_t   # CSR bag offsets
ctypedef float weight_t     # row and gradient values (float32 storage)
ctypedef uint32_t count_t   # per-row access count / last step

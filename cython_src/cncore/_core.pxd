# The extension class other Cython modules may cimport.
from cncore._ctable cimport cn_table, cn_evicted

cdef class Table:
    cdef cn_table t
    cdef bint alive
    cdef readonly int optimizer_kind
    cdef public object evict_sink
    cdef _deliver(self, cn_evicted *ev)

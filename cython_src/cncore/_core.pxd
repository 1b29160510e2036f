# The extension class other Cython modules may cimport.
from cncore._ctable cimport cn_table

cdef class Table:
    cdef cn_table t
    cdef bint alive
    cdef readonly int optimizer_kind

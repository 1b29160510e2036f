# The arrays the core reads and writes through raw pointers: their checks (shape, dtype,
# strides, writability) and their addresses.


cdef _check_len(object arr, int64_t n, int64_t width, str name):
    """arr (if given) has n rows (and `width` columns when width >= 0): the C side writes or
    reads n of them through a raw pointer."""
    if arr is None:
        return
    if arr.shape[0] != n or (width >= 0 and (arr.ndim != 2 or arr.shape[1] != width)):
        raise ValueError(f"{name}: expected {n} rows" + (f" of {width}" if width >= 0 else "") +
                         f", got shape {arr.shape}")


cdef inline const weight_t* _opt_ptr(object arr):
    """Data pointer of an optional float32 NumPy array (NULL for None)."""
    cdef const weight_t[:, ::1] view
    if arr is None:
        return NULL
    view = arr
    return &view[0, 0] if view.shape[0] > 0 else NULL


# The checks and pointers below use NumPy's C API: `arr.ctypes.data` built a ctypes object per
# call (3.4 us warm, 6 of them in a one-feature lookup) and `arr.dtype != np.int64` converted the
# type each time; with the caches cold (forward_large.py flushes them before every call) these
# Python-level steps cost ~100 us of a 4096-ID evaluation lookup that EmbeddingBag does in ~600.

cdef inline void* _ptr(object arr) except? NULL:
    """The address of an array's first element (NULL for None). Read from the array object
    itself: `arr.ctypes.data` built a ctypes object each time, 1.3 us a call, 4-5 calls a
    forward and 3-4 a backward (~9 us of a training step at any batch size)."""
    if arr is None:
        return NULL
    if not cnp.PyArray_Check(arr):
        raise TypeError(f"expected a NumPy array, got {type(arr).__name__}")
    return cnp.PyArray_DATA(<cnp.ndarray> arr)


cdef void* _scratch(int64_t n, size_t size) except NULL:
    """A zeroed block of n records of `size` bytes (at least one record) for a call's
    per-feature or per-table state; the caller frees it. Raises MemoryError."""
    cdef void* p = calloc(<size_t> max(n, 1), size)
    if p == NULL:
        raise MemoryError("cannot allocate the call's scratch")
    return p


cdef inline int _typenum(object dtype):
    return cnp.NPY_INT64 if dtype is np.int64 else cnp.NPY_FLOAT32 if dtype is np.float32 else \
        (<cnp.dtype> np.dtype(dtype)).type_num


cdef _check_vector(object arr, object dtype, int64_t n, str name):
    """The core reads `arr` through a raw pointer: it must be a C-contiguous 1-D `dtype` array
    of n entries (n < 0: any length). The `cncore` package converts user input before it gets
    here; this is what keeps a front end's (or a forged context's) arrays from reaching C
    unchecked."""
    if not isinstance(arr, np.ndarray) or not cnp.PyArray_EquivTypenums(cnp.PyArray_TYPE(<cnp.ndarray> arr), _typenum(dtype)) or \
            cnp.PyArray_NDIM(<cnp.ndarray> arr) != 1 or not cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray> arr):
        raise TypeError(f"{name}: expected a C-contiguous 1-D {np.dtype(dtype)} NumPy array")
    if n >= 0 and cnp.PyArray_DIM(<cnp.ndarray> arr, 0) != n:
        raise ValueError(f"{name}: expected {n} entries, got {arr.shape[0]}")


cdef _check_rows(object arr, object dtype, int64_t n_rows, int64_t dim, str name, bint writable):
    """A 2-D (n_rows, dim) array whose rows may be strided but whose values within a row are
    contiguous (a column block of a wider array)."""
    if not isinstance(arr, np.ndarray) or not cnp.PyArray_EquivTypenums(cnp.PyArray_TYPE(<cnp.ndarray> arr), _typenum(dtype)) or \
            cnp.PyArray_NDIM(<cnp.ndarray> arr) != 2:
        raise TypeError(f"{name}: expected a 2-D {np.dtype(dtype)} NumPy array")
    cdef cnp.ndarray a = <cnp.ndarray> arr
    if cnp.PyArray_DIM(a, 0) != n_rows or cnp.PyArray_DIM(a, 1) != dim:
        raise ValueError(f"{name}: expected shape ({n_rows}, {dim}), got {arr.shape}")
    cdef int64_t item = cnp.PyArray_ITEMSIZE(a), s0 = cnp.PyArray_STRIDE(a, 0), s1 = cnp.PyArray_STRIDE(a, 1)
    if n_rows > 1 and (s0 < item * dim or s0 % item) or n_rows > 0 and dim > 1 and s1 != item:
        raise BufferError(f"{name}: each row must be contiguous with rows not overlapping (strides {arr.strides})")
    if writable and not cnp.PyArray_ISWRITEABLE(a):
        raise BufferError(f"{name}: is read-only; the core writes its result there")


cdef inline uint32_t _saturate_u32(object value):
    """A lookup's step as the uint32 the rows' metadata keeps. A table's step never passes
    2^32 - 1 (_STEP_MAX), so this is exact for every lookup's step; the clamp keeps a value
    from a damaged record from wrapping to a small step that eviction would read as old."""
    return <uint32_t> min(max(int(value), 0), 0xFFFFFFFF)

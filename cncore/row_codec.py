"""Rows in a table file at their storage size: float16 rows as float16, bfloat16 rows as the
uint16 bit patterns of their values (NumPy has no bfloat16), float32 rows as float32.

Rows cross every API as float32; a table of 16-bit rows holds values that 16 bits represent
exactly, so encoding its export is exact. Other float32 values (a `TableWriter` fed by hand)
are rounded as the core rounds them (cython_src/include/cn_dtype.h): to nearest, ties to
even, finite values past the dtype's largest saturating to it (float16: 65504), NaN kept.

>>> import numpy as np
>>> bits = encode_rows(np.array([[1.0, -2.5, 3.1416]], np.float32), "bfloat16")
>>> bits.dtype, decode_rows(bits, "bfloat16").tolist()
(dtype('uint16'), [[1.0, -2.5, 3.140625]])
>>> decode_rows(encode_rows(np.array([[1e6]], np.float32), "float16"), "float16").tolist()
[[65504.0]]
"""
from __future__ import annotations

import numpy as np

__all__ = ["FILE_DTYPES", "encode_rows", "decode_rows"]

# The .npy dtype of each row dtype's rows in a table file (format version 3 on).
FILE_DTYPES: dict[str, np.dtype] = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
                                    "bfloat16": np.dtype(np.uint16)}
_F16_MAX = 65504.0


def encode_rows(rows: np.ndarray, dtype: str) -> np.ndarray:
    """float32 `rows` as the file dtype of `dtype`, rounded as the core rounds."""
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    if dtype == "float32":
        return rows
    if dtype == "float16":
        with np.errstate(invalid="ignore"):  # NaN passes through clip unchanged
            return np.clip(rows, -_F16_MAX, _F16_MAX).astype(np.float16)
    bits = rows.view(np.uint32)
    magnitude = bits & np.uint32(0x7FFFFFFF)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    # A finite value that rounded up to infinity saturates to the largest finite bfloat16.
    overflow = (magnitude < 0x7F800000) & ((rounded & np.uint16(0x7FFF)) == 0x7F80)
    rounded[overflow] = (rounded[overflow] & np.uint16(0x8000)) | np.uint16(0x7F7F)
    special = magnitude >= 0x7F800000  # inf stays inf, NaN stays NaN (quiet bit set)
    nan = magnitude > 0x7F800000
    rounded[special] = (bits[special] >> 16).astype(np.uint16) | np.where(nan[special], 0x40, 0).astype(np.uint16)
    return rounded


def decode_rows(stored: np.ndarray, dtype: str) -> np.ndarray:
    """The float32 values of rows read from a file of `dtype` rows (a new array)."""
    if dtype == "bfloat16":
        return (np.asarray(stored, np.uint16).astype(np.uint32) << 16).view(np.float32)
    return np.array(stored, dtype=np.float32)

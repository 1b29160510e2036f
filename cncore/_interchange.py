"""The DLPack boundary: any array producer in, NumPy arrays (DLPack-exportable) out.

Inputs may be anything with ``__dlpack__``/``__dlpack_device__`` (NumPy, PyTorch CPU tensors,
JAX CPU arrays, ...), an object with the buffer protocol, or a list. Nothing here imports a
framework: NumPy's ``from_dlpack`` consumes the capsule zero-copy and keeps its read-only
flag. Results are NumPy arrays, which ``np.from_dlpack``, ``torch.from_dlpack`` and
``jax.dlpack`` consume without a copy.
"""
from __future__ import annotations

import numpy as np

_DLPACK_CPU = 1  # kDLCPU

_KIND_NAMES = {"i": "integer", "u": "unsigned integer", "f": "floating point", "b": "bool"}


def to_numpy(obj, name: str) -> np.ndarray:
    """View `obj` as a NumPy array without copying when it is a CPU DLPack producer or buffer."""
    if isinstance(obj, np.ndarray):
        return obj
    if hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        device_type, device_id = obj.__dlpack_device__()
        if int(device_type) != _DLPACK_CPU:
            raise ValueError(f"{name}: must be a CPU array (DLPack device type 1), got device type "
                             f"{int(device_type)} (id {device_id}); move it to the CPU first")
        try:
            return np.from_dlpack(obj)
        except (BufferError, RuntimeError, TypeError) as exc:
            raise TypeError(f"{name}: cannot be read through DLPack ({exc})") from exc
    if isinstance(obj, (list, tuple)):
        return np.asarray(obj)
    try:
        memoryview(obj)
    except TypeError:
        raise TypeError(f"{name}: expected an array (a NumPy array, a PyTorch CPU tensor, a JAX CPU array, "
                        f"any __dlpack__ producer or buffer), got {type(obj).__name__}") from None
    return np.asarray(obj)


def _describe(dtype: np.dtype) -> str:
    return f"{dtype} ({_KIND_NAMES.get(dtype.kind, dtype.kind)})"


def as_keys(obj, name: str = "keys") -> np.ndarray:
    """1-D int64 keys; int32 keys are widened (a copy), any other dtype is refused."""
    arr = to_numpy(obj, name)
    if arr.dtype == np.int32 or (arr.size == 0 and arr.dtype.kind == "f" and isinstance(obj, (list, tuple))):
        arr = arr.astype(np.int64)
    if arr.dtype != np.int64:
        raise TypeError(f"{name}: expected int64 (or int32) IDs, got {_describe(arr.dtype)}")
    if arr.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D array, got shape {arr.shape}")
    return np.ascontiguousarray(arr)


def as_offsets(obj, name: str) -> np.ndarray:
    arr = to_numpy(obj, name)
    if arr.dtype not in (np.int64, np.int32):
        raise TypeError(f"{name}: expected int64 or int32, got {_describe(arr.dtype)}")
    if arr.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D array, got shape {arr.shape}")
    return np.ascontiguousarray(arr, dtype=np.int64)


def as_floats(obj, name: str, shape: tuple) -> np.ndarray:
    """A read-only float32 input of the given shape (None in `shape` = any size)."""
    arr = to_numpy(obj, name)
    if arr.dtype != np.float32:
        raise TypeError(f"{name}: expected float32, got {_describe(arr.dtype)}")
    if arr.ndim != len(shape) or any(want is not None and got != want for got, want in zip(arr.shape, shape)):
        want = tuple("*" if s is None else s for s in shape)
        raise ValueError(f"{name}: expected shape {want}, got {arr.shape}")
    return np.ascontiguousarray(arr)


def as_float_rows(obj, name: str, shape: tuple) -> np.ndarray:
    """A float32 2-D input whose rows may be strided (a column block of a wider array) but
    whose values within a row are contiguous; anything else is copied into that form."""
    arr = to_numpy(obj, name)
    if arr.dtype != np.float32:
        raise TypeError(f"{name}: expected float32, got {_describe(arr.dtype)}")
    if arr.ndim != 2 or arr.shape != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {arr.shape}")
    if arr.strides[1] != 4 or arr.strides[0] < 4 * shape[1] or arr.strides[0] % 4:
        arr = np.ascontiguousarray(arr)
    return arr


def as_output(obj, name: str, shape: tuple) -> np.ndarray:
    """A writable float32 output of `shape`; rows may be strided, values within a row contiguous."""
    arr = to_numpy(obj, name)
    if arr.dtype != np.float32:
        raise TypeError(f"{name}: expected float32, got {_describe(arr.dtype)}")
    if arr.shape != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {arr.shape}")
    if not arr.flags.writeable:
        raise BufferError(f"{name}: is read-only; the store writes its result there")
    rows_overlap = shape[0] > 1 and (arr.strides[0] < 4 * shape[1] or arr.strides[0] % 4)
    if rows_overlap or (shape[1] > 1 and arr.strides[1] != 4):
        raise BufferError(f"{name}: each row must be contiguous with rows not overlapping "
                          f"(strides {arr.strides} for shape {shape})")
    return arr


def as_count(value, name: str, low: int, high: int) -> int:
    """An int argument in [low, high): Python or NumPy integers; bools and floats are refused."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or not low <= int(value) < high:
        raise ValueError(f"{name} must be an int in [{low}, {high}), got {value!r}")
    return int(value)


def as_uint32(obj, name: str, n: int) -> np.ndarray | None:
    """An optional (n,) array of values in [0, 2**32) as uint32 (None stays None)."""
    if obj is None:
        return None
    arr = to_numpy(obj, name)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected an integer array, got {arr.dtype}")
    if arr.shape != (n,):
        raise ValueError(f"{name}: expected shape ({n},), got {arr.shape}")
    if arr.size and (arr.min() < 0 or arr.max() > 2**32 - 1):
        raise ValueError(f"{name}: values must be in [0, 2**32 - 1]")
    return np.ascontiguousarray(arr, dtype=np.uint32)

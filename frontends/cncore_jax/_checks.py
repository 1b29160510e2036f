"""Argument checks made while tracing, before anything reaches a table: a refused call changes
nothing, and the error names the argument and what is supported."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

MODES = ("sum", "mean", "max")
_ID_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))


def _dtype_of(x):
    return np.dtype(x.dtype) if hasattr(x, "dtype") else None


def as_int_array(x, name: str, what: str):
    """A 1-D int32/int64 array (jax or NumPy), without a silent narrowing of int64 to int32."""
    dtype = _dtype_of(x)
    if dtype is None or not hasattr(x, "shape"):
        raise TypeError(f"{name}: expected a 1-D int32 or int64 array of {what}, got {type(x).__name__}")
    if dtype not in _ID_DTYPES:
        raise TypeError(f"{name}: expected int32 or int64 {what}, got {dtype}")
    if dtype == np.int64 and not jax.config.jax_enable_x64:  # type: ignore[attr-defined]  # set at runtime
        raise TypeError(f"{name}: int64 {what} need jax.config.update('jax_enable_x64', True) (without it JAX "
                        "narrows them to int32); enable it, or pass int32")
    if len(x.shape) != 1:
        raise ValueError(f"{name}: expected a 1-D array of {what}, got shape {tuple(x.shape)}")
    return jnp.asarray(x)


def as_weights(x, name: str, n: int, mode: str):
    if mode == "max":
        raise ValueError(f"{name}: per-sample weights apply to 'sum' and 'mean' pooling, not 'max'")
    dtype = _dtype_of(x)
    if dtype is None or dtype.kind != "f":
        got = dtype if dtype is not None else type(x).__name__
        raise TypeError(f"{name}: expected a floating-point array, got {got}")
    if tuple(x.shape) != (n,):
        raise ValueError(f"{name}: expected shape ({n},), one weight per id, got {tuple(x.shape)}")
    return jnp.asarray(x, dtype=jnp.float32)


def as_mode(mode, name: str) -> str:
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"{name}: expected 'sum', 'mean' or 'max', got {mode!r}")
    return mode


def as_flag(value, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False (a Python bool, fixed when tracing), got {value!r}")
    return bool(value)


def per_feature(value, n: int, name: str) -> list:
    if value is None:
        return [None] * n
    if not isinstance(value, (list, tuple)) or len(value) != n:
        raise ValueError(f"{name}: expected a list with one entry per table ({n})")
    return list(value)

"""The XLA FFI route to the host: `call(fn, result_shape, *args)`, a drop-in for
`io_callback(fn, result_shape, *args, ordered=True)` built on `jax.ffi.ffi_call` with
`has_side_effect=True` (so XLA never eliminates it) over one C++ handler (`_ffi_bridge.cc`).

The handler gives `fn` XLA's own buffers (NumPy views, no copies in); `fn` writes its results
into XLA's output buffers (the pooled rows go straight there: no copy out). It skips JAX's
callback machinery and its copies: most of an `io_callback`'s fixed cost, and on a 1 MB
output the page faults of a fresh buffer (`python asv_bench/scripts/jax_boundary.py`).

Each traced call registers its host function under a new id, kept for the process (one per
trace, not per execution).

The handler is compiled on first use against jaxlib's FFI headers (`jax.ffi.include_dir()`) and
Python's, with the C++ compiler found on PATH, into a cache directory
(``$CNCORE_JAX_CACHE`` or ``~/.cache/cncore_jax``). `available()` says whether that worked.

What it does not give that `io_callback(ordered=True)` gives: JAX's ordered-effect token.
Within one program, calls are ordered only by their data: a lookup's token feeds its update,
so lookup -> update holds; two independent calls may run in either order.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import itertools
import os
import shutil
import subprocess
import sysconfig
import threading
from collections.abc import Callable

import jax
import numpy as np

TARGET = "cncore_jax_call"
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_ffi_bridge.cc")
_FUNCTIONS: dict[int, Callable] = {}
_ids = itertools.count()
_lock = threading.Lock()


def _dispatch(fn_id: int, views) -> None:
    _FUNCTIONS[fn_id](views)


def _build() -> str:
    with open(_SOURCE, "rb") as fh:
        digest = hashlib.sha256(fh.read() + jax.__version__.encode()).hexdigest()[:16]
    folder = os.environ.get("CNCORE_JAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "cncore_jax")
    lib = os.path.join(folder, f"ffi_bridge-{digest}.so")
    if os.path.exists(lib):
        return lib
    compiler = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler on PATH (set CXX)")
    os.makedirs(folder, exist_ok=True)
    tmp = f"{lib}.tmp-{os.getpid()}"
    done = subprocess.run([compiler, "-O2", "-std=c++17", "-shared", "-fPIC", "-w", f"-I{jax.ffi.include_dir()}",
                           f"-I{sysconfig.get_paths()['include']}", _SOURCE, "-o", tmp], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"compiling {_SOURCE} failed: {done.stderr.strip()[-500:]}")
    os.replace(tmp, lib)  # atomic: processes building at once each leave a whole library
    return lib


@functools.cache
def _setup() -> str:
    """Build, load and register the handler once per process; '' on success, else why not."""
    try:
        lib = ctypes.PyDLL(_build())  # PyDLL: calls keep the GIL, as cn_set_dispatch needs
        lib.cn_set_dispatch.argtypes = [ctypes.py_object]
        lib.cn_set_dispatch(_dispatch)
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.cn_call), platform="cpu")
        return ""
    except Exception as e:  # no compiler, no headers, an ABI mismatch: the callback route remains
        return f"{type(e).__name__}: {e}"


def available() -> bool:
    return _setup() == ""


def unavailable_reason() -> str:
    return _setup()


def call(fn: Callable, result_shape, *args, write_into: bool = False):
    """`fn(*args)` on the host, as numpy arrays, once per execution; its results (a pytree
    matching `result_shape`, or None) are the call's outputs. With `write_into`, `fn` also gets
    `outs=` (XLA's output buffers as writable NumPy arrays, flat) and may write its results
    there itself: a result that is already in its buffer is not copied."""
    if not available():
        raise RuntimeError(f"cncore_jax: the FFI route is unavailable ({unavailable_reason()})")
    flat_args, in_tree = jax.tree_util.tree_flatten(args)
    flat_args = [jax.numpy.asarray(a) for a in flat_args]
    in_specs = [(np.dtype(a.dtype), tuple(a.shape)) for a in flat_args]
    out_flat, out_tree = jax.tree_util.tree_flatten(result_shape)
    # A call with no result still needs one buffer for XLA to schedule it: a scalar.
    out_types = [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in out_flat] or [jax.ShapeDtypeStruct((), np.int8)]

    def host(views) -> None:
        inputs = [np.frombuffer(v, dtype=dt).reshape(shape) for v, (dt, shape) in zip(views, in_specs)]
        outs = [np.frombuffer(v, dtype=s.dtype).reshape(s.shape) for v, s in zip(views[len(in_specs):], out_flat)]
        unflat = jax.tree_util.tree_unflatten(in_tree, inputs)
        results = fn(*unflat, outs=outs) if write_into else fn(*unflat)
        for target, value in zip(outs, jax.tree_util.tree_leaves(results)):
            if not (isinstance(value, np.ndarray) and value.ctypes.data == target.ctypes.data and target.size):
                np.copyto(target, value, casting="same_kind")

    with _lock:
        fn_id = next(_ids)
        _FUNCTIONS[fn_id] = host
    outs = jax.ffi.ffi_call(TARGET, out_types, has_side_effect=True)(*flat_args, fn_id=np.int64(fn_id))
    return jax.tree_util.tree_unflatten(out_tree, outs) if out_flat else None

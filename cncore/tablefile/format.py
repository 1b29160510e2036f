"""The table file format itself: its constants, the arrays' dtypes, manifest checks and path rules
(see `cncore.tablefile`)."""
from __future__ import annotations

import hashlib
import io
import os
import re

import numpy as np
from numpy.typing import ArrayLike

import cncore
from cncore.fileio import TableFormatError, _error, _fields_exactly, _is_int, _show, config_from_dict
from cncore.row_codec import FILE_DTYPES

FORMAT = "cn-table"
FORMAT_VERSION = 3  # 3: 16-bit rows at their size, "evicted"; 2: manifest.sha256 added; 1 and 2 still read
ARRAYS = {"keys": np.int64, "rows": np.float32, "optimizer_state": np.float32, "counts": np.uint32,
          "last_steps": np.uint32}
_CHUNK = 1 << 22
_U32_MAX = 2**32 - 1
# The only entries a table directory holds: what saves make (CURRENT, versions, and the
# temporary names of saves in flight or killed). Anything else belongs to someone else.
_VERSION = re.compile(r"v[0-9]{6,}")
_SAVE_MADE = re.compile(r"CURRENT|v[0-9]{6,}|\.v[0-9]{6,}\.tmp-[0-9]+|\.CURRENT\.tmp-[0-9]+")
_MANIFEST_KEYS = ("format", "version", "rows", "step", "config", "arrays")
_MANIFEST_KEYS_V3 = _MANIFEST_KEYS + ("evicted",)
_DELTA_KEYS = ("parent", "removed")  # a delta version's manifest also has "delta": {these}
_DELTA_LINK_KEYS = ("name", "parent_sha256")  # and, written by this version on, these
_SHARD_KEYS = ("rank", "world_size", "save")  # the optional "shard" field of a shard table's manifest
MAX_CHAIN = 16  # deltas after a base before a save writes a new base
_ENTRY_KEYS = ("file", "dtype", "shape", "bytes", "sha256")


def array_dtypes(config: cncore.StoreConfig, version: int = FORMAT_VERSION) -> dict[str, np.dtype]:
    """The .npy dtype of each array of a table.

    Args:
        config (StoreConfig): the table's config.
        version (int): the file format version (rows: float32 before 3, the row dtype's own
            size from it).

    Returns:
        dict[str, np.dtype]: each array's dtype, by name.
    """
    dtypes = {name: np.dtype(dtype) for name, dtype in ARRAYS.items()}
    if version >= 3:
        dtypes["rows"] = FILE_DTYPES[config.dtype]
    return dtypes


def infer_config(dim: int, state_floats: int) -> cncore.StoreConfig:
    """A config for rows without one: the optimizer is guessed from the state width (0: none,
    1: row-wise Adagrad, dim: Adagrad, 2*dim: Adam), with default hyperparameters.

    Args:
        dim (int): the rows' width.
        state_floats (int): optimizer state floats per row.

    Returns:
        StoreConfig: the guessed config.

    >>> infer_config(4, 8).optimizer
    Adam(lr=0.001, betas=(0.9, 0.999), eps=1e-08)
    """
    optimizer = {0: None, 1: cncore.RowWiseAdagrad(), dim: cncore.Adagrad(), 2 * dim: cncore.Adam()}.get(state_floats)
    if optimizer is None and state_floats:
        raise ValueError(f"cannot infer an optimizer from {state_floats} state floats per row of dim {dim}; "
                         f"pass config=")
    return cncore.StoreConfig(dim=dim, optimizer=optimizer)


def as_column(name: str, value: ArrayLike) -> np.ndarray:
    """`value` as the table column `name` (dtype of `ARRAYS`), refusing casts that would change
    it: keys must be integers within int64, counts and last steps integers in [0, 2**32 - 1],
    rows and optimizer state real numbers. Raises ValueError naming the column.

    Args:
        name (str): the column: "keys", "rows", "optimizer_state", "counts" or "last_steps".
        value (ArrayLike): its values.

    Returns:
        np.ndarray: a C-contiguous array of the column's dtype.

    >>> as_column("counts", [3, 4]).dtype
    dtype('uint32')
    >>> as_column("keys", [1.2, 1.7])
    Traceback (most recent call last):
    ...
    ValueError: keys: expected integers, got float64
    """
    arr = np.asarray(value)
    kinds = "iuf" if name in ("rows", "optimizer_state") else "iu"
    if arr.dtype.kind not in kinds:
        raise ValueError(f"{name}: expected {'real numbers' if 'f' in kinds else 'integers'}, got {arr.dtype}")
    if name in ("counts", "last_steps") and arr.size and (arr.min() < 0 or arr.max() > _U32_MAX):
        raise ValueError(f"{name}: values must be in [0, 2**32 - 1], got {int(arr.min())} .. {int(arr.max())}")
    if name == "keys" and arr.dtype.kind == "u" and arr.size and arr.max() >= 2**63:
        raise ValueError(f"keys: values must fit int64, got {int(arr.max())}")
    return np.ascontiguousarray(arr, dtype=ARRAYS[name])


def _sha256_fd(fd: int) -> str:
    h, offset = hashlib.sha256(), 0
    while True:
        chunk = os.pread(fd, _CHUNK, offset)
        if not chunk:
            return h.hexdigest()
        h.update(chunk)
        offset += len(chunk)


def npy_header(dtype: np.typing.DTypeLike, shape: tuple) -> bytes:
    """The .npy (version 1.0) header of a C-ordered array: what comes before its raw bytes.

    Args:
        dtype (DTypeLike): the array's dtype.
        shape (tuple): its shape.

    Returns:
        bytes: the header.

    >>> len(npy_header("<i8", (3,))) % 64
    0
    """
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
                                               "fortran_order": False, "shape": shape})
    return buf.getvalue()


def check_path_name(name: object, what: str = "table name") -> str:
    """`name`, checked to be usable as one directory name under a directory the caller chose:
    a non-empty string, not '.' or '..', without '/', '\\' or NUL (so that joining it to a
    path never leaves that path). ValueError naming it otherwise.

    Args:
        name (object): the name to check.
        what (str): what it names, for the error.

    Returns:
        str: `name`.

    >>> check_path_name("t_user")
    't_user'
    >>> check_path_name("../x")  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    ValueError: table name '../x': is used as a directory name, so it must be one plain path component
    (not empty, '.' or '..', no '/', '\\' or NUL); rename the table; nothing was written
    """
    if not isinstance(name, str) or name in ("", ".", "..") or any(c in name for c in "/\\\0"):
        raise ValueError(f"{what} {name!r}: is used as a directory name, so it must be one plain path component "
                         f"(not empty, '.' or '..', no '/', '\\' or NUL); rename the table; nothing was written")
    return name


def _check_table_path(path: str) -> None:
    """A table is written only to a new path, an empty directory or an existing table."""
    if not os.path.lexists(path):
        return
    if not os.path.isdir(path):
        raise TableFormatError(f"{path}: exists and is not a directory; a table path must be a new or empty "
                               f"directory or an existing table")
    foreign = sorted(e for e in os.listdir(path) if not _SAVE_MADE.fullmatch(e))
    if foreign:
        shown = ", ".join(_show(e, 40) for e in foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise TableFormatError(f"{path}: not a table directory (it holds {shown}); a table path must be a new or "
                               f"empty directory or an existing table, nothing was written")


def _check_manifest(m, where: str) -> tuple[int, int, cncore.StoreConfig, int]:
    """(rows, step, config, evicted count) of a parsed manifest, after checking every field of
    it: its own fields, and each array entry against the row count and the config."""
    if isinstance(m, dict) and m.get("format") != FORMAT:
        raise _error(where, f"not a {FORMAT} table (format {_show(m.get('format'))})")
    if isinstance(m, dict) and _is_int(m.get("version"), FORMAT_VERSION + 1, 2**63):
        raise _error(where, f"format version {m['version']} is newer than this reader ({FORMAT_VERSION})")
    v3 = isinstance(m, dict) and _is_int(m.get("version"), 3, 2**63)
    _fields_exactly(m, (_MANIFEST_KEYS_V3 if v3 else _MANIFEST_KEYS)
                    + tuple(k for k in ("delta", "shard", "fallback") if isinstance(m, dict) and k in m), where,
                    "the manifest")
    if "shard" in m:
        _check_shard_record(m["shard"], "shard", where)
    if "delta" in m:
        linked = isinstance(m["delta"], dict) and any(k in m["delta"] for k in _DELTA_LINK_KEYS)
        _fields_exactly(m["delta"], _DELTA_KEYS + (_DELTA_LINK_KEYS if linked else ()), where, "delta")
        if linked and not (isinstance(m["delta"]["name"], str) and _VERSION.fullmatch(m["delta"]["name"])):
            raise _error(where, f"delta.name must be a version like 'v000002', got {_show(m['delta']['name'])}")
        if linked and not (isinstance(m["delta"]["parent_sha256"], str)
                           and re.fullmatch(r"[0-9a-f]{64}", m["delta"]["parent_sha256"])):
            raise _error(where, f"delta.parent_sha256 must be 64 hex digits, got {_show(m['delta']['parent_sha256'])}")
        if not (isinstance(m["delta"]["parent"], str) and _VERSION.fullmatch(m["delta"]["parent"])):
            raise _error(where, f"delta.parent must be a version like 'v000001', got {_show(m['delta']['parent'])}")
        entry = m["delta"]["removed"]
        _fields_exactly(entry, _ENTRY_KEYS, where, "delta.removed")
        if entry["file"] != "removed_keys.npy" or entry["dtype"] != np.dtype(np.int64).str or not (
                isinstance(entry["shape"], list) and len(entry["shape"]) == 1 and _is_int(entry["shape"][0])) \
                or not _is_int(entry["bytes"]) or not (isinstance(entry["sha256"], str)
                                                       and re.fullmatch(r"[0-9a-f]{64}", entry["sha256"])):
            raise _error(where, f"delta.removed must describe removed_keys.npy (int64, 1-D), got {_show(entry)}")
    if not _is_int(m["version"], 1, FORMAT_VERSION + 1):
        raise _error(where, f"version must be an int in [1, {FORMAT_VERSION}], got {_show(m['version'])}")
    for name in ("rows", "step") + (("evicted",) if v3 else ()):
        if not _is_int(m[name]):
            raise _error(where, f"{name} must be an int in [0, 2**63), got {_show(m[name])}")
    n, config = m["rows"], config_from_dict(m["config"], where)
    _fields_exactly(m["arrays"], tuple(ARRAYS), where, "arrays")
    shapes = {"keys": [n], "rows": [n, config.dim], "optimizer_state": [n, config.state_floats],
              "counts": [n], "last_steps": [n]}
    for name, dtype in array_dtypes(config, m["version"]).items():
        entry, at = m["arrays"][name], f"arrays.{name}"
        _fields_exactly(entry, _ENTRY_KEYS, where, at)
        expected = {"file": f"{name}.npy", "dtype": np.dtype(dtype).str, "shape": shapes[name]}
        for key, want in expected.items():
            # type() too: JSON's true equals 1, and 5.0 equals 5
            if entry[key] != want or type(entry[key]) is not type(want) or (
                    key == "shape" and any(type(v) is not int for v in entry[key])):
                opt = type(config.optimizer).__name__ if config.optimizer else None
                why = {"keys": f" (rows={n})", "rows": f" (rows={n}, config.dim={config.dim})",
                       "optimizer_state": f" (rows={n}, config.optimizer={opt}: {config.state_floats} state floats "
                                          f"per row of dim {config.dim})"}.get(name, f" (rows={n})")
                why = why if key == "shape" else ""
                raise _error(where, f"{at}.{key} must be {want!r}{why}, got {_show(entry[key])}")
        if not _is_int(entry["bytes"]):
            raise _error(where, f"{at}.bytes must be an int >= 0, got {_show(entry['bytes'])}")
        if not (isinstance(entry["sha256"], str) and re.fullmatch(r"[0-9a-f]{64}", entry["sha256"])):
            raise _error(where, f"{at}.sha256 must be 64 hex digits, got {_show(entry['sha256'])}")
    _check_fallback_entries(m, config, where)
    return n, m["step"], config, m.get("evicted", 0)


def _check_fallback_entries(m: dict, config: cncore.StoreConfig, where: str) -> None:
    """A table with fallback rows holds both arrays, float32, of their shapes; others (a
    ``fallback_rows="auto"`` table that has not chosen its split included) none."""
    if not config.fixed_fallback_rows:
        if "fallback" in m:
            raise _error(where, "fallback: the config has no fallback rows (fallback_rows=0), the manifest lists "
                                "them")
        return
    if "fallback" not in m:
        raise _error(where, f"fallback: missing (config.fallback_rows={config.fallback_rows})")
    _fields_exactly(m["fallback"], ("rows", "optimizer_state"), where, "fallback")
    n = config.fallback_rows
    for name, width in (("rows", config.dim), ("optimizer_state", config.state_floats)):
        entry, at = m["fallback"][name], f"fallback.{name}"
        _fields_exactly(entry, _ENTRY_KEYS, where, at)
        expected = {"file": f"fallback_{name}.npy", "dtype": np.dtype(np.float32).str, "shape": [n, width]}
        for key, want in expected.items():
            if entry[key] != want or (key == "shape" and any(type(v) is not int for v in entry[key])):
                raise _error(where, f"{at}.{key} must be {want!r}, got {_show(entry[key])}")
        if not _is_int(entry["bytes"]) or not (isinstance(entry["sha256"], str)
                                               and re.fullmatch(r"[0-9a-f]{64}", entry["sha256"])):
            raise _error(where, f"{at} must give bytes (an int) and sha256 (64 hex digits), got {_show(entry)}")


def _check_shard_record(d, what: str, where: str = "") -> None:
    _fields_exactly(d, _SHARD_KEYS, where, what)
    if not (_is_int(d["world_size"], 1, 2**31) and _is_int(d["rank"], 0, d["world_size"])):
        raise _error(where, f"{what}: rank must be an int in [0, world_size) and world_size an int >= 1, got "
                            f"rank {_show(d['rank'])} of world_size {_show(d['world_size'])}")
    if not (isinstance(d["save"], str) and re.fullmatch(r"[0-9A-Za-z_.:-]{1,80}", d["save"])):
        raise _error(where, f"{what}.save must be a save id (1 to 80 letters, digits, '_.:-'), got {_show(d['save'])}")

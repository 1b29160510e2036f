"""The table file format: a directory that outlives the code that wrote it.

    TABLE/
      CURRENT            the name of the live version directory (replaced atomically)
      v000003/
        manifest.json    format, version, config, row count, step, and per array: file, dtype,
                         shape, byte size and SHA-256
        manifest.sha256  the SHA-256 of manifest.json (`sha256sum -c manifest.sha256` checks it)
        keys.npy         int64 (N,)
        rows.npy         (N, dim) in the row dtype's size: float32, float16, or bfloat16 as
                         uint16 bit patterns (`cncore.row_codec.decode_rows` widens them)
        optimizer_state.npy  float32 (N, state floats)
        counts.npy       uint32 (N,)    access counts
        last_steps.npy   uint32 (N,)    step of the last training access

Every array is a plain C-ordered `.npy` file: NumPy reads it, memory-mapped, without this
package. A save writes a new version directory (files fsynced), then points CURRENT at it with
an atomic rename, then removes older versions: a crash or kill at any moment leaves CURRENT
naming either the old table or the new one, complete. A table directory holds nothing else:
saving refuses a directory with other files in it, and a save removes only what saves make.

Opening trusts nothing in the directory: the manifest's own checksum, every field's type and
range, each array's .npy header, shape and dtype against the row count and the config, the
file sizes and (by default) the arrays' checksums and the keys' uniqueness. A damaged,
truncated or edited table is refused with `TableFormatError`, naming the file or field.
An opened `TableFile` holds its files open, so saves that replace (and delete) its version
do not disturb it.

Format version 2 added manifest.sha256; version 1 tables (without it) still open. Version 3
stores 16-bit rows at their size (a bfloat16 table file is half its version 2 size) and the
table's eviction counter ("evicted" in the manifest: rows a bounded table evicted so far);
`TableFile.read` / `take` / `batches` hand rows out as float32 whatever the file holds.

Incremental saves (a chain: one full base, then deltas). ``save_table(store, path,
since=checkpoint)`` writes a delta version: the rows trained (last step >= the checkpoint's
step) or inserted since the checkpoint (count and last step 0: never trained), plus
``removed_keys.npy``, the keys of the chain that the store no longer holds (erased or
evicted), found by comparing key sets, so no erase log is kept. Its manifest has a "delta"
field naming its parent version; the commit keeps the chain's versions and removes the rest.
A delta also records its own version name ("name") and the SHA-256 of its parent's
manifest.json ("parent_sha256", what the parent's manifest.sha256 holds). Each manifest holds
its parent's digest, so the head's manifest pins the whole chain: reading a chain checks every
link, and a link replaced by another save's, or versions renamed, are refused with
`TableFormatError` naming the link. Deltas written before these fields existed have neither:
they read as before (there is nothing to check them against).

Shard tables (one file per rank of a sharded table, `cncore.routing.shard_name`) also record
their place: an optional "shard" field {"rank", "world_size", "save"} (the save id every
rank's file of one save shares), which `check_shard` holds against the file's name and keys.
A crash mid-delta leaves CURRENT on the previous head, so the chain opens as the last complete
state. ``load_store`` reads a chain as one table; ``open_table`` (memory maps of one version)
refuses a chain's head and ``compact_table`` rewrites the chain as one full base. A save falls
back to a full one when it cannot prove a delta complete: the checkpoint is of another store
or path, the table was saved since, rows were written by assign / insert_or_assign / load
(those do not record a step), the step went back, or the chain holds MAX_CHAIN deltas.

>>> import numpy as np, tempfile, os, cncore
>>> from cncore.tablefile import save_table, load_store, open_table
>>> store = cncore.EmbeddingStore(dim=2, optimizer=cncore.RowWiseAdagrad())
>>> _ = store.find_or_insert(np.array([-1, 2**63 - 1]))
>>> path = os.path.join(tempfile.mkdtemp(), "users.cnt")
>>> checkpoint = save_table(store, path)
>>> table = open_table(path)                 # memory-mapped, checked
>>> sorted(table.keys.tolist()), table.rows.shape
([-1, 9223372036854775807], (2, 2))
>>> len(load_store(path))
2
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import re
import shutil
import weakref
from dataclasses import dataclass, field
from typing import Dict, Iterator, Optional, Tuple

import numpy as np

import cncore
from cncore.row_codec import FILE_DTYPES, decode_rows, encode_rows

__all__ = ["save_table", "open_table", "load_store", "TableFile", "TableWriter", "TableFormatError",
           "FORMAT_VERSION", "config_to_dict", "config_from_dict", "infer_config", "Checkpoint", "compact_table",
           "chain_length", "chain_versions", "chain_head", "check_shard", "check_path_name"]

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
_INITIALIZERS = {c.__name__: c for c in (cncore.Uniform, cncore.Normal, cncore.TruncatedNormal, cncore.Constant)}
_OPTIMIZERS = {c.__name__: c for c in (cncore.SGD, cncore.Adagrad, cncore.RowWiseAdagrad, cncore.Adam)}
_EVICTIONS = {c.__name__: c for c in (cncore.LRU, cncore.LFU, cncore.TTL)}
# Config fields a file holds only when they are set (bounded tables): files of unbounded tables
# stay what they were, and files written before these fields existed read as unbounded.
_OPTIONAL_FIELDS = ("max_rows", "eviction", "headroom", "admission")
_ADMISSIONS = {"MinCount": cncore.MinCount, "Probability": cncore.Probability}
# Policy fields a file holds only when set (added later): a file of a policy without them reads
# and writes as before, also by older versions of this package, which refuse unknown fields.
_POLICY_OPTIONAL_FIELDS = {"LFU": ("halve_every",)}


class TableFormatError(ValueError):
    """A table directory that cannot be read: missing, damaged, truncated or of another format."""


def _show(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _error(where: str, message: str) -> TableFormatError:
    return TableFormatError(f"{where}: {message}" if where else message)


def _is_int(value, lo: int = 0, hi: int = 2**63) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and lo <= value < hi


def array_dtypes(config: cncore.StoreConfig, version: int = FORMAT_VERSION) -> Dict[str, np.dtype]:
    """The .npy dtype of each array of a table of `config` in format `version` (rows: float32
    before version 3, the row dtype's own size from it)."""
    dtypes = {name: np.dtype(dtype) for name, dtype in ARRAYS.items()}
    if version >= 3:
        dtypes["rows"] = FILE_DTYPES[config.dtype]
    return dtypes


def config_to_dict(config: cncore.StoreConfig) -> dict:
    d = dataclasses.asdict(config)
    d["initializer"] = {"type": type(config.initializer).__name__, **dataclasses.asdict(config.initializer)}
    d["optimizer"] = (None if config.optimizer is None else
                      {"type": type(config.optimizer).__name__, **dataclasses.asdict(config.optimizer)})
    d["eviction"] = (None if config.eviction is None else
                     {"type": type(config.eviction).__name__, **{
                         k: v for k, v in dataclasses.asdict(config.eviction).items()
                         if v is not None or k not in _POLICY_OPTIONAL_FIELDS.get(type(config.eviction).__name__, ())}})
    d["admission"] = (None if config.admission is None else
                      {"type": type(config.admission).__name__, **dataclasses.asdict(config.admission)})
    for name in _OPTIONAL_FIELDS:
        if d[name] is None:
            del d[name]
    del d["storage"]  # where a store keeps its rows is not part of the table
    return d


def infer_config(dim: int, state_floats: int) -> cncore.StoreConfig:
    """A config for rows without one: the optimizer is guessed from the state width (0: none,
    1: row-wise Adagrad, dim: Adagrad, 2*dim: Adam), with default hyperparameters.

    >>> infer_config(4, 8).optimizer
    Adam(lr=0.001, betas=(0.9, 0.999), eps=1e-08)
    """
    optimizer = {0: None, 1: cncore.RowWiseAdagrad(), dim: cncore.Adagrad(), 2 * dim: cncore.Adam()}.get(state_floats)
    if optimizer is None and state_floats:
        raise ValueError(f"cannot infer an optimizer from {state_floats} state floats per row of dim {dim}; "
                         f"pass config=")
    return cncore.StoreConfig(dim=dim, optimizer=optimizer)


def _fields_exactly(d, names, where: str, what: str) -> None:
    """`d` must be a dict with exactly the keys `names` (the writer always writes them all)."""
    if not isinstance(d, dict):
        raise _error(where, f"{what} must be an object, got {_show(d)}")
    missing, unknown = [n for n in names if n not in d], sorted(set(d) - set(names), key=str)
    if missing or unknown:
        raise _error(where, f"{what} must have the fields {list(names)}"
                     + (f"; missing {missing}" if missing else "")
                     + (f"; unknown {[_show(u, 30) for u in unknown]}" if unknown else ""))


def _from_whitelist(d, classes: dict, what: str, where: str):
    """Build one of `classes` (by name) from {"type": name, **fields}: only these classes, so a
    file can never name some other callable of the package."""
    kind = d.get("type") if isinstance(d, dict) else None
    if not isinstance(kind, str) or kind not in classes:
        raise _error(where, f"{what}.type must be one of {sorted(classes)}, got {_show(kind)}")
    cls = classes[kind]
    optional = _POLICY_OPTIONAL_FIELDS.get(kind, ())
    _fields_exactly({n: None for n in optional} | d if isinstance(d, dict) else d,
                    ("type",) + tuple(f.name for f in dataclasses.fields(cls)), where, what)
    values = {k: v for k, v in d.items() if k != "type"}
    for k, v in values.items():  # numbers (betas: a list of them); the constructor checks ranges
        if k == "unadmitted" and isinstance(v, str):  # MinCount's one word; its constructor checks it
            continue
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool)
                   for x in (v if k == "betas" and isinstance(v, (list, tuple)) else [v])):
            raise _error(where, f"{what}.{k} must be {'a list of numbers' if k == 'betas' else 'a number'}, "
                                f"got {_show(v)}")
    if "betas" in values:
        values["betas"] = tuple(values["betas"])
    try:
        return cls(**values)
    except (TypeError, ValueError) as exc:
        raise _error(where, f"{what}: {exc}") from None


def config_from_dict(d, where: str = "") -> cncore.StoreConfig:
    """The StoreConfig a file describes (see `config_to_dict`); anything else, an unknown
    initializer or optimizer type included, is a `TableFormatError` naming the field.

    >>> config_from_dict(config_to_dict(cncore.StoreConfig(dim=3, optimizer=cncore.Adam()))).optimizer
    Adam(lr=0.001, betas=(0.9, 0.999), eps=1e-08)
    >>> try:
    ...     config_from_dict({**config_to_dict(cncore.StoreConfig(dim=3)), "initializer": {"type": "set_num_threads"}})
    ... except TableFormatError as exc:
    ...     print(exc)
    config.initializer.type must be one of ['Constant', 'Normal', 'TruncatedNormal', 'Uniform'], got 'set_num_threads'
    >>> config_from_dict(config_to_dict(cncore.StoreConfig(dim=3, max_rows=100, eviction=cncore.TTL(5)))).eviction
    TTL(steps=5)
    """
    if isinstance(d, dict):
        if "storage" in d:  # never written: a table file holds rows, not where a store keeps them
            raise _error(where, "config has an unknown field 'storage'")
        d = {**{name: None for name in _OPTIONAL_FIELDS}, **d, "storage": None}
    _fields_exactly(d, tuple(f.name for f in dataclasses.fields(cncore.StoreConfig)), where, "config")
    d = dict(d)
    if d["eviction"] is not None:
        d["eviction"] = _from_whitelist(d["eviction"], _EVICTIONS, "config.eviction", where)
    if d["admission"] is not None:
        d["admission"] = _from_whitelist(d["admission"], _ADMISSIONS, "config.admission", where)
    if not _is_int(d["capacity"]):  # a hint, but the core allocates it: it must fit an int64
        raise _error(where, f"config.capacity must be an int in [0, 2**63), got {_show(d['capacity'])}")
    d["initializer"] = _from_whitelist(d["initializer"], _INITIALIZERS, "config.initializer", where)
    if d["optimizer"] is not None:
        d["optimizer"] = _from_whitelist(d["optimizer"], _OPTIMIZERS, "config.optimizer", where)
    try:
        return cncore.StoreConfig(**d)
    except (TypeError, ValueError) as exc:
        raise _error(where, f"config: {exc}") from None


def as_column(name: str, value) -> np.ndarray:
    """`value` as the table column `name` (dtype of `ARRAYS`), refusing casts that would change
    it: keys must be integers within int64, counts and last steps integers in [0, 2**32 - 1],
    rows and optimizer state real numbers. Raises ValueError naming the column.

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


def npy_header(dtype, shape: tuple) -> bytes:
    """The .npy (version 1.0) header of a C-ordered array: what comes before its raw bytes."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
                                               "fortran_order": False, "shape": shape})
    return buf.getvalue()


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_path_name(name, what: str = "table name") -> str:
    """`name`, checked to be usable as one directory name under a directory the caller chose:
    a non-empty string, not '.' or '..', without '/', '\\' or NUL (so that joining it to a
    path never leaves that path). ValueError naming it otherwise.

    >>> check_path_name("t_user")
    't_user'
    >>> check_path_name("../x")
    Traceback (most recent call last):
    ...
    ValueError: table name '../x': is used as a directory name, so it must be one plain path component (not empty, '.' or '..', no '/', '\\' or NUL); rename the table; nothing was written
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


class TableWriter:
    """Writes a table directory in batches of rows, never holding the table in memory.

    The arrays go to plain files (header first, then each batch appended, hashed as it is
    written); `commit` fsyncs them, writes the manifest and makes the new version live with
    an atomic rename of CURRENT. Leaving the `with` block by an exception, or a crash,
    leaves the table as it was (and a path the writer created is removed again).

    `path` must be new, an empty directory or an existing table: a directory holding anything
    else is refused (`TableFormatError`) before anything is written.

    >>> import numpy as np, tempfile, os, cncore
    >>> path = os.path.join(tempfile.mkdtemp(), "t.cnt")
    >>> with TableWriter(path, cncore.StoreConfig(dim=2), n_rows=3, step=7) as w:
    ...     w.write(np.array([1, 2]), np.ones((2, 2), np.float32))
    ...     w.write(np.array([3]), np.zeros((1, 2), np.float32), counts=np.array([5]))
    >>> open_table(path).counts.tolist(), open_table(path).step
    ([0, 0, 5], 7)
    """

    def __init__(self, path: str, config: cncore.StoreConfig, n_rows: int, step: int = 0, *,
                 parent: Optional[str] = None, removed_keys=None, keep: Tuple[str, ...] = (), evicted_count: int = 0,
                 parent_sha256: Optional[str] = None, shard: Optional[dict] = None):
        """parent, removed_keys, keep: a delta version (see the module docstring): the version
        it extends, the keys it removes, and the versions its commit must keep (the chain's,
        and any other a caller still needs). parent_sha256: the SHA-256 of the parent's
        manifest.json as the caller checked it (read from the parent when not given).
        evicted_count: the table's count of evicted rows (`EmbeddingStore.evicted_count`).
        shard: {"rank", "world_size", "save"} of a shard table (see the module docstring)."""
        if not isinstance(config, cncore.StoreConfig):
            raise TypeError(f"config must be a cncore.StoreConfig, got {type(config).__name__}")
        if not _is_int(int(n_rows) if isinstance(n_rows, np.integer) else n_rows):
            raise ValueError(f"n_rows must be an int >= 0, got {n_rows!r}")
        if not _is_int(int(step) if isinstance(step, np.integer) else step):
            raise ValueError(f"step must be an int in [0, 2**63), got {step!r}")
        if not _is_int(int(evicted_count) if isinstance(evicted_count, np.integer) else evicted_count):
            raise ValueError(f"evicted_count must be an int in [0, 2**63), got {evicted_count!r}")
        self.path, self.config, self.n_rows, self.step = path, config, int(n_rows), int(step)
        self.evicted_count, self._dtypes = int(evicted_count), array_dtypes(config)
        self.parent, self.keep = parent, tuple(keep) + ((parent,) if parent else ())
        self.removed_keys = None if parent is None else as_column("keys", np.asarray(
            removed_keys if removed_keys is not None else [], dtype=np.int64).reshape(-1))
        _check_table_path(path)
        if shard is not None:
            _check_shard_record(shard, "shard")
        self.shard = None if shard is None else {k: shard[k] for k in _SHARD_KEYS}
        if parent is not None and parent_sha256 is None:
            parent_sha256 = _manifest_sha256(path, parent)
        self.parent_sha256 = parent_sha256
        # The first directory this writer creates (if any): abort removes what it made, empty.
        self._created = None
        head = os.path.abspath(path)
        while not os.path.lexists(head):
            self._created, head = head, os.path.dirname(head)
        os.makedirs(path, exist_ok=True)
        # The next number after every version present, committed or not: a version directory
        # is never rewritten, so a reader holding one is never disturbed.
        numbers = [int(e[1:]) for e in os.listdir(path) if _VERSION.fullmatch(e)]
        current = _read_current(path, missing_ok=True, must_parse=False)
        if current:
            numbers.append(int(current[1:]))
        self.version = f"v{max(numbers, default=0) + 1:06d}"
        self._tmp = os.path.join(path, f".{self.version}.tmp-{os.getpid()}")
        n, sf = self.n_rows, config.state_floats
        self._shapes = {"keys": (n,), "rows": (n, config.dim), "optimizer_state": (n, sf), "counts": (n,),
                        "last_steps": (n,)}
        self._files, self._hashes = {}, {}
        try:
            shutil.rmtree(self._tmp, ignore_errors=True)
            os.makedirs(self._tmp)
            for name in ARRAYS:
                self._files[name] = open(os.path.join(self._tmp, f"{name}.npy"), "wb")
                self._hashes[name] = hashlib.sha256()
                self._append(name, npy_header(self._dtypes[name], self._shapes[name]))
        except BaseException:
            self.abort()
            raise
        self.rows_written = 0

    def _append(self, name: str, data) -> None:
        self._files[name].write(data)
        self._hashes[name].update(data)

    def write(self, keys, rows, optimizer_state=None, counts=None, last_steps=None) -> None:
        """Append a batch: keys (k,), rows (k, dim); optimizer state (k, state floats) defaults
        to the optimizer's initial state, counts and last steps to 0. Values that a cast would
        change (float keys, negative counts, ...) are refused (see `as_column`)."""
        keys = as_column("keys", keys)
        k = len(keys) if keys.ndim else 0
        if keys.ndim != 1:
            raise ValueError(f"keys must be 1-D, got shape {keys.shape}")
        if self.rows_written + k > self.n_rows:
            raise ValueError(f"more rows written ({self.rows_written + k}) than announced (n_rows={self.n_rows})")
        sf = self.config.state_floats
        if optimizer_state is None:
            initial = self.config.optimizer.initial_state if sf else 0.0
            optimizer_state = np.full((k, sf), initial, np.float32)
        zeros = np.zeros(k, np.uint32)
        values = {"keys": keys, "rows": rows, "optimizer_state": optimizer_state,
                  "counts": zeros if counts is None else counts, "last_steps": zeros if last_steps is None else last_steps}
        arrays = {}
        for name, value in values.items():
            arr = as_column(name, value)
            if arr.shape != (k,) + self._shapes[name][1:]:
                raise ValueError(f"{name} must have shape {(k,) + self._shapes[name][1:]}, got {arr.shape}")
            arrays[name] = arr
        arrays["rows"] = encode_rows(arrays["rows"], self.config.dtype)
        for name, arr in arrays.items():
            if arr.size:
                self._append(name, memoryview(arr.reshape(-1)).cast("B"))
        self.rows_written += k

    def commit(self) -> None:
        """Make the written rows the table's live version (atomic)."""
        if self.rows_written != self.n_rows:
            raise ValueError(f"{self.rows_written} rows written, {self.n_rows} announced")
        manifest = {"format": FORMAT, "version": FORMAT_VERSION, "rows": self.n_rows, "step": self.step,
                    "evicted": self.evicted_count, "config": config_to_dict(self.config), "arrays": {}}
        if self.shard is not None:
            manifest["shard"] = self.shard
        if self.parent is not None:
            removed = np.ascontiguousarray(self.removed_keys)
            data = npy_header(np.int64, removed.shape) + removed.tobytes()
            with open(os.path.join(self._tmp, "removed_keys.npy"), "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            manifest["delta"] = {"parent": self.parent, "removed": {
                "file": "removed_keys.npy", "dtype": np.dtype(np.int64).str, "shape": [len(removed)],
                "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()},
                "name": self.version, "parent_sha256": self.parent_sha256}
        for name, fh in self._files.items():
            fh.flush()
            os.fsync(fh.fileno())
            manifest["arrays"][name] = {"file": f"{name}.npy", "dtype": self._dtypes[name].str,
                                        "shape": list(self._shapes[name]), "bytes": fh.tell(),
                                        "sha256": self._hashes[name].hexdigest()}
            fh.close()
        text = json.dumps(manifest, indent=1).encode()
        for name, data in (("manifest.json", text),
                           ("manifest.sha256", f"{hashlib.sha256(text).hexdigest()}  manifest.json\n".encode())):
            with open(os.path.join(self._tmp, name), "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
        _fsync_dir(self._tmp)
        path, version = self.path, self.version
        os.rename(self._tmp, os.path.join(path, version))
        pointer = os.path.join(path, f".CURRENT.tmp-{os.getpid()}")
        with open(pointer, "w") as fh:
            fh.write(version + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        _fsync_dir(path)
        os.replace(pointer, os.path.join(path, "CURRENT"))  # the commit point
        _fsync_dir(path)
        # Older versions and leftovers of interrupted saves; only names saves make (the path
        # was checked to hold nothing else). Readers that opened an older version hold its
        # files open, so removing it does not disturb them.
        for entry in os.listdir(path):
            if entry not in ("CURRENT", version) + self.keep and _SAVE_MADE.fullmatch(entry):
                full = os.path.join(path, entry)
                shutil.rmtree(full, ignore_errors=True) if os.path.isdir(full) else os.remove(full)

    def abort(self) -> None:
        """Drop what was written; the table stays as it was, and a directory the writer
        created is removed (if it is still empty)."""
        for fh in self._files.values():
            fh.close()
        shutil.rmtree(self._tmp, ignore_errors=True)
        if self._created:
            head = os.path.abspath(self.path)
            while True:
                try:
                    os.rmdir(head)
                except OSError:
                    break
                if head == self._created:
                    break
                head = os.path.dirname(head)

    def __enter__(self) -> "TableWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


@dataclass(frozen=True)
class Checkpoint:
    """What `save_table` returns: pass it as `since` to make the next save of the same store to
    the same path a delta. delta: whether this save was one; chain: deltas since the base."""
    path: str
    version: str
    step: int
    delta: bool
    chain: int
    _store: tuple = field(default=(), repr=False)  # (the store's id token, its count of row writes)


def _delta_blocker(store, path: str, since) -> Optional[str]:
    """Why a delta from `since` could miss a change (None: it cannot)."""
    if not isinstance(since, Checkpoint):
        raise TypeError(f"since must be the Checkpoint a previous save_table returned, got {type(since).__name__}")
    if os.path.abspath(since.path) != os.path.abspath(path):
        return "the checkpoint is of another path"
    if since._store != (store._uid, store._writes):
        return "the checkpoint is of another store, or rows were written by assign / insert_or_assign / load"
    if store.step < since.step:
        return "the step went back"
    if since.chain >= MAX_CHAIN:
        return f"the chain holds {MAX_CHAIN} deltas"
    if _read_current(path, missing_ok=True, must_parse=False) != since.version:
        return "the table was saved since the checkpoint"
    return None


def save_table(store: cncore.EmbeddingStore, path: str, batch_rows: int = 1 << 18, *, since=None,
               keep: Tuple[str, ...] = (), shard: Optional[dict] = None) -> Checkpoint:
    """Write `store` (rows, optimizer state, metadata, config, step) to the table directory
    `path`, atomically. Rows are streamed in batches of `batch_rows`, so memory stays bounded.
    `path` must be new, an empty directory or an existing table (see `TableWriter`).

    With `since` (the Checkpoint of a previous save of this store to this path), a delta:
    only the rows trained or inserted since, and the keys removed since (see the module
    docstring, which also says when a save falls back to a full one; the Checkpoint's
    `delta` tells). Memory: 8 bytes per row of the store and of the chain for the key sets.

    keep: version names the commit leaves in place besides the new chain, e.g. the chain of
    the state another file still refers to (`chain_versions(path)` lists them).
    shard: the place of a shard table, {"rank", "world_size", "save"} (see `check_shard`).

    >>> import numpy as np, tempfile, os
    >>> s = cncore.EmbeddingStore(dim=2, optimizer=cncore.SGD())
    >>> def train(keys):
    ...     _, ctx = s.pooled_lookup(keys, lengths=np.array([len(keys)]))
    ...     s.apply_gradients(ctx, np.ones((1, 2), np.float32))
    >>> train(np.arange(100))
    >>> path = os.path.join(tempfile.mkdtemp(), "t.cnt"); base = save_table(s, path)
    >>> train(np.array([5, 7])); _ = s.erase(np.array([9]))
    >>> d = save_table(s, path, since=base); d.delta, open_table_rows(path, d.version), len(load_store(path))
    (True, 2, 99)
    """
    blocker = None if since is None else _delta_blocker(store, path, since)
    if since is not None and blocker is None:
        return _save_delta(store, path, batch_rows, since, tuple(keep), shard)
    with TableWriter(path, store.config, len(store), store.step, evicted_count=store.evicted_count,
                     keep=tuple(keep), shard=shard) as writer:
        for batch in store.iter_export(batch_rows):
            if writer.rows_written + len(batch.keys) > writer.n_rows:
                raise RuntimeError("the store changed during the save")
            writer.write(batch.keys, batch.rows, batch.optimizer_state, batch.counts, batch.last_steps)
        if writer.rows_written != writer.n_rows:
            raise RuntimeError(f"the store changed during the save ({writer.rows_written} rows exported, "
                               f"{writer.n_rows} expected)")
    return Checkpoint(path, writer.version, store.step, False, 0, (store._uid, store._writes))


def open_table_rows(path: str, version: str) -> int:
    """Rows held by one version's own arrays (a delta's: the rows it writes)."""
    with open(os.path.join(path, version, "manifest.json"), "rb") as fh:
        return json.loads(fh.read())["rows"]


def _save_delta(store, path: str, batch_rows: int, since: Checkpoint, keep: Tuple[str, ...] = (),
                shard: Optional[dict] = None) -> Checkpoint:
    chain = _open_chain(path, verify=False)
    if chain[-1].version != since.version:
        raise RuntimeError("the table was saved while this delta was being prepared; nothing was written")
    held = _chain_keys(chain)
    # Pass 1: which rows changed (trained since the checkpoint, never trained, or new to the
    # chain), and every key the store holds (for the removed ones).
    changed, present = [], []
    for batch in store.iter_export(batch_rows, with_rows=False):
        pick = (batch.last_steps >= since.step) | ((batch.counts == 0) & (batch.last_steps == 0))
        changed.append(batch.keys[pick])
        present.append(batch.keys)
    present = np.sort(np.concatenate(present)) if present else np.empty(0, np.int64)
    # Keys new to the chain (a net under the rule above), found with sorted needles: searching
    # the export's hash-ordered keys took 1.0 of a 1.45 s delta of 2M rows.
    at = np.searchsorted(held, present).clip(max=max(len(held) - 1, 0))
    new = present[held[at] != present] if len(held) else present
    changed = np.unique(np.concatenate(changed + [new]))
    removed = np.setdiff1d(held, present, assume_unique=True)
    versions = tuple(link.version for link in chain)
    # Pass 2: the chosen rows, read by key (a row trained between the passes is written as it
    # is now; a key erased between them stops the save).
    with TableWriter(path, store.config, len(changed), store.step, parent=since.version, removed_keys=removed,
                     keep=versions + tuple(keep), evicted_count=store.evicted_count,
                     parent_sha256=chain[-1].manifest_sha256, shard=shard) as writer:
        for start in range(0, len(changed), batch_rows):
            b = store.read(changed[start:start + batch_rows])
            if not b.found.all():
                raise RuntimeError("the store lost keys during the save; nothing was written")
            writer.write(b.keys, b.rows, b.optimizer_state, b.counts, b.last_steps)
    return Checkpoint(path, writer.version, store.step, True, since.chain + 1, (store._uid, store._writes))


def _chain_keys(chain) -> np.ndarray:
    """The sorted keys the chain's last state holds. (A sort and a neighbour compare: NumPy's
    union1d went through its hashing unique, 0.25 s for 400k keys against 0.03 s.)"""
    held = np.empty(0, np.int64)
    for link in chain:
        if link.delta is not None:
            held = np.setdiff1d(held, np.asarray(link.delta["removed"]), assume_unique=True)
        merged = np.concatenate([held, link.read("keys", 0, len(link))])
        merged.sort()
        keep = np.ones(len(merged), bool)
        keep[1:] = merged[1:] != merged[:-1]
        held = merged[keep]
    return held


def load_store(path: str, verify: bool = True, batch_rows: int = 1 << 18, kind=None,
               version: Optional[str] = None) -> cncore.EmbeddingStore:
    """A store (of class `kind`, an EmbeddingStore subclass; EmbeddingStore by default) holding
    everything in the table directory, read in batches: keys, rows, optimizer state, counts,
    last steps and the step, exactly. A chain (base + deltas) is read as one table; with
    `version`, the chain ending at that version (one the last save kept) instead of the live one.

    >>> import numpy as np, tempfile, os
    >>> s = cncore.EmbeddingStore(dim=3, optimizer=cncore.Adam()); _ = s.find_or_insert(np.array([-2**63, 7]))
    >>> path = os.path.join(tempfile.mkdtemp(), "t.cnt"); _ = save_table(s, path)
    >>> back = load_store(path)
    >>> sorted(back.export().keys.tolist()), back.config == s.config
    ([-9223372036854775808, 7], True)
    """
    chain = _open_chain(path, verify, head=version)
    head = chain[-1]
    store = (kind or cncore.EmbeddingStore)(head.config)
    store.reserve(len(chain[0]))
    sf = head.config.state_floats
    for link in chain:
        if link.delta is not None:
            store.erase(np.asarray(link.delta["removed"]))
        for _, b in link.batches(batch_rows):
            store.load(b["keys"], b["rows"], b["optimizer_state"] if sf else None, b["counts"], b["last_steps"])
    store.step = head.step
    store.evicted_count = head.evicted_count
    return store


def compact_table(path: str, verify: bool = True, out: Optional[str] = None) -> Checkpoint:
    """Rewrite a chain (base + deltas) as one full base, atomically (the chain's versions are
    removed after the commit), or write it to the new table `out` and leave `path` as it is.
    Holds the table in memory while it writes."""
    store = load_store(path, verify)
    return save_table(store, path if out is None else out)


def chain_length(path: str, verify: bool = False) -> int:
    """How many deltas (incremental saves) the table at `path` holds over its base: 0 for a
    table saved in full. Without `verify`, the chain's manifests and sizes are checked, not the
    arrays' checksums.

    >>> import numpy as np, tempfile, os
    >>> s = cncore.EmbeddingStore(dim=2); _ = s.find_or_insert(np.arange(3))
    >>> path = os.path.join(tempfile.mkdtemp(), "t.cnt"); base = save_table(s, path)
    >>> _ = s.find_or_insert(np.arange(5)); _ = save_table(s, path, since=base)
    >>> chain_length(path)
    1
    """
    return len(_open_chain(path, verify)) - 1


def _read_current(path: str, missing_ok: bool = False, must_parse: bool = True) -> Optional[str]:
    """The version CURRENT names (None if there is no CURRENT and `missing_ok`); a damaged
    CURRENT raises, or gives None when not `must_parse` (a save then replaces it)."""
    pointer = os.path.join(path, "CURRENT")
    try:
        with open(pointer, "rb") as fh:
            raw = fh.read(64)
    except FileNotFoundError:
        if missing_ok:
            return None
        raise TableFormatError(f"{path}: not a table (no CURRENT file)") from None
    except OSError as exc:
        if not must_parse:
            return None
        raise TableFormatError(f"{path}: CURRENT cannot be read ({exc.strerror})") from None
    version = raw.decode("ascii", "replace").strip()
    if not _VERSION.fullmatch(version):
        if not must_parse:
            return None
        raise TableFormatError(f"{path}: CURRENT is damaged ({version[:40]!r}; expected a version like 'v000001')")
    return version


def _close_all(files: dict) -> None:
    for fh in files.values():
        fh.close()


@dataclass
class TableFile:
    """A table on disk, its arrays memory-mapped read-only (plain NumPy).

    The attributes are `np.memmap`s for random access, of the stored dtypes (`rows` of a
    bfloat16 table: uint16 bit patterns; `read`, `take` and `batches` give float32). Tools that walk the whole table use
    `batches`, which reads with plain file reads into fresh buffers: touched pages of a
    memory map stay in the process's resident set, so a scan through a mapped 5 GiB table
    would show 5 GiB resident; a read batch is freed as soon as it is processed.

    The array files stay open for the life of the object (through `_files`), and every read
    goes through them: a save that replaces this version and deletes its directory leaves
    this table readable to the end.
    """
    path: str
    config: cncore.StoreConfig
    step: int
    keys: np.ndarray
    rows: np.ndarray
    optimizer_state: np.ndarray
    counts: np.ndarray
    last_steps: np.ndarray
    _files: Dict[str, io.FileIO] = field(default_factory=dict, repr=False, compare=False)
    version: str = field(default="", repr=False, compare=False)
    # a delta version: {"parent": version, "removed": keys it removes (memmap)}; None for a base
    delta: Optional[dict] = field(default=None, repr=False, compare=False)
    evicted_count: int = 0  # rows the table had evicted when saved (0 in files before version 3)
    manifest_sha256: str = field(default="", repr=False, compare=False)  # of its manifest.json as read
    # a shard table's {"rank", "world_size", "save"} as saved; None for other tables and older files
    shard: Optional[dict] = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        weakref.finalize(self, _close_all, self._files)

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def dim(self) -> int:
        return self.config.dim

    @property
    def nbytes(self) -> int:
        """Bytes of the table's array files on disk."""
        return sum(os.fstat(self._file(name).fileno()).st_size for name in ARRAYS)

    def _file(self, name: str):
        fh = self._files.get(name)
        if fh is None:  # a TableFile built by hand from memmaps: open their files now
            fh = self._files[name] = open(getattr(self, name).filename, "rb", buffering=0)
        return fh

    def read(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of one array, read into a new array (not a view of the map);
        rows as float32 whatever the file stores (see `cncore.row_codec`)."""
        out = self._read_stored(name, start, stop)
        return decode_rows(out, self.config.dtype) if name == "rows" and out.dtype != np.float32 else out

    def _read_stored(self, name: str, start: int, stop: int) -> np.ndarray:
        mapped = getattr(self, name)
        stop = min(stop, len(mapped))
        out = np.empty((max(stop - start, 0),) + mapped.shape[1:], dtype=mapped.dtype)
        if out.nbytes:
            row_bytes = out.nbytes // len(out)
            view, offset = memoryview(out.reshape(-1)).cast("B"), mapped.offset + start * row_bytes
            fd = self._file(name).fileno()
            while len(view):
                got = os.preadv(fd, [view], offset)
                if not got:
                    raise TableFormatError(f"{self.path}: {name} ends early (truncated while open?)")
                view, offset = view[got:], offset + got
        return out

    def take(self, name: str, rows: np.ndarray, chunk: int = 1 << 14) -> np.ndarray:
        """One array's entries at row numbers `rows` (any order, repeats allowed). Reads go in
        row order through short-lived maps of `chunk` rows each, so the pages a gather touches
        leave the resident set when the chunk is done. Rows come as float32."""
        mapped = getattr(self, name)
        rows = np.asarray(rows, dtype=np.int64)
        out = np.empty((len(rows),) + mapped.shape[1:], mapped.dtype)
        if not len(rows) or not out.itemsize or not out.size:
            return out
        if rows.min() < 0 or rows.max() >= len(mapped):
            raise IndexError(f"rows: row numbers must be in [0, {len(mapped)})")
        order = np.argsort(rows, kind="stable")
        for start in range(0, len(rows), chunk):
            at = order[start:start + chunk]
            window = np.memmap(self._file(name), dtype=mapped.dtype, mode="r", offset=mapped.offset,
                               shape=mapped.shape)
            out[at] = window[rows[at]]
            del window
        return decode_rows(out, self.config.dtype) if name == "rows" and out.dtype != np.float32 else out

    def batches(self, batch_rows: int = 1 << 18, names=tuple(ARRAYS)) -> Iterator[Tuple[int, Dict[str, np.ndarray]]]:
        """(start, {name: rows [start, start + batch_rows)}) over the whole table, in file order."""
        for start in range(0, len(self), batch_rows):
            yield start, {name: self.read(name, start, start + batch_rows) for name in names}

    def lookup(self, keys) -> np.ndarray:
        """Rows (N, dim) of keys, zeros where a key is not in the table. No compiled core is
        involved: the keys are sorted once (16 bytes per row in memory), the rows are read
        from the memory map.

        >>> import numpy as np, tempfile, os, cncore
        >>> path = os.path.join(tempfile.mkdtemp(), "t.cnt")
        >>> with TableWriter(path, cncore.StoreConfig(dim=2), n_rows=2) as w:
        ...     w.write(np.array([10, -3]), np.array([[1, 2], [3, 4]], np.float32))
        >>> open_table(path).lookup([-3, 7]).tolist()
        [[3.0, 4.0], [0.0, 0.0]]
        """
        from cncore.tablefile_lookup import file_lookup
        return file_lookup(self, keys)

    def pooled_lookup(self, keys, offsets=None, *, lengths=None, mode: str = "sum",
                      per_sample_weights=None) -> np.ndarray:
        """Offline scoring: the pooled rows (B, dim) of bags of keys, as
        `EmbeddingStore.pooled_lookup(..., insert_missing=False)` computes them (unknown keys
        are zero rows), straight from the file.

        >>> import numpy as np, tempfile, os, cncore
        >>> path = os.path.join(tempfile.mkdtemp(), "t.cnt")
        >>> with TableWriter(path, cncore.StoreConfig(dim=1), n_rows=2) as w:
        ...     w.write(np.array([1, 2]), np.array([[1], [10]], np.float32))
        >>> open_table(path).pooled_lookup([1, 2, 2, 5], lengths=[2, 0, 2], mode="mean").ravel().tolist()
        [5.5, 0.0, 5.0]
        """
        from cncore.tablefile_lookup import file_pooled_lookup
        return file_pooled_lookup(self, keys, offsets, lengths, mode, per_sample_weights)


def _check_manifest(m, where: str) -> Tuple[int, int, cncore.StoreConfig, int]:
    """(rows, step, config, evicted count) of a parsed manifest, after checking every field of
    it: its own fields, and each array entry against the row count and the config."""
    if isinstance(m, dict) and m.get("format") != FORMAT:
        raise _error(where, f"not a {FORMAT} table (format {_show(m.get('format'))})")
    if isinstance(m, dict) and _is_int(m.get("version"), FORMAT_VERSION + 1, 2**63):
        raise _error(where, f"format version {m['version']} is newer than this reader ({FORMAT_VERSION})")
    v3 = isinstance(m, dict) and _is_int(m.get("version"), 3, 2**63)
    _fields_exactly(m, (_MANIFEST_KEYS_V3 if v3 else _MANIFEST_KEYS)
                    + tuple(k for k in ("delta", "shard") if isinstance(m, dict) and k in m), where, "the manifest")
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
    return n, m["step"], config, m.get("evicted", 0)


def _check_shard_record(d, what: str, where: str = "") -> None:
    _fields_exactly(d, _SHARD_KEYS, where, what)
    if not (_is_int(d["world_size"], 1, 2**31) and _is_int(d["rank"], 0, d["world_size"])):
        raise _error(where, f"{what}: rank must be an int in [0, world_size) and world_size an int >= 1, got "
                            f"rank {_show(d['rank'])} of world_size {_show(d['world_size'])}")
    if not (isinstance(d["save"], str) and re.fullmatch(r"[0-9A-Za-z_.:-]{1,80}", d["save"])):
        raise _error(where, f"{what}.save must be a save id (1 to 80 letters, digits, '_.:-'), got {_show(d['save'])}")


def _open_array(file: str, entry: dict, where: str, verify: bool):
    """(file object, memmap) of one array file, checked against its manifest entry."""
    try:
        fh = open(file, "rb", buffering=0)
    except FileNotFoundError:
        raise TableFormatError(f"{where} is missing") from None
    except OSError as exc:
        raise TableFormatError(f"{where} cannot be read ({exc.strerror})") from None
    try:
        size = os.fstat(fh.fileno()).st_size
        if size != entry["bytes"]:
            raise TableFormatError(f"{where} has {size} bytes, the manifest says {entry['bytes']} "
                                   f"(truncated or overwritten)")
        head = io.BytesIO(os.pread(fh.fileno(), 1 << 16, 0))
        try:
            version = np.lib.format.read_magic(head)
            read = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}[version]
            shape, fortran, dtype = read(head)
        except (ValueError, KeyError, SyntaxError, TypeError) as exc:
            raise TableFormatError(f"{where} has no readable .npy header ({str(exc)[:80]})") from None
        if fortran:
            # The bytes would be read as C order: rows scrambled. Tables hold C order only.
            raise TableFormatError(f"{where} is Fortran-ordered (fortran_order: True); table arrays are C-ordered")
        if dtype.str != entry["dtype"] or list(shape) != entry["shape"]:
            raise TableFormatError(f"{where} holds {dtype.str} {tuple(shape)}, the manifest says {entry['dtype']} "
                                   f"{tuple(entry['shape'])}")
        offset = head.tell()
        if offset + dtype.itemsize * int(np.prod(shape)) != size:
            raise TableFormatError(f"{where} has {size} bytes, its header needs "
                                   f"{offset + dtype.itemsize * int(np.prod(shape))} (truncated or overwritten)")
        if verify and _sha256_fd(fh.fileno()) != entry["sha256"]:
            raise TableFormatError(f"{where} fails its SHA-256 check (damaged)")
        return fh, np.memmap(fh, dtype=dtype, mode="r", offset=offset, shape=tuple(shape))
    except BaseException:
        fh.close()
        raise


def _open_version(path: str, version: str, verify: bool) -> TableFile:
    directory = os.path.join(path, version)
    where = f"{path}: {version}/manifest.json"
    try:
        with open(os.path.join(directory, "manifest.json"), "rb") as fh:
            text = fh.read()
    except FileNotFoundError:
        raise TableFormatError(f"{where} is missing") from None
    except OSError as exc:
        raise TableFormatError(f"{where} cannot be read ({exc.strerror})") from None
    try:
        with open(os.path.join(directory, "manifest.sha256"), "rb") as fh:
            recorded = fh.read(200).split(b" ")[0].decode("ascii", "replace")
    except FileNotFoundError:
        recorded = None
    except OSError as exc:
        raise TableFormatError(f"{path}: {version}/manifest.sha256 cannot be read ({exc.strerror})") from None
    if recorded is not None and recorded != hashlib.sha256(text).hexdigest():
        raise TableFormatError(f"{where} fails its SHA-256 check against manifest.sha256 (damaged or edited)")
    try:
        manifest = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise TableFormatError(f"{where} is damaged (not JSON: {str(exc)[:80]})") from None
    n, step, config, evicted = _check_manifest(manifest, where)
    if recorded is None and manifest["version"] >= 2:
        raise TableFormatError(f"{path}: {version}/manifest.sha256 is missing")
    files: Dict[str, io.FileIO] = {}
    arrays: Dict[str, np.ndarray] = {}
    try:
        for name in ARRAYS:
            files[name], arrays[name] = _open_array(os.path.join(directory, f"{name}.npy"), manifest["arrays"][name],
                                                    f"{path}: {version}/{name}.npy", verify)
        delta = None
        if "delta" in manifest:
            files["removed_keys"], removed = _open_array(os.path.join(directory, "removed_keys.npy"),
                                                         manifest["delta"]["removed"],
                                                         f"{path}: {version}/removed_keys.npy", verify)
            delta = {"parent": manifest["delta"]["parent"], "removed": removed,
                     "name": manifest["delta"].get("name"), "parent_sha256": manifest["delta"].get("parent_sha256")}
        table = TableFile(path, config, step, **arrays, _files=files, version=version, delta=delta,
                          evicted_count=evicted, manifest_sha256=hashlib.sha256(text).hexdigest(),
                          shard=manifest.get("shard"))
    except BaseException:
        _close_all(files)
        raise
    if verify and n:
        # One row per key. Sorting a copy costs 8 bytes a row, once, at open.
        keys = np.sort(table.read("keys", 0, n))
        same = np.flatnonzero(keys[1:] == keys[:-1])
        if len(same):
            raise TableFormatError(f"{path}: {version}/keys.npy holds duplicate keys ({len(same)}, e.g. "
                                   f"{int(keys[same[0]])}); a table holds one row per key")
    return table


def _manifest_sha256(path: str, version: str) -> str:
    """The SHA-256 of `version`'s manifest.json (what a delta over it records)."""
    try:
        with open(os.path.join(path, version, "manifest.json"), "rb") as fh:
            return hashlib.sha256(fh.read()).hexdigest()
    except OSError as exc:
        raise TableFormatError(f"{path}: {version}/manifest.json cannot be read ({exc.strerror})") from None


def _check_link(path: str, child: TableFile, parent: TableFile) -> None:
    """`child` (a delta) was written over exactly `parent`, under the name it is read by.
    A delta written before deltas recorded these has nothing to check."""
    name, digest = child.delta.get("name"), child.delta.get("parent_sha256")
    if name is not None and name != child.version:
        raise TableFormatError(f"{path}: {child.version}/manifest.json was written as {name}: the chain's versions "
                               f"were renamed, so its links no longer follow one save after another; restore the "
                               f"original names (or load another checkpoint); nothing was read")
    if digest is not None and digest != parent.manifest_sha256:
        raise TableFormatError(f"{path}: {child.version} is a delta over a {parent.version} whose manifest.json has "
                               f"SHA-256 {digest[:16]}..., but {parent.version}/manifest.json here has "
                               f"{parent.manifest_sha256[:16]}...: {parent.version} was replaced by another save's "
                               f"version, so the chain is not one table's history; restore the original "
                               f"{parent.version} (or load another checkpoint); nothing was read")


def _open_chain(path: str, verify: bool = True, head: Optional[str] = None) -> list:
    """The versions of the live chain (or of the chain ending at version `head`), base first
    (one version for a table saved in full), each link checked against its parent. A save
    may replace the table while it is being opened: the open then starts over. A tier's
    directory (cncore/tiered.py) is one version, as of its last flush."""
    from cncore.tiered import is_tier_directory, open_tier
    if is_tier_directory(path):
        if head is not None:
            raise TableFormatError(f"{path}: a tier directory has no versions (asked for {head})")
        return [open_tier(path, verify)]
    pinned = head
    for attempt in range(100):
        head = pinned or _read_current(path)
        try:
            chain = [_open_version(path, head, verify)]
            while chain[0].delta is not None:
                parent = chain[0].delta["parent"]
                if int(parent[1:]) >= int(chain[0].version[1:]) or len(chain) > MAX_CHAIN + 1:
                    raise TableFormatError(f"{path}: {chain[0].version}/manifest.json names parent {parent}, "
                                           "not an earlier version of a chain")
                chain.insert(0, _open_version(path, parent, verify))
                _check_link(path, chain[1], chain[0])
            for link in chain[1:]:
                if link.config != chain[0].config:
                    raise TableFormatError(f"{path}: {link.version} has another config than its base "
                                           f"{chain[0].version}")
            return chain
        except TableFormatError:
            if pinned or attempt == 99 or _read_current(path, missing_ok=True, must_parse=False) == head:
                raise
    raise AssertionError("unreachable")


def chain_head(path: str, verify: bool = False) -> TableFile:
    """The live version of a table (a chain's last delta), its chain's links checked: what
    the table's step, eviction count and shard record are read from."""
    return _open_chain(path, verify)[-1]


def check_shard(table: TableFile, path: str, rank: int, world_size: int, batch_rows: int = 1 << 18,
                progress=iter, keys_of=None) -> None:
    """Check that `table` (opened from `path`) is shard `rank` of a `world_size`-way split:
    its recorded place (a shard table written by this version on) must be that, and every key
    must be owned by `rank` (`cncore.routing.owner_of`). `keys_of`: an iterable of key batches
    to check instead of the table's own (a chain read whole). ValueError naming the path."""
    from cncore.routing import owner_of
    recorded = table.shard
    if recorded is not None and (recorded["rank"], recorded["world_size"]) != (rank, world_size):
        raise ValueError(f"{path}: was saved as shard {recorded['rank']} of {recorded['world_size']}, not shard "
                         f"{rank} of {world_size}: shard folders were renamed or moved; put each back under its "
                         f"own name (shard-{recorded['rank']}-of-{recorded['world_size']}); nothing was loaded or "
                         f"written")
    batches = keys_of if keys_of is not None else (b["keys"] for _, b in table.batches(batch_rows, ("keys",)))
    for keys in progress(batches):
        owners = owner_of(keys, world_size)
        stray = np.flatnonzero(owners != rank)
        if len(stray):
            k = int(keys[stray[0]])
            raise ValueError(f"{path}: holds key {k}, which shard {int(owners[stray[0]])} of {world_size} owns, "
                             f"not {rank}: not shard {rank} of a {world_size}-way split (shards overlap or were "
                             f"renamed); nothing was loaded or written")


def chain_versions(path: str, head: Optional[str] = None) -> Tuple[str, ...]:
    """The version names of the live chain (or of the chain ending at `head`), base first,
    its manifests and links checked (not the arrays' checksums)."""
    return tuple(link.version for link in _open_chain(path, verify=False, head=head))


def open_table(path: str, verify: bool = True) -> TableFile:
    """Open a table directory read-only, every field checked (see the module docstring);
    with `verify`, every array's SHA-256 and the keys' uniqueness too.

    A save may replace the table while it is being opened: the open then starts over on the
    new version, so it sees one complete version, never a mix. A chain (base + deltas) has no
    single version to map: it is refused; `load_store` reads it, `compact_table` merges it.

    A tier's directory (`StoreConfig(storage=cncore.Tiered(path, ...))`, flushed) opens as a
    `cncore.tiered.TierFile`: the same reading verbs, as of the tier's last flush.
    """
    from cncore.tiered import is_tier_directory, open_tier
    if is_tier_directory(path):
        return open_tier(path, verify)
    for attempt in range(100):
        version = _read_current(path)
        try:
            table = _open_version(path, version, verify)
        except TableFormatError:
            # A concurrent save removed this version as we read it: open the new one.
            if attempt == 99 or _read_current(path, missing_ok=True, must_parse=False) == version:
                raise
            continue
        if table.delta is not None:
            raise TableFormatError(f"{path}: {version} is a delta (incremental save) over {table.delta['parent']}; "
                                   "load_store() reads the chain as one table, compact_table() merges it into one "
                                   "version that open_table maps")
        return table
    raise AssertionError("unreachable")

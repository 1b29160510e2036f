"""The table file format: a directory that outlives the code that wrote it.

    TABLE/
      CURRENT            the name of the live version directory (replaced atomically)
      v000003/
        manifest.json    format, version, config, row count, step, and per array: dtype, shape,
                         byte size and SHA-256
        keys.npy         int64 (N,)
        rows.npy         float32 (N, dim)
        optimizer_state.npy  float32 (N, state floats)
        counts.npy       uint32 (N,)    access counts
        last_steps.npy   uint32 (N,)    step of the last training access

Every array is a plain `.npy` file: NumPy reads it, memory-mapped, without this package.
A save writes a new version directory (files fsynced), then points CURRENT at it with an
atomic rename, then removes older versions: a crash or kill at any moment leaves CURRENT
naming either the old table or the new one, complete. Opening checks the manifest, the sizes
and (by default) the checksums, and refuses a damaged or truncated table saying what is wrong.

>>> import numpy as np, tempfile, os, cncore
>>> from cncore_numpy import save_table, load_table, open_table
>>> store = cncore.EmbeddingStore(dim=2, optimizer=cncore.RowWiseAdagrad())
>>> _ = store.find_or_insert(np.array([-1, 2**63 - 1]))
>>> path = os.path.join(tempfile.mkdtemp(), "users.cnt")
>>> save_table(store, path)
>>> table = open_table(path)                 # memory-mapped, checked
>>> sorted(table.keys.tolist()), table.rows.shape
([-1, 9223372036854775807], (2, 2))
>>> len(load_table(path))
2
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import shutil
from dataclasses import dataclass
from typing import Dict, Iterator, Optional, Tuple

import numpy as np

import cncore

__all__ = ["save_table", "open_table", "TableFile", "TableWriter", "TableFormatError",
           "FORMAT_VERSION"]

FORMAT = "cn-table"
FORMAT_VERSION = 1
ARRAYS = {"keys": np.int64, "rows": np.float32, "optimizer_state": np.float32, "counts": np.uint32,
          "last_steps": np.uint32}
_CHUNK = 1 << 22


class TableFormatError(ValueError):
    """A table directory that cannot be read: missing, damaged, truncated or of another format."""


def config_to_dict(config: cncore.StoreConfig) -> dict:
    d = dataclasses.asdict(config)
    d["initializer"] = {"type": type(config.initializer).__name__, **dataclasses.asdict(config.initializer)}
    d["optimizer"] = (None if config.optimizer is None else
                      {"type": type(config.optimizer).__name__, **dataclasses.asdict(config.optimizer)})
    return d


def config_from_dict(d: dict) -> cncore.StoreConfig:
    d = dict(d)
    init = dict(d["initializer"])
    d["initializer"] = getattr(cncore, init.pop("type"))(**init)
    if d["optimizer"] is not None:
        opt = dict(d["optimizer"])
        kind = getattr(cncore, opt.pop("type"))
        if "betas" in opt:
            opt["betas"] = tuple(opt["betas"])
        d["optimizer"] = kind(**opt)
    return cncore.StoreConfig(**d)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


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


class TableWriter:
    """Writes a table directory in batches of rows, never holding the table in memory.

    The arrays go to plain files (header first, then each batch appended, hashed as it is
    written); `commit` fsyncs them, writes the manifest and makes the new version live with
    an atomic rename of CURRENT. Leaving the `with` block by an exception, or a crash,
    leaves the table as it was.

    >>> import numpy as np, tempfile, os, cncore
    >>> path = os.path.join(tempfile.mkdtemp(), "t.cnt")
    >>> with TableWriter(path, cncore.StoreConfig(dim=2), n_rows=3, step=7) as w:
    ...     w.write(np.array([1, 2]), np.ones((2, 2), np.float32))
    ...     w.write(np.array([3]), np.zeros((1, 2), np.float32), counts=np.array([5]))
    >>> open_table(path).counts.tolist(), open_table(path).step
    ([0, 0, 5], 7)
    """

    def __init__(self, path: str, config: cncore.StoreConfig, n_rows: int, step: int = 0):
        if not isinstance(n_rows, (int, np.integer)) or n_rows < 0:
            raise ValueError(f"n_rows must be an int >= 0, got {n_rows!r}")
        self.path, self.config, self.n_rows, self.step = path, config, int(n_rows), int(step)
        os.makedirs(path, exist_ok=True)
        current = _read_current(path, missing_ok=True)
        self.version = f"v{int(current[1:]) + 1 if current else 1:06d}"
        self._tmp = os.path.join(path, f".{self.version}.tmp-{os.getpid()}")
        shutil.rmtree(self._tmp, ignore_errors=True)
        os.makedirs(self._tmp)
        n, sf = self.n_rows, config.state_floats
        self._shapes = {"keys": (n,), "rows": (n, config.dim), "optimizer_state": (n, sf), "counts": (n,),
                        "last_steps": (n,)}
        self._files, self._hashes = {}, {}
        for name in ARRAYS:
            self._files[name] = open(os.path.join(self._tmp, f"{name}.npy"), "wb")
            self._hashes[name] = hashlib.sha256()
            self._append(name, npy_header(ARRAYS[name], self._shapes[name]))
        self.rows_written = 0

    def _append(self, name: str, data) -> None:
        self._files[name].write(data)
        self._hashes[name].update(data)

    def write(self, keys, rows, optimizer_state=None, counts=None, last_steps=None) -> None:
        """Append a batch: keys (k,), rows (k, dim); optimizer state (k, state floats) defaults
        to the optimizer's initial state, counts and last steps to 0."""
        keys = np.ascontiguousarray(keys, dtype=np.int64)
        k = len(keys)
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
            arr = np.ascontiguousarray(value, dtype=ARRAYS[name])
            if arr.shape != (k,) + self._shapes[name][1:]:
                raise ValueError(f"{name} must have shape {(k,) + self._shapes[name][1:]}, got {arr.shape}")
            arrays[name] = arr
        for name, arr in arrays.items():
            if arr.size:
                self._append(name, memoryview(arr.reshape(-1)).cast("B"))
        self.rows_written += k

    def commit(self) -> None:
        """Make the written rows the table's live version (atomic)."""
        if self.rows_written != self.n_rows:
            raise ValueError(f"{self.rows_written} rows written, {self.n_rows} announced")
        manifest = {"format": FORMAT, "version": FORMAT_VERSION, "rows": self.n_rows, "step": self.step,
                    "config": config_to_dict(self.config), "arrays": {}}
        for name, fh in self._files.items():
            fh.flush()
            os.fsync(fh.fileno())
            manifest["arrays"][name] = {"file": f"{name}.npy", "dtype": np.dtype(ARRAYS[name]).str,
                                        "shape": list(self._shapes[name]), "bytes": fh.tell(),
                                        "sha256": self._hashes[name].hexdigest()}
            fh.close()
        with open(os.path.join(self._tmp, "manifest.json"), "w") as fh:
            json.dump(manifest, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        _fsync_dir(self._tmp)
        path, version = self.path, self.version
        # A save killed between this rename and the CURRENT update leaves a complete but
        # uncommitted directory of this name: it is not the live table, so it can go.
        shutil.rmtree(os.path.join(path, version), ignore_errors=True)
        os.rename(self._tmp, os.path.join(path, version))
        pointer = os.path.join(path, f".CURRENT.tmp-{os.getpid()}")
        with open(pointer, "w") as fh:
            fh.write(version + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        _fsync_dir(path)
        os.replace(pointer, os.path.join(path, "CURRENT"))  # the commit point
        _fsync_dir(path)
        for entry in os.listdir(path):  # older versions and leftovers of interrupted saves
            if entry not in ("CURRENT", version):
                full = os.path.join(path, entry)
                shutil.rmtree(full, ignore_errors=True) if os.path.isdir(full) else os.remove(full)

    def abort(self) -> None:
        """Drop what was written; the table stays as it was."""
        for fh in self._files.values():
            fh.close()
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> "TableWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


def save_table(store: cncore.EmbeddingStore, path: str, batch_rows: int = 1 << 18) -> None:
    """Write `store` (rows, optimizer state, metadata, config, step) to the table directory
    `path`, atomically. Rows are streamed in batches of `batch_rows`, so memory stays bounded."""
    with TableWriter(path, store.config, len(store), store.step) as writer:
        for batch in store.iter_export(batch_rows):
            if writer.rows_written + len(batch.keys) > writer.n_rows:
                raise RuntimeError("the store changed during the save")
            writer.write(batch.keys, batch.rows, batch.optimizer_state, batch.counts, batch.last_steps)
        if writer.rows_written != writer.n_rows:
            raise RuntimeError(f"the store changed during the save ({writer.rows_written} rows exported, "
                               f"{writer.n_rows} expected)")


def _read_current(path: str, missing_ok: bool = False) -> Optional[str]:
    pointer = os.path.join(path, "CURRENT")
    if not os.path.exists(pointer):
        if missing_ok:
            return None
        raise TableFormatError(f"{path}: not a table (no CURRENT file)")
    version = open(pointer).read().strip()
    if not (version.startswith("v") and version[1:].isdigit()):
        raise TableFormatError(f"{path}: CURRENT is damaged ({version[:40]!r})")
    return version


@dataclass
class TableFile:
    """A table on disk, its arrays memory-mapped read-only (plain NumPy).

    The attributes are `np.memmap`s for random access. Tools that walk the whole table use
    `batches`, which reads with plain file reads into fresh buffers: touched pages of a
    memory map stay in the process's resident set, so a scan through a mapped 5 GiB table
    would show 5 GiB resident; a read batch is freed as soon as it is processed.
    """
    path: str
    config: cncore.StoreConfig
    step: int
    keys: np.ndarray
    rows: np.ndarray
    optimizer_state: np.ndarray
    counts: np.ndarray
    last_steps: np.ndarray

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def dim(self) -> int:
        return self.config.dim

    @property
    def nbytes(self) -> int:
        """Bytes of the table's array files on disk."""
        return sum(os.path.getsize(getattr(self, name).filename) for name in ARRAYS)

    def read(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of one array, read into a new array (not a view of the map)."""
        mapped = getattr(self, name)
        stop = min(stop, len(mapped))
        out = np.empty((max(stop - start, 0),) + mapped.shape[1:], dtype=mapped.dtype)
        if out.nbytes:
            row_bytes = out.nbytes // len(out)
            view = memoryview(out.reshape(-1)).cast("B")
            with open(mapped.filename, "rb") as fh:
                fh.seek(mapped.offset + start * row_bytes)
                if fh.readinto(view) != out.nbytes:
                    raise TableFormatError(f"{self.path}: {name} ends early (truncated while open?)")
        return out

    def take(self, name: str, rows: np.ndarray, chunk: int = 1 << 14) -> np.ndarray:
        """One array's entries at row numbers `rows` (any order, repeats allowed). Reads go in
        row order through short-lived maps of `chunk` rows each, so the pages a gather touches
        leave the resident set when the chunk is done."""
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
            window = np.memmap(mapped.filename, dtype=mapped.dtype, mode="r", offset=mapped.offset,
                               shape=mapped.shape)
            out[at] = window[rows[at]]
            del window
        return out

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
        from cncore_numpy.offline import file_lookup
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
        from cncore_numpy.offline import file_pooled_lookup
        return file_pooled_lookup(self, keys, offsets, lengths, mode, per_sample_weights)


def open_table(path: str, verify: bool = True) -> TableFile:
    """Open a table directory read-only; with `verify`, every array's SHA-256 is checked."""
    version = _read_current(path)
    directory = os.path.join(path, version)
    try:
        with open(os.path.join(directory, "manifest.json")) as fh:
            manifest = json.load(fh)
    except FileNotFoundError:
        raise TableFormatError(f"{path}: {version}/manifest.json is missing") from None
    except json.JSONDecodeError as exc:
        raise TableFormatError(f"{path}: {version}/manifest.json is damaged ({exc})") from None
    if manifest.get("format") != FORMAT:
        raise TableFormatError(f"{path}: not a {FORMAT} table (format {manifest.get('format')!r})")
    if manifest.get("version", 0) > FORMAT_VERSION:
        raise TableFormatError(f"{path}: format version {manifest['version']} is newer than this reader "
                               f"({FORMAT_VERSION})")
    arrays: Dict[str, np.ndarray] = {}
    for name in ARRAYS:
        entry = manifest["arrays"].get(name)
        if entry is None:
            raise TableFormatError(f"{path}: the manifest lists no {name!r} array")
        file = os.path.join(directory, entry["file"])
        if not os.path.exists(file):
            raise TableFormatError(f"{path}: {version}/{entry['file']} is missing")
        size = os.path.getsize(file)
        if size != entry["bytes"]:
            raise TableFormatError(f"{path}: {version}/{entry['file']} has {size} bytes, the manifest says "
                                   f"{entry['bytes']} (truncated or overwritten)")
        if verify and _sha256(file) != entry["sha256"]:
            raise TableFormatError(f"{path}: {version}/{entry['file']} fails its SHA-256 check (damaged)")
        try:
            arr = np.load(file, mmap_mode="r")
        except ValueError as exc:
            raise TableFormatError(f"{path}: {version}/{entry['file']} is not a readable .npy ({exc})") from None
        if arr.dtype != np.dtype(entry["dtype"]) or list(arr.shape) != entry["shape"]:
            raise TableFormatError(f"{path}: {version}/{entry['file']} holds {arr.dtype} {arr.shape}, the manifest "
                                   f"says {entry['dtype']} {tuple(entry['shape'])}")
        arrays[name] = arr
    return TableFile(path, config_from_dict(manifest["config"]), int(manifest["step"]), **arrays)

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
import json
import os
import shutil
from dataclasses import dataclass
from typing import Dict, Optional

import numpy as np

import cncore

__all__ = ["save_table", "open_table", "load_table", "TableFile", "TableFormatError", "FORMAT_VERSION"]

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


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_table(store: cncore.EmbeddingStore, path: str, batch_rows: int = 1 << 18) -> None:
    """Write `store` (rows, optimizer state, metadata, config, step) to the table directory
    `path`, atomically. Rows are streamed in batches of `batch_rows`, so memory stays bounded."""
    os.makedirs(path, exist_ok=True)
    current = _read_current(path, missing_ok=True)
    number = int(current[1:]) + 1 if current else 1
    version = f"v{number:06d}"
    tmp = os.path.join(path, f".{version}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    n, sf = len(store), store.config.state_floats
    shapes = {"keys": (n,), "rows": (n, store.dim), "optimizer_state": (n, sf), "counts": (n,), "last_steps": (n,)}
    files = {name: np.lib.format.open_memmap(os.path.join(tmp, f"{name}.npy"), mode="w+", dtype=ARRAYS[name],
                                             shape=shapes[name]) for name in ARRAYS}
    at = 0
    for batch in store.iter_export(batch_rows):
        k = len(batch.keys)
        for name in ARRAYS:
            files[name][at:at + k] = getattr(batch, name)
        at += k
    if at != n:
        raise RuntimeError(f"the store changed during the save ({at} rows exported, {n} expected)")
    manifest = {"format": FORMAT, "version": FORMAT_VERSION, "rows": n, "step": store.step,
                "config": config_to_dict(store.config), "arrays": {}}
    for name, arr in files.items():
        arr.flush()
        del arr
        file = os.path.join(tmp, f"{name}.npy")
        with open(file, "rb+") as fh:
            os.fsync(fh.fileno())
        manifest["arrays"][name] = {"file": f"{name}.npy", "dtype": np.dtype(ARRAYS[name]).str,
                                    "shape": list(shapes[name]), "bytes": os.path.getsize(file),
                                    "sha256": _sha256(file)}
    files.clear()
    with open(os.path.join(tmp, "manifest.json"), "w") as fh:
        json.dump(manifest, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    _fsync_dir(tmp)
    # A save killed between this rename and the CURRENT update leaves a complete but
    # uncommitted directory of this name: it is not the live table, so it can go.
    shutil.rmtree(os.path.join(path, version), ignore_errors=True)
    os.rename(tmp, os.path.join(path, version))
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
    """A table on disk, its arrays memory-mapped read-only (plain NumPy)."""
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


def load_table(path: str, verify: bool = True, batch_rows: int = 1 << 18) -> cncore.EmbeddingStore:
    """A store holding everything in the table directory (streamed in batches)."""
    table = open_table(path, verify)
    store = cncore.EmbeddingStore(table.config)
    store.reserve(len(table))
    sf = table.config.state_floats
    for start in range(0, len(table), batch_rows):
        stop = min(start + batch_rows, len(table))
        store.load(np.asarray(table.keys[start:stop]), np.asarray(table.rows[start:stop]),
                   np.asarray(table.optimizer_state[start:stop]) if sf else None,
                   np.asarray(table.counts[start:stop]), np.asarray(table.last_steps[start:stop]))
    store.step = table.step
    return store

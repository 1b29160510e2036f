"""Export table files to other formats and import them back, streaming in batches.

=========  ================================================================================
``.npz``   one member per array (keys, rows, optimizer_state, counts, last_steps) plus
           ``config`` (JSON string) and ``step``: ``np.load`` reads it; the round trip is exact.
``.npy``   one structured array, a record per row: ``key``, ``row`` (dim,),
           ``optimizer_state`` (state floats,; absent without an optimizer), ``count``,
           ``last_step``. A .npy header holds no config: importing takes it from
           ``config=`` (or another table) or infers it from the field shapes.
``.parquet``  columns ``key`` int64, ``row`` fixed-size list of float32, ``optimizer_state``
           (same; absent without an optimizer), ``count``, ``last_step`` uint32, one row group
           per batch; config and step in the schema metadata under ``cn-table``. Needs pyarrow
           (``pip install cncore[parquet]``).
=========  ================================================================================

Every export is written to a temporary name, fsynced and renamed, so a crash leaves no
half-written file under the final name. Imports check that keys are unique.

>>> import numpy as np, tempfile, os, cncore
>>> from cncore_numpy import Table, open_table
>>> d = tempfile.mkdtemp(); t = Table(dim=2, optimizer=cncore.Adagrad())
>>> _ = t.find_or_insert([3, -3]); t.save(os.path.join(d, "t.cnt"))
>>> export_table(open_table(os.path.join(d, "t.cnt")), os.path.join(d, "t.npz"))
>>> sorted(np.load(os.path.join(d, "t.npz"))["keys"].tolist())
[-3, 3]
>>> import_table(os.path.join(d, "t.npz"), os.path.join(d, "back.cnt"))
>>> open_table(os.path.join(d, "back.cnt")).config == t.config
True
"""
from __future__ import annotations

import json
import os
import zipfile
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, Optional

import numpy as np

import cncore
from cncore_numpy.format import (ARRAYS, TableFile, TableWriter, config_from_dict, config_to_dict,
                                 npy_header)

__all__ = ["export_table", "import_table", "FORMATS", "NpzStreamWriter"]

BATCH = 1 << 18
FORMATS = (".npz", ".npy", ".parquet")
_FIELDS = {"keys": "key", "rows": "row", "optimizer_state": "optimizer_state", "counts": "count",
           "last_steps": "last_step"}


def format_of(path: str) -> str:
    for ext in FORMATS:
        if path.endswith(ext):
            return ext
    raise ValueError(f"{path}: unknown format; expected a file name ending in {', '.join(FORMATS)}")


class _AtomicFile:
    """A file written under a temporary name and renamed into place on success."""

    def __init__(self, path: str):
        self.path, self.tmp = path, f"{path}.tmp-{os.getpid()}"

    def __enter__(self) -> str:
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            if os.path.exists(self.tmp):
                os.remove(self.tmp)
            return
        with open(self.tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(self.tmp, self.path)


class NpzStreamWriter:
    """An .npz written one array at a time, each from batches, never whole in memory.

    >>> import tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "a.npz")
    >>> with NpzStreamWriter(path) as npz:
    ...     npz.write("x", np.int64, (4,), iter([np.arange(2), np.arange(2, 4)]))
    >>> np.load(path)["x"].tolist()
    [0, 1, 2, 3]
    """

    def __init__(self, path: str):
        self._atomic = _AtomicFile(path)
        self._zip = zipfile.ZipFile(self._atomic.__enter__(), "w", zipfile.ZIP_STORED, allowZip64=True)

    def write(self, name: str, dtype, shape: tuple, batches) -> None:
        with self._zip.open(name + ".npy", "w", force_zip64=True) as member:
            member.write(npy_header(dtype, shape))
            for batch in batches:
                arr = np.ascontiguousarray(batch, dtype=dtype)
                if arr.size:
                    member.write(memoryview(arr.reshape(-1)).cast("B"))

    def __enter__(self) -> "NpzStreamWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._zip.close()
        self._atomic.__exit__(exc_type, exc, tb)


def _npy_member_reader(fh, name: str):
    """(dtype, shape, read(k) -> next k records) of a .npy stream positioned at its start."""
    version = np.lib.format.read_magic(fh)
    read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, fortran, dtype = read_header(fh)
    if fortran:
        raise ValueError(f"{name}: Fortran-ordered arrays are not supported")
    def read(k: int) -> np.ndarray:
        out = np.empty((k,) + tuple(shape[1:]), dtype)
        if out.nbytes and fh.readinto(memoryview(out.reshape(-1)).cast("B")) != out.nbytes:
            raise ValueError(f"{name}: ends early (truncated)")
        return out
    return dtype, tuple(shape), read


# --- export ---------------------------------------------------------------------------------

def export_table(table: TableFile, out: str, batch_rows: int = BATCH, progress: Callable = iter) -> None:
    """Write `table` to `out` in the format its extension names (see the module docstring).
    `progress` wraps the batch iterator (tqdm, for instance)."""
    {".npz": _export_npz, ".npy": _export_npy, ".parquet": _export_parquet}[format_of(out)](
        table, out, batch_rows, progress)


def _export_npz(table, out, batch_rows, progress) -> None:
    n, sf = len(table), table.config.state_floats
    shapes = {"keys": (n,), "rows": (n, table.dim), "optimizer_state": (n, sf), "counts": (n,), "last_steps": (n,)}
    with NpzStreamWriter(out) as npz:
        for name in ARRAYS:  # one member at a time: a zip takes one writer at once
            npz.write(name, ARRAYS[name], shapes[name],
                      (b[name] for _, b in progress(table.batches(batch_rows, (name,)))))
        config = np.array(json.dumps(config_to_dict(table.config)))
        npz.write("config", config.dtype, (), [config])
        npz.write("step", np.int64, (), [np.array(table.step)])


def _record_dtype(dim: int, sf: int) -> np.dtype:
    fields = [("key", "<i8"), ("row", "<f4", (dim,))]
    if sf:
        fields.append(("optimizer_state", "<f4", (sf,)))
    return np.dtype(fields + [("count", "<u4"), ("last_step", "<u4")])


def _export_npy(table, out, batch_rows, progress) -> None:
    dtype = _record_dtype(table.dim, table.config.state_floats)
    with _AtomicFile(out) as tmp, open(tmp, "wb") as fh:
        fh.write(npy_header(dtype, (len(table),)))
        for _, b in progress(table.batches(batch_rows)):
            rec = np.empty(len(b["keys"]), dtype)
            for name, field in _FIELDS.items():
                if field in dtype.names:
                    rec[field] = b[name]
            fh.write(memoryview(rec).cast("B") if len(rec) else b"")


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise ImportError("Parquet needs pyarrow: pip install 'cncore[parquet]' (or pyarrow)") from None
    return pyarrow


def _export_parquet(table, out, batch_rows, progress) -> None:
    pa = _pyarrow()
    sf = table.config.state_floats
    fields = [pa.field("key", pa.int64()), pa.field("row", pa.list_(pa.float32(), table.dim))]
    if sf:
        fields.append(pa.field("optimizer_state", pa.list_(pa.float32(), sf)))
    fields += [pa.field("count", pa.uint32()), pa.field("last_step", pa.uint32())]
    meta = {"cn-table": json.dumps({"config": config_to_dict(table.config), "step": table.step})}
    schema = pa.schema(fields, metadata=meta)
    with _AtomicFile(out) as tmp:
        with pa.parquet.ParquetWriter(tmp, schema) as writer:
            for _, b in progress(table.batches(batch_rows)):
                cols = [pa.array(b["keys"]), pa.FixedSizeListArray.from_arrays(pa.array(b["rows"].reshape(-1)), table.dim)]
                if sf:
                    cols.append(pa.FixedSizeListArray.from_arrays(pa.array(b["optimizer_state"].reshape(-1)), sf))
                cols += [pa.array(b["counts"]), pa.array(b["last_steps"])]
                writer.write_table(pa.Table.from_arrays(cols, schema=schema))


# --- import ---------------------------------------------------------------------------------

@dataclass
class _Source:
    """What an import reads: row count, config and step if the file holds them, and batches."""
    n_rows: int
    dim: int
    state_floats: int
    config: Optional[cncore.StoreConfig]
    step: Optional[int]
    batches: Callable[..., Iterator[Dict[str, np.ndarray]]]  # (batch_rows, wanted array names)


def _npz_source(path: str) -> _Source:
    with zipfile.ZipFile(path) as zf:
        names = set(zf.namelist())
    missing = [n for n in ("keys", "rows") if n + ".npy" not in names]
    if missing:
        raise ValueError(f"{path}: the .npz has no {missing} array")
    small = np.load(path, allow_pickle=False)
    config = config_from_dict(json.loads(str(small["config"]))) if "config.npy" in names else None
    step = int(small["step"]) if "step.npy" in names else None
    with zipfile.ZipFile(path) as zf, zf.open("rows.npy") as fh:
        _, shape, _ = _npy_member_reader(fh, "rows")
    sf = 0
    if "optimizer_state.npy" in names:
        with zipfile.ZipFile(path) as zf, zf.open("optimizer_state.npy") as fh:
            sf = _npy_member_reader(fh, "optimizer_state")[1][1]

    def batches(batch_rows: int, wanted=tuple(ARRAYS)):
        with zipfile.ZipFile(path) as zf:
            readers = {}
            for name in ARRAYS:
                if name + ".npy" in names:
                    readers[name] = _npy_member_reader(zf.open(name + ".npy"), name)
            for name, (_, shp, _) in readers.items():
                if shp[0] != shape[0]:
                    raise ValueError(f"{path}: {name} has {shp[0]} rows, rows has {shape[0]}")
            for start in range(0, shape[0], batch_rows):
                k = min(batch_rows, shape[0] - start)
                yield {name: r[2](k) for name, r in readers.items() if name in wanted}
    return _Source(shape[0], shape[1], sf, config, step, batches)


def _npy_source(path: str) -> _Source:
    with open(path, "rb") as fh:
        dtype, shape, _ = _npy_member_reader(fh, path)
    if dtype.names is None or "key" not in dtype.names or "row" not in dtype.names or len(shape) != 1:
        raise ValueError(f"{path}: expected a 1-D structured array with fields key, row, ... (a cn-table export)")
    sf = dtype["optimizer_state"].shape[0] if "optimizer_state" in dtype.names else 0

    def batches(batch_rows: int, wanted=tuple(ARRAYS)):
        with open(path, "rb") as fh:
            _, _, read = _npy_member_reader(fh, path)
            for start in range(0, shape[0], batch_rows):
                rec = read(min(batch_rows, shape[0] - start))  # whole records: the fields interleave
                yield {name: rec[field] for name, field in _FIELDS.items() if field in dtype.names and name in wanted}
    return _Source(shape[0], dtype["row"].shape[0], sf, None, None, batches)


def _parquet_source(path: str) -> _Source:
    pa = _pyarrow()
    pf = pa.parquet.ParquetFile(path)
    schema = pf.schema_arrow
    for field in ("key", "row"):
        if field not in schema.names:
            raise ValueError(f"{path}: the Parquet file has no {field!r} column")
    meta = json.loads((schema.metadata or {}).get(b"cn-table", b"null"))
    sf = schema.field("optimizer_state").type.list_size if "optimizer_state" in schema.names else 0
    dim = schema.field("row").type.list_size

    def batches(batch_rows: int, wanted=tuple(ARRAYS)):
        columns = [_FIELDS[name] for name in wanted if _FIELDS[name] in schema.names]
        for rb in pf.iter_batches(batch_size=batch_rows, columns=columns):
            out = {}
            for name, field in _FIELDS.items():
                if field in rb.schema.names:
                    col = rb.column(field)
                    width = col.type.list_size if pa.types.is_fixed_size_list(col.type) else None
                    out[name] = (col.flatten().to_numpy(zero_copy_only=False).reshape(-1, width) if width
                                 else col.to_numpy(zero_copy_only=False))
            yield out
    return _Source(pf.metadata.num_rows, dim, sf, config_from_dict(meta["config"]) if meta else None,
                   meta["step"] if meta else None, batches)


def infer_config(dim: int, state_floats: int) -> cncore.StoreConfig:
    """A config for rows without one: the optimizer is guessed from the state width (0: none,
    1: row-wise Adagrad, dim: Adagrad, 2*dim: Adam), with default hyperparameters."""
    optimizer = {0: None, 1: cncore.RowWiseAdagrad(), dim: cncore.Adagrad(), 2 * dim: cncore.Adam()}.get(state_floats)
    if optimizer is None and state_floats:
        raise ValueError(f"cannot infer an optimizer from {state_floats} state floats per row of dim {dim}; "
                         f"pass config=")
    return cncore.StoreConfig(dim=dim, optimizer=optimizer)


def import_table(src: str, out: str, config: Optional[cncore.StoreConfig] = None, step: Optional[int] = None,
                 batch_rows: int = BATCH, progress: Callable = iter) -> None:
    """Write the table file `out` from an export `src` (.npz, .npy, .parquet). The config and
    step come from `src` when it holds them, else from the arguments, else inferred
    (`infer_config`, step 0); given arguments win over the file's."""
    source = {".npz": _npz_source, ".npy": _npy_source, ".parquet": _parquet_source}[format_of(src)](src)
    config = config or source.config or infer_config(source.dim, source.state_floats)
    if config.dim != source.dim or config.state_floats != source.state_floats:
        raise ValueError(f"config: dim {config.dim} with {config.state_floats} state floats per row does not match "
                         f"{src} (dim {source.dim}, {source.state_floats} state floats)")
    keys = np.concatenate([b["keys"] for b in source.batches(batch_rows, ("keys",))] or [np.zeros(0, np.int64)])
    if len(keys) != source.n_rows:
        raise ValueError(f"{src}: {len(keys)} keys, {source.n_rows} rows announced")
    unique = np.unique(keys)
    if len(unique) != len(keys):
        raise ValueError(f"{src}: keys are not unique ({len(keys) - len(unique)} duplicates); a table holds one "
                         f"row per key")
    del keys, unique
    with TableWriter(out, config, source.n_rows, step if step is not None else source.step or 0) as writer:
        for b in progress(source.batches(batch_rows)):
            writer.write(b["keys"], b["rows"], b.get("optimizer_state"), b.get("counts"), b.get("last_steps"))

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
           (``pip install 'cn-embedding[parquet]'``).
=========  ================================================================================

Every export is written to a temporary name, fsynced and renamed, so a crash leaves no
half-written file under the final name. Imports check what they read and cast nothing
that a cast would change: keys must be unique integers, counts and last steps integers in
[0, 2**32 - 1], no nulls; a refused import writes nothing.

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
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

import cncore
from cncore.tablefile import (
    ARRAYS,
    TableFile,
    TableFormatError,
    TableWriter,
    as_column,
    config_from_dict,
    config_to_dict,
    infer_config,
    npy_header,
)

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
        if os.path.isdir(path):  # a directory (a table, say) is never replaced by a file
            raise ValueError(f"{path}: is a directory; expected the name of a file to write")
        self.path, self.tmp = path, f"{path}.tmp-{os.getpid()}"

    def __enter__(self) -> str:
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                with open(self.tmp, "rb+") as fh:
                    os.fsync(fh.fileno())
                os.replace(self.tmp, self.path)
        finally:
            if os.path.exists(self.tmp):
                os.remove(self.tmp)


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
                    member.write(arr.reshape(-1).data.cast("B"))

    def __enter__(self) -> NpzStreamWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._zip.close()
        self._atomic.__exit__(exc_type, exc, tb)


def _npy_member_reader(fh, name: str):
    """(dtype, shape, read(k) -> next k records) of a .npy stream positioned at its start."""
    try:
        version = np.lib.format.read_magic(fh)
        read_header = {(1, 0): np.lib.format.read_array_header_1_0,
                       (2, 0): np.lib.format.read_array_header_2_0}[version]
        shape, fortran, dtype = read_header(fh)
    except (ValueError, KeyError, SyntaxError, TypeError) as exc:
        raise TableFormatError(f"{name}: not a readable .npy ({str(exc)[:80]})") from None
    if fortran:
        raise TableFormatError(f"{name}: Fortran-ordered arrays are not supported")
    if dtype.hasobject:
        raise TableFormatError(f"{name}: holds Python objects ({dtype}); expected numbers")

    def read(k: int) -> np.ndarray:
        out = np.empty((k,) + tuple(shape[1:]), dtype)
        if out.nbytes and fh.readinto(out.reshape(-1).data.cast("B")) != out.nbytes:
            raise TableFormatError(f"{name}: ends early (truncated)")
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
                if field in (dtype.names or ()):
                    rec[field] = b[name]
            fh.write(rec.data.cast("B") if len(rec) else b"")


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise ImportError("Parquet needs pyarrow: pip install 'cn-embedding[parquet]' (or pyarrow)") from None
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
                rows = pa.FixedSizeListArray.from_arrays(pa.array(b["rows"].reshape(-1)), table.dim)
                cols = [pa.array(b["keys"]), rows]
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
    config: cncore.StoreConfig | None
    step: int | None
    batches: Callable[..., Iterator[dict[str, np.ndarray]]]  # (batch_rows, wanted array names)


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:60] + "..."


def _npz_source(path: str) -> _Source:
    with zipfile.ZipFile(path) as zf:
        names = set(zf.namelist())
        missing = [n for n in ("keys", "rows") if n + ".npy" not in names]
        if missing:
            raise TableFormatError(f"{path}: the .npz has no {missing} array")
        shapes = {}
        for name in ARRAYS:
            if name + ".npy" in names:
                with zf.open(name + ".npy") as fh:
                    shapes[name] = _npy_member_reader(fh, f"{path}: {name}")[1]
    n = shapes["keys"][0] if len(shapes["keys"]) == 1 else -1  # -1: no shape matches, keys is refused below
    for name, shape in shapes.items():
        ndim = 2 if name in ("rows", "optimizer_state") else 1
        if len(shape) != ndim or shape[0] != n:
            raise TableFormatError(f"{path}: {name} has shape {shape}; expected {ndim}-D with one entry per key "
                                   f"(keys: {shapes['keys']})")
    config, step = None, None
    with np.load(path, allow_pickle=False) as small:
        if "config.npy" in names:
            try:
                config = json.loads(str(small["config"]))
            except ValueError as exc:
                raise TableFormatError(f"{path}: config is not JSON ({str(exc)[:80]})") from None
            config = config_from_dict(config, f"{path}: config")
        if "step.npy" in names:
            step = small["step"]
            if step.shape != () or step.dtype.kind not in "iu" or not 0 <= int(step) < 2**63:
                raise TableFormatError(f"{path}: step must be one integer in [0, 2**63), got {_show(step)}")
            step = int(step)
    sf = shapes["optimizer_state"][1] if "optimizer_state" in shapes else 0

    def batches(batch_rows: int, wanted=tuple(ARRAYS)):
        with zipfile.ZipFile(path) as zf:
            readers = {name: _npy_member_reader(zf.open(name + ".npy"), f"{path}: {name}")[2]
                       for name in shapes if name in wanted}
            for start in range(0, n, batch_rows):
                k = min(batch_rows, n - start)
                yield {name: read(k) for name, read in readers.items()}
    return _Source(n, shapes["rows"][1], sf, config, step, batches)


def _npy_source(path: str) -> _Source:
    with open(path, "rb") as fh:
        dtype, shape, _ = _npy_member_reader(fh, path)
    if (dtype.names is None or "key" not in dtype.names or "row" not in dtype.names or len(shape) != 1
            or len(dtype["row"].shape) != 1
            or ("optimizer_state" in dtype.names and len(dtype["optimizer_state"].shape) != 1)):
        raise TableFormatError(f"{path}: expected a 1-D structured array with fields key, row (dim,), ... "
                               f"(a cn-table export), got {dtype} {shape}")
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
    try:
        pf = pa.parquet.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise TableFormatError(f"{path}: not a readable Parquet file ({str(exc)[:80]})") from None
    schema = pf.schema_arrow
    for field in ("key", "row"):
        if field not in schema.names:
            raise TableFormatError(f"{path}: the Parquet file has no {field!r} column")
    for field in ("row", "optimizer_state"):
        if field in schema.names and not pa.types.is_fixed_size_list(schema.field(field).type):
            raise TableFormatError(f"{path}: column {field!r} must be a fixed-size list of floats, got "
                                   f"{schema.field(field).type}")
    try:
        meta = json.loads((schema.metadata or {}).get(b"cn-table", b"null"))
    except ValueError as exc:
        raise TableFormatError(f"{path}: the cn-table metadata is not JSON ({str(exc)[:80]})") from None
    if meta is not None:
        if not isinstance(meta, dict) or set(meta) != {"config", "step"}:
            raise TableFormatError(f"{path}: the cn-table metadata must hold exactly config and step")
        if not isinstance(meta["step"], int) or isinstance(meta["step"], bool) or not 0 <= meta["step"] < 2**63:
            raise TableFormatError(f"{path}: the cn-table metadata's step must be an int in [0, 2**63), got "
                                   f"{_show(meta['step'])}")
    config = config_from_dict(meta["config"], f"{path}: config") if meta else None
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
                    values = col.flatten() if width else col
                    nulls = col.null_count + (values.null_count if width else 0)
                    if nulls:  # NumPy has no null: a cast would make one up (INT64_MIN, NaN)
                        raise TableFormatError(f"{path}: column {field!r} holds {nulls} nulls; every entry needs "
                                               f"a value")
                    values = values.to_numpy(zero_copy_only=False)
                    out[name] = values.reshape(-1, width) if width else values
            yield out
    return _Source(pf.metadata.num_rows, dim, sf, config, meta["step"] if meta else None, batches)


def import_table(src: str, out: str, config: cncore.StoreConfig | None = None, step: int | None = None,
                 batch_rows: int = BATCH, progress: Callable = iter) -> None:
    """Write the table file `out` from an export `src` (.npz, .npy, .parquet). The config and
    step come from `src` when it holds them, else from the arguments, else inferred
    (`infer_config`, step 0); given arguments win over the file's."""
    source = {".npz": _npz_source, ".npy": _npy_source, ".parquet": _parquet_source}[format_of(src)](src)
    config = config or source.config or infer_config(source.dim, source.state_floats)
    if config.dim != source.dim or config.state_floats != source.state_floats:
        raise ValueError(f"config: dim {config.dim} with {config.state_floats} state floats per row does not match "
                         f"{src} (dim {source.dim}, {source.state_floats} state floats)")
    # Every value is checked before its cast (see `as_column`): the keys in a first pass, which
    # also counts them and checks their uniqueness, the other columns as they are written.
    try:
        keys = np.concatenate([as_column("keys", b["keys"]) for b in source.batches(batch_rows, ("keys",))]
                              or [np.zeros(0, np.int64)])
    except ValueError as exc:
        raise TableFormatError(f"{src}: {exc}") from None
    if len(keys) != source.n_rows:
        raise TableFormatError(f"{src}: {len(keys)} keys, {source.n_rows} rows announced")
    keys.sort()
    duplicates = int(np.count_nonzero(keys[1:] == keys[:-1]))
    if duplicates:
        raise TableFormatError(f"{src}: keys are not unique ({duplicates} duplicates); a table holds one row per key")
    del keys
    with TableWriter(out, config, source.n_rows, step if step is not None else source.step or 0) as writer:
        for b in progress(source.batches(batch_rows)):
            try:
                writer.write(b["keys"], b["rows"], b.get("optimizer_state"), b.get("counts"), b.get("last_steps"))
            except ValueError as exc:
                raise TableFormatError(f"{src}: {exc}") from None

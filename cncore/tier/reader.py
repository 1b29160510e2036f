"""`TierFile`: a flushed tier directory read as a table file (cn-table, open_table, load_store)."""
from __future__ import annotations

import os
import weakref
from collections.abc import Iterator

import numpy as np
from numpy.typing import ArrayLike

from cncore import _core
from cncore.config import StoreConfig
from cncore.fileio import TableFormatError, config_from_dict
from cncore.tablefile_lookup import file_lookup, file_pooled_lookup
from cncore.tier.directory import _close_fds, _replaced, read_flushed, writer_of
from cncore.tier.records import check_offset, record_error, record_layout, record_offsets, records_end, rows_of

_OPEN_TRIES = 20  # a TierFile's opens that a concurrent flush may restart


class TierFile:
    """A flushed tier directory read as a table file: what `open_table(path)` returns for one,
    with `TableFile`'s reading verbs (`len`, `config`, `step`, `evicted_count`, `nbytes`,
    `keys`, `read`, `take`, `batches`, `lookup`, `pooled_lookup`), so every `cn-table` command
    and `load_store` read it like any table.

    It holds the last flush's index in memory (16 bytes a row: the keys and their slots,
    ordered by slot so that a walk reads rows.dat front to back) and reads records on demand,
    a batch at a time: a tier far larger than memory walks in bounded memory. Rows come as
    float32 whatever the table's dtype. Every record read is checked to hold the key the index
    gives and, from directory version 4, to match its checksum (a mismatch: TableFormatError
    naming the key and slot).

    It takes no lock, so a store may train on the directory meanwhile: what it reads is the
    table as of the flush it opened, consistently. Rows the writer cached and has not flushed
    are not in it; once the writer flushes again (its flushes may reuse the slots this index
    names), every read refuses (TableFormatError naming the writer's pid): open it again. An
    open that races a flush starts over on the new one.

    Args:
        path (str): the tier's directory.
        verify (bool): check the index's keys are distinct and its slots in order.

    >>> import numpy as np, tempfile, os, cncore
    >>> from cncore.tablefile import open_table
    >>> path = os.path.join(tempfile.mkdtemp(), "t.tier")
    >>> store = cncore.make_store(cncore.StoreConfig(dim=2, storage=cncore.Tiered(path, cache_bytes=2000)))
    >>> for start in range(0, 100, 10):                  # most rows go to disk
    ...     _ = store.find_or_insert(np.arange(start, start + 10))
    >>> store.flush(); table = open_table(path)
    >>> len(table), bool((table.lookup([7, 500]) == store.lookup(np.array([7, 500]))).all())
    (100, True)
    """

    delta = None  # never a chain
    fallback = None  # a tiered table keeps no fallback rows (StoreConfig refuses fallback_rows with storage=)

    def __init__(self, path: str, verify: bool = True):
        self.path, error = path, None
        self._fd: int | None = None
        for _ in range(_OPEN_TRIES):
            try:  # held open: while it is, its inode is meta.json's exactly when no flush replaced it
                meta_fd = os.open(os.path.join(path, "meta.json"), os.O_RDONLY)
            except OSError:
                meta_fd = None  # read_flushed says what is wrong (no meta.json: never flushed)
            try:
                self._open(path, verify)
                if meta_fd is not None and not _replaced(path, meta_fd):
                    self._meta_fd = meta_fd
                    weakref.finalize(self, _close_fds, self._fd, meta_fd)
                    return
            except (TableFormatError, OSError) as exc:
                if meta_fd is None or not _replaced(path, meta_fd):
                    _close_fds(self._fd, meta_fd)
                    if isinstance(exc, OSError):
                        raise TableFormatError(f"{path}: cannot be read ({exc.strerror or exc})") from None
                    raise
                error = exc
            _close_fds(self._fd, meta_fd)  # a flush replaced meta.json meanwhile: open the new one
            self._fd = None
        raise TableFormatError(f"{path}: the tier was flushed again during each of {_OPEN_TRIES} tries to open it "
                               f"({writer_of(path)}); open it once its writer is idle ({error})")

    def _check_current(self) -> None:
        """Refuse once the writer has flushed again since the open (its flushes may reuse the
        slots of the index this reads)."""
        if _replaced(self.path, self._meta_fd):
            raise TableFormatError(f"{self.path}: the tier was flushed again since it was opened "
                                   f"({writer_of(self.path)}), and the new flush may reuse the slots of the one "
                                   "opened: open the directory again")

    def _open(self, path: str, verify: bool) -> None:
        meta, keys, slots = read_flushed(path, TableFormatError, "")
        config = meta.get("config")
        if isinstance(config, dict):
            config = {**config, "capacity": StoreConfig.__dataclass_fields__["capacity"].default}
        self.config = config_from_dict(config, f"{path}/meta.json")
        self.path, self.step, self.evicted_count = path, int(meta["step"]), int(meta["evicted"])
        self.version = str(meta["index"])
        self._record, self._per_page = record_layout(self.config, int(meta["version"]))
        if meta.get("record_bytes") != self._record.itemsize or meta.get("rows") != len(keys) \
                or keys.dtype != np.int64 or slots.dtype != np.int64 or keys.shape != slots.shape \
                or keys.ndim != 1:
            raise TableFormatError(f"{path}: meta.json (rows {meta.get('rows')!r}, record_bytes "
                                   f"{meta.get('record_bytes')!r}) does not match its index ({len(keys)} keys) or "
                                   f"its config (records of {self._record.itemsize} bytes); the tier is damaged")
        order = np.argsort(slots, kind="stable")
        self.keys, self._slots = keys[order], slots[order]
        del keys, slots, order
        if verify and len(self.keys):
            ordered = np.sort(self.keys)
            same = np.flatnonzero(ordered[1:] == ordered[:-1])
            if len(same):
                raise TableFormatError(f"{path}: the index holds duplicate keys ({len(same)}, e.g. "
                                       f"{int(ordered[same[0]])}); the tier is damaged")
            del ordered
        if len(self._slots) and (self._slots[0] < 0 or (np.diff(self._slots) == 0).any()):
            raise TableFormatError(f"{path}: the index gives a negative or repeated slot; the tier is damaged")
        try:
            self._fd = fd = os.open(os.path.join(path, "rows.dat"), os.O_RDONLY)
        except FileNotFoundError:
            raise TableFormatError(f"{path}: rows.dat is missing (meta.json names {len(self.keys)} rows in it); "
                                   "the tier is damaged") from None
        end = records_end(self._slots, self._record.itemsize, self._per_page)
        size = os.fstat(fd).st_size
        if size < end:
            raise TableFormatError(f"{path}: rows.dat has {size} bytes, the index needs {end} (truncated)")

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def dim(self) -> int:
        return self.config.dim

    @property
    def record_bytes(self) -> int:
        """Bytes of one record in rows.dat."""
        return self._record.itemsize

    @property
    def nbytes(self) -> int:
        """Bytes of rows.dat and the index on disk."""
        self._check_current()
        try:
            return os.fstat(self._rows_fd).st_size + os.path.getsize(os.path.join(self.path, self.version))
        except FileNotFoundError:  # removed by a flush after the check above
            self._check_current()
            raise

    @property
    def _rows_fd(self) -> int:
        """The open rows.dat (set by a successful open: every other method runs after one)."""
        if self._fd is None:
            raise RuntimeError(f"{self.path}: read before the tier was opened")
        return self._fd

    def _records(self, at: np.ndarray) -> np.ndarray:
        """The records of row numbers `at`, checked against the index's keys."""
        slots = self._slots[at]
        buf = np.zeros(len(slots), self._record)
        if len(slots):
            raw = buf.view(np.uint8).reshape(len(slots), -1)
            try:
                offsets = record_offsets(slots, self._record.itemsize, self._per_page)
                _core.block_io(self._rows_fd, offsets, raw, False, 4)
            except OSError as exc:
                self._check_current()
                raise TableFormatError(f"{self.path}: rows.dat cannot be read ({exc.strerror}): truncated or damaged "
                                       "since the tier was opened") from None
            self._check_current()  # else the records may be the new flush's
            keys = self.keys[at]
            bad = _core.check_records(raw, keys, check_offset(self._record))
            if bad >= 0:
                raise record_error(self.path, raw[bad], int(keys[bad]), int(slots[bad]), "the tier is damaged")
        return buf

    def _fields(self, rec: np.ndarray, names) -> dict:
        out = {}
        for name in names:
            if name == "keys":
                out[name] = rec["key"].copy()
            elif name == "rows":
                out[name] = rows_of(rec, self.config.dtype)
            elif name == "optimizer_state":
                out[name] = (np.ascontiguousarray(rec["state"]) if "state" in (rec.dtype.names or ())
                             else np.empty((len(rec), 0), np.float32))
            elif name == "counts":
                out[name] = rec["count"].copy()
            elif name == "last_steps":
                out[name] = rec["last_step"].copy()
            else:
                raise ValueError(f"name: expected one of keys, rows, optimizer_state, counts, last_steps, got {name!r}")
        return out

    def read(self, name: str, start: int, stop: int) -> np.ndarray:
        """As `cncore.tablefile.TableFile.read` (row numbers in the tier's slot order)."""
        if name == "keys":
            return self.keys[start:stop].copy()
        return self._fields(self._records(np.arange(start, min(stop, len(self)))), (name,))[name]

    def take(self, name: str, rows: np.ndarray, chunk: int = 1 << 14) -> np.ndarray:
        """As `cncore.tablefile.TableFile.take` (row numbers in the tier's slot order)."""
        rows = np.asarray(rows, dtype=np.int64)
        if len(rows) and (rows.min() < 0 or rows.max() >= len(self)):
            raise IndexError(f"rows: row numbers must be in [0, {len(self)})")
        if name == "keys":
            return self.keys[rows]
        parts = [self._fields(self._records(rows[a:a + chunk]), (name,))[name] for a in range(0, len(rows), chunk)]
        if parts:
            return np.concatenate(parts)
        return self._fields(np.zeros(0, self._record), (name,))[name]

    def batches(self, batch_rows: int = 1 << 18,
                names: tuple[str, ...] = ("keys", "rows", "optimizer_state", "counts", "last_steps")
                ) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
        """As `cncore.tablefile.TableFile.batches`, in slot order; each batch one batched read
        of rows.dat (none for keys alone)."""
        for start in range(0, len(self), batch_rows):
            stop = min(start + batch_rows, len(self))
            if all(n == "keys" for n in names):
                yield start, {n: self.keys[start:stop].copy() for n in names}
            else:
                yield start, self._fields(self._records(np.arange(start, stop)), names)

    def lookup(self, keys: ArrayLike) -> np.ndarray:
        """As `cncore.tablefile.TableFile.lookup`."""
        return file_lookup(self, keys)

    def pooled_lookup(self, keys: ArrayLike, offsets: ArrayLike | None = None, *, lengths: ArrayLike | None = None,
                      mode: str = "sum", per_sample_weights: ArrayLike | None = None) -> np.ndarray:
        """As `cncore.tablefile.TableFile.pooled_lookup`."""
        return file_pooled_lookup(self, keys, offsets, lengths, mode, per_sample_weights)


def open_tier(path: str, verify: bool = True) -> TierFile:
    """A flushed tier directory as a read-only table; open_table(path) calls this for one.

    Args:
        path (str): the tier's directory.
        verify (bool): check the index's keys are distinct and its slots in order.

    Returns:
        TierFile: the table as of the last flush.
    """
    return TierFile(path, verify)

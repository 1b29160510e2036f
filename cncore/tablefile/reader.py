"""Reading table files: `TableFile`, chains of versions, `open_table` and `load_store`."""
from __future__ import annotations

import hashlib
import io
import json
import os
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal, overload

import numpy as np
from numpy.typing import ArrayLike

import cncore
from cncore.fileio import TableFormatError
from cncore.row_codec import decode_rows
from cncore.tablefile.format import _VERSION, ARRAYS, MAX_CHAIN, _check_manifest, _sha256_fd
from cncore.tablefile_lookup import file_lookup, file_pooled_lookup
from cncore.tier import TierFile, is_tier_directory, open_tier


def open_table_rows(path: str, version: str) -> int:
    """Rows held by one version's own arrays (a delta's: the rows it writes).

    Args:
        path (str): the table directory.
        version (str): one of its versions (a directory name under `path`).

    Returns:
        int: the rows its manifest names.
    """
    with open(os.path.join(path, version, "manifest.json"), "rb") as fh:
        return json.loads(fh.read())["rows"]


def load_store(path: str, verify: bool = True, batch_rows: int = 1 << 18, kind: type | None = None,
               version: str | None = None) -> cncore.EmbeddingStore:
    """A store (of class `kind`, an EmbeddingStore subclass; EmbeddingStore by default) holding
    everything in the table directory, read in batches: keys, rows, optimizer state, counts,
    last steps and the step, exactly. A chain (base + deltas) is read as one table; with
    `version`, the chain ending at that version (one the last save kept) instead of the live one.

    Args:
        path (str): the table directory (or a flushed tier's directory).
        verify (bool): check every array's SHA-256 and the keys' uniqueness.
        batch_rows (int): rows read at a time.
        kind (type | None): the store class to build (an EmbeddingStore subclass).
        version (str | None): the version the chain read ends at (None: the live one).

    Returns:
        EmbeddingStore: a new store holding the table.

    >>> import numpy as np, tempfile, os
    >>> s = cncore.EmbeddingStore(dim=3, optimizer=cncore.Adam()); _ = s.find_or_insert(np.array([-2**63, 7]))
    >>> from cncore.tablefile import TableWriter, save_table
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
    if head.fallback is not None:
        store.load_fallback(*head.fallback)
    return store


def chain_length(path: str, verify: bool = False) -> int:
    """How many deltas (incremental saves) the table at `path` holds over its base: 0 for a
    table saved in full. Without `verify`, the chain's manifests and sizes are checked, not the
    arrays' checksums.

    Args:
        path (str): the table directory.
        verify (bool): check every array's SHA-256 too.

    Returns:
        int: the deltas over the base.

    >>> import numpy as np, tempfile, os
    >>> s = cncore.EmbeddingStore(dim=2); _ = s.find_or_insert(np.arange(3))
    >>> from cncore.tablefile import TableWriter, save_table
    >>> path = os.path.join(tempfile.mkdtemp(), "t.cnt"); base = save_table(s, path)
    >>> _ = s.find_or_insert(np.arange(5)); _ = save_table(s, path, since=base)
    >>> chain_length(path)
    1
    """
    return len(_open_chain(path, verify)) - 1


@overload
def _read_current(path: str, missing_ok: Literal[False] = ..., must_parse: Literal[True] = ...) -> str: ...
@overload
def _read_current(path: str, missing_ok: bool = ..., must_parse: bool = ...) -> str | None: ...
def _read_current(path: str, missing_ok: bool = False, must_parse: bool = True) -> str | None:
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
    this table readable to the end. Made by `open_table`, not by hand.

    Args:
        path (str): the table directory.
        config (StoreConfig): the table's config.
        step (int): the step it was saved at.
        keys, rows, optimizer_state, counts, last_steps (np.memmap): its arrays, row by row.
    """
    path: str
    config: cncore.StoreConfig
    step: int
    keys: np.ndarray
    rows: np.ndarray
    optimizer_state: np.ndarray
    counts: np.ndarray
    last_steps: np.ndarray
    _files: dict[str, io.FileIO] = field(default_factory=dict, repr=False, compare=False)
    version: str = field(default="", repr=False, compare=False)
    # a delta version: {"parent": version, "removed": keys it removes (memmap)}; None for a base
    delta: dict | None = field(default=None, repr=False, compare=False)
    evicted_count: int = 0  # rows the table had evicted when saved (0 in files before version 3)
    manifest_sha256: str = field(default="", repr=False, compare=False)  # of its manifest.json as read
    # a shard table's {"rank", "world_size", "save"} as saved; None for other tables and older files
    shard: dict | None = field(default=None, repr=False, compare=False)
    # the fallback rows and their optimizer state (StoreConfig.fallback_rows), in memory; None without them
    fallback: tuple[np.ndarray, np.ndarray] | None = field(default=None, repr=False, compare=False)

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
        """Rows [start, stop) of one array, read into a new array (not a view of the map).

        Args:
            name (str): "keys", "rows", "optimizer_state", "counts" or "last_steps".
            start (int): first row number.
            stop (int): row number after the last (clipped to the table's length).

        Returns:
            np.ndarray: the entries; rows as float32 whatever the file stores (`cncore.row_codec`).
        """
        out = self._read_stored(name, start, stop)
        return decode_rows(out, self.config.dtype) if name == "rows" and out.dtype != np.float32 else out

    def _read_stored(self, name: str, start: int, stop: int) -> np.ndarray:
        mapped = getattr(self, name)
        stop = min(stop, len(mapped))
        out = np.empty((max(stop - start, 0),) + mapped.shape[1:], dtype=mapped.dtype)
        if out.nbytes:
            row_bytes = out.nbytes // len(out)
            view, offset = out.reshape(-1).data.cast("B"), mapped.offset + start * row_bytes
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
        leave the resident set when the chunk is done.

        Args:
            name (str): "keys", "rows", "optimizer_state", "counts" or "last_steps".
            rows (np.ndarray): (N,) row numbers in [0, len(table)).
            chunk (int): rows a short-lived map covers.

        Returns:
            np.ndarray: the entries in the order of `rows`; rows as float32.
        """
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

    def batches(self, batch_rows: int = 1 << 18, names: tuple[str, ...] = tuple(ARRAYS)
                ) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
        """The whole table in file order, a batch at a time (plain reads into fresh buffers).

        Args:
            batch_rows (int): rows a batch.
            names (tuple[str, ...]): the arrays to read.

        Yields:
            tuple[int, dict[str, np.ndarray]]: the batch's first row number, and each array's
            entries [start, start + batch_rows).
        """
        for start in range(0, len(self), batch_rows):
            yield start, {name: self.read(name, start, start + batch_rows) for name in names}

    def lookup(self, keys: ArrayLike) -> np.ndarray:
        """Rows of keys, zeros where a key is not in the table. No compiled core is involved:
        the keys are sorted once (16 bytes per row in memory), the rows are read from the map.

        Args:
            keys (ArrayLike): (N,) int64 keys.

        Returns:
            np.ndarray: (N, dim) float32 rows.

        >>> import numpy as np, tempfile, os, cncore
        >>> path = os.path.join(tempfile.mkdtemp(), "t.cnt")
        >>> from cncore.tablefile import TableWriter, save_table
        >>> with TableWriter(path, cncore.StoreConfig(dim=2), n_rows=2) as w:
        ...     w.write(np.array([10, -3]), np.array([[1, 2], [3, 4]], np.float32))
        >>> open_table(path).lookup([-3, 7]).tolist()
        [[3.0, 4.0], [0.0, 0.0]]
        """
        return file_lookup(self, keys)

    def pooled_lookup(self, keys: ArrayLike, offsets: ArrayLike | None = None, *, lengths: ArrayLike | None = None,
                      mode: str = "sum", per_sample_weights: ArrayLike | None = None) -> np.ndarray:
        """Offline scoring: the pooled rows of bags of keys, as
        `EmbeddingStore.pooled_lookup(..., insert_missing=False)` computes them (unknown keys
        are zero rows), straight from the file.

        Args:
            keys (ArrayLike): (N,) int64 keys, bag after bag.
            offsets (ArrayLike | None): (B + 1,) bag starts, the last one N; or `lengths`.
            lengths (ArrayLike | None): (B,) keys per bag.
            mode (str): "sum", "mean" or "max".
            per_sample_weights (ArrayLike | None): (N,) float32 weights (sum and mean).

        Returns:
            np.ndarray: (B, dim) float32.

        >>> import numpy as np, tempfile, os, cncore
        >>> path = os.path.join(tempfile.mkdtemp(), "t.cnt")
        >>> from cncore.tablefile import TableWriter, save_table
        >>> with TableWriter(path, cncore.StoreConfig(dim=1), n_rows=2) as w:
        ...     w.write(np.array([1, 2]), np.array([[1], [10]], np.float32))
        >>> open_table(path).pooled_lookup([1, 2, 2, 5], lengths=[2, 0, 2], mode="mean").ravel().tolist()
        [5.5, 0.0, 5.0]
        """
        return file_pooled_lookup(self, keys, offsets, lengths, mode, per_sample_weights)


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
    files: dict[str, io.FileIO] = {}
    arrays: dict[str, np.ndarray] = {}
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
        fallback = None
        if "fallback" in manifest:
            parts = []
            for part in ("rows", "optimizer_state"):
                fh, arr = _open_array(os.path.join(directory, f"fallback_{part}.npy"), manifest["fallback"][part],
                                      f"{path}: {version}/fallback_{part}.npy", verify)
                with fh:
                    parts.append(np.array(arr))
            fallback = (parts[0], parts[1])
        table = TableFile(path, config, step, **arrays, _files=files, version=version, delta=delta,
                          evicted_count=evicted, manifest_sha256=hashlib.sha256(text).hexdigest(),
                          shard=manifest.get("shard"), fallback=fallback)
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
    delta = child.delta or {}
    name, digest = delta.get("name"), delta.get("parent_sha256")
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


def _open_chain(path: str, verify: bool = True, head: str | None = None) -> list:
    """The versions of the live chain (or of the chain ending at version `head`), base first
    (one version for a table saved in full), each link checked against its parent. A save
    may replace the table while it is being opened: the open then starts over. A tier's
    directory (cncore/tier/) is one version, as of its last flush."""
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
    the table's step, eviction count and shard record are read from.

    Args:
        path (str): the table directory.
        verify (bool): check every array's SHA-256 too.

    Returns:
        TableFile: the last version of the live chain.
    """
    return _open_chain(path, verify)[-1]


def chain_versions(path: str, head: str | None = None) -> tuple[str, ...]:
    """The version names of the live chain (or of the chain ending at `head`), base first,
    its manifests and links checked (not the arrays' checksums).

    Args:
        path (str): the table directory.
        head (str | None): the version the chain ends at (None: the live one).

    Returns:
        tuple[str, ...]: the versions, base first.
    """
    return tuple(link.version for link in _open_chain(path, verify=False, head=head))


def open_table(path: str, verify: bool = True) -> TableFile | TierFile:
    """Open a table directory read-only, every field checked (see the module docstring);
    with `verify`, every array's SHA-256 and the keys' uniqueness too.

    A save may replace the table while it is being opened: the open then starts over on the
    new version, so it sees one complete version, never a mix. A chain (base + deltas) has no
    single version to map: it is refused; `load_store` reads it, `compact_table` merges it.

    A tier's directory (`StoreConfig(storage=cncore.Tiered(path, ...))`, flushed) opens as a
    `cncore.tier.TierFile`: the same reading verbs, as of the tier's last flush.

    Args:
        path (str): the table (or flushed tier) directory.
        verify (bool): check every array's SHA-256 and the keys' uniqueness.

    Returns:
        TableFile | TierFile: the table, read-only.
    """
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

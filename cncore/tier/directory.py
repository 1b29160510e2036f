"""A tier's directory: its files and format, meta.json with its checksums, the last flush read
back, and the one-writer lock."""
from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import zipfile

import numpy as np

from cncore.config import StoreConfig
from cncore.fileio import config_to_dict

_CHUNK = 1 << 13  # rows a flush or compaction moves at a time (its scratch: one chunk of records, 2.5 MiB at dim 64)
_FORMAT = "cn-tier"
_READS = (2, 3, 4)  # versions this code opens (an older directory keeps its layout: no checksums, and
#                     in version 2 float32 rows)
_WRITER_PID = "lock"  # the writing process's pid, in the directory while a store holds it
_META_FIELDS = ("config", "flush", "commit", "index", "rows", "step", "evicted", "high_water", "record_bytes",
                "index_sha256")



def writer_of(directory: str) -> str:
    """Who holds a tier directory's writer lock, in words, from its pid file, for messages; the
    lock itself (flock on the directory) is what TieredStore checks.

    Args:
        directory (str): the tier's directory.

    Returns:
        str: e.g. "held by process 1234".
    """
    try:
        with open(os.path.join(directory, _WRITER_PID)) as fh:
            pid = int(fh.read().strip())
    except (OSError, ValueError):
        return "held by another process"
    if pid == os.getpid():
        return f"held by this process, {pid}"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return f"last held by process {pid}, which has ended"
    except PermissionError:  # alive, another user's
        pass
    return f"held by process {pid}"


def _open_rows(path: str) -> int:
    """The tier's record file, read and written: with O_NOATIME where the kernel allows it (the
    file's owner), because every read of a page-cache file otherwise checks, and may update, its
    access time: `perf` put touch_atime, atime_needs_update and current_time at 1.7% of a 3x Zipf
    1.05 run's samples, ~7% of the background thread's read path. Without it (another owner's
    file: EPERM) the file opens as before."""
    flags = os.O_RDWR | os.O_CREAT
    try:
        return os.open(path, flags | getattr(os, "O_NOATIME", 0), 0o644)
    except PermissionError:
        return os.open(path, flags, 0o644)


def _config_record(config: StoreConfig) -> dict:
    """What must match for a directory to reopen as this table (its storage aside)."""
    d = config_to_dict(dataclasses.replace(config, storage=None))
    d.pop("capacity", None)  # a hint, not part of the table
    return json.loads(json.dumps(d))  # as meta.json holds it (tuples as lists)


def _replaced(directory: str, meta_fd: int) -> bool:
    """Whether the directory's meta.json is no longer the file open at meta_fd: a flush replaced
    it (by a rename; the open descriptor keeps the old inode's number from being reused)."""
    try:
        now = os.stat(os.path.join(directory, "meta.json"))
    except FileNotFoundError:
        return True
    was = os.fstat(meta_fd)
    return (now.st_ino, now.st_dev) != (was.st_ino, was.st_dev)


def _close_fds(*fds) -> None:
    for fd in fds:
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

def _meta_digest(meta: dict) -> str:
    """The checksum meta.json carries of its other fields (from version 4): SHA-256 of them as
    canonical JSON (sorted keys), so that a changed count or step is refused, not taken."""
    fields = {k: v for k, v in meta.items() if k != "meta_sha256"}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def _sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def read_flushed(directory: str, error: type[Exception] = ValueError, prefix: str = ""
                 ) -> tuple[dict, np.ndarray, np.ndarray]:
    """The last flush of a tier directory: meta.json parsed and checked, the index checksummed.

    Args:
        directory (str): the tier's directory.
        error (type[Exception]): what to raise, saying what is wrong: no meta.json (never
            flushed), damage, another format or version.
        prefix (str): the start of the error's message.

    Returns:
        tuple[dict, np.ndarray, np.ndarray]: meta.json's fields, the keys and their slots.
    """
    meta_path = os.path.join(directory, "meta.json")
    try:
        with open(meta_path) as fh:
            meta = json.load(fh)
    except FileNotFoundError:
        raise error(f"{prefix}{directory} holds no flushed table (no meta.json: the tier was never flushed, or its "
                    "first flush did not finish); TieredStore.flush() makes the directory a table") from None
    except (ValueError, UnicodeDecodeError) as exc:  # written whole by one rename: damage, not a crash
        raise error(f"{prefix}{meta_path} is not valid JSON ({exc}); the tier is damaged") from None
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT or meta.get("version") not in _READS:
        version = meta.get("version") if isinstance(meta, dict) else None
        raise error(f"{prefix}{meta_path} is not a {_FORMAT} directory of version {' or '.join(map(str, _READS))} "
                    f"(version {version!r}: export it with the version of cncore that wrote it)")
    missing = [k for k in _META_FIELDS + (("meta_sha256",) if meta["version"] >= 4 else ()) if k not in meta]
    if not missing and meta["version"] >= 4 and meta["meta_sha256"] != _meta_digest(meta):
        raise error(f"{prefix}{meta_path} fails its checksum (damaged)")
    if missing or not isinstance(meta["index"], str) or not isinstance(meta["config"], dict) \
            or not all(isinstance(meta[k], int) for k in _META_FIELDS if k not in ("config", "index", "index_sha256")):
        raise error(f"{prefix}{meta_path} lacks or mistypes fields ({missing or 'index, config or a count'}); "
                    "the tier is damaged")
    index_path = os.path.join(directory, meta["index"])
    try:
        with open(index_path, "rb") as fh:  # one descriptor: the bytes checked are the bytes loaded
            digest = hashlib.sha256()
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
            if digest.hexdigest() != meta.get("index_sha256"):
                raise error(f"{prefix}{index_path} fails its checksum (damaged)")
            fh.seek(0)
            with np.load(fh) as index:
                keys, slots = index["keys"], index["slots"]
    except FileNotFoundError:
        raise error(f"{prefix}{index_path} is missing (meta.json names it; the tier is damaged)") from None
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as exc:
        if isinstance(exc, error):
            raise
        raise error(f"{prefix}{index_path} cannot be read ({exc}); the tier is damaged") from None
    return meta, keys, slots


def is_tier_directory(path: str) -> bool:
    """Whether `path` is a tier's directory (meta.json or rows.dat, and no table file's CURRENT).

    Args:
        path (str): a directory.

    Returns:
        bool: True for a tier's directory.
    """
    return os.path.isdir(path) and not os.path.exists(os.path.join(path, "CURRENT")) and (
        os.path.exists(os.path.join(path, "meta.json")) or os.path.exists(os.path.join(path, "rows.dat")))


def check_directory(path: str) -> None:
    """A tier's path must be new, empty, or a tier of this same table; anything else is refused
    (ValueError naming it) before anything is made."""
    if os.path.islink(path) and not os.path.exists(path):
        raise ValueError(f"Tiered.path: {path} is a symbolic link to {os.readlink(path)}, which does "
                         "not exist; create the directory it points to, or give another path")
    if not os.path.exists(path):
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):  # a typo in the path would otherwise start an empty table
            raise ValueError(f"Tiered.path: the directory {parent} that should hold {path} does not "
                             "exist; create it first (the tier creates only its own directory)")
        return
    if not os.path.isdir(path):
        raise ValueError(f"Tiered.path: {path} exists and is not a directory")
    entries = set(os.listdir(path)) - {"rows.dat", "meta.json", _WRITER_PID}
    if any(not (e.startswith(".tmp-") or (e.startswith("index-") and e.endswith(".npz"))) for e in entries):
        raise ValueError(f"Tiered.path: {path} holds other files ({sorted(entries)[:3]}); give a new or "
                         "empty directory, or one a tiered table of this config flushed")


class WriterLock:
    """A tier directory's one-writer lock: an exclusive flock(2) on the directory, held by one
    store from its open to close().

    A second store on the same directory (in this process or another) is refused at once and
    touches nothing. The lock is the kernel's, so a writer killed by SIGKILL leaves none behind;
    the pid in the directory's `lock` file (written once the open has succeeded, removed at
    release) only names the holder in the refusal. Readers (TierFile) take no lock: they read
    the last flush and refuse once the writer flushes again (TierFile._check_current). A forked
    child inherits the descriptor, and with it the lock: it closes its copy (`disown`), never
    unlocking, which would release the parent's lock too.

    Attributes:
        directory: the tier's directory.
        fd: the directory's descriptor that holds the lock (None once released or disowned).
        owner: the pid of the process that took it.
    """

    def __init__(self, directory: str):
        """Take the directory's writer lock, or refuse (BlockingIOError) naming its holder."""
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise BlockingIOError(f"Tiered.path: {directory} is open in another TieredStore ({writer_of(directory)}); "
                                  "a tier directory has one writer at a time: close that store first, or read its "
                                  "last flush with cncore.tablefile.open_table") from None
        except OSError as exc:
            os.close(fd)
            raise OSError(exc.errno, f"Tiered.path: {directory} cannot be locked for one writer "
                                     f"({exc.strerror}); give a directory on a local file system") from None
        self.directory, self.owner, self._pid_written = directory, os.getpid(), False
        self.fd: int | None = fd

    @property
    def held(self) -> bool:
        return self.fd is not None

    def write_pid(self) -> None:
        """Name this process in the directory's pid file (once the open has succeeded: a refused
        open leaves the directory as it was, a stale pid file of a killed writer included)."""
        with open(os.path.join(self.directory, _WRITER_PID), "w") as fh:
            fh.write(f"{os.getpid()}\n")
        self._pid_written = True

    def release(self) -> None:
        """Remove the pid file and give the lock back (a second release does nothing)."""
        fd, self.fd = self.fd, None
        if fd is None:
            return
        try:
            if self._pid_written:
                os.remove(os.path.join(self.directory, _WRITER_PID))
        except OSError:  # removed by hand meanwhile: the lock is what counts
            pass
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def disown(self) -> None:
        """In a forked child: close this copy of the descriptor without unlocking (the lock is
        the parent's)."""
        fd, self.fd = self.fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

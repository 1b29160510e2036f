"""What both file formats (table files, `cncore.tablefile`, and tier directories, `cncore.tier`)
share: their error type, the config as a file holds it, and durable-write helpers.

>>> import cncore
>>> config_from_dict(config_to_dict(cncore.StoreConfig(dim=3, optimizer=cncore.Adam()))).optimizer
Adam(lr=0.001, betas=(0.9, 0.999), eps=1e-08)
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

from cncore.config import (
    LFU,
    LRU,
    SGD,
    TTL,
    Adagrad,
    Adam,
    Constant,
    MinCount,
    Normal,
    Probability,
    RowWiseAdagrad,
    StoreConfig,
    TruncatedNormal,
    Uniform,
)

__all__ = ["TableFormatError", "config_to_dict", "config_from_dict", "fsync_dir"]

_INITIALIZERS = {c.__name__: c for c in (Uniform, Normal, TruncatedNormal, Constant)}
_OPTIMIZERS = {c.__name__: c for c in (SGD, Adagrad, RowWiseAdagrad, Adam)}
_EVICTIONS = {c.__name__: c for c in (LRU, LFU, TTL)}
# Config fields a file holds only when they are set (bounded tables): files of unbounded tables
# stay what they were, and files written before these fields existed read as unbounded.
_OPTIONAL_FIELDS = ("max_rows", "eviction", "headroom", "admission")
_ADMISSIONS = {"MinCount": MinCount, "Probability": Probability}
# Policy fields a file holds only when set (added later): a file of a policy without them reads
# and writes as before, also by older versions of this package, which refuse unknown fields.
_POLICY_OPTIONAL_FIELDS = {"LFU": ("halve_every",)}
# Config fields a file holds only when the table has fallback rows, with the values a file
# without them reads as.
_FALLBACK_FIELDS = {"fallback_rows": 0, "fallback_copy": True, "fallback_mode": "miss"}


class TableFormatError(ValueError):
    """A table directory that cannot be read: missing, damaged, truncated or of another format."""


def _show(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _error(where: str, message: str) -> TableFormatError:
    return TableFormatError(f"{where}: {message}" if where else message)


def _is_int(value, lo: int = 0, hi: int = 2**63) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and lo <= value < hi


def config_to_dict(config: StoreConfig) -> dict:
    """A config as the JSON-able dict a table file's manifest holds (where the rows live left out).

    Args:
        config (StoreConfig): the config.

    Returns:
        dict: its fields; initializer, optimizer and policies as {"type": name, **fields}.

    >>> config_to_dict(StoreConfig(dim=2))["initializer"]
    {'type': 'Uniform', 'low': -0.05, 'high': 0.05}
    """
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
    if not config.fallback_rows:
        for name in _FALLBACK_FIELDS:
            del d[name]
    return d


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
    _fields_exactly(dict.fromkeys(optional) | d if isinstance(d, dict) else d,
                    ("type",) + tuple(f.name for f in dataclasses.fields(cls)), where, what)
    values = {k: v for k, v in d.items() if k != "type"}
    for k, v in values.items():  # numbers (betas: a list of them); the constructor checks ranges
        if k == "unadmitted" and isinstance(v, str):  # MinCount's one word; its constructor checks it
            continue
        if k == "halve_every" and v == "auto":  # LFU's aging in the table's own time
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


def config_from_dict(d: Any, where: str = "") -> StoreConfig:
    """The StoreConfig a file describes (see `config_to_dict`); anything else, an unknown
    initializer or optimizer type included, is a `TableFormatError` naming the field.

    Args:
        d (Any): the dict read from the file (anything: it is checked).
        where (str): the file, for the errors.

    Returns:
        StoreConfig: the config.

    >>> config_from_dict(config_to_dict(StoreConfig(dim=3, optimizer=Adam()))).optimizer
    Adam(lr=0.001, betas=(0.9, 0.999), eps=1e-08)
    >>> try:
    ...     config_from_dict({**config_to_dict(StoreConfig(dim=3)), "initializer": {"type": "set_num_threads"}})
    ... except TableFormatError as exc:
    ...     print(exc)
    config.initializer.type must be one of ['Constant', 'Normal', 'TruncatedNormal', 'Uniform'], got 'set_num_threads'
    >>> config_from_dict(config_to_dict(StoreConfig(dim=3, max_rows=100, eviction=TTL(5)))).eviction
    TTL(steps=5)
    """
    if isinstance(d, dict):
        if "storage" in d:  # never written: a table file holds rows, not where a store keeps them
            raise _error(where, "config has an unknown field 'storage'")
        d = {**_FALLBACK_FIELDS, **dict.fromkeys(_OPTIONAL_FIELDS), **d, "storage": None}
    _fields_exactly(d, tuple(f.name for f in dataclasses.fields(StoreConfig)), where, "config")
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
        return StoreConfig(**d)
    except (TypeError, ValueError) as exc:
        raise _error(where, f"config: {exc}") from None


def fsync_dir(path: str) -> None:
    """fsync a directory: what makes a rename or a new entry in it durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

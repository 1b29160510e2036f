"""The per-table options of the torch front end that go straight into a table's
`cncore.StoreConfig`: the row budget and its policies (`max_rows`, `eviction`, `admission`,
`headroom`; README "Bounded tables"), the shared rows for keys without a row of their own
(`fallback_rows`, `fallback_copy`, `fallback_mode`; docs/bounded-tables.md), the row dtype, and
the storage (`cncore.Tiered`: the SSD tier, README "Tables larger than memory").

A module takes each option as one value; a collection takes each either as one value for every
table or as {table name: value}, and `max_rows="num_embeddings"` gives every table the budget its
TorchRec config names (the table size a TorchRec user already chose). A `storage=cncore.Tiered(path,
cache_bytes)` given once puts each table in its own directory `path/<table name>`, with a share of
cache_bytes proportional to its num_embeddings. The values themselves are checked by StoreConfig,
whose messages name the option and the table.

>>> import cncore
>>> from torchrec import EmbeddingBagConfig
>>> tables = [EmbeddingBagConfig(name="t_user", embedding_dim=4, num_embeddings=1000, feature_names=["user"]),
...           EmbeddingBagConfig(name="t_item", embedding_dim=4, num_embeddings=50, feature_names=["item"])]
>>> opts = per_table_options(tables, max_rows="num_embeddings", eviction=cncore.LRU(),
...                          admission={"t_user": cncore.MinCount(2)})
>>> opts["t_user"]["max_rows"], opts["t_item"]["max_rows"], opts["t_item"]["admission"]
(1000, 50, None)
"""
from __future__ import annotations

import torch

__all__ = ["OPTION_NAMES", "row_dtype_name", "module_options", "per_table_options"]

# StoreConfig's field for each option (the row dtype is StoreConfig.dtype).
OPTION_NAMES = ("max_rows", "eviction", "admission", "headroom", "row_dtype", "storage", "fallback_rows",
                "fallback_copy", "fallback_mode")
_TORCH_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def row_dtype_name(value, context: str = "") -> str:
    """'float32' / 'float16' / 'bfloat16' from that string or the torch dtype."""
    if isinstance(value, torch.dtype):
        if value not in _TORCH_DTYPES:
            raise ValueError(f"{context}row_dtype must be torch.float32, torch.float16 or torch.bfloat16, got {value}")
        return _TORCH_DTYPES[value]
    if not isinstance(value, str):
        raise TypeError(f"{context}row_dtype must be a string or a torch dtype, got {type(value).__name__}")
    return value  # StoreConfig names the strings it accepts


def module_options(max_rows=None, eviction=None, admission=None, headroom=None, row_dtype="float32",
                   storage=None, fallback_rows=None, fallback_copy=True, fallback_mode="miss") -> dict:
    """StoreConfig fields of one table."""
    return {"max_rows": max_rows, "eviction": eviction, "admission": admission, "headroom": headroom,
            "dtype": row_dtype_name(row_dtype if row_dtype is not None else "float32"), "storage": storage,
            "fallback_rows": fallback_rows, "fallback_copy": fallback_copy, "fallback_mode": fallback_mode}


def per_table_options(tables, **options) -> dict[str, dict]:
    """{table name: StoreConfig fields} from options given once or per table (see above).
    Unknown option or table names are refused, naming them."""
    unknown = sorted(set(options) - set(OPTION_NAMES))
    if unknown:
        raise TypeError(f"unknown table options {unknown}; expected some of {list(OPTION_NAMES)}")
    names: list[str] = [c.name for c in tables]
    resolved: dict[str, dict] = {name: {} for name in names}
    for option in OPTION_NAMES:
        value = options.get(option)
        if isinstance(value, dict):
            strays = sorted(set(value) - set(names))
            if strays:
                raise ValueError(f"{option}: no table named {strays} (tables: {names})")
            values = {name: value.get(name) for name in names}
        elif option == "max_rows" and value == "num_embeddings":
            values = {c.name: c.num_embeddings for c in tables}
        elif isinstance(value, str) and option == "max_rows":
            raise ValueError(f"max_rows must be an int, a {{table name: int}} dict or 'num_embeddings', got {value!r}")
        elif option == "storage" and value is not None:
            values = _split_storage(value, tables)
        else:
            values = dict.fromkeys(names, value)
        for name in names:
            resolved[name][option] = values[name]
    return {name: _fields(name, fields) for name, fields in resolved.items()}


def _split_storage(storage, tables) -> dict[str, object]:
    """One Tiered for every table: a directory and a share of the cache each. The collection's
    directory is made here (its parent must exist, as for one table's Tiered.path)."""
    import dataclasses
    import os

    import cncore
    if not isinstance(storage, cncore.Tiered):
        raise TypeError(f"storage must be a cncore.Tiered or a {{table name: Tiered}} dict, got "
                        f"{type(storage).__name__}")
    from cncore.tablefile import check_path_name
    for c in tables:  # each table's directory is path/<its name>: a name must not leave path
        check_path_name(c.name, "table name")
    parent = os.path.dirname(os.path.abspath(storage.path))
    if not os.path.isdir(parent):
        raise ValueError(f"storage: the directory {parent} that should hold {storage.path} does not exist; create "
                         "it first")
    os.makedirs(storage.path, exist_ok=True)
    total = sum(max(1, c.num_embeddings) for c in tables)
    return {c.name: dataclasses.replace(
                storage, path=os.path.join(storage.path, c.name),
                cache_bytes=max(1 << 16, storage.cache_bytes * max(1, c.num_embeddings) // total))
            for c in tables}


def _fields(table: str, options: dict) -> dict:
    fields = dict(options)
    dtype: object | None = fields.pop("row_dtype")
    fields["dtype"] = row_dtype_name(dtype if dtype is not None else "float32", f"table {table!r}: ")
    if fields.get("fallback_copy") is None:
        fields["fallback_copy"] = True
    if fields.get("fallback_mode") is None:
        fields["fallback_mode"] = "miss"
    return fields

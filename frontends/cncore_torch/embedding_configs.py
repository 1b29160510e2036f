"""TorchRec's table configs (`EmbeddingBagConfig`, `EmbeddingConfig`) as cncore store configs.

What the collections (and their sharded forms, through the collections) build their tables
from: `store_configs` checks the configs (type, unique names, pooling, known per-table
overrides) and gives each table a `cncore.StoreConfig` (initializer from the config's
`init_fn`, a seed per table name, a capacity from `num_embeddings`); `collection_placement`
says where the tables live; `feature_names_of` names features and embeddings as TorchRec's
collections do.
"""
from __future__ import annotations

import functools
import zlib

import torch
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import get_embedding_names_by_table

import cncore
from cncore.tier import TieredStore
from cncore_torch.base import store_config
from cncore_torch.devices import Placement, resolve_device
from cncore_torch.table_options import per_table_options, row_dtype_name

__all__ = ["initializer_from_config", "store_configs", "make_stores", "collection_placement", "feature_names_of",
           "row_dtype_of", "POOLING", "ROW_DTYPES"]

_MAX_INITIAL_ROWS = 1 << 20
POOLING = {PoolingType.SUM: "sum", PoolingType.MEAN: "mean"}
# A config's data_type as the row dtype (docs/row-dtypes.md); the integer types have no rows here.
ROW_DTYPES = {DataType.FP32: "float32", DataType.FP16: "float16", DataType.BF16: "bfloat16"}


def row_dtype_of(config, row_dtype) -> str:
    """The row dtype of a table: its config's `data_type` (FP32, FP16 or BF16), or `row_dtype`
    where that is given and the config says FP32 (TorchRec's default). Other data types, and a
    row_dtype that disagrees with FP16 / BF16, are refused, naming both.

    Args:
        config: the table's EmbeddingBagConfig / EmbeddingConfig.
        row_dtype: the collection's `row_dtype` for this table (a string, torch dtype or None).

    Returns:
        'float32', 'float16' or 'bfloat16'.

    >>> from torchrec import EmbeddingBagConfig
    >>> from torchrec.types import DataType
    >>> row_dtype_of(EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=9, data_type=DataType.BF16), None)
    'bfloat16'
    >>> row_dtype_of(EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=9, data_type=DataType.INT8), None)
    Traceback (most recent call last):
    ...
    ValueError: table 't': data_type DataType.INT8 is not supported: rows are stored as FP32, FP16 or BF16 (pass one of those; for 8-bit serving, quantize the trained model)
    """  # noqa: E501 (a doctest's expected error message is one line)
    data_type = getattr(config, "data_type", DataType.FP32)
    if data_type not in ROW_DTYPES:
        raise ValueError(f"table {config.name!r}: data_type DataType.{data_type.name} is not supported: rows are "
                         "stored as FP32, FP16 or BF16 (pass one of those; for 8-bit serving, quantize the trained "
                         "model)")
    wanted = ROW_DTYPES[data_type]
    if row_dtype is None:
        return wanted
    given = row_dtype_name(row_dtype, f"table {config.name!r}: ")
    if data_type != DataType.FP32 and given != wanted:
        raise ValueError(f"table {config.name!r}: row_dtype={given!r} disagrees with the config's data_type "
                         f"DataType.{data_type.name} ({wanted!r}); give one of them")
    return given


def initializer_from_config(config: EmbeddingBagConfig):
    """The cncore initializer equal to a config's `init_fn`: TorchRec's default (uniform between
    the config's bounds) and partials of torch.nn.init's uniform_/normal_/trunc_normal_/constant_.
    Any other callable cannot be applied row by row as IDs arrive, and is refused."""
    fn = config.init_fn
    if fn is None:
        return cncore.Uniform(config.get_weight_init_min(), config.get_weight_init_max())
    if isinstance(fn, functools.partial) and not fn.args:
        kw = fn.keywords
        if fn.func is torch.nn.init.uniform_:
            return cncore.Uniform(kw.get("a", 0.0), kw.get("b", 1.0))
        if fn.func is torch.nn.init.normal_:
            return cncore.Normal(kw.get("mean", 0.0), kw.get("std", 1.0))
        if fn.func is torch.nn.init.trunc_normal_:
            return cncore.TruncatedNormal(kw.get("mean", 0.0), kw.get("std", 1.0), kw.get("a", -2.0), kw.get("b", 2.0))
        if fn.func is torch.nn.init.constant_:
            return cncore.Constant(kw["val"])
    raise ValueError(f"table {config.name!r}: init_fn {fn!r} cannot initialise rows one ID at a time; pass "
                     f"initializers={{{config.name!r}: cncore.Uniform(...)}} (or Normal, TruncatedNormal, Constant)")


def make_stores(tables, config_type, optimizer, initializers, capacities, seed: int, device,
                what: str, options: dict | None = None) -> dict[str, cncore.EmbeddingStore | TieredStore]:
    """One store per TorchRec table config (checked: type, unique names, known overrides)."""
    return {name: cncore.make_store(config) for name, config in
            store_configs(tables, config_type, optimizer, initializers, capacities, seed, device, what,
                          options).items()}


def collection_placement(device, what: str) -> Placement:
    """Where the tables live: 'cpu' (the core), 'meta' (no storage until `to_empty`, as DMP
    builds models) or 'cncard' / an accelerator device (rows in device memory, keys indexed by
    the core on the host; `CNCORE_CNCARD=cpu` runs that path on the CPU). device=None inside
    `with torch.device("meta"):` is 'meta', as for TorchRec's collections."""
    if device is None and torch.empty(0).is_meta:
        device = "meta"
    try:
        placement = resolve_device(device)
        if placement.kind == "device":
            torch.empty(0, device=placement.device)  # an accelerator this torch build cannot reach
    except (ValueError, RuntimeError, AssertionError) as exc:
        raise ValueError(f"device={device!r}: {what} runs on 'cpu', 'meta' or 'cncard' ({exc})") from exc
    return placement


def store_configs(tables, config_type, optimizer, initializers, capacities, seed: int, device,
                  what: str, options: dict | None = None) -> dict[str, cncore.StoreConfig]:
    """One store config per TorchRec table config (checked: type, unique names, known overrides);
    `options`: the table options of cncore_torch.table_options, each once or per table."""
    collection_placement(device, what)
    if not isinstance(tables, (list, tuple)):
        raise TypeError(f"tables must be a list of {config_type.__name__}, got {type(tables).__name__}")
    if not tables:
        raise ValueError(f"tables: at least one {config_type.__name__} is needed")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    initializers, capacities = dict(initializers or {}), dict(capacities or {})
    stores: dict[str, cncore.StoreConfig] = {}
    for config in tables:
        if not isinstance(config, config_type):
            raise TypeError(f"tables: expected {config_type.__name__}, got {type(config).__name__}")
    per_table = per_table_options(tables, **(options or {}))
    for config in tables:
        if not isinstance(config, config_type):
            raise TypeError(f"tables: expected {config_type.__name__}, got {type(config).__name__}")
        if config.name in stores:
            raise ValueError(f"tables: duplicate table name {config.name!r}")
        if not isinstance(config.name, str) or not config.name or "." in config.name:
            raise ValueError(f"table name {config.name!r}: a collection holds a module per table under its name "
                             "(embedding_bags[name], as TorchRec's collections do), so a table name is a non-empty "
                             "string without '.'; rename the table")
        if isinstance(config, EmbeddingBagConfig) and config.pooling not in POOLING:
            raise ValueError(f"table {config.name!r}: pooling {config.pooling} is not supported (SUM or MEAN)")
        n = config.num_embeddings
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:  # TorchRec's default init reads 1/n
            raise ValueError(f"table {config.name!r}: num_embeddings must be an int >= 1 (a capacity hint), got {n!r}")
        init = initializers.pop(config.name, None) or initializer_from_config(config)
        fields = per_table[config.name]
        fields["dtype"] = row_dtype_of(config, _given(options or {}, "row_dtype", config.name))
        capacity = capacities.pop(config.name, min(n, _MAX_INITIAL_ROWS))
        if isinstance(fields["max_rows"], int) and not isinstance(fields["max_rows"], bool) \
                and 0 < fields["max_rows"] < capacity:
            capacity = fields["max_rows"]  # a bounded table never holds more
        stores[config.name] = store_config(
            f"table {config.name!r}: ", config.embedding_dim, initializer=init, optimizer=optimizer,
            seed=(seed * 1_000_003 + zlib.crc32(config.name.encode())) % 2**64, capacity=capacity, **fields)
    for leftover, name in ((initializers, "initializers"), (capacities, "capacities")):
        if leftover:
            raise ValueError(f"{name}: no table named {sorted(leftover)}")
    return stores


def _given(options: dict, option: str, table: str):
    """The value of `option` given for `table` (one value for every table, or {table: value}),
    None where none was."""
    value = options.get(option)
    return value.get(table) if isinstance(value, dict) else value


def feature_names_of(tables) -> tuple[list[list[str]], list[list[str]]]:
    """(feature names, embedding names) per table, exactly as TorchRec's collections name them
    (`feature@table` for a feature read by several tables); the configs are not mutated
    (TorchRec fills in empty feature_names with the table name; we read them that way)."""
    features = [list(c.feature_names) or [c.name] for c in tables]
    names = get_embedding_names_by_table(tables) if all(c.feature_names for c in tables) else features
    return features, names

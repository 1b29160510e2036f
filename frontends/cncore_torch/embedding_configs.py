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
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import get_embedding_names_by_table

import cncore
from cncore_torch.base import store_config
from cncore_torch.devices import Placement, resolve_device
from cncore_torch.table_options import per_table_options

__all__ = ["initializer_from_config", "store_configs", "make_stores", "collection_placement", "feature_names_of",
           "POOLING"]

_MAX_INITIAL_ROWS = 1 << 20
POOLING = {PoolingType.SUM: "sum", PoolingType.MEAN: "mean"}


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
                what: str, options: dict | None = None) -> dict[str, cncore.EmbeddingStore]:
    """One store per TorchRec table config (checked: type, unique names, known overrides)."""
    return {name: cncore.make_store(config) for name, config in
            store_configs(tables, config_type, optimizer, initializers, capacities, seed, device, what,
                          options).items()}


def collection_placement(device, what: str) -> Placement:
    """Where the tables live: 'cpu' (the core), 'meta' (no storage until `to_empty`, as DMP
    builds models) or 'cncard' / an accelerator device (rows in device memory, keys indexed by
    the core on the host; `CNCORE_CNCARD=cpu` runs that path on the CPU)."""
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
        if isinstance(config, EmbeddingBagConfig) and config.pooling not in POOLING:
            raise ValueError(f"table {config.name!r}: pooling {config.pooling} is not supported (SUM or MEAN)")
        n = config.num_embeddings
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:  # TorchRec's default init reads 1/n
            raise ValueError(f"table {config.name!r}: num_embeddings must be an int >= 1 (a capacity hint), got {n!r}")
        init = initializers.pop(config.name, None) or initializer_from_config(config)
        fields = per_table[config.name]
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



def feature_names_of(tables) -> tuple[list[list[str]], list[list[str]]]:
    """(feature names, embedding names) per table, exactly as TorchRec's collections name them
    (`feature@table` for a feature read by several tables); the configs are not mutated
    (TorchRec fills in empty feature_names with the table name; we read them that way)."""
    features = [list(c.feature_names) or [c.name] for c in tables]
    names = get_embedding_names_by_table(tables) if all(c.feature_names for c in tables) else features
    return features, names

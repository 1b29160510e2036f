"""`make_store`: the one place a store is built from a `StoreConfig`.

The config says where the rows live: in memory (``storage=None``: an `EmbeddingStore`), or on
disk under a bounded memory cache (``storage=cncore.Tiered(...)``: a `cncore.tier.TieredStore`,
which holds an `EmbeddingStore` as its cache and creates or reopens its directory). Front ends
build every table through it; `EmbeddingStore` itself refuses ``storage=``, so a tiered config is
never built in memory by mistake.

>>> import os, tempfile, cncore
>>> type(cncore.make_store(dim=4)).__name__
'EmbeddingStore'
>>> path = os.path.join(tempfile.mkdtemp(), "t.tier")
>>> store = cncore.make_store(dim=4, storage=cncore.Tiered(path, cache_bytes=1 << 20))
>>> type(store).__name__, type(store.cache).__name__
('TieredStore', 'EmbeddingStore')
>>> store.close()
"""
from __future__ import annotations

from typing import Any

from cncore.config import StoreConfig, Tiered, store_config_of
from cncore.store import EmbeddingStore
from cncore.tier import TieredStore

__all__ = ["make_store"]


def make_store(config: StoreConfig | None = None, **config_fields: Any) -> EmbeddingStore | TieredStore:
    """The store a config describes: an `EmbeddingStore` for ``storage=None``, a
    `cncore.tier.TieredStore` for ``storage=cncore.Tiered(...)``.

    Args:
        config: a `StoreConfig`, or None to build one from `config_fields`.
        **config_fields: the `StoreConfig` fields, when no `config` is given.

    Returns:
        A new store implementing `cncore.storage.RowStorage`.

    Raises:
        TypeError: both a config and fields given, a config that is not a `StoreConfig`, or a
            storage this version does not know.
    """
    config = store_config_of(config, config_fields)
    if config.storage is None:
        return EmbeddingStore(config)
    if isinstance(config.storage, Tiered):
        return TieredStore(config)
    raise TypeError(f"config.storage must be None or a cncore.Tiered, got {type(config.storage).__name__}")

"""The row-storage interface: what every place a table's rows can live offers to the front ends.

Three storages implement it:

- `cncore.EmbeddingStore`: rows in memory, in the core's arena (hash index -> slot -> row);
- `cncore.tier.TieredStore`: every row on disk, the hot ones in a bounded memory cache, which is
  an `EmbeddingStore` it holds (`store.cache`);
- `cncore_torch.device_rows.DeviceRows`: rows, optimizer state and metadata as accelerator
  tensors, the key index in the core on the host (it needs torch, so it lives in the torch
  front end and implements this protocol from there).

The core stores are built by one factory from a `StoreConfig`: `cncore.make_store(config)` (an
`EmbeddingStore`, or a `TieredStore` for ``storage=cncore.Tiered(...)``).

A front end holds one `RowStorage` per table and calls these verbs without asking which one it
is: the torch modules keep a single `storage` (no branch per placement), and their lookups go
through one bridge (`cncore_torch._ops`), which hands the core stores of a call to one grouped
core call and a device table's features to PyTorch ops. Arrays cross as NumPy (host) arrays:
keys int64, rows float32 (the row dtype is the storage's business), optimizer state float32,
counts and last steps as integers.

>>> import numpy as np, cncore
>>> from cncore.storage import RowStorage
>>> store = cncore.EmbeddingStore(dim=2, optimizer=cncore.SGD(lr=0.1))
>>> isinstance(store, RowStorage)
True
>>> store.insert_or_assign(np.array([5]), np.ones((1, 2), np.float32)).tolist()
[False]
>>> len(store), store.export().keys.tolist()
(1, [5])
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

__all__ = ["RowStorage"]


@runtime_checkable
class RowStorage(Protocol):
    """The verbs (see each on `EmbeddingStore` for the exact contract)."""

    config: object  # the StoreConfig: dim, optimizer, initializer, seed, policies

    @property
    def dim(self) -> int: ...

    @property
    def capacity(self) -> int: ...

    @property
    def nbytes(self) -> int: ...

    @property
    def step(self) -> int: ...          # settable: optimizer steps applied so far

    @property
    def evicted_count(self) -> int: ...  # settable: rows evicted so far

    def __len__(self) -> int: ...

    def export(self): ...  # every row: keys, rows, optimizer_state, counts, last_steps

    def load(self, keys, rows, optimizer_state=None, counts=None, last_steps=None): ...

    def insert_or_assign(self, keys, rows, optimizer_state=None): ...  # -> which keys were present

    def assign(self, keys, rows, optimizer_state=None): ...  # present keys only -> which were

    def clear(self) -> None: ...

    def reserve(self, n_rows: int) -> None: ...

    def set_optimizer(self, optimizer) -> None: ...

    def on_evict(self, callback) -> None: ...

    def evict(self, n: int) -> int: ...

    def evict_expired(self) -> int: ...

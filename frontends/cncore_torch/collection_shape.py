"""`CollectionShape`: what TorchRec code reads from a collection besides its forward, for both
collections (`cncore_torch.collection`).

- Each collection is TorchRec's own: `CNEmbeddingBagCollection` subclasses TorchRec's
  `EmbeddingBagCollection` (and `CNEmbeddingCollection` its `EmbeddingCollection`), so
  `isinstance` checks and type hints in models hold, but it is built without TorchRec's
  constructor (which allocates dense tables). DMP and the planner pick a sharder by the module's
  exact type (`sharder_name(type(module))`), so our sharders shard it, never TorchRec's; without
  ours it stays unsharded, and refuses to run so in a group of several ranks (`_check_world`).
- `device`, `reset_parameters()` (DMP's meta initialisation calls it), a `repr` listing the
  tables through the per-table modules (`embedding_bags` / `embeddings`,
  `cncore_torch.table_views`).

>>> import torch
>>> from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
>>> from cncore_torch import CNEmbeddingBagCollection
>>> ebc = CNEmbeddingBagCollection([EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10,
...                                                    feature_names=["f"])], device="meta")
>>> isinstance(ebc, EmbeddingBagCollection), ebc.device
(True, device(type='meta'))
>>> print(ebc)
CNEmbeddingBagCollection(
  device=meta
  (embedding_bags): ModuleDict(
    (t): CNEmbeddingBag(10, 4, mode='sum', rows=meta)
  )
)
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from cncore_torch.base import check_unsharded_world
from cncore_torch.devices import Placement
from cncore_torch.embedding_configs import collection_placement

__all__ = ["CollectionShape"]


class CollectionShape:
    """The collections' TorchRec surface (see the module docstring); mixed into the collections'
    base, whose `_placement`, `_stores`, `_anchor`, `_materialise` and `_owner` it reads."""

    _per_rank_tables: bool = False
    # (the collection's, for the type checker)
    _placement: Placement
    _stores: dict
    _anchor: nn.Parameter
    _owner: str
    _materialise: Callable[[], None]

    if TYPE_CHECKING:
        @property
        def is_meta(self) -> bool: ...

    def __init__(self) -> None:
        nn.Module.__init__(self)  # type: ignore[arg-type]  # not TorchRec's constructor: no dense tables

    @property
    def device(self) -> torch.device:
        """Where the tables live, as TorchRec's `device`: cpu (rows in the core), meta, or the
        accelerator holding the rows."""
        return self._placement.device

    def reset_parameters(self) -> None:
        """TorchRec's reset: every row back to its initial value. The tables are emptied (rows,
        optimizer state, counts) and each ID's row is drawn again from (seed, table, ID), the
        configs' init, when it next arrives. On meta there is nothing to reset; a collection
        whose anchor DMP's meta initialisation moved off meta (it replaces meta parameters in
        place, then calls this) gets its empty tables here."""
        if self.is_meta:
            return
        if self._placement.kind == "meta":
            self._placement = collection_placement(self._anchor.device, self._owner)
            self._materialise()
            return
        for store in self._stores.values():
            store.clear()

    def _check_world(self) -> None:
        """Refuse to run unsharded in a group of several ranks (`base.check_unsharded_world`),
        unless built with per_rank_tables=True."""
        check_unsharded_world(self._owner, self._owner + "Sharder", self._per_rank_tables)

    def extra_repr(self) -> str:
        optimizer = self.__dict__.get("_optimizer")
        return f"device={self.device}" + (f", optimizer={optimizer}" if optimizer is not None else "")

"""The per-table modules of the collections: `CNEmbeddingBagCollection.embedding_bags` (a
`CNEmbeddingBag` per table) and `CNEmbeddingCollection.embeddings` (a `CNEmbedding` per table),
where TorchRec's collections hold `nn.EmbeddingBag` / `nn.Embedding`.

Each is a view of one of the collection's tables, not a copy: it reads and writes the very store
the collection looks up (`collection.stores[name]`), with the collection's placement, optimizer
and anchor parameter. So a lookup through `embedding_bags[name]` trains the collection's rows,
and rows the collection inserts are the view's. The collection owns the table's state: a view
adds no parameter and no `state_dict` entry (the rows are saved once, under the collection's
`tables.<name>.`), moves with the collection (`.to_empty`, `.to`) and refuses to move alone.

>>> import torch, cncore
>>> from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
>>> from cncore_torch import CNEmbeddingBagCollection
>>> ebc = CNEmbeddingBagCollection([EmbeddingBagConfig(name="t", embedding_dim=2, num_embeddings=10,
...                                                    feature_names=["f"])], optimizer=cncore.SGD(lr=0.1))
>>> _ = ebc(KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor([5, 9]), torch.tensor([2])))
>>> bag = ebc.embedding_bags["t"]
>>> bag.store is ebc.stores["t"], sorted(bag.keys().tolist())
(True, [5, 9])
"""
from __future__ import annotations

import torch
from torch import nn

from cncore_torch import bridge, functional
from cncore_torch.base import TableModule
from cncore_torch.modules import CNEmbedding, CNEmbeddingBag
from cncore_torch.ops import register_operators
from cncore_torch.optim import no_optimizer_error

__all__ = ["TableView", "EmbeddingBagView", "EmbeddingView", "table_views"]


class TableView:
    """What makes a `CNEmbeddingBag` / `CNEmbedding` a view of a collection's table (see the
    module docstring): the table, placement, config, optimizer and anchor are read from the
    collection each time, so they follow its materialisation, moves and optimizer adoption."""

    _table_name: str

    def _init_view(self, collection: nn.Module, name: str, config) -> None:
        nn.Module.__init__(self)  # type: ignore[arg-type]
        # The collection is not a submodule of its own view: kept out of _modules.
        self.__dict__["_collection"] = collection
        self._table_name = name
        self.num_embeddings = config.num_embeddings
        self.embedding_dim = self.dim = config.embedding_dim
        self.padding_idx = None
        self._gradient_hooks: list = []
        self.last_gradients = None
        register_operators()
        self._handle = bridge.register(self)

    @property
    def _anchor(self) -> nn.Parameter:
        return self.__dict__["_collection"]._anchor

    @property
    def placement(self):
        return self.__dict__["_collection"]._placement

    @property
    def storage(self):
        return self.__dict__["_collection"]._stores.get(self._table_name)

    @property
    def config(self):
        return self.__dict__["_collection"]._store_configs[self._table_name]

    @property
    def fused_optimizer(self):
        return self.__dict__["_collection"].fused_optimizer

    def _require_optimizer(self, *needed: bool) -> None:
        self.__dict__["_collection"]._require_optimizer(*needed)

    def _deliver_gradients(self, ids: torch.Tensor, grads: torch.Tensor) -> None:
        """Gradients for rows of a collection with no optimizer: they would be lost."""
        raise no_optimizer_error(self.__dict__["_collection"]._owner)

    def _check_world(self) -> None:
        self.__dict__["_collection"]._check_world()

    def register_gradient_hook(self, hook):
        raise RuntimeError(f"embedding table {self._table_name!r} is a view of a collection's table, trained by the "
                           "collection's fused optimizer; gradient hooks are for a CNEmbeddingBag / CNEmbedding of "
                           "its own")

    def move_to(self, device):
        raise ValueError(f"table {self._table_name!r} belongs to its collection and moves with it: move the "
                         f"collection (to_empty / to), not embedding table {self._table_name!r}")

    def _apply(self, fn, recurse=True):
        """Nothing of its own to move: the collection moves the table and the view follows.
        Moved alone (`embedding_bags[name].to(...)`) to another device, it refuses."""
        collection = self.__dict__["_collection"]
        if not collection.__dict__.get("_moving_tables"):
            here = collection._anchor.device
            if fn(torch.empty(0, device=here)).device != here:
                self.move_to(None)  # raises, naming the collection
        return self

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        """Nothing: the collection saves the table (under `tables.<name>.`)."""

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        """Nothing: the collection loads the table."""

    def __getstate__(self):
        state = self.__dict__.copy()
        state.pop("_handle", None)
        return state

    def __setstate__(self, state) -> None:
        TableModule.__setstate__(self, state)  # type: ignore[arg-type]

    def _get_name(self) -> str:
        return type(self).__mro__[2].__name__  # the module it stands for (CNEmbeddingBag, CNEmbedding)


class EmbeddingBagView(TableView, CNEmbeddingBag):  # type: ignore[override, misc]  # (read-only properties)
    """A `CNEmbeddingBag` over one table of a `CNEmbeddingBagCollection` (see the module docstring)."""

    def __init__(self, collection: nn.Module, name: str, config, mode: str) -> None:
        self._init_view(collection, name, config)
        self.mode = mode
        self.include_last_offset = False

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        self._check_world()  # (the general path: the anchor is the collection's, not a parameter of the view)
        return functional.embedding_bag_lookup(self._anchor, self._handle, self.placement.kind, self.embedding_dim,
                                               input, offsets, per_sample_weights, self.mode, self.include_last_offset,
                                               self.padding_idx, self.training)


class EmbeddingView(TableView, CNEmbedding):  # type: ignore[override, misc]
    """A `CNEmbedding` over one table of a `CNEmbeddingCollection` (see the module docstring)."""

    def __init__(self, collection: nn.Module, name: str, config) -> None:
        self._init_view(collection, name, config)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_world()
        return functional.embedding_lookup(self._anchor, self._handle, self.placement.kind, self.embedding_dim, input,
                                           self.padding_idx, self.training)


def table_views(collection: nn.Module, configs, modes: list[str] | None) -> nn.ModuleDict:
    """A ModuleDict of views, one per table config, in the configs' order (`modes`: each table's
    pooling, for the pooled collection; None for the unpooled one)."""
    if modes is None:
        return nn.ModuleDict({c.name: EmbeddingView(collection, c.name, c) for c in configs})
    return nn.ModuleDict({c.name: EmbeddingBagView(collection, c.name, c, mode) for c, mode in zip(configs, modes)})


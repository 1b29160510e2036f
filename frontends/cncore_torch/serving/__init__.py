"""Serving a model trained on dynamic tables (guide: docs/serving.md).

`freeze` turns the tables into tensors behind an in-graph ID lookup (plain torch, exportable
into one file that runs without cncore); TorchRec's quantizers then work on it as on their own
collections; `apply_delta` keeps it fresh from training's incremental saves while it serves.
"""
from cncore_torch.serving.collection import FrozenEmbeddingBagCollection, FrozenEmbeddingCollection
from cncore_torch.serving.freeze import freeze
from cncore_torch.serving.modules import FrozenEmbedding, FrozenEmbeddingBag

__all__ = ["freeze", "FrozenEmbeddingBagCollection", "FrozenEmbeddingCollection", "FrozenEmbeddingBag",
           "FrozenEmbedding"]

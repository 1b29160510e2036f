"""Serving a model trained on dynamic tables (guide: docs/serving.md).

`freeze` turns the tables into tensors behind an in-graph ID lookup (plain torch, exportable
into one file that runs without cncore); TorchRec's quantizers then work on it as on their own
collections; `apply_delta` keeps it fresh from training's incremental saves while it serves.
"""
from cncore_torch.serving.collection import FrozenEmbeddingBagCollection, FrozenEmbeddingCollection
from cncore_torch.serving.delta import DeltaReport, TableDelta, apply_delta, frozen_tables
from cncore_torch.serving.export import export_program
from cncore_torch.serving.freeze import freeze
from cncore_torch.serving.modules import FrozenEmbedding, FrozenEmbeddingBag
from cncore_torch.serving.quantize import row_error_bound

__all__ = ["freeze", "export_program", "apply_delta", "TableDelta", "DeltaReport", "frozen_tables", "row_error_bound",
           "FrozenEmbeddingBagCollection", "FrozenEmbeddingCollection", "FrozenEmbeddingBag", "FrozenEmbedding"]

"""The frozen TorchRec collections: an in-graph ID remap in front of TorchRec's own modules.

`FrozenEmbeddingBagCollection` holds `remap` (a `TableSlots` per table) and
`embedding_bag_collection`, a plain TorchRec `EmbeddingBagCollection` whose tables hold the
frozen rows (row 0 zeros, for unseen IDs). TorchRec's tools therefore see their own module:
`torchrec.inference.modules.quantize_embeddings` / `quantize_inference_model` swap it for a
`QuantEmbeddingBagCollection` (int8, int4, fp16 rows), `torch.export` records TorchRec's
lookup, and the remap is a few tensor operations before it. `FrozenEmbeddingCollection` is the
same over TorchRec's `EmbeddingCollection`.

Mean pooling runs as a sum in TorchRec's module, then times 1/length here, in float32: the
live tables' arithmetic (a division by the length differs from it in the last bit), and also
what per-sample weights with mean need (the live collections' weighted sum / bag length,
which `nn.EmbeddingBag` refuses).
"""
from __future__ import annotations

import dataclasses
from typing import cast

import numpy as np
import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingCollection
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, EmbeddingConfig, PoolingType
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor

from cncore_torch.serving.table import TableSlots, dense_rows

__all__ = ["FrozenEmbeddingBagCollection", "FrozenEmbeddingCollection", "IdRemap"]


class IdRemap(nn.Module):
    """Raw IDs -> weight rows, per table (`tables[name]`), applied to a KJT's features.

    The tables' ID maps are also held merged, for one lookup over every feature at once: all
    tables' IDs sorted (ties by table), with each entry's table and slot. A value is looked up
    with one `searchsorted`, then `probes` compares (the most tables any one ID is in), so the
    number of operations does not grow with the number of features (one searchsorted per
    feature cost more than TorchRec's whole int8 lookup at small batches).

    >>> import numpy as np
    >>> remap = IdRemap({"t": TableSlots(np.array([30, 10])), "u": TableSlots(np.array([10]))}, {"f": "t", "g": "u"})
    >>> kjt = KeyedJaggedTensor.from_lengths_sync(["f", "g"], torch.tensor([10, 30, 99, 10, 30]),
    ...                                           torch.tensor([2, 1, 1, 1]))
    >>> remap(kjt).values().tolist(), remap.probes
    ([2, 1, 0, 1, 0], 2)
    """

    merged_ids: torch.Tensor
    merged_tables: torch.Tensor
    merged_slots: torch.Tensor

    def __init__(self, tables: dict[str, TableSlots], table_of_feature: dict[str, str]) -> None:
        super().__init__()
        self.tables = nn.ModuleDict(tables)
        self.table_of_feature = dict(table_of_feature)
        self.table_index = {name: i for i, name in enumerate(tables)}
        merged = self.merged({})
        self.probes = merged[3]
        for name, t in zip(("merged_ids", "merged_tables", "merged_slots"), merged[:3]):
            self.register_buffer(name, t)

    def merged(self, replaced: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> tuple:
        """(ids, tables, slots, probes) merged over every table, each table's (ids, slots)
        taken from `replaced` where given (a delta prepares them before swapping them in)."""
        held = {name: cast(TableSlots, t) for name, t in self.tables.items()}
        parts = [replaced.get(name, (t.ids, t.slots)) for name, t in held.items()]
        ids = np.concatenate([p[0].numpy() for p in parts]) if parts else np.empty(0, np.int64)
        slots = np.concatenate([p[1].numpy() for p in parts]) if parts else np.empty(0, np.int64)
        tables = np.repeat(np.arange(len(parts), dtype=np.int64), [len(p[0]) for p in parts])
        order = np.lexsort((tables, ids))
        ids, tables, slots = ids[order], tables[order], slots[order]
        runs = np.diff(np.flatnonzero(np.concatenate([[True], ids[1:] != ids[:-1], [True]]))) if len(ids) else [0]
        return (torch.from_numpy(ids), torch.from_numpy(tables), torch.from_numpy(slots), max(int(np.max(runs)), 1))

    def forward(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        if features.variable_stride_per_key():
            raise ValueError("features: a KJT with a batch size per feature (VBE: stride_per_key_per_rank) reached a "
                             "frozen collection, which takes one batch size for all features; expand it first "
                             "(one bag per sample and feature, empty bags allowed)")
        values = features.values().to(torch.int64)
        n_keys = len(features.keys())
        table_of_key = torch.tensor([self.table_index.get(self.table_of_feature.get(k, ""), -1)
                                     for k in features.keys()], dtype=torch.int64)
        per_key = features.lengths().view(n_keys, -1).sum(dim=1) if n_keys else table_of_key
        table = torch.repeat_interleave(table_of_key, per_key, output_size=values.numel())
        slots = torch.zeros_like(values)
        if self.merged_ids.numel():
            last = self.merged_ids.numel() - 1
            pos = torch.searchsorted(self.merged_ids, values)
            for probe in range(self.probes):
                at = (pos + probe).clamp(max=last)
                hit = (self.merged_ids[at] == values) & (self.merged_tables[at] == table)
                slots = torch.where(hit, self.merged_slots[at], slots)
        return KeyedJaggedTensor(keys=features.keys(), values=slots, lengths=features.lengths(),
                                 weights=features.weights_or_none(), stride=features.stride())


def _remap_of(configs, keys: dict[str, np.ndarray]) -> IdRemap:
    return IdRemap({c.name: TableSlots(keys[c.name]) for c in configs},
                   {f: c.name for c in configs for f in c.feature_names})


def _load_weights(module: nn.Module, rows: dict[str, np.ndarray]) -> None:
    """Each TorchRec table's weight (allocated on meta, so no initializer runs over it) as
    the zero row followed by `rows[name]`."""
    module.to_empty(device="cpu")
    tables = module.embedding_bags if isinstance(module, EmbeddingBagCollection) else module.embeddings
    assert isinstance(tables, nn.ModuleDict)
    for name, table in tables.items():
        table.weight = nn.Parameter(dense_rows(rows[name], first_slot=1), requires_grad=False)


class FrozenEmbeddingBagCollection(nn.Module):
    """A trained `CNEmbeddingBagCollection` as plain torch (see the module docstring): same
    forward (KJT of raw IDs -> KeyedTensor), same keys and shapes; unseen IDs read zeros.
    Built by `cncore_torch.serving.freeze`.

    Args:
        tables: the collection's `EmbeddingBagConfig`s (pooling SUM or MEAN).
        is_weighted: whether the KJT's weights scale the rows.
        keys: {table name: int64 (N,) IDs}.
        rows: {table name: float32 (N, dim) rows, row i of ID keys[i]}.
    """

    def __init__(self, tables: list[EmbeddingBagConfig], is_weighted: bool, keys: dict[str, np.ndarray],
                 rows: dict[str, np.ndarray]) -> None:
        super().__init__()
        self._configs = list(tables)
        self._is_weighted = is_weighted
        inner = [dataclasses.replace(c, num_embeddings=len(keys[c.name]) + 1, data_type=DataType.FP32,
                                     pooling=PoolingType.SUM,
                                     feature_names=list(c.feature_names)) for c in tables]
        self.remap = _remap_of(tables, keys)
        self.embedding_bag_collection = EmbeddingBagCollection(tables=inner, is_weighted=is_weighted, device="meta")
        _load_weights(self.embedding_bag_collection, rows)
        self.requires_grad_(False)
        # (feature, first column, last column) of each mean feature, scaled by 1/length
        self._means: list[tuple[str, int, int]] = []
        column = 0
        for c in tables:
            for f in c.feature_names:
                if c.pooling == PoolingType.MEAN:
                    self._means.append((f, column, column + c.embedding_dim))
                column += c.embedding_dim

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        """The trained collection's table configs.

        Returns:
            list[EmbeddingBagConfig]: as given.
        """
        return self._configs

    def is_weighted(self) -> bool:
        """Whether the KJT's weights scale the rows.

        Returns:
            bool: as the trained collection's.
        """
        return self._is_weighted

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """The pooled rows, as the trained collection's forward in eval mode.

        Args:
            features (KeyedJaggedTensor): raw int64 IDs per feature (and weights if weighted).

        Returns:
            KeyedTensor: (B, sum of dims), one key per feature.
        """
        out = self.embedding_bag_collection(self.remap(features))
        if not self._means:
            return out
        values, lengths = out.values(), features.lengths().view(len(features.keys()), -1)
        scale = torch.ones((1, values.shape[1]), dtype=values.dtype).expand(values.shape[0], -1).clone()
        for feature, start, stop in self._means:
            bag = lengths[features.keys().index(feature)].clamp(min=1).to(values.dtype)
            scale[:, start:stop] = (1.0 / bag).unsqueeze(1)
        return KeyedTensor(keys=out.keys(), length_per_key=out.length_per_key(), values=values * scale)


class FrozenEmbeddingCollection(nn.Module):
    """A trained `CNEmbeddingCollection` as plain torch: KJT of raw IDs -> {feature:
    JaggedTensor of (N, dim) rows}, as the live one (with `need_indices`, the raw IDs as the
    JaggedTensors' weights); unseen IDs read zeros. Built by `cncore_torch.serving.freeze`.

    Args:
        tables: the collection's `EmbeddingConfig`s.
        need_indices: as the live collection's.
        keys, rows: as `FrozenEmbeddingBagCollection`'s.
    """

    def __init__(self, tables: list[EmbeddingConfig], need_indices: bool, keys: dict[str, np.ndarray],
                 rows: dict[str, np.ndarray]) -> None:
        super().__init__()
        self._configs = list(tables)
        self._need_indices = need_indices
        inner = [dataclasses.replace(c, num_embeddings=len(keys[c.name]) + 1, data_type=DataType.FP32,
                                     feature_names=list(c.feature_names)) for c in tables]
        self.remap = _remap_of(tables, keys)
        self.embedding_collection = EmbeddingCollection(tables=inner, device="meta")
        _load_weights(self.embedding_collection, rows)
        self.requires_grad_(False)

    def embedding_configs(self) -> list[EmbeddingConfig]:
        """The trained collection's table configs.

        Returns:
            list[EmbeddingConfig]: as given.
        """
        return self._configs

    def need_indices(self) -> bool:
        """Whether the outputs carry the raw IDs as their weights.

        Returns:
            bool: as the trained collection's.
        """
        return self._need_indices

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        """The rows of each ID, as the trained collection's forward in eval mode.

        Args:
            features (KeyedJaggedTensor): raw int64 IDs per feature.

        Returns:
            dict[str, JaggedTensor]: per feature, (N, dim) rows and the feature's lengths.
        """
        out = self.embedding_collection(self.remap(features))
        if not self._need_indices:
            return out
        ids = dict(zip(features.keys(), torch.split(features.values(), features.length_per_key())))
        return {name: JaggedTensor(values=jt.values(), lengths=jt.lengths(), weights=ids[name])
                for name, jt in out.items()}

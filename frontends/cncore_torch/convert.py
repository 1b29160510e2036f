"""Moving a TorchRec model onto dynamic tables, and back to fixed tables for serving.

>>> import torch, cncore
>>> from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
>>> from cncore_torch.convert import to_dynamic, to_fixed
>>> model = torch.nn.Sequential(EmbeddingBagCollection(
...     tables=[EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10, feature_names=["f"])]))
>>> model = to_dynamic(model, optimizer=cncore.SGD(lr=0.1))      # row i becomes the row of ID i
>>> type(model[0]).__name__, len(model[0].stores["t"])
('CNEmbeddingBagCollection', 10)
>>> fixed, id_maps = to_fixed(model[0])                           # for serving
>>> fixed.embedding_bags["t"].weight.shape, id_maps["t"].shape
(torch.Size([11, 4]), (10,))
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from cncore_torch.collection import CNEmbeddingBagCollection, CNEmbeddingCollection

__all__ = ["to_dynamic", "to_fixed", "remap_to_fixed"]


def to_dynamic(model: nn.Module, *, optimizer, seed: int = 0) -> nn.Module:
    """Replace every TorchRec `EmbeddingBagCollection` / `EmbeddingCollection` in `model` (in
    place; returned for chaining) with ours on the same configs, carrying each existing row over
    as the row of its ID (row i -> ID i). `optimizer` is the new tables' fused optimizer. Ours
    (which are TorchRec's collections too) are left as they are."""
    if isinstance(model, (CNEmbeddingBagCollection, CNEmbeddingCollection)):
        return model
    if isinstance(model, (EmbeddingBagCollection, EmbeddingCollection)):
        return _convert(model, optimizer, seed)
    for name, child in list(model.named_children()):
        if isinstance(child, (CNEmbeddingBagCollection, CNEmbeddingCollection)):
            continue
        if isinstance(child, (EmbeddingBagCollection, EmbeddingCollection)):
            setattr(model, name, _convert(child, optimizer, seed))
        else:
            to_dynamic(child, optimizer=optimizer, seed=seed)
    return model


def _convert(module, optimizer, seed: int):
    if isinstance(module, EmbeddingBagCollection):
        ours = CNEmbeddingBagCollection(tables=module.embedding_bag_configs(), is_weighted=module.is_weighted(),
                                        optimizer=optimizer, seed=seed)
        tables = module.embedding_bags.items()
    else:
        ours = CNEmbeddingCollection(tables=module.embedding_configs(), need_indices=module.need_indices(),
                                     optimizer=optimizer, seed=seed)
        tables = module.embeddings.items()
    for name, table in tables:
        weight = table.weight.detach().to(torch.float32).cpu().contiguous()
        ours.stores[name].insert_or_assign(np.arange(weight.shape[0]), weight.numpy())
    return ours


def to_fixed(collection: CNEmbeddingBagCollection) -> tuple[EmbeddingBagCollection, dict[str, np.ndarray]]:
    """A TorchRec `EmbeddingBagCollection` holding every row of `collection`, plus, per table,
    the sorted IDs whose position is the row index (`remap_to_fixed` applies them to a KJT).
    Each fixed table has one extra last row of zeros, where IDs it never saw go."""
    configs, id_maps, rows = [], {}, {}
    for config in collection.embedding_bag_configs():
        batch = collection.stores[config.name].export()
        order = np.argsort(batch.keys, kind="stable")
        id_maps[config.name] = batch.keys[order]
        rows[config.name] = batch.rows[order]
        configs.append(EmbeddingBagConfig(name=config.name, embedding_dim=config.embedding_dim,
                                          num_embeddings=len(order) + 1, feature_names=list(config.feature_names),
                                          pooling=config.pooling))
    fixed = EmbeddingBagCollection(tables=configs, is_weighted=collection.is_weighted())
    with torch.no_grad():
        for name, bag in fixed.embedding_bags.items():
            bag.weight.zero_()
            bag.weight[:-1] = torch.from_numpy(rows[name])
    return fixed, id_maps


def remap_to_fixed(features: KeyedJaggedTensor, collection_configs, id_maps: dict[str, np.ndarray]
                   ) -> KeyedJaggedTensor:
    """Raw IDs -> row indices of the fixed tables made by `to_fixed` (unknown IDs -> the zero row).

    >>> import torch, cncore
    >>> from torchrec import EmbeddingBagConfig
    >>> configs = [EmbeddingBagConfig(name="t", embedding_dim=2, num_embeddings=4, feature_names=["f"])]
    >>> kjt = KeyedJaggedTensor(keys=["f"], values=torch.tensor([7, 3, 5]), lengths=torch.tensor([3]))
    >>> remap_to_fixed(kjt, configs, {"t": np.array([3, 7])}).values().tolist()
    [1, 0, 2]
    >>> remap_to_fixed(kjt, configs, {"t": np.zeros(0, np.int64)}).values().tolist()   # an empty table
    [0, 0, 0]
    """
    table_of = {f: c.name for c in collection_configs for f in c.feature_names}
    by_key = features.to_dict()
    values = []
    for key in features.keys():
        ids = by_key[key].values().numpy()
        known = id_maps[table_of[key]]
        pos = np.searchsorted(known, ids)
        hit = pos < len(known)  # an empty table has no IDs: everything goes to its zero row
        hit[hit] = known[pos[hit]] == ids[hit]
        values.append(np.where(hit, pos, len(known)))
    return KeyedJaggedTensor(keys=features.keys(), values=torch.from_numpy(np.concatenate(values).astype(np.int64)),
                             lengths=features.lengths(), weights=features.weights_or_none())

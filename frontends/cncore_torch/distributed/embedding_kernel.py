"""`CNEmbeddingBagKernel`: the rank's local lookup (TorchRec's `BaseEmbedding` role).

It owns this rank's shard of every table (one `cncore.EmbeddingStore` each, holding only the
keys this rank owns) and looks up the features it receives after the input all-to-all in one
grouped core call, through the bridge every module of this front end uses
(`cncore_torch.bridge`): its backward applies the fused optimizer to the
rows here, on the owning rank, with the gradient the output all-to-all sent back.

Every feature is pooled with SUM here, also for MEAN tables: a bag split across ranks is
divided by its full length on the rank that owns the sample (see `embeddingbag.py`).
"""
from __future__ import annotations

import torch
from torch import nn
from torchrec.distributed.embedding_kernel import BaseEmbedding
from torchrec.distributed.embedding_types import GroupedEmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from cncore_torch import bridge
from cncore_torch.distributed.embedding_sharding import ShardStore

__all__ = ["CNEmbeddingBagKernel"]


class CNEmbeddingBagKernel(BaseEmbedding):
    """Pooled lookup of the routed features over this rank's stores.

    Args: `stores`: {table name: this rank's store}; `feature_tables`: the table of each
    feature, in the order of the KJT it receives; `is_weighted`; `anchor`: the sharded
    module's zero-size parameter (autograd hangs the lookup on it); `fused_optimizer`: what
    holds the learning rate (`.lr`); `config`: TorchRec's grouped config, for reference.

    forward(KJT with the features in order, stride Bt) -> (Bt, sum of dims) partial pools.
    """

    def __init__(self, stores: dict[str, ShardStore], feature_tables: list[str], is_weighted: bool,
                 anchor: nn.Parameter, config: GroupedEmbeddingConfig | None = None):
        super().__init__()
        self._stores = stores
        self._feature_stores = [stores[t] for t in feature_tables]
        self._modes = ["sum"] * len(feature_tables)
        self._dims = [s.dim for s in self._feature_stores]
        self._is_weighted = is_weighted
        self._anchor_ref = [anchor]  # not registered here: the sharded module owns it (state_dict, DMP)
        self._config = config
        self.fused_optimizer = None  # set by the sharded module (it holds .lr)

    @property
    def config(self) -> GroupedEmbeddingConfig:
        return self._config

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        n_features = len(self._feature_stores)
        stride = features.stride()
        lengths = features.lengths().view(n_features, stride)
        per_feature = lengths.sum(dim=1).tolist()
        values = features.values().to(torch.int64)
        keys = list(torch.split(values, per_feature))
        weights = features.weights_or_none() if self._is_weighted else None
        weight_list = (list(torch.split(weights.to(torch.float32), per_feature)) if weights is not None
                       else None)
        offsets = torch.zeros((n_features, stride + 1), dtype=torch.int64)
        torch.cumsum(lengths, dim=1, out=offsets[:, 1:])
        keys = [k.contiguous() for k in keys]
        weights_in: list[torch.Tensor | None] = ([w.contiguous() for w in weight_list] if weight_list is not None
                                                 else [None] * n_features)
        return bridge.lookup(self._anchor_ref[0], self, keys, list(offsets), weights_in, [0] * n_features,
                           self.training)

    def _lookup_tables(self) -> list:
        """The store of each feature (see cncore_torch.bridge)."""
        return self._feature_stores

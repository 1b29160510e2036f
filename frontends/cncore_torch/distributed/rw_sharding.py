"""Row-wise sharding of dynamic tables by a hash of the key (TorchRec's sharding role).

`CNRwPooledEmbeddingSharding` is TorchRec's `RwPooledEmbeddingSharding` with its three parts
replaced:

- input dist (`CNRwSparseFeaturesDist`): each key goes to `routing.owner_of(key, world_size)`
  (TorchRec buckets by contiguous row ranges of `num_embeddings`, which a growable table with
  raw int64 keys does not have). The routed KJT travels by TorchRec's own `KJTAllToAll`: raw
  keys, per-sample weights, and every rank's lengths for every bag (a bag with no key on a rank
  has length 0 there), so the owner sees the full local batch of every rank, in rank order;
- lookup (`CNGroupedPooledEmbeddingsLookup` over a `CNEmbeddingBagKernel`): partial pools of
  those bags, (sum of every rank's batch, sum of dims), SUM pooling for every table;
- output dist (`CNRwPooledEmbeddingDist`): an all-to-all of the partial pools back to the
  ranks that own the samples (rank s sends rows [B_0 + ... + B_{r-1}, + B_r) to rank r), then a
  local sum over the senders. TorchRec's row-wise output dist is a reduce-scatter, which gloo
  refuses when ranks have different batch sizes ("ProcessGroupGloo::allgather: invalid tensor
  size", the last batch of an epoch); an all-to-all with split sizes takes any batch sizes. The
  all-to-all is an autograd function (`_AllToAll`), so its backward sends the
  gradient of every partial pool back to the rank that computed it, where the kernel's
  backward applies the fused optimizer.

Communication per step and rank (B_r samples, F features, N_r keys, D = sum of dims, W ranks):
ids out = N_r keys (8 bytes, + 4 bytes of weight each) + W x F x B_r lengths (8 bytes; TorchRec's
own row-wise input dist sends the same lengths); pooled back = W x B_r x D floats received (the
partial pool of every rank for every sample, also where that rank holds none of its keys).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.dist_data import KJTAllToAll
from torchrec.distributed.embedding_sharding import (BaseEmbeddingDist, BaseSparseFeaturesDist,
                                                     EmbeddingShardingContext, EmbeddingShardingInfo)
from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingSharding
from torchrec.distributed.types import Awaitable, NoWait, ShardingEnv
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import cncore
from cncore_torch.distributed.embedding_kernel import CNEmbeddingBagKernel
from cncore_torch.distributed.embedding_lookup import CNGroupedPooledEmbeddingsLookup
from cncore_torch.distributed.routing import owner_of

__all__ = ["CNRwSparseFeaturesDist", "CNRwPooledEmbeddingDist", "CNRwPooledEmbeddingSharding", "route_kjt"]


def route_kjt(features: KeyedJaggedTensor, world_size: int) -> KeyedJaggedTensor:
    """The KJT each rank's share goes out in: keys = features' keys repeated world_size times
    (the first block for rank 0, ...), stride B; in block r, bag b of feature f holds the keys
    of that bag owned by rank r, in their original order (with their weights)."""
    keys, stride = features.keys(), features.stride()
    n = len(keys) * stride
    values, lengths, weights = features.values(), features.lengths(), features.weights_or_none()
    owner = owner_of(values, world_size)
    bag = torch.repeat_interleave(torch.arange(n, device=values.device), lengths.to(torch.int64),
                                  output_size=values.numel())
    bucket = owner * n + bag
    order = torch.argsort(bucket, stable=True)
    return KeyedJaggedTensor(keys=keys * world_size, values=values[order],
                             weights=None if weights is None else weights[order],
                             lengths=torch.bincount(bucket, minlength=world_size * n).to(lengths.dtype),
                             stride=stride)


class CNRwSparseFeaturesDist(BaseSparseFeaturesDist[KeyedJaggedTensor]):
    """Routes each key to its owner (see the module docstring), by TorchRec's KJTAllToAll."""

    def __init__(self, pg: dist.ProcessGroup, num_features: int):
        super().__init__()
        self._world_size = pg.size()
        self._dist = KJTAllToAll(pg=pg, splits=[num_features] * self._world_size)

    def forward(self, sparse_features: KeyedJaggedTensor) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        return self._dist(route_kjt(sparse_features, self._world_size))


class CNRwPooledEmbeddingDist(BaseEmbeddingDist[EmbeddingShardingContext, torch.Tensor, torch.Tensor]):
    """Partial pools back to the ranks owning the samples, summed there (any per-rank batch sizes)."""

    def __init__(self, pg: dist.ProcessGroup):
        super().__init__()
        self._pg = pg

    def forward(self, local_embs: torch.Tensor,
                sharding_ctx: Optional[EmbeddingShardingContext] = None) -> Awaitable[torch.Tensor]:
        world_size, rank = self._pg.size(), self._pg.rank()
        if world_size == 1:
            return NoWait(local_embs)
        splits = list(sharding_ctx.batch_size_per_rank)
        mine, dim = splits[rank], local_embs.shape[1]
        received = _AllToAll.apply(local_embs, [mine] * world_size, splits, self._pg)
        return NoWait(received.view(world_size, mine, dim).sum(dim=0))


class _AllToAll(torch.autograd.Function):
    """Rows of `input` split by `in_splits` to the ranks, rows from them by `out_splits`; the
    backward is the same exchange the other way (each partial pool's gradient goes home)."""

    @staticmethod
    def forward(ctx, input: torch.Tensor, out_splits: List[int], in_splits: List[int], pg) -> torch.Tensor:
        out = input.new_empty((sum(out_splits),) + tuple(input.shape[1:]))
        dist.all_to_all_single(out, input.contiguous(), out_splits, in_splits, group=pg)
        ctx.splits, ctx.pg = (out_splits, in_splits), pg
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        grad_in = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(grad_in, grad.contiguous(), in_splits, out_splits, group=ctx.pg)
        return grad_in, None, None, None


class CNRwPooledEmbeddingSharding(RwPooledEmbeddingSharding):
    """TorchRec's row-wise pooled sharding with our input dist, lookup and output dist.

    TorchRec's base keeps what it computes from the plan (the grouped configs, embedding names
    and dims per rank); the plan's row ranges are nominal for dynamic tables (a capacity hint per
    rank): rows go where the hash sends their keys."""

    def __init__(self, sharding_infos: List[EmbeddingShardingInfo], env: ShardingEnv,
                 device: Optional[torch.device], *, stores: Dict[str, cncore.EmbeddingStore],
                 feature_tables: List[str], is_weighted: bool, anchor: nn.Parameter):
        super().__init__(sharding_infos, env, device)
        self._cn_stores, self._cn_feature_tables = stores, feature_tables
        self._cn_is_weighted, self._cn_anchor = is_weighted, anchor

    def create_input_dist(self, device: Optional[torch.device] = None) -> BaseSparseFeaturesDist[KeyedJaggedTensor]:
        return CNRwSparseFeaturesDist(self._pg, len(self._cn_feature_tables))

    def create_lookup(self, device: Optional[torch.device] = None, fused_params: Optional[Dict[str, Any]] = None,
                      feature_processor=None) -> CNGroupedPooledEmbeddingsLookup:
        kernel = CNEmbeddingBagKernel(self._cn_stores, self._cn_feature_tables, self._cn_is_weighted,
                                      self._cn_anchor,
                                      self._grouped_embedding_configs[0] if self._grouped_embedding_configs else None)
        return CNGroupedPooledEmbeddingsLookup(kernel)

    def create_output_dist(self, device: Optional[torch.device] = None) -> CNRwPooledEmbeddingDist:
        return CNRwPooledEmbeddingDist(self._pg)

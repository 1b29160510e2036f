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
  ranks that own the samples, then a local sum over the senders. With the sharder's
  `pack_pools=True`, only the pools of bags that hold a key on the sending rank travel (a bag's
  pool from a rank holding none of its keys is zero): both ends know which those are without
  sending anything more, the receiver from the lengths it routed, the sender from the lengths it
  received, so each sends the values of those (sample, feature) blocks packed in order and the
  receiver adds them into place (off by default: it costs more CPU than the bytes it saves on
  loopback; see the sharder). TorchRec's row-wise output dist is a reduce-scatter, which gloo
  refuses when ranks have different batch sizes ("ProcessGroupGloo::allgather: invalid tensor
  size", the last batch of an epoch); an all-to-all with split sizes takes any batch sizes. The
  all-to-all is an autograd function (`SplitAllToAll`), so its backward sends the
  gradient of every partial pool back to the rank that computed it, where the kernel's
  backward applies the fused optimizer.

Communication per step and rank (B_r samples, F features, N_r keys, D = sum of dims, W ranks):
ids out = N_r keys (8 bytes, + 4 bytes of weight each) + W x F x B_r lengths (8 bytes; TorchRec's
own row-wise input dist sends the same lengths); pooled back = D floats for every sample of
another rank, and the same again for their gradients (3.71 MB a step at global batch 2048 in the
DLRM benchmark); packed, dim_f floats for every bag (sample, feature f) of another rank holding a
key here, and their gradients: the analytic minimum for the pools (1.97 MB, against a 1.55-2.00
MB minimum with the ids).
"""
from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.dist_data import KJTAllToAll
from torchrec.distributed.embedding_sharding import (
    BaseEmbeddingDist,
    BaseSparseFeaturesDist,
    EmbeddingShardingContext,
    EmbeddingShardingInfo,
)
from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingSharding
from torchrec.distributed.types import Awaitable, NoWait, ShardingEnv
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from cncore_torch.distributed.embedding_kernel import CNEmbeddingBagKernel
from cncore_torch.distributed.embedding_lookup import CNGroupedPooledEmbeddingsLookup
from cncore_torch.distributed.embedding_sharding import ShardStore
from cncore_torch.distributed.routing import owner_of

__all__ = ["CNRwSparseFeaturesDist", "CNRwPooledEmbeddingDist", "CNRwPooledEmbeddingSharding", "SplitAllToAll",
           "route_kjt", "route_kjt_and_order"]


def route_kjt(features: KeyedJaggedTensor, world_size: int) -> KeyedJaggedTensor:
    """The KJT each rank's share goes out in: keys = features' keys repeated world_size times
    (the first block for rank 0, ...), stride B; in block r, bag b of feature f holds the keys
    of that bag owned by rank r, in their original order (with their weights)."""
    return route_kjt_and_order(features, world_size)[0]


def route_kjt_and_order(features: KeyedJaggedTensor, world_size: int) -> tuple[KeyedJaggedTensor, torch.Tensor]:
    """`route_kjt`'s KJT and the position in `features.values()` of each routed value."""
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
                             stride=stride), order


class CNRwSparseFeaturesDist(BaseSparseFeaturesDist[KeyedJaggedTensor]):
    """Routes each key to its owner (see the module docstring), by TorchRec's KJTAllToAll."""

    def __init__(self, pg: dist.ProcessGroup, num_features: int):
        super().__init__()
        self._world_size = pg.size()
        self._dist = KJTAllToAll(pg=pg, splits=[num_features] * self._world_size)

    def forward(self, sparse_features: KeyedJaggedTensor) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        return self.send(route_kjt(sparse_features, self._world_size))

    def send(self, routed: KeyedJaggedTensor) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        """Send a KJT `route_kjt` made (the sharded module keeps its lengths for the output dist)."""
        return self._dist(routed)


class CNRwPooledEmbeddingDist(BaseEmbeddingDist[EmbeddingShardingContext, torch.Tensor, torch.Tensor]):
    """Partial pools back to the ranks owning the samples, summed there (any per-rank batch
    sizes), only those of bags with a key on the sending rank (see the module docstring).

    The sharding context carries the two masks (set by the sharded module): `cn_routed`, the
    (W, F, B_mine) lengths this rank routed (bag (f, b) of mine has keys on rank r where > 0),
    and `cn_received`, the (F, sum of B) lengths it received (its own partial pools that are
    not zero). Without them it sends every partial pool. `bytes_sent` counts the pool bytes this
    rank sent to other ranks, forward and backward, since construction (`steps` calls)."""

    def __init__(self, pg: dist.ProcessGroup, feature_dims: list[int] | None = None):
        super().__init__()
        self._pg = pg
        self._n_features = 0 if feature_dims is None else len(feature_dims)
        self._column_feature = (None if feature_dims is None else torch.repeat_interleave(
            torch.arange(len(feature_dims)), torch.tensor(feature_dims, dtype=torch.int64)))
        # Every feature of one dim (DLRM's tables): a pool is a row of a (B x F, dim) view, and the
        # masks are per bag, not per element (dim times fewer indices to build and follow).
        self._bag_dim = feature_dims[0] if feature_dims and len(set(feature_dims)) == 1 else None
        self.bytes_sent, self.steps = 0, 0

    def forward(self, local_embs: torch.Tensor,
                sharding_ctx: EmbeddingShardingContext | None = None) -> Awaitable[torch.Tensor]:
        world_size, rank = self._pg.size(), self._pg.rank()
        if world_size == 1:
            return NoWait(local_embs)
        if sharding_ctx is None:
            raise ValueError("sharding_ctx: the output dist of several ranks needs the input dist's context "
                             "(its batch size per rank)")
        splits = list(sharding_ctx.batch_size_per_rank)
        mine, dim = splits[rank], local_embs.shape[1]
        routed = getattr(sharding_ctx, "cn_routed", None)
        received = getattr(sharding_ctx, "cn_received", None)
        self.steps += 1
        if routed is None or received is None or self._column_feature is None:
            out = SplitAllToAll.apply(local_embs, [mine] * world_size, splits, self._pg, self)
            return NoWait(out.view(world_size, mine, dim).sum(dim=0))
        if self._bag_dim is not None:
            return NoWait(self._by_bag(local_embs, routed, received, splits, rank))
        columns = self._column_feature
        # What I send: my nonzero partial pools, rank s's block being rows [B_0 + ... + B_{s-1}, + B_s).
        have = (received.view(self._n_features, sum(splits)) > 0).t()[:, columns]  # (sum of B, D)
        starts = [0] + list(itertools.accumulate(splits))
        in_splits = [int(have[starts[s]:starts[s + 1]].sum()) for s in range(world_size)]
        # What I receive: from rank r, the pools of my bags with a key there, in (sample, column) order.
        want = (routed.view(world_size, self._n_features, mine) > 0).permute(0, 2, 1)[:, :, columns]
        flat = want.reshape(world_size, -1)
        out_splits = flat.sum(dim=1).tolist()
        positions = torch.nonzero(flat, as_tuple=True)[1]                      # rank-major, then row-major
        pools = SplitAllToAll.apply(local_embs[have], out_splits, in_splits, self._pg, self)
        summed = local_embs.new_zeros(mine * dim).index_add(0, positions, pools)  # ranks added in order
        return NoWait(summed.view(mine, dim))

    def _by_bag(self, local_embs, routed, received, splits, rank):
        """The same exchange with one dim for every feature: bag (b, f)'s pool is row b * F + f
        of the (rows, F, dim) view, so the masks and positions are per bag."""
        world_size, n_features, dim = len(splits), self._n_features, self._bag_dim
        mine = splits[rank]
        have = (received.view(n_features, sum(splits)) > 0).t().reshape(-1)   # (sum of B x F)
        starts = [0] + list(itertools.accumulate(splits))
        in_splits = [int(have[starts[s] * n_features:starts[s + 1] * n_features].sum()) for s in range(world_size)]
        want = (routed.view(world_size, n_features, mine) > 0).permute(0, 2, 1).reshape(world_size, -1)
        out_splits = want.sum(dim=1).tolist()
        positions = torch.nonzero(want, as_tuple=True)[1]                      # rank-major, then bag order
        pools = SplitAllToAll.apply(local_embs.reshape(-1, dim)[have], out_splits, in_splits, self._pg, self)
        summed = local_embs.new_zeros((mine * n_features, dim)).index_add(0, positions, pools)
        return summed.view(mine, n_features * dim)


class SplitAllToAll(torch.autograd.Function):
    """Rows of `input` split by `in_splits` to the ranks, rows from them by `out_splits`; the
    backward is the same exchange the other way (each partial pool's gradient goes home).
    `counter.bytes_sent` (when given) grows by the bytes sent to other ranks, each way."""

    @staticmethod
    def forward(ctx, input: torch.Tensor, out_splits: list[int], in_splits: list[int], pg,
                counter=None) -> torch.Tensor:
        out = input.new_empty((sum(out_splits),) + tuple(input.shape[1:]))
        dist.all_to_all_single(out, input.contiguous(), out_splits, in_splits, group=pg)
        ctx.splits, ctx.pg, ctx.counter = (out_splits, in_splits), pg, counter
        if counter is not None:
            counter.bytes_sent += _foreign_bytes(input, in_splits, pg.rank())
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        grad_in = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(grad_in, grad.contiguous(), in_splits, out_splits, group=ctx.pg)
        if ctx.counter is not None:
            ctx.counter.bytes_sent += _foreign_bytes(grad, out_splits, ctx.pg.rank())
        return grad_in, None, None, None, None


def _foreign_bytes(tensor: torch.Tensor, splits: list[int], rank: int) -> int:
    """Bytes of `tensor` (split by rows as `splits`) that go to other ranks than `rank`."""
    row = tensor[0].numel() * tensor.element_size() if tensor.shape[0] else 0
    return (sum(splits) - splits[rank]) * row


class CNRwPooledEmbeddingSharding(RwPooledEmbeddingSharding):
    """TorchRec's row-wise pooled sharding with our input dist, lookup and output dist.

    TorchRec's base keeps what it computes from the plan (the grouped configs, embedding names
    and dims per rank); the plan's row ranges are nominal for dynamic tables (a capacity hint per
    rank): rows go where the hash sends their keys."""

    def __init__(self, sharding_infos: list[EmbeddingShardingInfo], env: ShardingEnv,
                 device: torch.device | None, *, stores: dict[str, ShardStore],
                 feature_tables: list[str], is_weighted: bool, anchor: nn.Parameter):
        super().__init__(sharding_infos, env, device)
        self._cn_stores, self._cn_feature_tables = stores, feature_tables
        self._cn_is_weighted, self._cn_anchor = is_weighted, anchor

    def create_input_dist(self, device: torch.device | None = None) -> BaseSparseFeaturesDist[KeyedJaggedTensor]:
        return CNRwSparseFeaturesDist(self._pg, len(self._cn_feature_tables))

    def create_lookup(self, device: torch.device | None = None, fused_params: dict[str, Any] | None = None,
                      feature_processor=None) -> CNGroupedPooledEmbeddingsLookup:
        kernel = CNEmbeddingBagKernel(self._cn_stores, self._cn_feature_tables, self._cn_is_weighted,
                                      self._cn_anchor,
                                      self._grouped_embedding_configs[0] if self._grouped_embedding_configs else None)
        return CNGroupedPooledEmbeddingsLookup(kernel)

    def create_output_dist(self, device: torch.device | None = None) -> CNRwPooledEmbeddingDist:
        return CNRwPooledEmbeddingDist(self._pg, [self._cn_stores[t].dim for t in self._cn_feature_tables])

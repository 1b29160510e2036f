"""The per-sample weights' gradient in the sharded pooled collection: computed where the rows are,
sent home.

A weighted KJT's weights travel with their IDs to the ranks owning the rows (the input dist is
TorchRec's `KJTAllToAll`, which carries no autograd). The owner computes d loss / d w_i = row_i .
(the gradient of the pool w_i went into) in its lookup's backward, as the unsharded collection
does, and `WeightsHome` sends those gradients back with the reverse all-to-all, each to the
position its weight had in the sender's KJT.

Every rank takes part in that backward exchange, or none does: `weights_need_grad` agrees
across the ranks (one all-reduce of a flag) whether any rank's weights require grad, and the
ranks whose own weights do not still attach (their gradient is dropped), so no rank waits in an
all-to-all the others never start.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

__all__ = ["WeightsRoute", "WeightsHome", "weights_need_grad", "permuted_positions", "weights_route",
           "attach_weights"]


@dataclass
class WeightsRoute:
    """Where each weight a rank sent went: `weights`, the caller's weights (requiring grad or
    not); `index`, the position in `weights` of each routed value (routed order: owner rank,
    then feature, then bag; a position appears more than once where a VBE KJT's bag serves
    several samples, and its gradients add up); `sent`, how many values went to each rank."""

    weights: torch.Tensor
    index: torch.Tensor
    sent: list[int]


def weights_need_grad(weights: torch.Tensor | None, pg: dist.ProcessGroup) -> bool:
    """Whether any rank's per-sample weights require grad (with grad enabled): every rank gets the
    same answer, as every rank must run the backward exchange or none."""
    local = weights is not None and weights.requires_grad and torch.is_grad_enabled()
    if pg.size() == 1:
        return local
    flag = torch.tensor([int(local)])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=pg)
    return bool(flag.item())


def permuted_positions(features: KeyedJaggedTensor, feature_order: list[int]) -> torch.Tensor:
    """The position in `features.values()` of each value of `features.permute(feature_order)`."""
    index = torch.arange(features.values().numel())
    if feature_order == list(range(len(features.keys()))):
        return index
    positions = KeyedJaggedTensor(keys=features.keys(), values=index, lengths=features.lengths(),
                                  stride=features.stride())
    return positions.permute(feature_order).values()


def weights_route(weights: torch.Tensor, positions: torch.Tensor, route_order: torch.Tensor,
                  routed_lengths: torch.Tensor, world_size: int) -> WeightsRoute:
    """The route of the caller's `weights`: `positions` gives the position in them of each value
    of the KJT that was routed (the tables' feature order; a VBE KJT's expansion), `route_order`
    the position in that KJT of each routed value (from `route_kjt_and_order`); `routed_lengths`
    are the routed KJT's lengths (one block per rank)."""
    sent = routed_lengths.to(torch.int64).view(world_size, -1).sum(dim=1).tolist()
    return WeightsRoute(weights, positions[route_order], sent)


def _received_to_sent(lengths: torch.Tensor, n_features: int, splits: list[int]) -> torch.Tensor:
    """For each received value in the order its sender sent it (rank, then feature, then bag), its
    position in the received KJT (feature, then sending rank, then bag)."""
    per_bag = lengths.to(torch.int64).view(n_features, -1)
    blocks = torch.stack([b.sum(dim=1) for b in torch.split(per_bag, splits, dim=1)], dim=1)  # (F, W)
    received_start = torch.cumsum(blocks.reshape(-1), 0) - blocks.reshape(-1)                    # feature-major
    sizes = blocks.t().reshape(-1)                                                               # rank-major
    sent_start = torch.cumsum(sizes, 0) - sizes
    shift = received_start.view(n_features, -1).t().reshape(-1) - sent_start
    total = int(sizes.sum())
    return torch.arange(total) + torch.repeat_interleave(shift, sizes, output_size=total)


class WeightsHome(torch.autograd.Function):
    """Forward: the received weights unchanged (a new tensor on the graph). Backward: their
    gradient back to the ranks that sent them (the reverse of the input all-to-all), placed at
    each weight's position in that rank's KJT. `anchor` (the module's zero-size parameter, which
    requires grad) keeps the backward running on a rank whose own weights need no gradient."""

    @staticmethod
    def forward(ctx, received: torch.Tensor, anchor: torch.Tensor, weights: torch.Tensor, index: torch.Tensor,
                sent: list[int], order: torch.Tensor, received_splits: list[int], pg) -> torch.Tensor:
        ctx.save_for_backward(index, order)
        ctx.sent, ctx.received_splits, ctx.pg = sent, received_splits, pg
        ctx.n_weights, ctx.dtype, ctx.anchor_shape = weights.shape[0], weights.dtype, anchor.shape
        return received.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        index, order = ctx.saved_tensors
        grad_home = grad.new_empty((sum(ctx.sent),))
        dist.all_to_all_single(grad_home, grad[order].contiguous(), ctx.sent, ctx.received_splits, group=ctx.pg)
        grad_weights = None
        if ctx.needs_input_grad[2]:
            grad_weights = grad.new_zeros((ctx.n_weights,)).index_add_(0, index, grad_home).to(ctx.dtype)
        return None, grad.new_zeros(ctx.anchor_shape), grad_weights, None, None, None, None, None


def attach_weights(features: KeyedJaggedTensor, route: WeightsRoute, anchor: torch.Tensor, n_features: int,
                   batch_size_per_rank: list[int], pg: dist.ProcessGroup) -> KeyedJaggedTensor:
    """The received KJT with its weights on the graph (`WeightsHome`)."""
    lengths = features.lengths()
    blocks = torch.split(lengths.to(torch.int64).view(n_features, -1), batch_size_per_rank, dim=1)
    received_splits = [int(b.sum()) for b in blocks]
    order = _received_to_sent(lengths, n_features, batch_size_per_rank)
    weights = WeightsHome.apply(features.weights(), anchor, route.weights, route.index, route.sent, order,
                                received_splits, pg)
    return KeyedJaggedTensor(keys=features.keys(), values=features.values(), lengths=lengths, weights=weights,
                             stride=features.stride())

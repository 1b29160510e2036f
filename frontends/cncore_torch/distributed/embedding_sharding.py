"""The code both sharded collections share (TorchRec keeps its own in `embedding_sharding.py`).

- `check_features`: a rank's KJT, checked before any collective;
- `sharded_optimizer`, `fused_anchor`: the optimizer a sharded table trains with, and the
  zero-size parameter that carries it past TorchRec's dense-optimizer filter;
- `shard_store_configs`: each rank's store configuration (its share of the row budget and of
  the fallback rows, its own directory for a tiered table); `fallback_tables`, `save_shards`:
  the tables whose shards write fallback entries, and every shard's entries;
- `owned_writer`, `keep_owned_rows`: what loads a table's rows into a rank's store, keeping the
  keys that rank owns;
- `ShardStore`: the store a rank holds for a table (in memory, or on the SSD tier);
- `forward_outside_graph`: a sharded module's forward under `torch.compile` of the whole model.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, cast

import numpy as np
import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import cncore
from cncore.config import with_default_split
from cncore.routing import shard_name
from cncore.store_fallback import unplaceable_fallback_error
from cncore.tier import TieredStore
from cncore_torch.dcp import fallback_in_place, fallback_moved_error
from cncore_torch.distributed.routing import owner_of
from cncore_torch.optim import no_optimizer_error, resolve_optimizer
from cncore_torch.state import TableState, export_tensors, save_store

__all__ = ["check_features", "sharded_optimizer", "fused_anchor", "shard_store_configs", "fallback_tables",
           "save_shards", "owned_writer",
           "keep_owned_rows", "anchor_as_here", "ShardStore", "OwnedWriter", "forward_outside_graph",
           "OutsideGraphUnderCompile"]

ShardStore = cncore.EmbeddingStore | TieredStore


def check_features(features, needed: list[str], is_weighted: bool, variable_batch: bool = False) -> None:
    """A rank's KJT, checked before any collective (a bad batch raises here, on its rank, with the
    single-process collection's messages, instead of reaching the all-to-all): CPU tensors with
    values, int IDs, float weights (present when is_weighted), lengths >= 0 adding up to the
    values, one batch size for every key (or, with `variable_batch`, one per key), every feature
    the tables read present."""
    if not isinstance(features, KeyedJaggedTensor):
        raise TypeError(f"features must be a KeyedJaggedTensor, got {type(features).__name__}")
    vbe = features.variable_stride_per_key()
    if vbe and not variable_batch:
        raise ValueError("features: a variable batch size per key is not supported; one batch size per rank is "
                         "(ranks may differ)")
    values, lengths, weights = features.values(), features.lengths(), features.weights_or_none()
    for name, t in (("values", values), ("lengths", lengths), ("weights", weights)):
        if t is not None and (t.is_meta or t.device.type != "cpu"):
            raise ValueError(f"features: {name} is on {t.device}; expected a CPU tensor (the rows are in the core)")
    if values.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"features: values must be int64 or int32 IDs, got {values.dtype}")
    if is_weighted and weights is None:
        raise ValueError("features: is_weighted=True but the KJT has no weights")
    if weights is not None and (not weights.is_floating_point() or weights.shape != values.shape):
        raise ValueError(f"features: weights must be floating point with one weight per ID, got {weights.dtype} "
                         f"{tuple(weights.shape)} for {values.numel()} IDs")
    if lengths.numel() and int(lengths.min()) < 0:
        raise ValueError(f"features: lengths must be >= 0, got {int(lengths.min())}")
    if int(lengths.sum()) != values.numel():
        raise ValueError(f"features: lengths add up to {int(lengths.sum())}, but values holds {values.numel()} IDs")
    if vbe and lengths.numel() != sum(int(s) for s in features.stride_per_key()):
        raise ValueError(f"features: {lengths.numel()} lengths for keys of batch sizes {features.stride_per_key()}")
    if not vbe and lengths.numel() != len(features.keys()) * features.stride():
        raise ValueError(f"features: {lengths.numel()} lengths for {len(features.keys())} keys of batch size "
                         f"{features.stride()}")
    missing = [f for f in needed if f not in features.keys()]
    if missing:
        raise ValueError(f"features: no key {missing[0]!r} (it has {features.keys()})")


def sharded_optimizer(module, owner: str, fused_params: dict[str, Any] | None = None):
    """(optimizer, store configs with it) of a collection being sharded, read as TorchRec's own
    sharders read it: the collection's optimizer=, the optimizer `torchrec.optim.
    apply_optimizer_in_backward` attached to its parameters (DMP shards a meta module, which
    never adopted it), or the sharder's FBGEMM-style `fused_params`
    (`CNEmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
    "learning_rate": 0.05})`); those set must agree (`cncore_torch.optim.resolve_optimizer`). A
    sharded table trains only fused, so none is refused now rather than in backward."""
    optimizer = resolve_optimizer(module._optimizer, module._anchor, owner, fused_params, sharded=True)
    if optimizer is None:
        raise no_optimizer_error(owner)
    return optimizer, {name: dataclasses.replace(c, optimizer=optimizer) for name, c in module._store_configs.items()}


def fused_anchor() -> nn.Parameter:
    """The sharded module's zero-size parameter, marked as TorchRec marks the parameters of its
    fused tables (`_in_backward_optimizers`), so that `torchrec.optim.optimizers.
    in_backward_optimizer_filter(model.named_parameters())` leaves it out of the dense optimizer."""
    from torchrec.optim.fused import EmptyFusedOptimizer
    anchor = nn.Parameter(torch.empty(0))
    anchor._in_backward_optimizers = [EmptyFusedOptimizer()]  # type: ignore[attr-defined]  # TorchRec's mark
    return anchor


def shard_store_configs(configs: dict[str, cncore.StoreConfig], world_size: int,
                        rank: int = 0) -> dict[str, cncore.StoreConfig]:
    """Each rank's config of every table: a table's row budget (max_rows, and headroom) is split
    between the ranks, ceil(max_rows / world_size) each, as row-wise sharding splits
    num_embeddings; keys spread evenly by the owner hash, so the ranks together hold about the
    budget, and each shard evicts by its own policy when its share is full. Fallback rows are
    split the same way: ``fallback_rows=N``, ceil(N / world_size) each; ``"auto"`` (and the
    default where it can run, as for an unsharded table) lets each shard choose its split when
    it fills, from what that shard measured (ranks may choose different counts). A key reads
    the fallback rows of the rank that owns it. A tiered table (storage=) gets a directory per
    rank, `<its path>/shard-<rank>-of-<world size>` (two ranks in one directory would
    overwrite each other's records), with the same cache budget (each process holds its own
    cache).

    >>> import cncore
    >>> fixed = shard_store_configs({"t": cncore.StoreConfig(dim=2, max_rows=9, fallback_rows=3)}, 2)["t"]
    >>> default = shard_store_configs({"t": cncore.StoreConfig(dim=2, max_rows=9)}, 2)["t"]
    >>> fixed.max_rows, fixed.fallback_rows, default.fallback_rows
    (5, 2, 'auto')
    """
    out = {}
    for name, config in configs.items():
        config = with_default_split(config)
        if config.storage is not None and world_size > 1:
            os.makedirs(config.storage.path, exist_ok=True)
            config = dataclasses.replace(config, storage=dataclasses.replace(
                config.storage, path=os.path.join(config.storage.path, shard_name(rank, world_size))))
        if world_size == 1:
            out[name] = config
            continue
        if isinstance(config.fallback_rows, int) and config.fallback_rows:
            config = dataclasses.replace(config, fallback_rows=-(-config.fallback_rows // world_size))
        if config.max_rows is None:
            out[name] = config
            continue
        share = -(-config.max_rows // world_size)
        headroom = None if config.headroom is None else min(-(-config.headroom // world_size), share - 1)
        out[name] = dataclasses.replace(config, max_rows=share, headroom=headroom,
                                        capacity=min(config.capacity, share))
    return out


def fallback_tables(configs: dict[str, cncore.StoreConfig]) -> frozenset[str]:
    """The tables whose shards may hold fallback rows (a fixed count, or ``"auto"``), from the
    configs `shard_store_configs` gave every rank alike: each rank writes their fallback entries
    (`cncore_torch.state.save_store`'s `fallback_entries`), whatever its own shard chose."""
    return frozenset(name for name, config in configs.items() if config.fallback_rows)


def save_shards(stores: dict[str, ShardStore], destination: dict, prefix: str, shard: tuple[int, int, int], group,
                fallback: frozenset[str]) -> None:
    """Every table's shard under ``<prefix>tables.<name>.`` (`cncore_torch.state.save_store`),
    `fallback` the tables whose shards write fallback entries (`fallback_tables`)."""
    for name, store in stores.items():
        save_store(store, destination, f"{prefix}tables.{name}.", shard, group, fallback_entries=name in fallback)


class OwnedWriter:
    """What loads a checked TableState into `store`: the rows this rank owns (replacing all).
    The evicted count comes back from this rank's own shard entries (its ``shard`` entry names
    this rank and world size); from other entries it starts at 0 (merge_shards sums the ranks'
    counts, which no single rank's count can be restored from). `rows_kept(keys)` counts the keys
    it would keep; `place` (rank, world size) says whose shard entries are this table whole
    (cncore_torch.state reads both)."""

    def __init__(self, store: ShardStore, world_size: int, rank: int) -> None:
        self._store, self._world_size, self._rank = store, world_size, rank
        self.place = (rank, world_size)

    def _owned(self, keys: np.ndarray) -> np.ndarray:
        return (owner_of(torch.from_numpy(keys), self._world_size) == self._rank).numpy()

    def rows_kept(self, keys: np.ndarray) -> int:
        return int(self._owned(keys).sum())

    def __call__(self, state: TableState) -> None:
        mine = self._owned(state.keys)
        own_shard = state.shard is not None and state.shard[:2] == self.place
        if state.fallback is not None and len(state.fallback[0]) \
                and not fallback_in_place(state.shard, self.place):  # (load_tables refuses them first)
            raise ValueError(fallback_moved_error("", len(state.fallback[0]), state.shard, self.place))
        TableState(state.keys[mine], state.rows[mine], state.optimizer_state[mine], state.counts[mine],
                   state.last_steps[mine], state.step, state.evicted_count if own_shard else None,
                   fallback=state.fallback).load_into(self._store)


def owned_writer(store: ShardStore, world_size: int, rank: int) -> OwnedWriter:
    """The `OwnedWriter` of `store` on `rank` of `world_size`."""
    return OwnedWriter(store, world_size, rank)


def anchor_as_here(state_dict, prefix: str, anchor: nn.Parameter):
    """`state_dict` with its empty `_anchor` entry in this module's anchor shape: a collection's
    anchor is (0, 1), a sharded one's (0,), and neither holds a value, so a checkpoint of either
    loads into the other."""
    entry = state_dict.get(prefix + "_anchor")
    if isinstance(entry, torch.Tensor) and entry.numel() == 0 and entry.shape != anchor.shape:
        return {**state_dict, prefix + "_anchor": entry.reshape(anchor.shape)}
    return state_dict


def keep_owned_rows(stores, source_stores, world_size: int, rank: int) -> None:
    """Rows of a materialised unsharded module: each rank keeps the ones it owns. A used table
    with fallback rows is refused over several ranks (its shared rows are no shard's)."""
    for name, store in source_stores.items():
        used = len(store) > 0 or getattr(store, "step", 0) > 0
        if world_size > 1 and getattr(store, "fallback_rows", 0) > 0 and used:
            raise ValueError(unplaceable_fallback_error(
                f"table {name!r}", f"it holds {store.fallback_rows} trained fallback rows of a whole table",
                f"it is to be split over {world_size} ranks",
                ["shard the module before it trains (DMP on a meta or fresh module)",
                 "load its state_dict after cncore_torch.state.drop_fallback_rows"], "sharded"))
    for name, store in source_stores.items():
        if len(store):
            owned_writer(stores[name], world_size, rank)(TableState.from_export(export_tensors(store), store.step))


@torch.compiler.disable
def forward_outside_graph(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """TorchRec's sharded forward (input dist, lookup, output dist) of `module`, run eagerly with
    its result waited for: what a sharded collection's forward does under `torch.compile` of a
    model that holds it. The routing and the collectives are host-side work on varying sizes
    that dynamo cannot trace, so a graph break surrounds them; the model's other modules
    compile, and autograd runs through both."""
    from torchrec.distributed.types import LazyAwaitable, ShardedModule
    out = ShardedModule.forward(module, *args, **kwargs)
    return out.wait() if isinstance(out, LazyAwaitable) else out


class OutsideGraphUnderCompile:
    """What both sharded collections put before TorchRec's sharded module in their bases: its
    forward is TorchRec's, and under `torch.compile` of a model holding it runs outside the graph
    (`forward_outside_graph`)."""

    def forward(self, *input: Any, **kwargs: Any) -> Any:
        """TorchRec's sharded forward; under `torch.compile` of a model holding it, run outside the
        graph (see `forward_outside_graph`), its result waited for.

        Args:
            *input (Any): the KJT.
            **kwargs (Any): passed on.

        Returns:
            Any: the output (an awaitable of it in eager mode, as TorchRec's).
        """
        if torch.compiler.is_compiling():
            return forward_outside_graph(cast(nn.Module, self), *input, **kwargs)
        return super().forward(*input, **kwargs)  # type: ignore[misc]

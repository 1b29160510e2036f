"""The sharder and the sharded module: `CNEmbeddingBagCollection` under TorchRec's DMP.

>>> # in every rank, after torch.distributed.init_process_group("gloo", ...):
>>> # model = DistributedModelParallel(model, device=torch.device("cpu"),
>>> #                                  sharders=[CNEmbeddingBagCollectionSharder()])

Each table is sharded row-wise across all ranks: a key lives on `routing.owner_of(key,
world_size)` and nowhere else. A rank's shard of a table is a `cncore.EmbeddingStore` with the
same configuration (seed, initializer, optimizer) as the single-process table, so a key's row
starts out identical whichever rank owns it. `stores` gives them by table name, as the
collection's `stores` does.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import numpy as np
import torch
from torch import nn
from torchrec.distributed.embedding_sharding import (
    EmbeddingShardingContext,
    EmbeddingShardingInfo,
    KJTListSplitsAwaitable,
)
from torchrec.distributed.embedding_types import KJTList, ShardedEmbeddingModule
from torchrec.distributed.embeddingbag import (
    EmbeddingBagCollectionContext,
    EmbeddingBagCollectionSharder,
    ShardedEmbeddingBagCollection,
)
from torchrec.distributed.types import Awaitable, LazyAwaitable, ParameterSharding, ShardingEnv
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingTableConfig, PoolingType
from torchrec.optim.keyed import KeyedOptimizer
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

import cncore
from cncore_torch.collection import CNEmbeddingBagCollection
from cncore_torch.dcp import EntryPaths
from cncore_torch.distributed.checkpoint import agree_run_id
from cncore_torch.distributed.embedding_sharding import (
    OutsideGraphUnderCompile,
    ShardStore,
    anchor_as_here,
    check_features,
    fallback_tables,
    fused_anchor,
    keep_owned_rows,
    owned_writer,
    save_shards,
    shard_store_configs,
    sharded_optimizer,
)
from cncore_torch.distributed.planner import (
    KERNEL,
    ROW_WISE,
    check_plan,
    planner_parameters,
    register_planner_estimates,
)
from cncore_torch.distributed.rw_sharding import (
    CNRwPooledEmbeddingSharding,
    CNRwSparseFeaturesDist,
    route_kjt_and_order,
)
from cncore_torch.distributed.vbe import expand_variable_batch
from cncore_torch.distributed.weights_dist import (
    attach_weights,
    permuted_positions,
    weights_need_grad,
    weights_route,
)
from cncore_torch.optim import keyed_fused_optimizer
from cncore_torch.state import load_tables

__all__ = ["CNEmbeddingBagCollectionSharder", "ShardedCNEmbeddingBagCollection"]


class _KeyedTensorAwaitable(LazyAwaitable[KeyedTensor]):
    """The summed pools as TorchRec's KeyedTensor, mean-pooled features divided by their full
    bag length (the partial sums of a bag split across ranks add up to the bag's sum)."""

    def __init__(self, values: Awaitable[torch.Tensor], names: list[str], dims: list[int],
                 divisor: torch.Tensor | None):
        super().__init__()
        self._values, self._names, self._dims, self._divisor = values, names, dims, divisor

    def _wait_impl(self) -> KeyedTensor:
        values = self._values.wait()
        if self._divisor is not None:
            values = values / self._divisor
        return KeyedTensor(keys=self._names, length_per_key=self._dims, values=values)


class ShardedCNEmbeddingBagCollection(EntryPaths, OutsideGraphUnderCompile, ShardedEmbeddingBagCollection):
    """`CNEmbeddingBagCollection` sharded row-wise by key hash over every rank of the process group.

    TorchRec's `ShardedEmbeddingBagCollection` is built around dense weight tensors (it reads the
    unsharded module's parameters and registers sharded tensors per table); this subclass keeps its
    interface (input_dist / compute / output_dist, context, `fused_optimizer`) and replaces the
    construction: one `CNRwPooledEmbeddingSharding` for all tables, the rank's stores, and the
    state_dict (`tables.<name>.keys/rows/...`: this rank's keys only). Built by
    `CNEmbeddingBagCollectionSharder.shard`, which DMP calls.

    Args:
        module (CNEmbeddingBagCollection): the unsharded collection (its configs and options).
        table_name_to_parameter_sharding (dict[str, ParameterSharding]): the plan's entries
            (row-wise, our kernel, every rank).
        env (ShardingEnv): the process group, rank and world size.
        fused_params (dict[str, Any] | None): the sharder's fused optimizer parameters.
        device (torch.device | None): the compute device (cpu).
        qcomm_codecs_registry (dict | None): TorchRec's quantized-communication codecs.
        module_fqn (str | None): the module's path in the model.
        pack_pools (bool): send back only the partial pools of bags with a key on the rank.
    """

    def __init__(self, module: CNEmbeddingBagCollection, table_name_to_parameter_sharding: dict[str, ParameterSharding],
                 env: ShardingEnv, fused_params: dict[str, Any] | None = None,
                 device: torch.device | None = None, qcomm_codecs_registry: dict | None = None,
                 module_fqn: str | None = None, pack_pools: bool = False):
        ShardedEmbeddingModule.__init__(self, qcomm_codecs_registry=qcomm_codecs_registry)
        self._pack_pools = pack_pools
        if not isinstance(module, CNEmbeddingBagCollection):
            raise TypeError(f"module must be a CNEmbeddingBagCollection, got {type(module).__name__}")
        configs = module.embedding_bag_configs()
        check_plan(module, configs, table_name_to_parameter_sharding, device, fused_params)
        self._module_fqn = module_fqn
        self._env = env
        self._pg = env.process_group
        self._world_size, self._rank = env.world_size, env.rank
        self._run_id = agree_run_id(env)  # in every shard's state_dict and shard files
        self._device = torch.device("cpu")
        self._embedding_bag_configs = configs
        self._is_weighted = module.is_weighted()
        self._features = [f for names in module._feature_names for f in names]
        self._embedding_names = list(module._embedding_names)
        self._embedding_dims = list(module._lengths_per_embedding)
        self._feature_tables = [c.name for c, names in zip(configs, module._feature_names) for _ in names]
        self._mean_features = [i for i, mode in enumerate(module._modes) if mode == "mean"]
        self.module_sharding_plan = {c.name: table_name_to_parameter_sharding[c.name] for c in configs}
        optimizer, configs_with_optimizer = sharded_optimizer(module, "ShardedCNEmbeddingBagCollection", fused_params)
        self._store_configs = shard_store_configs(configs_with_optimizer, self._world_size, self._rank)
        self._fallback_tables = fallback_tables(self._store_configs)  # every rank alike (see save_shards)
        self._anchor = fused_anchor()
        self._stores = {name: cncore.make_store(config) for name, config in self._store_configs.items()}
        keep_owned_rows(self._stores, module.stores, self._world_size, self._rank)
        self._optim = keyed_fused_optimizer(self._anchor, optimizer, list(self._stores.values()),
                                            "embedding_bags.fused")
        infos = [EmbeddingShardingInfo(
            embedding_config=EmbeddingTableConfig(
                num_embeddings=c.num_embeddings, embedding_dim=c.embedding_dim, name=c.name, data_type=c.data_type,
                feature_names=list(names), pooling=PoolingType.SUM, is_weighted=self._is_weighted,
                has_feature_processor=False, embedding_names=list(emb)),
            param_sharding=table_name_to_parameter_sharding[c.name],
            param=torch.empty(c.num_embeddings, c.embedding_dim, device="meta"), fused_params={})
            for c, names, emb in zip(configs, module._feature_names,
                                     _split(self._embedding_names, module._feature_names))]
        sharding = CNRwPooledEmbeddingSharding(infos, env, self._device, stores=self._stores,
                                               feature_tables=self._feature_tables, is_weighted=self._is_weighted,
                                               anchor=self._anchor)
        self._embedding_shardings = [sharding]
        self._sharding_types = [ROW_WISE]
        lookup = sharding.create_lookup()
        lookup.kernel.fused_optimizer = self._optim
        self._input_dists = nn.ModuleList([sharding.create_input_dist()])
        self._lookups = nn.ModuleList([lookup])
        self._output_dists = nn.ModuleList([sharding.create_output_dist()])
        self._has_uninitialized_input_dist = False

    # --- what the collection offers -------------------------------------------------------------

    @property
    def stores(self) -> dict[str, ShardStore]:
        """{table name: this rank's store} (the keys this rank owns)."""
        return self._stores

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        """The collection's table configs, as TorchRec's sharded collection gives them.

        Returns:
            list[EmbeddingBagConfig]: one per table.
        """
        return self._embedding_bag_configs

    def is_weighted(self) -> bool:
        """Whether the features carry per-sample weights.

        Returns:
            bool: the collection's `is_weighted`.
        """
        return self._is_weighted

    @property
    def fused_optimizer(self) -> KeyedOptimizer:
        return self._optim

    @property
    def unsharded_module_type(self) -> type[CNEmbeddingBagCollection]:
        return CNEmbeddingBagCollection

    def reset_parameters(self) -> None:
        """Nothing to reset: rows are drawn from (seed, table, key) as keys arrive."""

    # --- the three stages --------------------------------------------------------------------------

    def create_context(self) -> EmbeddingBagCollectionContext:
        """A fresh context for one forward (TorchRec's pipeline keeps it between the stages).

        Returns:
            EmbeddingBagCollectionContext: empty.
        """
        return EmbeddingBagCollectionContext()

    def input_dist(self, ctx: EmbeddingBagCollectionContext,
                   features: KeyedJaggedTensor) -> Awaitable[Awaitable[KJTList]]:
        """Route each ID (and its weight) to the rank that owns its row (TorchRec's KJT all-to-all).

        Args:
            ctx (EmbeddingBagCollectionContext): this forward's context.
            features (KeyedJaggedTensor): the rank's batch (a variable batch per key is expanded).

        Returns:
            Awaitable[Awaitable[KJTList]]: the IDs this rank owns, from every rank.
        """
        check_features(features, self._features, self._is_weighted, variable_batch=True)
        weights = features.weights_or_none() if self._is_weighted else None
        attach = self._is_weighted and weights_need_grad(weights, self._pg)
        with torch.no_grad():
            keys = features.keys()
            order = [keys.index(f) for f in self._features]
            positions: torch.Tensor | None
            if features.variable_stride_per_key():  # each sample's bag, as one batch (see vbe.py)
                features, positions = expand_variable_batch(features, self._features, type(self).__name__)
            else:
                positions = permuted_positions(features, order) if attach else None
                if order != list(range(len(keys))):
                    features = features.permute(order)
            stride = features.stride()
            kjt = KeyedJaggedTensor(keys=self._embedding_names, values=features.values(),
                                    lengths=features.lengths(), stride=stride,
                                    weights=features.weights_or_none() if self._is_weighted else None)
            if self._mean_features:
                lengths = features.lengths().view(len(self._features), stride)
                divisor = torch.ones((stride, sum(self._embedding_dims)))
                starts = np.concatenate([[0], np.cumsum(self._embedding_dims)])
                for f in self._mean_features:
                    divisor[:, starts[f]:starts[f + 1]] = lengths[f].clamp(min=1).to(torch.float32).unsqueeze(1)
                ctx.divisor = divisor
            sharding_ctx = EmbeddingShardingContext(batch_size_per_rank=[stride] * self._world_size)
            routed, route_order = route_kjt_and_order(kjt, self._world_size)
            if attach:  # where each weight went, for its gradient's way home
                assert weights is not None and positions is not None  # attach: weights that require grad
                sharding_ctx.cn_weights = weights_route(weights, positions, route_order, routed.lengths(),
                                                        self._world_size)
            if self._pack_pools:
                sharding_ctx.cn_routed = routed.lengths()  # which ranks hold keys of which of my bags
            ctx.sharding_contexts.append(sharding_ctx)
            input_dist = cast(CNRwSparseFeaturesDist, self._input_dists[0])
            return KJTListSplitsAwaitable([input_dist.send(routed)], ctx, self._module_fqn,
                                          self._sharding_types)

    def compute(self, ctx: EmbeddingBagCollectionContext, dist_input: KJTList) -> list[torch.Tensor]:
        """Pool this rank's rows of every rank's bags (partial pools; the backward updates the rows).

        Args:
            ctx (EmbeddingBagCollectionContext): this forward's context.
            dist_input (KJTList): what `input_dist` delivered.

        Returns:
            list[torch.Tensor]: the partial pools, one tensor for all tables.
        """
        if self._pack_pools:
            for sharding_ctx, features in zip(ctx.sharding_contexts, dist_input):
                sharding_ctx.cn_received = features.lengths()  # which of my partial pools are not zero
        route = getattr(ctx.sharding_contexts[0], "cn_weights", None)
        if route is not None:
            dist_input = KJTList([attach_weights(dist_input[0], route, self._anchor, len(self._features),
                                                 list(ctx.sharding_contexts[0].batch_size_per_rank), self._pg)])
        return [lookup(features) for lookup, features in zip(self._lookups, dist_input)]

    def output_dist(self, ctx: EmbeddingBagCollectionContext, output: list[torch.Tensor]) -> LazyAwaitable[KeyedTensor]:
        """Send each rank its bags' partial pools and add them up (an all-to-all).

        Args:
            ctx (EmbeddingBagCollectionContext): this forward's context.
            output (list[torch.Tensor]): what `compute` returned.

        Returns:
            LazyAwaitable[KeyedTensor]: the pooled embeddings of this rank's batch.
        """
        values = self._output_dists[0](output[0], ctx.sharding_contexts[0])
        return _KeyedTensorAwaitable(values, self._embedding_names, self._embedding_dims, ctx.divisor)

    def compute_and_output_dist(self, ctx: EmbeddingBagCollectionContext, input: KJTList) -> LazyAwaitable[KeyedTensor]:
        """`compute`, then `output_dist`.

        Args:
            ctx (EmbeddingBagCollectionContext): this forward's context.
            input (KJTList): what `input_dist` delivered.

        Returns:
            LazyAwaitable[KeyedTensor]: the pooled embeddings of this rank's batch.
        """
        return self.output_dist(ctx, self.compute(ctx, input))

    # --- state ---------------------------------------------------------------------------------------

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        """This rank's shard of every table under `tables.<name>.` (keys it owns, rows, optimizer
        state, counts, last steps, step), as the collection saves a whole table."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        save_shards(self._stores, destination, prefix, (self._rank, self._world_size, self._run_id), self._pg,
                    self._fallback_tables)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        """All or nothing (see cncore_torch.state). The entries may hold any keys (one rank's shard
        at any world size, several ranks' shards merged with `merge_shards`, or a single-process
        collection's tables): this rank keeps the ones it owns now, so a checkpoint written by N
        ranks loads into M."""
        def load_rest(rest, missing, unexpected, errors):
            nn.Module._load_from_state_dict(self, rest, prefix, local_metadata, strict, missing, unexpected, errors)

        state_dict = anchor_as_here(state_dict, prefix, self._anchor)
        load_tables(self._tables(prefix), load_rest, state_dict, missing_keys, unexpected_keys, error_msgs)

    def _tables(self, prefix: str) -> dict:
        return {f"{prefix}tables.{name}.": (store.config, owned_writer(store, self._world_size, self._rank))
                for name, store in self._stores.items()}

    def sharded_parameter_names(self, prefix: str = "") -> Iterator[str]:
        """The names of the module's parameters (the anchor; the rows are not parameters).

        Args:
            prefix (str): prepended to each name.

        Returns:
            Iterator[str]: the names.
        """
        yield from (key for key, _ in self.named_parameters(prefix))


def _split(flat: list[str], groups: list[list[str]]) -> list[list[str]]:
    out, at = [], 0
    for g in groups:
        out.append(flat[at:at + len(g)])
        at += len(g)
    return out


class CNEmbeddingBagCollectionSharder(EmbeddingBagCollectionSharder):
    """Shards `CNEmbeddingBagCollection` row-wise (by key hash) with our kernel
    (`EmbeddingComputeKernel.CUSTOMIZED_KERNEL`), on cpu. Pass it to DMP:
    `DistributedModelParallel(model, device=torch.device("cpu"), sharders=[CNEmbeddingBagCollectionSharder()])`
    (add TorchRec's default sharders to the list for TorchRec's own modules in the same model).

    `pack_pools=True` sends back only the partial pools of bags that hold a key on the sending
    rank (the analytic minimum of pooled bytes; see rw_sharding.py) instead of every sample's
    partial pool, about half the pooled bytes in the DLRM benchmark. It trades bytes for CPU: its
    gathers and scatters cost more CPU than the unpacked sum, and on loopback gloo sending the
    bytes it saves costs less than that (docs/distributed.md and docs/benchmarks.md have the
    measurements). So the
    default is off; turn it on where the network, not the CPU, is the bottleneck.

    Args:
        fused_params (dict[str, Any] | None): the fused optimizer's parameters
            (``optimizer``, ``learning_rate``, ...), as TorchRec's sharders take them.
        qcomm_codecs_registry (dict | None): TorchRec's quantized-communication codecs.
        pack_pools (bool): send back only the partial pools of bags with a key on the rank.
        **kwargs (Any): passed to TorchRec's `EmbeddingBagCollectionSharder`.
    """

    def __init__(self, fused_params: dict[str, Any] | None = None, qcomm_codecs_registry: dict | None = None, *,
                 pack_pools: bool = False, **kwargs: Any) -> None:
        super().__init__(fused_params=fused_params, qcomm_codecs_registry=qcomm_codecs_registry, **kwargs)
        register_planner_estimates()  # DMP without a plan asks TorchRec's planner, which needs them
        if not isinstance(pack_pools, bool):
            raise TypeError(f"pack_pools must be True or False, got {pack_pools!r}")
        self._pack_pools = pack_pools

    def shard(self, module: CNEmbeddingBagCollection, params: dict[str, ParameterSharding], env: ShardingEnv,
              device: torch.device | None = None,
              module_fqn: str | None = None) -> ShardedCNEmbeddingBagCollection:
        return ShardedCNEmbeddingBagCollection(module, params, env, self.fused_params, device,
                                               qcomm_codecs_registry=self.qcomm_codecs_registry, module_fqn=module_fqn,
                                               pack_pools=self._pack_pools)

    def shardable_parameters(self, module: CNEmbeddingBagCollection) -> dict[str, nn.Parameter]:
        """One (num_embeddings, dim) meta parameter per table, in its row dtype: what TorchRec's planner sizes
        (num_embeddings is a capacity hint; nothing is allocated).

        Args:
            module (CNEmbeddingBagCollection): the collection to shard.

        Returns:
            dict[str, nn.Parameter]: a meta parameter per table name.
        """
        return planner_parameters(module, module.embedding_bag_configs(), self.fused_params)

    def sharding_types(self, compute_device_type: str) -> list[str]:
        """The shardings on offer: row-wise only (by key hash over every rank).

        Args:
            compute_device_type (str): the device type ("cpu").

        Returns:
            list[str]: ``[ShardingType.ROW_WISE.value]``.
        """
        return [ROW_WISE]

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        """The kernels on offer: ours (`EmbeddingComputeKernel.CUSTOMIZED_KERNEL`).

        Args:
            sharding_type (str): the plan's sharding type.
            compute_device_type (str): the device type ("cpu").

        Returns:
            list[str]: the one kernel.
        """
        return [KERNEL]

    @property
    def module_type(self) -> type[CNEmbeddingBagCollection]:
        return CNEmbeddingBagCollection

    @property
    def sharded_module_type(self) -> type[ShardedCNEmbeddingBagCollection]:
        return ShardedCNEmbeddingBagCollection




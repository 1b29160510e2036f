"""`CNEmbeddingCollection` (unpooled: one row per ID) sharded row-wise by key hash under DMP.

The same routing as the pooled collection (`routing.owner_of`), with the unpooled layout: every
ID goes to its owner (with its table), the owner looks up one row per ID, and the rows travel
back in the order the IDs went out, so each rank gets exactly the rows of its own IDs (N x dim,
not a pool per bag). Both exchanges are all-to-alls with split sizes (any per-rank batch sizes,
gloo included); the rows' all-to-all is an autograd function, so each row's gradient goes back
to its owner, where the fused optimizer applies it in backward (a table's IDs from every rank
in one update per row, as the single-process collection does).

The stages are those of TorchRec's `ShardedEmbeddingCollection` (input_dist, compute,
output_dist); the sharding, dist and kernel classes are not split out as for the pooled
collection (`embeddingbag.py`): this is the smaller sibling, with its parts in this file.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.embedding import (
    EmbeddingCollectionContext,
    EmbeddingCollectionSharder,
    ShardedEmbeddingCollection,
)
from torchrec.distributed.embedding_types import ShardedEmbeddingModule
from torchrec.distributed.types import Awaitable, LazyAwaitable, NoWait, ParameterSharding, ShardingEnv
from torchrec.optim.keyed import KeyedOptimizer
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

import cncore
from cncore_torch.collection import CNEmbeddingCollection
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
from cncore_torch.distributed.routing import owner_of
from cncore_torch.distributed.rw_sharding import SplitAllToAll
from cncore_torch.distributed.vbe import expand_variable_batch
from cncore_torch.functional import unpooled_lookup
from cncore_torch.optim import keyed_fused_optimizer
from cncore_torch.state import load_tables

__all__ = ["CNEmbeddingCollectionSharder", "ShardedCNEmbeddingCollection"]


class _Rows(LazyAwaitable[dict[str, JaggedTensor]]):
    def __init__(self, fn):
        super().__init__()
        self._fn = fn

    def _wait_impl(self) -> dict[str, JaggedTensor]:
        return self._fn()


class ShardedCNEmbeddingCollection(EntryPaths, OutsideGraphUnderCompile, ShardedEmbeddingCollection):
    """`CNEmbeddingCollection` with every table sharded row-wise by key hash over the process group.
    Built by `CNEmbeddingCollectionSharder.shard`, which DMP calls.

    Args:
        module (CNEmbeddingCollection): the unsharded collection (its configs and options).
        table_name_to_parameter_sharding (dict[str, ParameterSharding]): the plan's entries.
        env (ShardingEnv): the process group, rank and world size.
        fused_params (dict[str, Any] | None): the sharder's fused optimizer parameters.
        device (torch.device | None): the compute device (cpu).
        qcomm_codecs_registry (dict | None): TorchRec's quantized-communication codecs.
        module_fqn (str | None): the module's path in the model.
    """

    def __init__(self, module: CNEmbeddingCollection, table_name_to_parameter_sharding: dict[str, ParameterSharding],
                 env: ShardingEnv, fused_params: dict[str, Any] | None = None,
                 device: torch.device | None = None, qcomm_codecs_registry: dict | None = None,
                 module_fqn: str | None = None):
        ShardedEmbeddingModule.__init__(self, qcomm_codecs_registry=qcomm_codecs_registry)
        if not isinstance(module, CNEmbeddingCollection):
            raise TypeError(f"module must be a CNEmbeddingCollection, got {type(module).__name__}")
        check_plan(module, module.embedding_configs(), table_name_to_parameter_sharding, device, fused_params)
        self._module_fqn, self._env, self._pg = module_fqn, env, env.process_group
        self._world_size, self._rank = env.world_size, env.rank
        self._run_id = agree_run_id(env)  # in every shard's state_dict and shard files
        self._configs = module.embedding_configs()
        self._feature_names, self._names_by_table = module._feature_names, module.embedding_names_by_table()
        self._dim = module.embedding_dim()
        self._features = [f for names in self._feature_names for f in names]
        self._feature_table = [t for t, names in enumerate(self._feature_names) for _ in names]
        self.module_sharding_plan = {c.name: table_name_to_parameter_sharding[c.name] for c in self._configs}
        self._anchor = fused_anchor()
        optimizer, configs_with_optimizer = sharded_optimizer(module, "ShardedCNEmbeddingCollection", fused_params)
        store_configs = shard_store_configs(configs_with_optimizer, self._world_size, self._rank)
        self._stores = {name: cncore.make_store(config) for name, config in store_configs.items()}
        self._fallback_tables = fallback_tables(store_configs)  # every rank alike (see save_shards)
        keep_owned_rows(self._stores, module.stores, self._world_size, self._rank)
        self._table_stores = [self._stores[c.name] for c in self._configs]  # what the lookup reads
        self._optim = keyed_fused_optimizer(self._anchor, optimizer, list(self._stores.values()),
                                                      "embeddings.fused")
        # TorchRec's sharded EC keeps its dists and lookups here; ours are the methods below
        self._input_dists: list[nn.Module] = []
        self._lookups: list[nn.Module] = []
        self._output_dists: list[nn.Module] = []

    @property
    def fused_optimizer(self) -> KeyedOptimizer:
        return self._optim

    @property
    def stores(self) -> dict[str, ShardStore]:
        """{table name: this rank's store} (the keys this rank owns)."""
        return self._stores

    def _lookup_tables(self) -> list:
        """Each table's local store, once (see cncore_torch.functional.unpooled_lookup)."""
        return self._table_stores

    @property
    def unsharded_module_type(self) -> type[CNEmbeddingCollection]:
        return CNEmbeddingCollection

    def reset_parameters(self) -> None:
        """Nothing to reset: rows are drawn from (seed, table, key) as keys arrive."""

    def create_context(self) -> EmbeddingCollectionContext:
        """A fresh context for one forward.

        Returns:
            EmbeddingCollectionContext: empty.
        """
        return EmbeddingCollectionContext()

    def _exchange(self, tensor: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        out = tensor.new_empty((sum(out_splits),) + tuple(tensor.shape[1:]))
        dist.all_to_all_single(out, tensor.contiguous(), out_splits, in_splits, group=self._pg)
        return out

    def input_dist(self, ctx: EmbeddingCollectionContext, features: KeyedJaggedTensor) -> Awaitable[Awaitable[Any]]:
        """Route each ID to the rank that owns its row.

        Args:
            ctx (EmbeddingCollectionContext): this forward's context.
            features (KeyedJaggedTensor): the rank's batch. With a batch size per key and
                `inverse_indices`, sample b of feature f is its bag `inverse_indices[f, b]` (every
                feature's JaggedTensor then has B bags, as TorchRec's sharded EC gives them); without
                `inverse_indices`, each feature keeps its own bags (as the unsharded collection).

        Returns:
            Awaitable[Awaitable[Any]]: the IDs this rank owns, from every rank, with their tables.
        """
        check_features(features, self._features, False, variable_batch=True)
        with torch.no_grad():
            if features.variable_stride_per_key() and features.inverse_indices_or_none() is not None:
                # each sample's bag of every feature, as one batch (TorchRec's sharded EC expands too)
                features, _ = expand_variable_batch(features, self._features, type(self).__name__)
            keys = features.keys()
            order = [keys.index(f) for f in self._features]
            if order != list(range(len(keys))):
                features = features.permute(order)
            values = features.values().to(torch.int64)
            strides = ([int(s) for s in features.stride_per_key()] if features.variable_stride_per_key()
                       else [features.stride()] * len(self._features))
            per_feature = features.length_per_key()
            table = torch.repeat_interleave(torch.tensor(self._feature_table, dtype=torch.int64),
                                            torch.tensor(per_feature, dtype=torch.int64), output_size=values.numel())
            owner = owner_of(values, self._world_size)
            sort = torch.argsort(owner * len(self._configs) + table, stable=True)
            send = torch.bincount(owner, minlength=self._world_size)
            recv = self._exchange(send, [1] * self._world_size, [1] * self._world_size)
            send_splits, recv_splits = send.tolist(), recv.tolist()
            ctx.cn = {"sort": sort, "send": send_splits, "recv": recv_splits, "per_feature": per_feature,
                      "lengths": torch.split(features.lengths(), strides)}
            routed = (self._exchange(values[sort], recv_splits, send_splits),
                      self._exchange(table[sort], recv_splits, send_splits))
            return NoWait(NoWait(routed))

    def compute(self, ctx: EmbeddingCollectionContext, dist_input: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Read this rank's rows of the routed IDs (the backward updates them).

        Args:
            ctx (EmbeddingCollectionContext): this forward's context.
            dist_input (tuple[torch.Tensor, torch.Tensor]): the routed keys and their tables.

        Returns:
            torch.Tensor: (N, dim) rows, in the routed order.
        """
        keys, tables = dist_input
        positions = [torch.nonzero(tables == t).squeeze(1) for t in range(len(self._configs))]
        rows = unpooled_lookup(self._anchor, self, [keys[p].contiguous() for p in positions], self.training)
        everything = torch.cat(rows) if rows else keys.new_empty((0, self._dim), dtype=torch.float32)
        return everything[torch.argsort(torch.cat(positions))]  # rows in the order the keys arrived

    def output_dist(self, ctx: EmbeddingCollectionContext,
                    output: torch.Tensor) -> LazyAwaitable[dict[str, JaggedTensor]]:
        """Send each rank the rows of its IDs back (an all-to-all), as one jagged tensor a feature.

        Args:
            ctx (EmbeddingCollectionContext): this forward's context.
            output (torch.Tensor): what `compute` returned.

        Returns:
            LazyAwaitable[dict[str, JaggedTensor]]: each feature's rows, as TorchRec's EC gives them.
        """
        c = ctx.cn
        back = SplitAllToAll.apply(output, c["send"], c["recv"], self._pg)  # rows of my keys, in `sort` order

        def assemble() -> dict[str, JaggedTensor]:
            rows = back[torch.argsort(c["sort"])]
            result, start, f = {}, 0, 0
            for _names, emb_names in zip(self._feature_names, self._names_by_table):
                for emb_name in emb_names:
                    n = c["per_feature"][f]
                    result[emb_name] = JaggedTensor(values=rows[start:start + n], lengths=c["lengths"][f])
                    start, f = start + n, f + 1
            return result

        return _Rows(assemble)

    def compute_and_output_dist(self, ctx: EmbeddingCollectionContext, input: tuple[torch.Tensor, torch.Tensor]
                                ) -> LazyAwaitable[dict[str, JaggedTensor]]:
        """`compute`, then `output_dist`.

        Args:
            ctx (EmbeddingCollectionContext): this forward's context.
            input (tuple[torch.Tensor, torch.Tensor]): what `input_dist` delivered.

        Returns:
            LazyAwaitable[dict[str, JaggedTensor]]: each feature's rows.
        """
        return self.output_dist(ctx, self.compute(ctx, input))

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        nn.Module._save_to_state_dict(self, destination, prefix, keep_vars)
        save_shards(self._stores, destination, prefix, (self._rank, self._world_size, self._run_id), self._pg,
                    self._fallback_tables)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        """As the pooled sharded collection: entries with any keys; this rank keeps its own."""
        def load_rest(rest, missing, unexpected, errors):
            nn.Module._load_from_state_dict(self, rest, prefix, local_metadata, strict, missing, unexpected, errors)

        tables = {f"{prefix}tables.{name}.": (store.config, owned_writer(store, self._world_size, self._rank))
                  for name, store in self._stores.items()}
        state_dict = anchor_as_here(state_dict, prefix, self._anchor)
        load_tables(tables, load_rest, state_dict, missing_keys, unexpected_keys, error_msgs)


class CNEmbeddingCollectionSharder(EmbeddingCollectionSharder):
    """Shards `CNEmbeddingCollection` row-wise by key hash (CUSTOMIZED_KERNEL), on cpu.

    Args:
        fused_params (dict[str, Any] | None): the fused optimizer's parameters, as TorchRec's
            sharders take them.
        qcomm_codecs_registry (dict | None): TorchRec's quantized-communication codecs.
        **kwargs (Any): passed to TorchRec's `EmbeddingCollectionSharder`.
    """

    def __init__(self, fused_params: dict[str, Any] | None = None, qcomm_codecs_registry: dict | None = None,
                 **kwargs: Any) -> None:
        super().__init__(fused_params=fused_params, qcomm_codecs_registry=qcomm_codecs_registry, **kwargs)
        register_planner_estimates()  # DMP without a plan asks TorchRec's planner, which needs them

    def shard(self, module: CNEmbeddingCollection, params: dict[str, ParameterSharding], env: ShardingEnv,
              device: torch.device | None = None, module_fqn: str | None = None) -> ShardedCNEmbeddingCollection:
        return ShardedCNEmbeddingCollection(module, params, env, self.fused_params, device,
                                            qcomm_codecs_registry=self.qcomm_codecs_registry, module_fqn=module_fqn)

    def shardable_parameters(self, module: CNEmbeddingCollection) -> dict[str, nn.Parameter]:
        """One (num_embeddings, dim) meta parameter per table, in its row dtype: what TorchRec's planner sizes.

        Args:
            module (CNEmbeddingCollection): the collection to shard.

        Returns:
            dict[str, nn.Parameter]: a meta parameter per table name.
        """
        return planner_parameters(module, module.embedding_configs(), self.fused_params)

    def sharding_types(self, compute_device_type: str) -> list[str]:
        """The shardings on offer: row-wise only.

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
    def module_type(self) -> type[CNEmbeddingCollection]:
        return CNEmbeddingCollection

    @property
    def sharded_module_type(self) -> type[ShardedCNEmbeddingCollection]:
        return ShardedCNEmbeddingCollection

"""`CNEmbeddingBagCollection`: TorchRec's `EmbeddingBagCollection` over growable tables.

It takes TorchRec's `EmbeddingBagConfig`s and `KeyedJaggedTensor`s and returns the same
`KeyedTensor` (same keys, order and shapes), but IDs are raw int64 values: no modulo hashing
into `num_embeddings` (now a capacity hint), no collisions. All tables are looked up in one
grouped core call per batch, and the backward updates every table in one call too, with the
fused optimizer given at construction (features sharing a table get one update per row).

>>> import torch, cncore
>>> from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
>>> from cncore_torch import CNEmbeddingBagCollection
>>> ebc = CNEmbeddingBagCollection(
...     tables=[EmbeddingBagConfig(name="t_user", embedding_dim=4, num_embeddings=100, feature_names=["user"]),
...             EmbeddingBagConfig(name="t_item", embedding_dim=8, num_embeddings=100, feature_names=["item"])],
...     optimizer=cncore.RowWiseAdagrad(lr=0.1))
>>> kjt = KeyedJaggedTensor.from_lengths_sync(keys=["user", "item"], values=torch.tensor([2**60, 5, 6, 7]),
...                                          lengths=torch.tensor([1, 0, 2, 1]))
>>> kt = ebc(kjt)
>>> kt.keys(), kt.values().shape
(['user', 'item'], torch.Size([2, 12]))
>>> kt.values().sum().backward()   # rows of both tables updated here
"""
from __future__ import annotations

import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor

from cncore.config import Admission, Eviction, Initializer, Optimizer, Tiered
from cncore_torch import bridge
from cncore_torch.base import check_flag
from cncore_torch.collection_tables import DynamicTables
from cncore_torch.embedding_configs import (
    POOLING,
    feature_names_of,
    initializer_from_config,
)
from cncore_torch.functional import unpooled_lookup
from cncore_torch.kjt_features import (
    feature_positions,
    features_by_key,
    grouped_arrays,
    kjt_of_parts,
    plain_arrays,
)
from cncore_torch.table_views import table_views
from cncore_torch.variable_batch import expand, inverse_rows, strides_of, weight_spans

__all__ = ["CNEmbeddingBagCollection", "CNEmbeddingCollection", "initializer_from_config"]


@torch.fx.wrap
def pooled_collection_lookup(anchor: torch.Tensor, handle: int, features: KeyedJaggedTensor,
                             training: bool) -> KeyedTensor:
    """CNEmbeddingBagCollection's forward: one node under torch.fx (the tables are state the
    tracer cannot see; `training` is read when traced, as TorchRec's own traced modules do)."""
    collection = bridge.table_of(handle)
    return KeyedTensor(keys=collection._embedding_names, length_per_key=collection._lengths_per_embedding,
                       values=_pooled_values(anchor, collection, features, training))


def _pooled_values(anchor: torch.Tensor, collection, features: KeyedJaggedTensor, training: bool) -> torch.Tensor:
    """The (B, sum of dims) pooled output of `pooled_collection_lookup`."""
    arrays = plain_arrays(collection, features) if collection._placement.kind == "core" else None
    if arrays is not None and not collection.is_meta:  # the common KJT, on tables in the core
        collection._adopt_tagged_optimizer()
        ids, bags = arrays
        return bridge.lookup(anchor, collection, ids, bags, [None] * len(ids), collection._modes, training,
                             inputs=(features.values(),))
    by_key = features_by_key(features, collection._feature_names, collection._rows_device)
    inverse = None if strides_of(features) is None else inverse_rows(
        features, [n for names in collection._feature_names for n in names], collection._owner)
    if collection.is_meta:  # shape inference only
        return torch.empty((features.stride(), sum(collection._lengths_per_embedding)), device="meta")
    collection._adopt_tagged_optimizer()
    keys, offsets, weights = grouped_arrays(collection, by_key)
    if inverse is None:
        return _eager_lookup(anchor, collection, keys, offsets, weights, training)
    # a batch size per feature: each feature's bags, then every sample's (autograd sums them back)
    return expand(_eager_lookup(anchor, collection, keys, offsets, weights, training, split=True), inverse,
                  collection._embedding_names)


def _on_rows_device(collection, t: torch.Tensor) -> torch.Tensor:
    """A KJT tensor where a compiled lookup's operator puts its rows (accelerator rows: their device)."""
    return t.to(collection._anchor.device) if collection._placement.kind == "device" else t


def _eager_lookup(anchor, collection, keys, offsets, weights, training: bool, split: bool = False):
    """The bridge's eager lookup (cncore_torch.bridge); on accelerator rows a graph break for
    torch.compile, as the modules' device path."""
    if collection._placement.kind == "device":
        return _device_lookup(anchor, collection, keys, offsets, weights, training, split)
    return bridge.lookup(anchor, collection, keys, offsets, weights, collection._modes, training, split)


@torch.compiler.disable
def _device_lookup(anchor, collection, keys, offsets, weights, training: bool, split: bool):
    return bridge.lookup(anchor, collection, keys, offsets, weights, collection._modes, training, split)


class CNEmbeddingBagCollection(DynamicTables, EmbeddingBagCollection):
    """TorchRec's `EmbeddingBagCollection` on dynamic tables (see the module docstring).

    One optimizer per collection: a tag that disagrees with `optimizer=`, or that changes once
    adopted, is refused. Evicted rows of a bounded table go to `stores[name].on_evict`
    callbacks and are counted in `stores[name].evicted_count`.

    Args:
        tables (list[EmbeddingBagConfig]): TorchRec's table configs (num_embeddings is a
            capacity hint, not a bound on the IDs).
        is_weighted (bool): the KJT carries per-ID weights.
        device (str | torch.device | None): "cpu" (rows in the core), "meta" (no storage until
            `to_empty`, as DMP builds models) or "cncard" / an accelerator device (rows,
            optimizer state and metadata as device tensors, the key index in the core on the
            host, as the modules' `device="cncard"`; `stores` then holds each table's
            `DeviceRows`).
        optimizer (Optimizer | None): the fused optimizer of every table (a cncore optimizer
            config); without it, the one `torchrec.optim.apply_optimizer_in_backward` puts on
            the collection's parameters (torch.optim.SGD, Adagrad, Adam or
            torchrec.optim.RowWiseAdagrad, mapped by `cncore_torch.optim.optimizer_from_torch`),
            read at the first forward (or load, or `fused_optimizer`), and also by the DMP
            sharder.
        initializers (dict[str, Initializer] | None): {table name: cncore initializer}
            overriding the configs' init.
        capacities (dict[str, int] | None): {table name: rows to allocate up front} (default
            min(num_embeddings, 2^20)).
        seed (int): each table's rows are drawn from (seed, table name, ID).
        max_rows (int | str | dict[str, int | None] | None): the row budget (README "Bounded
            tables"); "num_embeddings" makes each config's num_embeddings its table's budget.
        eviction (Eviction | dict[str, Eviction | None] | None): `cncore.LRU()`, `LFU()` or
            `TTL(steps)`.
        admission (Admission | dict[str, Admission | None] | None): `cncore.MinCount(c)` or
            `Probability(p)`.
        headroom (int | dict[str, int | None] | None): rows one eviction frees beyond the need.
        row_dtype (str | dict[str, str] | None): "float32", "float16" or "bfloat16".
        storage (Tiered | dict[str, Tiered | None] | None): `cncore.Tiered(path, cache_bytes)`:
            rows on disk under a bounded cache.
        fallback_rows (int | str | dict[str, int | str | None] | None): shared rows that IDs without
            a row of their own read and train (``StoreConfig.fallback_rows``; docs/bounded-tables.md),
            or "auto": each such table chooses its split of max_rows when it fills; None (the
            default): "auto" for each table that can take it (rows in the core, unsharded), else 0.
        fallback_copy (bool | dict[str, bool | None] | None): a new row starts as a copy of its
            fallback row (None: True) or from the initializer.
        fallback_mode (str | dict[str, str | None] | None): "miss" (None: the default) or
            "residual": every ID reads its own row plus its fallback row
            (``StoreConfig.fallback_mode``).
        per_rank_tables (bool): each rank keeps its own tables unsharded in a process group.

    Each of max_rows, eviction, admission, headroom, row_dtype and storage is one value for
    every table or {table name: value}.

    Example::

    >>> import torch, cncore
    >>> from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
    >>> ebc = CNEmbeddingBagCollection(
    ...     [EmbeddingBagConfig(name="t", embedding_dim=2, num_embeddings=3, feature_names=["f"])],
    ...     optimizer=cncore.SGD(lr=0.1), max_rows="num_embeddings", eviction=cncore.LRU(), headroom=0,
    ...     fallback_rows=0)  # a row per ID, evicted by LRU (the default may split a table that fills this fast)
    >>> for ids in ([1, 2, 3], [4]):
    ...     ebc(KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor(ids), torch.tensor([len(ids)]))
    ...         ).values().sum().backward()
    >>> ebc.table_rows(), ebc.stores["t"].evicted_count
    ({'t': 3}, 1)

    The optimizer the TorchRec way (a plain `torch.optim.SGD(model.parameters())` cannot move
    the rows, which are not parameters: the forward runs, and a gradient reaching rows with no
    optimizer says so, before any row changes):

    >>> import warnings
    >>> from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    >>> ebc = CNEmbeddingBagCollection([EmbeddingBagConfig(name="t", embedding_dim=2, num_embeddings=3,
    ...                                                    feature_names=["f"])],
    ...                                initializers={"t": cncore.Constant(1.0)})
    >>> kjt = KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor([7, 7]), torch.tensor([2]))
    >>> ebc(kjt).values().sum().backward()
    Traceback (most recent call last):
    ...
    RuntimeError: CNEmbeddingBagCollection has no optimizer, and a torch.optim optimizer over model.parameters() cannot train its rows (they are not parameters). Either build it with optimizer=cncore.RowWiseAdagrad(lr=...) (or SGD, Adagrad, Adam), or call torchrec.optim.apply_optimizer_in_backward(optimizer_class, <its parameters>, {"lr": ...}) before training, as for TorchRec's fused tables. (A forward needs neither, nor does a frozen collection: requires_grad_(False).)
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore", DeprecationWarning)  # TorchRec points at torch's private twin
    ...     apply_optimizer_in_backward(torch.optim.Adagrad, ebc.parameters(), {"lr": 0.5})
    >>> ebc(kjt).values().sum().backward()   # ID 7 twice in one bag: gradient 2 per value
    >>> ebc.stores["t"].config.optimizer, ebc.stores["t"].lookup(torch.tensor([7]).numpy()).tolist()
    (Adagrad(lr=0.5, eps=1e-10, initial_accumulator_value=0.0), [[0.5, 0.5]])
    """  # noqa: E501 (a doctest's expected error message is one line)

    def __init__(self, tables: list[EmbeddingBagConfig], is_weighted: bool = False,
                 device: str | torch.device | None = None, *, optimizer: Optimizer | None = None,
                 initializers: dict[str, Initializer] | None = None, capacities: dict[str, int] | None = None,
                 seed: int = 0, max_rows: int | str | dict[str, int | None] | None = None,
                 eviction: Eviction | dict[str, Eviction | None] | None = None,
                 admission: Admission | dict[str, Admission | None] | None = None,
                 headroom: int | dict[str, int | None] | None = None, row_dtype: str | dict[str, str] | None = None,
                 storage: Tiered | dict[str, Tiered | None] | None = None, per_rank_tables: bool = False,
                 fallback_rows: int | str | dict[str, int | str | None] | None = None,
                 fallback_copy: bool | dict[str, bool | None] | None = None,
                 fallback_mode: str | dict[str, str | None] | None = None) -> None:
        super().__init__()
        check_flag("per_rank_tables", per_rank_tables)
        self._per_rank_tables = per_rank_tables
        self._init_tables(tables, EmbeddingBagConfig, optimizer, initializers, capacities, seed, device,
                          "CNEmbeddingBagCollection", "embedding_bags.fused",
                          {"max_rows": max_rows, "eviction": eviction, "admission": admission, "headroom": headroom,
                           "row_dtype": row_dtype, "storage": storage, "fallback_rows": fallback_rows,
                           "fallback_copy": fallback_copy, "fallback_mode": fallback_mode})
        check_flag("is_weighted", is_weighted)
        self._is_weighted = is_weighted
        self._embedding_bag_configs = tables
        self._feature_names, names_by_table = feature_names_of(tables)
        self._embedding_names = [n for names in names_by_table for n in names]
        self._modes = [POOLING[c.pooling] for c, f in zip(tables, self._feature_names) for _ in f]
        self._lengths_per_embedding = [c.embedding_dim for c, f in zip(tables, self._feature_names) for _ in f]
        self.embedding_bags: nn.ModuleDict = table_views(self, tables, [POOLING[c.pooling] for c in tables])
        self._bind_stores()

    def _bind_stores(self) -> None:
        self._feature_stores = [self._stores[c.name] for c, f in zip(self._embedding_bag_configs, self._feature_names)
                                for _ in f] if self._stores else []

    def _lookup_tables(self) -> list:
        """The table of each feature, in the order of the lookup (see cncore_torch.bridge)."""
        self._check_world()
        return self._feature_stores

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self._embedding_bag_configs

    def is_weighted(self) -> bool:
        return self._is_weighted

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """The pooled rows of every feature; `torch.fx.symbolic_trace`-able (one node) and
        `torch.compile`-able (one operator each way, no graph break).

        Args:
            features (KeyedJaggedTensor): int64 or int32 IDs of every feature the tables read
                (other keys are ignored), with float weights when `is_weighted`.

        Returns:
            KeyedTensor: (B, sum of dims) float32, one key per embedding name, in the tables'
            order.
        """
        if torch.compiler.is_compiling() and self._placement.kind != "meta":
            return self._compiled_lookup(features)
        return pooled_collection_lookup(self._anchor, self._handle, features, self.training)

    def _compiled_lookup(self, features: KeyedJaggedTensor) -> KeyedTensor:
        positions = feature_positions(self, features)
        weights = features.weights_or_none() if self._is_weighted else None
        if self._is_weighted and weights is None:
            raise ValueError("features: is_weighted=True but the KJT has no weights")
        strides = strides_of(features)
        inverse = None if strides is None else inverse_rows(
            features, [n for names in self._feature_names for n in names], self._owner)
        values, _ = torch.ops.cncore.collection_pooled_lookup(
            self._anchor, self._handle, _on_rows_device(self, features.values()), features.lengths(),
            None if weights is None else _on_rows_device(self, weights), len(features.keys()),
            positions, strides, inverse, bridge.lookup_training(self._anchor, self.training))
        return KeyedTensor(keys=self._embedding_names, length_per_key=self._lengths_per_embedding, values=values)

    def _pooled_rows(self, values, lengths, weights, n_keys: int, positions: list[int], strides: list[int] | None,
                     inverse, training: bool):
        """What the `cncore::collection_pooled_lookup` operator runs (cncore_torch.ops): the KJT's
        parts checked as the eager forward checks them (`features_by_key`), then the bridge's
        forward: ((B, sum of dims) rows, what its backward needs). With a batch size per key
        (`strides`), each feature's bags expanded by `inverse` (cncore_torch.variable_batch)."""
        features = kjt_of_parts(self, values, lengths, weights, n_keys, positions, strides)
        by_key = features_by_key(features, self._feature_names)
        self._adopt_tagged_optimizer()
        keys, offsets, feature_weights = grouped_arrays(self, by_key)
        out, pending = bridge.forward_impl(self, self._lookup_tables(), keys, offsets, feature_weights, self._modes,
                                           training, split=inverse is not None)
        if inverse is not None:
            out, pending.expanded = expand(out, inverse, self._embedding_names), inverse
        if weights is not None:
            pending.spans = weight_spans(features, positions)
        return out, pending

    def table_rows(self) -> dict[str, int]:
        """Rows in each table.

        Returns:
            dict[str, int]: {table name: rows}.
        """
        return {name: len(store) for name, store in self._stores.items()}

    def nbytes(self) -> int:
        """Bytes held by all tables.

        Returns:
            int: the bytes of every table's rows, optimizer state, metadata and index.
        """
        return sum(store.nbytes for store in self._stores.values())


@torch.fx.wrap
def unpooled_collection_lookup(anchor: torch.Tensor, handle: int, features: KeyedJaggedTensor,
                               training: bool) -> dict[str, JaggedTensor]:
    """CNEmbeddingCollection's eager forward: one node under torch.fx, as the pooled one's."""
    return bridge.table_of(handle)._eager_forward(features, training)


class CNEmbeddingCollection(DynamicTables, EmbeddingCollection):
    """TorchRec's `EmbeddingCollection` (unpooled: one row per ID) over dynamic tables.

    forward(KJT) -> Dict[str, JaggedTensor] with TorchRec's keys; each JaggedTensor holds the
    (N, dim) rows of that feature's IDs and its lengths.

    Args:
        tables (list[EmbeddingConfig]): TorchRec's table configs, one embedding_dim for all.
        device (str | torch.device | None): "cpu" (rows in the core), "meta" or "cncard" / an
            accelerator device, as `CNEmbeddingBagCollection`'s.
        need_indices (bool): each output JaggedTensor's weights carry its IDs (TorchRec's).
        optimizer (Optimizer | None): the fused optimizer of every table, or None (the one
            `apply_optimizer_in_backward` tags, read at the first forward).
        initializers (dict[str, Initializer] | None): {table name: cncore initializer}.
        capacities (dict[str, int] | None): {table name: rows to allocate up front}.
        seed (int): each table's rows are drawn from (seed, table name, ID).
        max_rows, eviction, admission, headroom, row_dtype, storage, fallback_rows, fallback_copy,
            fallback_mode: one value for every table or {table name: value}, as
            `CNEmbeddingBagCollection`'s.
        per_rank_tables (bool): each rank keeps its own tables unsharded in a process group.

    >>> import torch, cncore
    >>> from torchrec import EmbeddingConfig, KeyedJaggedTensor
    >>> ec = CNEmbeddingCollection(tables=[EmbeddingConfig(name="t", embedding_dim=4, num_embeddings=10,
    ...                                                    feature_names=["f"])], optimizer=cncore.SGD(lr=0.1))
    >>> out = ec(KeyedJaggedTensor.from_lengths_sync(keys=["f"], values=torch.tensor([2**40, 3, 3]),
    ...                                              lengths=torch.tensor([2, 1])))
    >>> out["f"].values().shape, out["f"].lengths().tolist()
    (torch.Size([3, 4]), [2, 1])
    """

    def __init__(self, tables: list[EmbeddingConfig], device: str | torch.device | None = None,
                 need_indices: bool = False, *, optimizer: Optimizer | None = None,
                 initializers: dict[str, Initializer] | None = None, capacities: dict[str, int] | None = None,
                 seed: int = 0, max_rows: int | str | dict[str, int | None] | None = None,
                 eviction: Eviction | dict[str, Eviction | None] | None = None,
                 admission: Admission | dict[str, Admission | None] | None = None,
                 headroom: int | dict[str, int | None] | None = None, row_dtype: str | dict[str, str] | None = None,
                 storage: Tiered | dict[str, Tiered | None] | None = None, per_rank_tables: bool = False,
                 fallback_rows: int | str | dict[str, int | str | None] | None = None,
                 fallback_copy: bool | dict[str, bool | None] | None = None,
                 fallback_mode: str | dict[str, str | None] | None = None) -> None:
        super().__init__()
        check_flag("need_indices", need_indices)
        check_flag("per_rank_tables", per_rank_tables)
        self._per_rank_tables = per_rank_tables
        self._init_tables(tables, EmbeddingConfig, optimizer, initializers, capacities, seed, device,
                          "CNEmbeddingCollection", "embeddings.fused",
                          {"max_rows": max_rows, "eviction": eviction, "admission": admission, "headroom": headroom,
                           "row_dtype": row_dtype, "storage": storage, "fallback_rows": fallback_rows,
                           "fallback_copy": fallback_copy, "fallback_mode": fallback_mode})
        dims = {c.embedding_dim for c in tables}
        if len(dims) > 1:
            raise ValueError(f"tables: an EmbeddingCollection needs one embedding_dim for all tables, got "
                             f"{sorted(dims)}")
        self._configs, self._need_indices, self._dim = tables, need_indices, dims.pop()
        self._feature_names, self._names_by_table = feature_names_of(tables)
        self.embeddings: nn.ModuleDict = table_views(self, tables, None)
        self._bind_stores()

    def _bind_stores(self) -> None:
        self._table_stores = [self._stores[c.name] for c in self._configs] if self._stores else []

    def _lookup_tables(self) -> list:
        """Each table once: its features' IDs are looked up together (see unpooled_lookup)."""
        self._check_world()
        return self._table_stores

    def embedding_configs(self) -> list[EmbeddingConfig]:
        return self._configs

    def need_indices(self) -> bool:
        return self._need_indices

    def embedding_dim(self) -> int:
        return self._dim

    def embedding_names_by_table(self) -> list[list[str]]:
        return self._names_by_table

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        """Each feature's rows, one per ID; `torch.compile`-able (one operator each way, no
        graph break).

        Args:
            features (KeyedJaggedTensor): int64 or int32 IDs of every feature the tables read.

        Returns:
            dict[str, JaggedTensor]: {embedding name: (N_f, dim) rows with the feature's
            lengths (and its IDs as weights with `need_indices`)}.
        """
        if torch.compiler.is_compiling() and self._placement.kind != "meta":
            return self._compiled_lookup(features)
        return unpooled_collection_lookup(self._anchor, self._handle, features, self.training)

    def _eager_forward(self, features: KeyedJaggedTensor, training: bool) -> dict[str, JaggedTensor]:
        """The eager forward (`unpooled_collection_lookup`)."""
        by_key = features_by_key(features, self._feature_names, self._rows_device)
        keys_by_table = [torch.cat([by_key[n].values().detach().to(torch.int64) for n in names])
                         for names in self._feature_names]
        if self.is_meta:  # shape inference only
            outs = [torch.empty((len(k), self._dim), device="meta") for k in keys_by_table]
        else:
            self._adopt_tagged_optimizer()
            outs = unpooled_lookup(self._anchor, self, keys_by_table, training)
        result: dict[str, JaggedTensor] = {}
        for out, names, emb_names in zip(outs, self._feature_names, self._names_by_table):
            start = 0
            for name, emb_name in zip(names, emb_names):
                jt = by_key[name]
                n = jt.values().numel()
                result[emb_name] = JaggedTensor(values=out[start:start + n], lengths=jt.lengths(),
                                                weights=jt.values() if self._need_indices else None)
                start += n
        return result

    def _compiled_lookup(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        positions = feature_positions(self, features)
        n_keys, n = len(features.keys()), len(positions)
        strides = strides_of(features)
        outs = torch.ops.cncore.collection_unpooled_lookup(
            self._anchor, self._handle, _on_rows_device(self, features.values()), features.lengths(), n_keys,
            positions, strides,
            bridge.lookup_training(self._anchor, self.training), self._need_indices)
        lengths = (features.lengths().view(n_keys, -1) if strides is None
                   else torch.split(features.lengths(), strides))
        emb_names = [e for names in self._names_by_table for e in names]
        return {e: JaggedTensor(values=outs[i], lengths=lengths[positions[i]],
                                weights=outs[n + i] if self._need_indices else None)
                for i, e in enumerate(emb_names)}

    def _unpooled_rows(self, values, lengths, n_keys: int, positions: list[int], strides: list[int] | None,
                       training: bool, need_indices: bool):
        """What the `cncore::collection_unpooled_lookup` operator runs (cncore_torch.ops): the (N_f,
        dim) rows of each feature, then (need_indices) each feature's IDs; and what the backward
        needs (with each table's features' sizes, by which the backward joins their gradients)."""
        by_key = features_by_key(kjt_of_parts(self, values, lengths, None, n_keys, positions, strides),
                                 self._feature_names)
        self._adopt_tagged_optimizer()
        ids = [[by_key[n].values().detach() for n in names] for names in self._feature_names]
        keys = [torch.cat(t).to(torch.int64).contiguous() for t in ids]
        offsets = [torch.arange(len(k) + 1, dtype=torch.int64) for k in keys]
        outs, pending = bridge.forward_impl(self, self._lookup_tables(), keys, offsets, [None] * len(keys),
                                            [0] * len(keys), training, split=True)
        pending.sizes = [[len(i) for i in t] for t in ids]
        rows = [r.clone() for out, n in zip(outs, pending.sizes) for r in torch.split(out, n)]  # outputs may not alias
        indices = [i.clone() for t in ids for i in t] if need_indices else []
        return rows + indices, pending

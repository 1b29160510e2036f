"""The frozen TorchRec collections: an in-graph ID remap in front of TorchRec's own modules.

`FrozenEmbeddingBagCollection` holds `remap` (a `TableSlots` per table) and
`embedding_bag_collection`, a plain TorchRec `EmbeddingBagCollection` whose tables hold the
frozen rows (row 0 zeros, for unseen IDs; then the table's fallback rows, if it has any,
which unseen IDs read instead: `fallback`). TorchRec's tools therefore see their own module:
`torchrec.inference.modules.quantize_embeddings` / `quantize_inference_model` swap it for a
`QuantEmbeddingBagCollection` (int8, int4, fp16 rows), `torch.export` records TorchRec's
lookup, and the remap is one FBGEMM operator before it (`hashmap`). `FrozenEmbeddingCollection` is the
same over TorchRec's `EmbeddingCollection`.

Mean pooling runs as a sum in TorchRec's module, then times 1/length here, in float32: the
live tables' arithmetic (a division by the length differs from it in the last bit), and also
what per-sample weights with mean need (the live collections' weighted sum / bag length,
which `nn.EmbeddingBag` refuses).
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import cast

import numpy as np
import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingCollection
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, EmbeddingConfig, PoolingType
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor

from cncore_torch.serving.fallback import misses_to_fallback, wrap_of
from cncore_torch.serving.hashmap import EMPTY, TOMBSTONE, PrunedHash, insert, lookup, region_room
from cncore_torch.serving.table import TableSlots, dense_rows

__all__ = ["FrozenEmbeddingBagCollection", "FrozenEmbeddingCollection", "IdRemap"]


class IdRemap(nn.Module):
    """Raw IDs -> weight rows, per table (`tables[name]`), applied to a KJT's features.

    Each table's ID map (a `TableSlots`: sorted IDs, kept for deltas) is also held as FBGEMM's
    pruned-index hash table with one region per feature (`hashmap.PrunedHash`: buffers
    `hash_table`, `hash_offsets`, attribute `key_mask`), which a request reads with one
    operator call over every value of every feature. A KJT whose keys come in another order
    than the configs' features (or name a feature of no table) is read key by key. An ID a
    table with fallback rows lacks reads its fallback row (`fallback.fallback_slot`, rows
    1 .. N of the weight); without fallback rows the graph holds no operation for them.

    >>> import numpy as np
    >>> remap = IdRemap({"t": TableSlots(np.array([30, 10])), "u": TableSlots(np.array([10]))}, {"f": "t", "g": "u"})
    >>> kjt = KeyedJaggedTensor.from_lengths_sync(["f", "g"], torch.tensor([10, 30, 99, 10, 30]),
    ...                                           torch.tensor([2, 1, 1, 1]))
    >>> remap(kjt).values().tolist()
    [2, 1, 0, 1, 0]
    """

    hash_table: torch.Tensor
    hash_offsets: torch.Tensor
    fallback_per_feature: torch.Tensor
    fallback_uniform = 0     # N > 0 when every feature's table has N fallback rows
    fallback_first = 1       # ... at weight rows fallback_first .. fallback_first + N - 1
    fallback_mixed = False   # features whose tables differ in N (buffer fallback_per_feature)
    hash_used: list[int] | None = None   # entries in use per region (None: count them when needed)

    def __init__(self, tables: dict[str, TableSlots], table_of_feature: dict[str, str]) -> None:
        super().__init__()
        self.tables = nn.ModuleDict(tables)
        self.table_of_feature = dict(table_of_feature)
        # the usual key order (the configs'): feature f reads region f
        self.feature_order = list(table_of_feature)
        self.region_of_feature = {f: i for i, f in enumerate(self.feature_order)}
        self.key_mask = 0
        self.register_buffer("hash_table", torch.zeros((0, 2), dtype=torch.int64))
        self.register_buffer("hash_offsets", torch.zeros(1, dtype=torch.int64))
        self.swap(self.rebuilt({}))
        held = [cast(TableSlots, self.tables[table_of_feature[f]]) for f in self.feature_order]
        counts, firsts = [t.fallback_rows for t in held], [t.first_fallback for t in held]
        if counts and all(n == counts[0] for n in counts) and all(f == firsts[0] for f in firsts):
            self.fallback_uniform, self.fallback_first = counts[0], firsts[0]
        elif any(counts):
            # per feature (N, 2^64 mod N, first fallback row), and (1, 0, 0) without fallback rows:
            # a miss there reads 0 + anything mod 1, the zero row, with no mask
            self.fallback_mixed = True
            self.register_buffer("fallback_per_feature", torch.tensor(
                [(n, wrap_of(n), f) if n else (1, 0, 0) for n, f in zip(counts, firsts)], dtype=torch.int64))

    def rebuilt(self, replaced: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> PrunedHash:
        """The hash over every feature's table, each table's (ids, slots) taken from
        `replaced` where given (a delta builds it aside, then `swap`s it in under the lock)."""
        held = {name: cast(TableSlots, t) for name, t in self.tables.items()}
        parts = {name: replaced.get(name, (t.ids, t.slots)) for name, t in held.items()}
        return PrunedHash([(parts[self.table_of_feature[f]][0].numpy(), parts[self.table_of_feature[f]][1].numpy())
                           for f in self.feature_order])

    def __setstate__(self, state: dict) -> None:
        # A serving file pickled before the remap was FBGEMM's hash holds other buffers: refuse it
        # when it loads, rather than fail inside the first request.
        if "hash_table" not in state.get("_buffers", {}):
            raise ValueError("this serving file's ID remap was written by an earlier cncore_torch (buffers "
                             f"{sorted(state.get('_buffers', {}))}, not hash_table/hash_offsets): freeze the model "
                             "again from its checkpoint with cncore_torch.serving.freeze (or `cn-serve freeze`)")
        super().__setstate__(state)

    def swap(self, built: PrunedHash) -> None:
        """Read `built` from the next request on."""
        self.hash_table, self.hash_offsets, self.key_mask = built.table, built.offsets, built.mask
        self.hash_used = list(built.used)

    def held_rows(self, table: str, ids: np.ndarray) -> np.ndarray | None:
        """The weight row of each of `ids` in `table`, -1 where it does not hold it, read from
        the hash (O(len(ids))); None where no feature reads the table (it has no region).

        Args:
            table: a table name.
            ids: int64 IDs.

        Returns:
            np.ndarray | None: int64 rows.
        """
        features = [f for f in self.feature_order if self.table_of_feature[f] == table]
        if not features:
            return None
        ids = np.asarray(ids, dtype=np.int64)
        if not len(ids):
            return np.empty(0, np.int64)
        region = self.region_of_feature[features[0]]
        got = torch.ops.fbgemm.pruned_hashmap_lookup(torch.from_numpy(ids ^ self.key_mask),
                                                     torch.tensor([0, len(ids)], dtype=torch.int64),
                                                     self.hash_table, self.hash_offsets[region:region + 2])
        return got.numpy().clip(min=-1)    # (a tombstone's -2 too)

    def planned(self, changes: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]
                ) -> list[tuple[np.ndarray, np.ndarray]] | None:
        """The in-place update of the hash for `changes` ({table name: (added IDs, their rows,
        removed IDs)}, IDs the table did not hold and IDs it held): per region, the IDs and rows
        to `insert` (removed IDs as `TOMBSTONE`s first, so an ID in both ends added), or None
        where the hash must be rebuilt whole instead: a region would pass `hashmap._FULL`, or an
        added ID is the one the key mask turns into FBGEMM's empty key. Reads only.

        Args:
            changes: per changed table, int64 (added, rows of added, removed).

        Returns:
            list | None: one (ids, rows) pair per region, in feature order.
        """
        if self.hash_used is None:    # a file pickled before the count was kept: count once
            ends = self.hash_offsets.tolist()
            empty = self.hash_table[:, 0] == EMPTY
            self.hash_used = [int((~empty[a:b]).sum()) for a, b in itertools.pairwise(ends)]
        room = region_room(self.hash_offsets, self.hash_used)
        plan = []
        for f, feature in enumerate(self.feature_order):
            change = changes.get(self.table_of_feature[feature])
            if change is None:
                plan.append((np.empty(0, np.int64), np.empty(0, np.int64)))
                continue
            added, rows, removed = change
            if len(added) > room[f] or bool((added == ~self.key_mask).any()):
                return None
            removed = removed[~np.isin(removed, added)]
            plan.append((np.concatenate([removed, added]),
                         np.concatenate([np.full(len(removed), TOMBSTONE, np.int64), rows])))
        return plan

    def insert(self, plan: list[tuple[np.ndarray, np.ndarray]], added: dict[str, int]) -> int:
        """Write `planned`'s update into the live hash (under the serving lock).

        Args:
            plan: `planned`'s answer.
            added: {table name: IDs it added} (the regions' entries in use grow by them).

        Returns:
            int: hash entries written.
        """
        written = insert(self.hash_table, self.hash_offsets, self.key_mask, [i for i, _ in plan], [r for _, r in plan])
        assert self.hash_used is not None
        for f, feature in enumerate(self.feature_order):
            self.hash_used[f] += added.get(self.table_of_feature[feature], 0)
        return written

    def forward(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        if features.variable_stride_per_key():
            raise ValueError("features: a KJT with a batch size per feature (VBE: stride_per_key_per_rank) reached a "
                             "frozen collection, which takes one batch size for all features; expand it first "
                             "(one bag per sample and feature, empty bags allowed)")
        values = features.values().to(torch.int64)
        offsets = features.offsets()
        keys = features.keys()
        if keys == self.feature_order:
            slots = self.rows(values, offsets.to(torch.int64))
            if self.fallback_mixed:
                slots = self._fallback_mixed(values, slots, features.lengths(), len(keys), features.stride())
        else:
            slots = self._by_key(keys, values, features.length_per_key())
        return KeyedJaggedTensor(keys=keys, values=slots, lengths=features.lengths(),
                                 weights=features.weights_or_none(), stride=features.stride(), offsets=offsets,
                                 length_per_key=features.length_per_key_or_none(),
                                 offset_per_key=features.offset_per_key_or_none())

    def rows(self, values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """The weight row of each ID: one FBGEMM call over every feature's bags, then the
        fallback rows of the misses where every feature's table has the same (a collection with
        tables that differ in them finishes in `forward`). The frozen modules call it too, as
        one feature whose one bag holds the whole input.

        Args:
            values (Tensor): int64 (n,) raw IDs, the features in `feature_order`.
            offsets (Tensor): int64 (F * B + 1,) bag offsets over `values`.

        Returns:
            Tensor: int64 (n,) weight rows.
        """
        slots = lookup(self.hash_table, self.hash_offsets, self.key_mask, values, offsets)
        if self.fallback_uniform:
            slots = misses_to_fallback(slots, values, self.fallback_first, self.fallback_uniform)
        return slots

    def _fallback_mixed(self, values: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor, n_features: int,
                        stride: int) -> torch.Tensor:
        """Misses of the features whose tables have fallback rows, to them (N per feature)."""
        per_feature = lengths.to(torch.int64).view(n_features, stride).sum(1)
        n, wrap, first = torch.repeat_interleave(self.fallback_per_feature, per_feature, dim=0,
                                                 output_size=values.numel()).unbind(1)
        return misses_to_fallback(slots, values, first, n, wrap)

    def _by_key(self, keys: list[str], values: torch.Tensor, per_key: list[int]) -> torch.Tensor:
        """Each key's values as one bag in its feature's region; zeros for a key of no table."""
        out = []
        for key, part in zip(keys, torch.split(values, per_key)):
            region = self.region_of_feature.get(key)
            if region is None:
                out.append(torch.zeros_like(part))
            else:
                bag = torch.tensor([0, part.numel()], dtype=torch.int64)
                got = lookup(self.hash_table, self.hash_offsets[region:region + 2], self.key_mask, part, bag)
                table = cast(TableSlots, self.tables[self.table_of_feature[key]])
                if table.fallback_rows:
                    got = misses_to_fallback(got, part, table.first_fallback, table.fallback_rows)
                out.append(got)
        return torch.cat(out) if out else values.clone()


Fallback = dict[str, np.ndarray | None]   # {table name: its fallback rows, None without them}


def _fallback_count(fallback: Fallback | None, name: str) -> int:
    shared = None if fallback is None else fallback.get(name)
    return 0 if shared is None else len(shared)


def _remap_of(configs, keys: dict[str, np.ndarray], fallback: Fallback | None) -> IdRemap:
    counts = {c.name: _fallback_count(fallback, c.name) for c in configs}
    return IdRemap({c.name: TableSlots(keys[c.name], first_slot=1 + counts[c.name], fallback_rows=counts[c.name])
                    for c in configs}, {f: c.name for c in configs for f in c.feature_names})


def _load_weights(module: nn.Module, rows: dict[str, np.ndarray], fallback: Fallback | None) -> None:
    """Each TorchRec table's weight (allocated on meta, so no initializer runs over it) as
    the zero row, then the table's fallback rows (if any), then `rows[name]`."""
    module.to_empty(device="cpu")
    tables = module.embedding_bags if isinstance(module, EmbeddingBagCollection) else module.embeddings
    assert isinstance(tables, nn.ModuleDict)
    for name, table in tables.items():
        shared = None if fallback is None else fallback.get(name)
        table.weight = nn.Parameter(dense_rows(rows[name], first_slot=1, fallback=shared), requires_grad=False)


class FrozenEmbeddingBagCollection(nn.Module):
    """A trained `CNEmbeddingBagCollection` as plain torch (see the module docstring): same
    forward (KJT of raw IDs -> KeyedTensor), same keys and shapes; unseen IDs read zeros
    (or their fallback rows).
    Built by `cncore_torch.serving.freeze`.

    Args:
        tables: the collection's `EmbeddingBagConfig`s (pooling SUM or MEAN).
        is_weighted: whether the KJT's weights scale the rows.
        keys: {table name: int64 (N,) IDs}.
        rows: {table name: float32 (N, dim) rows, row i of ID keys[i]}.
        fallback: {table name: float32 (M, dim) fallback rows} of the tables that have them
            (`store.export_fallback()[0]`): the IDs such a table lacks read them; None: none.
    """

    def __init__(self, tables: list[EmbeddingBagConfig], is_weighted: bool, keys: dict[str, np.ndarray],
                 rows: dict[str, np.ndarray], fallback: dict[str, np.ndarray | None] | None = None) -> None:
        super().__init__()
        self._configs = list(tables)
        self._is_weighted = is_weighted
        inner = [dataclasses.replace(c, num_embeddings=len(keys[c.name]) + 1 + _fallback_count(fallback, c.name),
                                     data_type=DataType.FP32, pooling=PoolingType.SUM,
                                     feature_names=list(c.feature_names)) for c in tables]
        self.remap = _remap_of(tables, keys, fallback)
        self.embedding_bag_collection = EmbeddingBagCollection(tables=inner, is_weighted=is_weighted, device="meta")
        _load_weights(self.embedding_bag_collection, rows, fallback)
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
    JaggedTensors' weights); unseen IDs read zeros (or their fallback rows). Built by `cncore_torch.serving.freeze`.

    Args:
        tables: the collection's `EmbeddingConfig`s.
        need_indices: as the live collection's.
        keys, rows, fallback: as `FrozenEmbeddingBagCollection`'s.
    """

    def __init__(self, tables: list[EmbeddingConfig], need_indices: bool, keys: dict[str, np.ndarray],
                 rows: dict[str, np.ndarray], fallback: dict[str, np.ndarray | None] | None = None) -> None:
        super().__init__()
        self._configs = list(tables)
        self._need_indices = need_indices
        inner = [dataclasses.replace(c, num_embeddings=len(keys[c.name]) + 1 + _fallback_count(fallback, c.name),
                                     data_type=DataType.FP32, feature_names=list(c.feature_names)) for c in tables]
        self.remap = _remap_of(tables, keys, fallback)
        self.embedding_collection = EmbeddingCollection(tables=inner, device="meta")
        _load_weights(self.embedding_collection, rows, fallback)
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

"""`DynamicTables`: what `CNEmbeddingBagCollection` and `CNEmbeddingCollection` share.

A store per table (created by `_init_tables`), the fused optimizer over them (given at
construction or tagged by TorchRec's `apply_optimizer_in_backward`), the meta-device life cycle
DMP drives, and every table's rows, optimizer state and metadata in the module's state_dict.
The collections themselves (`cncore_torch.collection`) add the lookups.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

import cncore
from cncore_torch.base import TableModule
from cncore_torch.collection_shape import CollectionShape
from cncore_torch.dcp import EntryPaths
from cncore_torch.device_rows import DeviceRows
from cncore_torch.embedding_configs import collection_placement, store_configs
from cncore_torch.modules import TableStorage
from cncore_torch.optim import (
    changed_optimizer_error,
    keyed_fused_optimizer,
    no_optimizer_error,
    optimizer_tag,
    resolve_optimizer,
)
from cncore_torch.state import TableState, save_store

__all__ = ["DynamicTables", "ANCHOR_SHAPE"]

# Zero rows of one column: 2-D because apply_optimizer_in_backward builds its optimizer over the
# anchor, and TorchRec's RowWiseAdagrad reads a parameter's second dimension.
ANCHOR_SHAPE = (0, 1)


def store_writer(store: TableStorage) -> Callable[[TableState], None]:
    return lambda state: state.load_into(store)


class DynamicTables(EntryPaths, CollectionShape, TableModule):
    """What both collections share: a store per table (created by `_init_tables`), the fused
    optimizer over them, and every table's rows, optimizer state and metadata in the module's
    state_dict (the anchor and the handle: `TableModule`).

    On device="meta" there are no stores (and no fused optimizer) until `to_empty(device="cpu")`
    creates them, empty; forward then only infers shapes. DMP shards a meta collection without
    ever materialising it (each rank builds its own shard).

    What TorchRec code reads from a collection (`device`, `reset_parameters`, the per-table
    modules, being TorchRec's own collection): `cncore_torch.collection_shape`."""

    def _init_tables(self, tables, config_type, optimizer, initializers, capacities, seed: int, device, owner: str,
                     optimizer_prefix: str, options: dict | None = None) -> None:
        self._store_configs = store_configs(tables, config_type, optimizer, initializers, capacities, seed, device,
                                            owner, options)
        self._optimizer, self._optimizer_prefix, self._owner = optimizer, optimizer_prefix, owner
        # Zero rows of one column: 2-D because apply_optimizer_in_backward builds its optimizer over
        # it, and TorchRec's RowWiseAdagrad reads a parameter's second dimension.
        self._placement = collection_placement(device, owner)
        self._init_lookup(ANCHOR_SHAPE, self._placement.device)
        self._stores: dict[str, TableStorage] = {}
        self.fused_optimizer = None
        if not self.is_meta:
            self._materialise()

    @property
    def _rows_device(self):
        """The accelerator device the rows are on, or meta (None: the core)."""
        return self._placement.device if self._placement.kind != "core" else None

    @property
    def is_meta(self) -> bool:
        """True while the collection is on the meta device (no stores)."""
        return self._anchor.device.type == "meta"

    # --- the optimizer: optimizer= at construction, or TorchRec's apply_optimizer_in_backward ------

    @property
    def fused_optimizer(self):
        """The tables' fused optimizer as a TorchRec KeyedOptimizer (None without one). One set
        by `apply_optimizer_in_backward` on the parameters is adopted when first needed."""
        self._adopt_tagged_optimizer()
        return self.__dict__.get("_fused_optimizer")

    @fused_optimizer.setter
    def fused_optimizer(self, value) -> None:
        self.__dict__["_fused_optimizer"] = value

    def _adopt_tagged_optimizer(self) -> None:
        """Take the optimizer `torchrec.optim.apply_optimizer_in_backward` attached to the anchor
        parameter (at the first forward, load or `fused_optimizer`: the tagging comes after
        construction). Rows already in the tables stay, each starting from the optimizer's
        initial state (`EmbeddingStore.set_optimizer`). A tag that disagrees with optimizer=, or
        that changes once adopted, is refused (ValueError), the tables unchanged."""
        if self.is_meta:
            return
        tag = optimizer_tag(self._anchor)
        adopted = self.__dict__.get("_adopted_tag")
        if tag is None or tag == adopted:
            return
        if adopted is not None:
            raise changed_optimizer_error(self._owner, self._optimizer, self._anchor)
        optimizer = resolve_optimizer(self._optimizer, self._anchor, self._owner)
        if self._optimizer is None:
            for store in self._stores.values():
                store.set_optimizer(optimizer)
            self._store_configs = {name: dataclasses.replace(c, optimizer=optimizer)
                                   for name, c in self._store_configs.items()}
            self._optimizer = optimizer
            self.fused_optimizer = keyed_fused_optimizer(self._anchor, optimizer, list(self._stores.values()),
                                                         self._optimizer_prefix)
        self.__dict__["_adopted_tag"] = tag

    def _require_optimizer(self) -> None:
        """A gradient reached the rows (the bridge's backward calls this when the collection has
        no optimizer): refuse, naming both ways to give one, before any row changes. The forward
        needs none (it only adopts a tagged one): a model runs, and a frozen collection
        (`requires_grad_(False)`) never gets here."""
        self._adopt_tagged_optimizer()
        if self._optimizer is None:
            raise no_optimizer_error(self._owner)

    def _materialise(self) -> None:
        """Empty tables from the configs (in the core, or device rows), and the fused optimizer
        over the anchor."""
        if self._placement.kind == "device":
            for name, config in self._store_configs.items():
                if config.storage is not None:
                    raise ValueError(f"table {name!r}: a tiered table (storage=) keeps its rows in the core and on "
                                     f"disk; build the collection with device='cpu'")
                if config.dtype != "float32":
                    raise ValueError(f"table {name!r}: rows on an accelerator are float32 for now (row_dtype="
                                     f"{config.dtype!r}); build the collection with device='cpu' (the core)")
            self._stores = {name: DeviceRows(config, self._placement.device)
                            for name, config in self._store_configs.items()}
        else:
            self._stores = {name: cncore.make_store(config) for name, config in self._store_configs.items()}
        self.fused_optimizer = (keyed_fused_optimizer(self._anchor, self._optimizer, list(self._stores.values()),
                                                      self._optimizer_prefix) if self._optimizer else None)
        if hasattr(self, "_feature_names"):  # else the constructor binds them when it has the names
            self._bind_stores()

    def _bind_stores(self) -> None:
        """Per-feature views of `_stores` (set by each collection)."""

    def _apply(self, fn, recurse=True):
        """`.to_empty(device="cpu")` (or `.to("cpu")`) of a meta collection creates its empty tables;
        moving tables that hold rows anywhere but the CPU is refused (their rows live in the core)."""
        was_meta = self._placement.kind == "meta"  # (DMP's meta init may have moved the anchor alone)
        target = fn(torch.empty(0, device=self._anchor.device)).device
        if not was_meta and target.type != "meta" and target != self._placement.device:
            raise ValueError(f"{self._owner} keeps its rows where it was built ({self._placement.device}); moving "
                             f"it to {target} is not supported: build it with device={target.type!r}")
        if target.type == "meta" and not was_meta and any(len(s) for s in self._stores.values()):
            raise ValueError(f"moving {self._owner} to meta would drop its rows; build a new one with device='meta' "
                             "for shape inference instead")
        self.__dict__["_moving_tables"] = True  # (its per-table modules follow; alone they refuse)
        try:
            result = super()._apply(fn, recurse)
        finally:
            self.__dict__["_moving_tables"] = False
        if was_meta and not self.is_meta:
            self._placement = collection_placement(target, self._owner)
            self._materialise()
        elif self.is_meta and not was_meta:
            self._placement = collection_placement("meta", self._owner)
            self._stores, self.fused_optimizer = {}, None
            self._bind_stores()
        return result

    @property
    def stores(self) -> dict[str, TableStorage]:
        """The tables by name (none on the meta device)."""
        return self._stores

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for name, store in self._stores.items():
            save_store(store, destination, f"{prefix}tables.{name}.")

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        """All or nothing (see cncore_torch.state): every table is checked before any changes."""
        self._adopt_tagged_optimizer()  # a checkpoint's optimizer state needs the optimizer's width
        anchor = state_dict.get(prefix + "_anchor")
        if isinstance(anchor, torch.Tensor) and anchor.numel() == 0 and anchor.shape != ANCHOR_SHAPE:
            state_dict = {**state_dict, prefix + "_anchor": anchor.reshape(ANCHOR_SHAPE)}  # saved before (0, 1)
        self._load_tables(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)

    def _tables(self, prefix: str) -> dict:
        """The tables in a state_dict (see cncore_torch.state.TableSpec): each replaced in place,
        so the lookups, the fused optimizer and `stores` keep pointing at it."""
        return {f"{prefix}tables.{name}.": (store.config, store_writer(store)) for name, store in self._stores.items()}

"""`CNEmbeddingBag` and `CNEmbedding`: drop-in for `torch.nn.EmbeddingBag` / `torch.nn.Embedding`
whose IDs are any int64 and whose table grows as new IDs arrive.

`num_embeddings` is only a capacity hint. In training mode a lookup inserts unseen IDs (their
rows drawn deterministically from (seed, ID)); in eval mode unseen IDs read as zero rows and
nothing is inserted. With `optimizer=` the rows are updated inside backward (fused, as
TorchRec's fused tables); without it, backward hands (unique IDs, gradient rows) to the hooks
registered with `register_gradient_hook` and keeps the last ones in `last_gradients`.

>>> import torch, cncore
>>> from cncore_torch import CNEmbeddingBag
>>> bag = CNEmbeddingBag(1000, 4, mode="sum", optimizer=cncore.SGD(lr=0.1))
>>> out = bag(torch.tensor([[2**40, 7], [7, 7]]))     # IDs far beyond num_embeddings
>>> out.shape, bag.num_rows
(torch.Size([2, 4]), 2)
>>> out.sum().backward()                               # rows updated here, in place
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import cncore
from cncore.config import Admission, Eviction, Initializer, Optimizer, Tiered, with_default_split
from cncore.tier import TieredStore
from cncore_torch import bridge, functional
from cncore_torch.base import TableModule, check_flag, store_config
from cncore_torch.dcp import FALLBACK_ENTRIES, PER_RANK, EntryPaths
from cncore_torch.device_rows import DeviceRows
from cncore_torch.devices import resolve_device
from cncore_torch.functional import MODES
from cncore_torch.optim import FusedOptimizer
from cncore_torch.state import FIELDS, TableState, export_tensors, is_store_entry, save_store
from cncore_torch.table_options import module_options
from cncore_torch.table_weight import TableWeight

__all__ = ["CNEmbeddingBag", "CNEmbedding"]

_MAX_INITIAL_ROWS = 1 << 20


def _check_padding_idx(padding_idx) -> None:
    if padding_idx is not None and (not isinstance(padding_idx, int) or isinstance(padding_idx, bool)):
        raise TypeError(f"padding_idx must be None or an int ID, got {padding_idx!r}")


def _check_unsupported(max_norm, scale_grad_by_freq, sparse, device, dtype):
    """Options that make no sense for a hash table are refused here, never silently ignored."""
    if max_norm is not None:
        raise ValueError("max_norm is not supported: rows are renormalised by the optimizer's update, not at "
                         "lookup (pass max_norm=None)")
    if scale_grad_by_freq:
        raise ValueError("scale_grad_by_freq is not supported (pass scale_grad_by_freq=False)")
    if sparse:
        raise ValueError("sparse=True is not supported: there is no dense weight to get a sparse gradient; pass "
                         "optimizer= for fused updates, or leave it None and read gradients from "
                         "register_gradient_hook / last_gradients")
    if dtype is not None and dtype != torch.float32:
        raise TypeError(f"dtype must be torch.float32 (or None), got {dtype}")


# A table's rows: in the core (in memory, or tiered) or on an accelerator.
TableStorage = cncore.EmbeddingStore | TieredStore | DeviceRows


class _DynamicTable(EntryPaths, TableModule):
    """What both modules share: the store, optimizer and table methods (the anchor and the
    handle: `TableModule`)."""

    _entry_roots = (*FIELDS, *PER_RANK, *FALLBACK_ENTRIES)  # its entries sit at its own prefix

    def __init__(self, num_embeddings: int, embedding_dim: int, optimizer, initializer, seed: int,
                 max_load_factor: float, device=None, options: dict | None = None):
        super().__init__()
        if not isinstance(num_embeddings, int) or isinstance(num_embeddings, bool) or num_embeddings < 0:
            raise ValueError(f"num_embeddings must be an int >= 0 (a capacity hint), got {num_embeddings!r}")
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.dim = embedding_dim
        # num_embeddings is a hint: TorchRec configs often name the whole ID space (billions), so
        # at most 2^20 rows are allocated up front and the table grows from there.
        self.config = store_config(
            "", embedding_dim, capacity=min(num_embeddings, _MAX_INITIAL_ROWS), seed=seed,
            initializer=initializer if initializer is not None else cncore.Normal(0.0, 1.0),
            max_load_factor=max_load_factor, optimizer=optimizer, **(options or {}))
        self.placement = resolve_device(device)
        # The table's RowStorage (cncore.storage): in the core, or device rows; None on meta.
        self.storage: TableStorage | None = None
        self._make_storage()
        # Zero-size parameter: carries the backward (see TableModule) and the fused optimizer's lr.
        self._init_lookup((0,), self.placement.device)
        self.fused_optimizer = FusedOptimizer(self._anchor, optimizer, lambda: self.storage) if optimizer else None
        self._gradient_hooks: list[Callable] = []
        self.last_gradients: tuple[torch.Tensor, torch.Tensor] | None = None

    # --- placement --------------------------------------------------------------------------------

    def _make_storage(self) -> None:
        kind = self.placement.kind
        if kind == "device" and self.config.storage is not None:
            raise ValueError(f"device={self.placement.device}: a tiered table (storage=) keeps its rows in the core "
                             "and on disk; keep it on device='cpu'")
        if kind == "device" and self.config.dtype != "float32":
            raise ValueError(f"device={self.placement.device}: rows on an accelerator are float32 for now "
                             f"(row_dtype={self.config.dtype!r}); keep this table on device='cpu' (the core)")
        self.storage = (cncore.make_store(self.config) if kind == "core" else
                        DeviceRows(self.config, self.placement.device) if kind == "device" else None)

    @property
    def store(self):
        """The table's store when its rows are in the core (an EmbeddingStore, or the SSD tier's
        TieredStore), else None."""
        return self.storage if self.placement.kind == "core" else None

    @property
    def device_rows(self):
        """The table's DeviceRows when its rows are on an accelerator, else None."""
        return self.storage if self.placement.kind == "device" else None

    def _lookup_tables(self) -> list:
        """What the lookup reads (see cncore_torch.bridge): this table's storage."""
        return [self.storage]

    def _require_storage(self) -> TableStorage:
        """The table's storage; on the meta device (no rows) a RuntimeError naming what to do."""
        if self.placement.kind == "meta" or self.storage is None:
            raise RuntimeError("this table is on the meta device and holds no rows; materialise it with "
                               "to_empty(device='cpu') or move_to('cncard')")
        return self.storage

    def move_to(self, device) -> _DynamicTable:
        """Move every row, its optimizer state and metadata to `device` ('cpu': the core;
        'cncard' or an accelerator device: device tensors; 'meta': drop the rows)."""
        target = resolve_device(device)
        if target == self.placement:
            return self
        if target.kind == "meta" and self.placement.kind != "meta" and self.num_rows:
            raise ValueError(f"moving this table to meta would drop its {self.num_rows} rows; build a new module "
                             "with device='meta' for shape inference instead")
        rows = None
        if self.placement.kind != "meta":
            storage = self._require_storage()
            if target.kind == "device" and isinstance(storage, cncore.EmbeddingStore) and storage.fallback_rows:
                raise ValueError(f"device={target.device}: this table holds {storage.fallback_rows} fallback rows "
                                 f"(fallback_rows={storage.config.fallback_rows!r}), which rows on an accelerator "
                                 "do not keep; keep it on device='cpu', or build it with fallback_rows=0")
            rows = dataclasses.replace(TableState.from_export(self.export(), storage.step),
                                       evicted_count=storage.evicted_count)  # moves with the rows
        self.placement = target
        self._make_storage()
        if rows is not None and target.kind != "meta":
            self._replace_rows(rows)
        with torch.no_grad():
            self._anchor.data = torch.empty(0, device=target.device)
        return self

    def _apply(self, fn, recurse=True):
        """`.to()`, `.cuda()`, `.to_empty()` and friends: follow the anchor to its new device."""
        before = self._anchor.device
        target = fn(torch.empty(0, device=before)).device  # where this call sends tensors
        if target.type == "meta" and self.placement.kind != "meta" and self.num_rows:
            raise ValueError(f"moving this table to meta would drop its {self.num_rows} rows; build a new module "
                             "with device='meta' for shape inference instead")
        result = super()._apply(fn, recurse)
        after = self._anchor.device
        if after != before:
            if self.placement.kind == "meta":  # to_empty(): an empty table, no rows to carry
                self.placement = resolve_device(after)
                self._make_storage()
            else:
                anchor = self._anchor
                self.move_to(after)
                self._anchor = anchor
        if self.fused_optimizer is not None:
            self.fused_optimizer.param_groups[0]["params"] = [self._anchor]
        return result

    def __getstate__(self):
        """Pickling (torch.save of a whole model): the store pickles itself; the operator handle,
        the optimizer object and the hooks are rebuilt or dropped."""
        state = self.__dict__.copy()
        state["_fused_lr"] = self.fused_optimizer.lr if self.fused_optimizer is not None else None
        for name in ("fused_optimizer", "_handle"):
            state.pop(name, None)
        state["_gradient_hooks"] = []
        return state

    def __setstate__(self, state):
        lr = state.pop("_fused_lr")
        super().__setstate__(state)  # (and a new handle: TableModule)
        optimizer = self.config.optimizer
        self.fused_optimizer = FusedOptimizer(self._anchor, optimizer, lambda: self.storage) if optimizer else None
        if self.fused_optimizer is not None:
            self.fused_optimizer.param_groups[0]["lr"] = lr

    # --- backward ------------------------------------------------------------------------------

    def register_gradient_hook(self, hook: Callable[[torch.Tensor, torch.Tensor], None]):
        """Call `hook(unique_ids, grads)` in every backward (non-fused tables)."""
        if self.fused_optimizer is not None:
            raise RuntimeError("this table has a fused optimizer; gradients never leave the core")
        if not callable(hook):
            raise TypeError(f"hook must be callable as hook(unique_ids, grads), got {type(hook).__name__}")
        self._gradient_hooks.append(hook)
        return hook

    def _deliver_gradients(self, ids: torch.Tensor, grads: torch.Tensor) -> None:
        """The non-fused backward: (unique IDs, gradient rows) to the hooks (from the bridge, or the device path)."""
        self.last_gradients = (ids, grads)
        for hook in self._gradient_hooks:
            hook(ids, grads)

    # --- the dynamic table ------------------------------------------------------------------------

    @property
    def num_rows(self) -> int:
        return len(self._require_storage())

    @property
    def capacity(self) -> int:
        return self._require_storage().capacity

    def keys(self) -> torch.Tensor:
        """Every ID in the table (int64, in no particular order)."""
        return self.export()["keys"]

    def export(self) -> dict:
        """keys, rows, optimizer_state, counts and last_steps, as CPU tensors."""
        return export_tensors(self._require_storage())

    def _replace_rows(self, state: TableState) -> None:
        """Every row, its optimizer state, metadata and the step replaced (in place: the store
        object stays, so the operator handle and `module.store` references stay valid)."""
        state.load_into(self._require_storage())

    def insert(self, ids, rows) -> torch.Tensor:
        """Write rows for IDs, inserting the absent ones; returns which were present."""
        return self._write(ids, rows, insert=True)

    def assign(self, ids, rows) -> torch.Tensor:
        """Write rows for IDs that are present; returns which were."""
        return self._write(ids, rows, insert=False)

    def _write(self, ids, rows, insert: bool) -> torch.Tensor:
        storage = self._require_storage()
        rows = torch.as_tensor(rows).detach().cpu().contiguous()
        verb = storage.insert_or_assign if insert else storage.assign
        return torch.from_numpy(np.array(verb(ids, rows), dtype=bool))

    def reserve(self, n_rows: int) -> None:
        self._require_storage().reserve(n_rows)

    @property
    def weight(self) -> TableWeight:
        """What `nn.EmbeddingBag.weight` tells, without values: a tensor of shape (rows held now,
        embedding_dim) with the row dtype, on the rows' device ('meta' before materialisation),
        every operation on whose values raises, naming what reads and writes rows instead
        (cncore_torch.table_weight). Not a parameter."""
        rows = 0 if self.storage is None else len(self.storage)
        return TableWeight(rows, self.embedding_dim, getattr(torch, self.config.dtype), self.placement.device,
                           type(self).__name__)

    def reset_parameters(self) -> None:
        """Every row back to its initial value, as `nn.EmbeddingBag.reset_parameters` redraws
        the weight: the table is emptied (rows, optimizer state, counts), and each ID's row is
        drawn again from (seed, ID) when it next arrives. On meta there is nothing to reset."""
        if self.storage is not None:
            self.storage.clear()

    # --- state ----------------------------------------------------------------------------------

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.placement.kind == "meta":
            return
        # TableEntry tensors, as a collection's tables: DCP saves them and CNLoadPlanner loads them whole
        save_store(self._require_storage(), destination, prefix)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        """All or nothing (see cncore_torch.state): the table changes only when every entry is valid."""
        if self.placement.kind == "meta":  # no rows to load into, as none were saved
            if any(is_store_entry(k, prefix) for k in state_dict):
                error_msgs.append(f"{prefix}rows: this table is on the meta device and holds no rows; materialise it "
                                  "with to_empty(device='cpu') before loading rows")
            self._load_rest({k: v for k, v in state_dict.items() if not is_store_entry(k, prefix)}, prefix,
                            local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
            return
        self._load_tables(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)

    def _tables(self, prefix: str) -> dict:
        """This module's table in a state_dict (see cncore_torch.state.TableSpec)."""
        return {prefix: (with_default_split(self.config, self.placement.kind == "core"), self._replace_rows)}

    def extra_repr(self) -> str:
        mode = f", mode={self.mode!r}" if hasattr(self, "mode") else ""
        dtype = "" if self.config.dtype == "float32" else f", row_dtype={self.config.dtype!r}"
        rows = "meta" if self.storage is None else len(self.storage)
        return f"{self.num_embeddings}, {self.embedding_dim}{mode}{dtype}, rows={rows}"


class CNEmbeddingBag(_DynamicTable):
    """`torch.nn.EmbeddingBag` over a growable table (see the module docstring).

    Same constructor and forward; the extra keywords are `optimizer` (a cncore optimizer config:
    fused updates in backward), `initializer` (default N(0, 1), as nn.EmbeddingBag), `seed` and
    `max_load_factor`. `max_norm`, `scale_grad_by_freq` and `sparse=True` are refused. Per-sample
    weights work with "sum" and also "mean" (weighted sum / bag length).

    A bounded table (README "Bounded tables"): `max_rows`, `eviction` (cncore.LRU(), LFU(),
    TTL(steps)), `admission` (cncore.MinCount(c)), `headroom`; evicted rows go to the callbacks of
    `module.store.on_evict` and are counted in `module.store.evicted_count` (kept in state_dict).
    `row_dtype`: the rows' storage dtype (StoreConfig.dtype); the output stays float32.

    Args:
        num_embeddings (int): a capacity hint (IDs are not bounded by it).
        embedding_dim (int): the row width.
        max_norm, norm_type, scale_grad_by_freq, sparse: as nn.EmbeddingBag; max_norm,
            scale_grad_by_freq and sparse=True are refused.
        mode (str): "sum", "mean" or "max".
        include_last_offset (bool): `offsets` has B + 1 entries, the last the ID count.
        padding_idx (int | None): an ID that reads as zeros and takes no gradient.
        device (str | torch.device | None): "cpu" (rows in the core), "meta" (no rows until
            `to_empty`) or "cncard" / an accelerator device (rows there, the key index on the host).
        dtype (torch.dtype | None): torch.float32 or None (the output's dtype).
        optimizer (Optimizer | None): the fused optimizer applied in backward (`cncore.SGD`,
            `Adagrad`, `RowWiseAdagrad`, `Adam`), or None (gradients go to the hooks).
        initializer (Initializer | None): how a new ID's row is drawn (None: N(0, 1)).
        seed (int): the table seed of that draw.
        max_load_factor (float): the index grows past it (0.1 .. 0.9).
        max_rows (int | None): the row budget of a bounded table, or None.
        eviction (Eviction | None): `cncore.LRU()`, `LFU()` or `TTL(steps)`.
        admission (Admission | None): `cncore.MinCount(c)` or `Probability(p)`.
        headroom (int | None): rows one eviction frees beyond the need.
        row_dtype (str): the rows' storage dtype: "float32", "float16" or "bfloat16".
        storage (Tiered | None): `cncore.Tiered(path, cache_bytes)`: rows on disk under a
            bounded cache.
        fallback_rows (int | str | None): shared rows that IDs without a row of their own read and
            train (``StoreConfig.fallback_rows``; docs/bounded-tables.md), or "auto" (with
            max_rows: the table chooses its split of max_rows when it fills); None (the default):
            "auto" where it can run (rows in the core), else 0 (one row per ID).
        fallback_copy (bool): a new row starts as a copy of its fallback row, or from the
            initializer.
        fallback_mode (str): "miss" (the default) or "residual": every ID reads its own row
            plus its fallback row (``StoreConfig.fallback_mode``).

    Example::

    >>> import torch, cncore
    >>> bag = CNEmbeddingBag(100, 4, mode="sum", optimizer=cncore.SGD(lr=0.1), max_rows=2, eviction=cncore.LRU(),
    ...                      headroom=0, fallback_rows=0)  # a row per ID (the default may split a table this small)
    >>> bag(torch.tensor([[5, 6]])).sum().backward()
    >>> bag(torch.tensor([[7]])).sum().backward()      # 5 and 6 were used alike: the smaller key goes
    >>> sorted(bag.keys().tolist()), bag.store.evicted_count
    ([6, 7], 1)
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, max_norm: float | None = None,
                 norm_type: float = 2.0, scale_grad_by_freq: bool = False, mode: str = "mean", sparse: bool = False,
                 _weight: torch.Tensor | None = None, include_last_offset: bool = False,
                 padding_idx: int | None = None, device: str | torch.device | None = None,
                 dtype: torch.dtype | None = None, *, optimizer: Optimizer | None = None,
                 initializer: Initializer | None = None, seed: int = 0, max_load_factor: float = 0.7,
                 max_rows: int | None = None, eviction: Eviction | None = None, admission: Admission | None = None,
                 headroom: int | None = None, row_dtype: str = "float32", storage: Tiered | None = None,
                 fallback_rows: int | str | None = None, fallback_copy: bool = True,
                 fallback_mode: str = "miss") -> None:
        _check_unsupported(max_norm, scale_grad_by_freq, sparse, device, dtype)
        if mode not in MODES:
            raise ValueError(f"mode must be 'sum', 'mean' or 'max', got {mode!r}")
        check_flag("include_last_offset", include_last_offset)
        _check_padding_idx(padding_idx)
        super().__init__(num_embeddings, embedding_dim, optimizer, initializer, seed, max_load_factor, device,
                         module_options(max_rows, eviction, admission, headroom, row_dtype, storage, fallback_rows,
                                        fallback_copy, fallback_mode))
        self.mode = mode
        self.include_last_offset = include_last_offset
        self.padding_idx = padding_idx
        if _weight is not None:
            _load_dense(self, _weight)

    @classmethod
    def from_pretrained(cls, embeddings: torch.Tensor, freeze: bool = True, **kwargs: Any) -> CNEmbeddingBag:
        """Rows 0..N-1 from a dense (N, dim) matrix (as nn.EmbeddingBag.from_pretrained); with
        freeze (the default) the module stays in eval mode: no insertions.

        Args:
            embeddings (torch.Tensor): (N, dim) float rows, row i for ID i.
            freeze (bool): keep the module in eval mode (lookups insert nothing).
            **kwargs: the constructor's other arguments (mode, optimizer, ...).

        Returns:
            CNEmbeddingBag: the module holding those N rows.

        Example::

            >>> import torch
            >>> bag = CNEmbeddingBag.from_pretrained(torch.eye(3), mode="sum")
            >>> bag(torch.tensor([[0, 2]])).tolist()
            [[1.0, 0.0, 1.0]]
        """
        _check_dense("embeddings", embeddings)
        module = cls(embeddings.shape[0], embeddings.shape[1], _weight=embeddings, **kwargs)
        if freeze:
            module.eval()
        return module

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        """The pooled rows of each bag, as nn.EmbeddingBag's forward.

        Args:
            input (torch.Tensor): (B, L) int IDs (B bags of L), or (N,) IDs with `offsets`.
            offsets (torch.Tensor | None): (B,) bag starts of a 1-D input ((B + 1,) with
                `include_last_offset`).
            per_sample_weights (torch.Tensor | None): float weights of input's shape ("sum" and
                "mean" only).

        Returns:
            torch.Tensor: (B, embedding_dim) float32.
        """
        if per_sample_weights is None and _fast_ids(self, input):
            # The common eager calls go straight to the bridge (bridge.lookup_table), with the
            # keys as their NumPy view: a (B, L) batch with the shared offsets of its shape
            # (_fixed_offsets), or 1-D IDs with int64 CPU offsets (include_last_offset=False:
            # N appended, as the general path does; the core checks the offsets' values, as it
            # does there). Every check of embedding_bag_lookup holds for them (see _fast_ids;
            # no weights; offsets only with 1-D input), so they need none of it.
            if offsets is None:
                if input.ndim == 2:
                    n_bags, length = input.shape
                    return bridge.lookup_table(self, input.numpy().reshape(-1), _fixed_offsets(n_bags, length),
                                               MODES[self.mode], self.training, inputs=(input,))
            elif (input.ndim == 1 and type(offsets) is torch.Tensor and offsets.dtype is torch.int64
                  and offsets.ndim == 1 and offsets.is_cpu and (not self.include_last_offset or len(offsets))):
                offsets_np = offsets.numpy()
                if not self.include_last_offset:
                    offsets_np = np.concatenate((offsets_np, [len(input)]))  # (cheaper than np.append)
                return bridge.lookup_table(self, input.numpy(), offsets_np, MODES[self.mode], self.training,
                                           inputs=(input, offsets))
        return functional.embedding_bag_lookup(self._anchor, self._handle, self.placement.kind, self.embedding_dim,
                                               input, offsets, per_sample_weights, self.mode, self.include_last_offset,
                                               self.padding_idx, self.training)


def _fast_ids(module: _DynamicTable, input) -> bool:
    """Whether `input` can go to the bridge as it is (the modules' fast path): a plain int64
    CPU tensor (not meta, as it is on the CPU; an int64 never needs a gradient), a table in
    the core with no padding ID to drop, in eager mode: not compiling (the graph takes the
    operator), not under torch.jit.trace (the general path refuses it: bridge.lookup) nor a
    functorch transform (torch.func.grad, vmap: there `.numpy()` of any tensor failed, "Cannot
    access data pointer of Tensor that doesn't have storage"; the general path's
    autograd.Function says what functorch needs). A torch.fx Proxy or a tensor subclass takes
    the general path. This path skips the general path's input handling, most of the module's
    own cost in a training step (docs/design/torch-bridge.md)."""
    return (type(input) is torch.Tensor and input.dtype is torch.int64 and input.is_cpu
            and module.padding_idx is None and module.placement.kind == "core" and not torch.compiler.is_compiling()
            and not torch.jit.is_tracing() and not torch._C._are_functorch_transforms_active())


class CNEmbedding(_DynamicTable):
    """`torch.nn.Embedding` over a growable table: any input shape, output input.shape + (dim,).
    Positions holding `padding_idx` read as zeros and take no gradient.

    Args:
        num_embeddings (int): a capacity hint (IDs are not bounded by it).
        embedding_dim (int): the row width.
        padding_idx (int | None): an ID that reads as zeros and takes no gradient.
        max_norm, norm_type, scale_grad_by_freq, sparse: as nn.Embedding; max_norm,
            scale_grad_by_freq and sparse=True are refused.
        device (str | torch.device | None): "cpu" (rows in the core), "meta" (no rows until
            `to_empty`) or "cncard" / an accelerator device (rows there, the key index on the host).
        dtype (torch.dtype | None): torch.float32 or None (the output's dtype).
        optimizer (Optimizer | None): the fused optimizer applied in backward (`cncore.SGD`,
            `Adagrad`, `RowWiseAdagrad`, `Adam`), or None (gradients go to the hooks).
        initializer (Initializer | None): how a new ID's row is drawn (None: N(0, 1)).
        seed (int): the table seed of that draw.
        max_load_factor (float): the index grows past it (0.1 .. 0.9).
        max_rows (int | None): the row budget of a bounded table, or None.
        eviction (Eviction | None): `cncore.LRU()`, `LFU()` or `TTL(steps)`.
        admission (Admission | None): `cncore.MinCount(c)` or `Probability(p)`.
        headroom (int | None): rows one eviction frees beyond the need.
        row_dtype (str): the rows' storage dtype: "float32", "float16" or "bfloat16".
        storage (Tiered | None): `cncore.Tiered(path, cache_bytes)`: rows on disk under a
            bounded cache.
        fallback_rows (int | str | None): shared rows that IDs without a row of their own read and
            train (``StoreConfig.fallback_rows``; docs/bounded-tables.md), or "auto" (with
            max_rows: the table chooses its split of max_rows when it fills); None (the default):
            "auto" where it can run (rows in the core), else 0 (one row per ID).
        fallback_copy (bool): a new row starts as a copy of its fallback row, or from the
            initializer.
        fallback_mode (str): "miss" (the default) or "residual": every ID reads its own row
            plus its fallback row (``StoreConfig.fallback_mode``).

    Example::

        >>> import torch, cncore
        >>> emb = CNEmbedding(10, 2, optimizer=cncore.SGD(lr=0.1), initializer=cncore.Constant(1.0))
        >>> emb(torch.tensor([[2**50, 3]])).shape
        torch.Size([1, 2, 2])
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 max_norm: float | None = None, norm_type: float = 2.0, scale_grad_by_freq: bool = False,
                 sparse: bool = False, _weight: torch.Tensor | None = None, _freeze: bool = False,
                 device: str | torch.device | None = None,
                 dtype: torch.dtype | None = None, *, optimizer: Optimizer | None = None,
                 initializer: Initializer | None = None, seed: int = 0, max_load_factor: float = 0.7,
                 max_rows: int | None = None, eviction: Eviction | None = None, admission: Admission | None = None,
                 headroom: int | None = None, row_dtype: str = "float32", storage: Tiered | None = None,
                 fallback_rows: int | str | None = None, fallback_copy: bool = True,
                 fallback_mode: str = "miss") -> None:
        _check_unsupported(max_norm, scale_grad_by_freq, sparse, device, dtype)
        _check_padding_idx(padding_idx)
        super().__init__(num_embeddings, embedding_dim, optimizer, initializer, seed, max_load_factor, device,
                         module_options(max_rows, eviction, admission, headroom, row_dtype, storage, fallback_rows,
                                        fallback_copy, fallback_mode))
        self.padding_idx = padding_idx
        if _weight is not None:
            _load_dense(self, _weight)
        if _freeze:
            self.eval()

    @classmethod
    def from_pretrained(cls, embeddings: torch.Tensor, freeze: bool = True, **kwargs: Any) -> CNEmbedding:
        """Rows 0..N-1 from a dense (N, dim) matrix (as nn.Embedding.from_pretrained).

        Args:
            embeddings (torch.Tensor): (N, dim) float rows, row i for ID i.
            freeze (bool): keep the module in eval mode (lookups insert nothing).
            **kwargs: the constructor's other arguments (padding_idx, optimizer, ...).

        Returns:
            CNEmbedding: the module holding those N rows.

        Example::

            >>> import torch
            >>> CNEmbedding.from_pretrained(torch.eye(2))(torch.tensor([1])).tolist()
            [[0.0, 1.0]]
        """
        _check_dense("embeddings", embeddings)
        return cls(embeddings.shape[0], embeddings.shape[1], _weight=embeddings, _freeze=freeze, **kwargs)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Each ID's row, as nn.Embedding's forward.

        Args:
            input (torch.Tensor): int IDs of any shape.

        Returns:
            torch.Tensor: input.shape + (embedding_dim,) float32.
        """
        if _fast_ids(self, input):  # the fast path (see CNEmbeddingBag.forward): each ID a bag of one
            keys = input.numpy().reshape(-1)
            return bridge.lookup_table(self, keys, _unit_offsets(len(keys)), MODES["sum"], self.training,
                                       input.shape + (self.embedding_dim,), inputs=(input,))
        return functional.embedding_lookup(self._anchor, self._handle, self.placement.kind, self.embedding_dim, input,
                                           self.padding_idx, self.training)


_FIXED_OFFSETS: dict[tuple[int, int], np.ndarray] = {}  # (B, L): the read-only offsets 0, L, ..., B * L


def _fixed_offsets(n_bags: int, length: int) -> np.ndarray:
    """The offsets of B bags of L IDs each (a 2-D input), one read-only array per shape, made
    once: a training loop sees one or two shapes, and building them per call (torch.arange * L)
    costs more than the lookup's own checks. Nothing writes to them (the core, the contexts and
    the backward only read offsets; the array is read-only besides). At most 64 shapes kept."""
    offsets = _FIXED_OFFSETS.get((n_bags, length))
    if offsets is None:
        if len(_FIXED_OFFSETS) >= 64:
            _FIXED_OFFSETS.clear()
        offsets = np.arange(n_bags + 1, dtype=np.int64) * length
        offsets.flags.writeable = False
        _FIXED_OFFSETS[(n_bags, length)] = offsets
    return offsets


_UNIT_OFFSETS = [np.zeros(1, dtype=np.int64)]  # 0, 1, 2, ...: read-only, grown by doubling


def _unit_offsets(n: int) -> np.ndarray:
    """The offsets of n bags of one ID each (CNEmbedding's), 0..n: a prefix of one shared
    read-only range, grown by doubling past the largest n seen (8-16 MiB at a million IDs a call),
    so no call builds them (a slice in place of the general path's torch.arange(n + 1))."""
    offsets = _UNIT_OFFSETS[0]
    if len(offsets) <= n:
        offsets = np.arange(max(n + 1, 2 * len(offsets)), dtype=np.int64)
        offsets.flags.writeable = False
        _UNIT_OFFSETS[0] = offsets
    return offsets[:n + 1]


def _check_dense(name: str, weight) -> None:
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        raise TypeError(f"{name} must be a floating point torch.Tensor, got "
                        f"{getattr(weight, 'dtype', type(weight).__name__)}")
    if weight.is_meta:
        raise ValueError(f"{name} is a meta tensor, which holds no values; expected the rows as a CPU tensor")
    if weight.dim() != 2:
        raise ValueError(f"{name} must be 2-D (num_embeddings, embedding_dim), got shape {tuple(weight.shape)}")


def _load_dense(module: _DynamicTable, weight: torch.Tensor) -> None:
    _check_dense("_weight", weight)
    if weight.shape[1] != module.embedding_dim:
        raise ValueError(f"_weight must be (num_embeddings, {module.embedding_dim}), got {tuple(weight.shape)}")
    module.insert(torch.arange(weight.shape[0]), weight.detach().to(torch.float32).contiguous())

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

from typing import Callable, List, Optional

import numpy as np
import torch
from torch import nn

import cncore
from cncore_torch import _ops
from cncore_torch.device_rows import DeviceRows
from cncore_torch.devices import resolve_device
from cncore_torch.optim import FusedOptimizer
from cncore_torch.state import TableState, export_tensors, is_store_entry, load_tables, save_evicted_count
from cncore_torch.table_options import module_options

__all__ = ["CNEmbeddingBag", "CNEmbedding"]

_MODES = {"sum": 0, "mean": 1, "max": 2}
_MAX_INITIAL_ROWS = 1 << 20


def store_config(context: str, embedding_dim, **fields) -> cncore.StoreConfig:
    """`cncore.StoreConfig(dim=embedding_dim, **fields)`, its errors naming our arguments (the
    core calls embedding_dim `dim`), after `context` (say, which table)."""
    try:
        return cncore.StoreConfig(dim=embedding_dim, **fields)
    except (TypeError, ValueError) as exc:
        message = str(exc)
        raise type(exc)(context + ("embedding_" + message if message.startswith("dim ") else message)) from None


def check_flag(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")


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


class _DynamicTable(nn.Module):
    """What both modules share: the store, the autograd anchor, optimizer and table methods."""

    def __init__(self, num_embeddings: int, embedding_dim: int, optimizer, initializer, seed: int,
                 max_load_factor: float, device=None, options: Optional[dict] = None):
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
        self.storage = None  # the table's RowStorage (cncore.storage): in the core, or device rows; None on meta
        self._make_storage()
        # Zero-size parameter: carries the backward (see _ops) and the fused optimizer's lr.
        self._anchor = nn.Parameter(torch.empty(0, device=self.placement.device))
        self._handle = _ops.register(self)
        self.fused_optimizer = FusedOptimizer(self._anchor, optimizer, lambda: self.storage) if optimizer else None
        self._gradient_hooks: List[Callable] = []
        self.last_gradients = None

    # --- placement --------------------------------------------------------------------------------

    def _make_storage(self) -> None:
        kind = self.placement.kind
        if kind == "device" and self.config.storage is not None:
            raise ValueError(f"device={self.placement.device}: a tiered table (storage=) keeps its rows in the core "
                             "and on disk; keep it on device='cpu'")
        if kind == "device" and self.config.dtype != "float32":
            raise ValueError(f"device={self.placement.device}: rows on an accelerator are float32 for now "
                             f"(row_dtype={self.config.dtype!r}); keep this table on device='cpu' (the core)")
        self.storage = (cncore.EmbeddingStore(self.config) if kind == "core" else
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
        """What the lookup reads (see cncore_torch._ops): this table's storage."""
        return [self.storage]

    def _require_storage(self):
        if self.placement.kind == "meta":
            raise RuntimeError("this table is on the meta device and holds no rows; materialise it with "
                               "to_empty(device='cpu') or move_to('cncard')")

    def move_to(self, device) -> "_DynamicTable":
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
            rows = dataclasses.replace(TableState.from_export(self.export(), self.storage.step),
                                       evicted_count=self.storage.evicted_count)  # moves with the rows
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
        super().__setstate__(state)
        self._handle = _ops.register(self)
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
        """The non-fused backward: (unique IDs, gradient rows) to the hooks (from _ops, or the device path)."""
        self.last_gradients = (ids, grads)
        for hook in self._gradient_hooks:
            hook(ids, grads)

    # --- the dynamic table ------------------------------------------------------------------------

    @property
    def num_rows(self) -> int:
        self._require_storage()
        return len(self.storage)

    @property
    def capacity(self) -> int:
        self._require_storage()
        return self.storage.capacity

    def keys(self) -> torch.Tensor:
        """Every ID in the table (int64, in no particular order)."""
        return self.export()["keys"]

    def export(self) -> dict:
        """keys, rows, optimizer_state, counts and last_steps, as CPU tensors."""
        self._require_storage()
        return export_tensors(self.storage)

    def _replace_rows(self, state: TableState) -> None:
        """Every row, its optimizer state, metadata and the step replaced (in place: the store
        object stays, so the operator handle and `module.store` references stay valid)."""
        self._require_storage()
        state.load_into(self.storage)

    def insert(self, ids, rows) -> torch.Tensor:
        """Write rows for IDs, inserting the absent ones; returns which were present."""
        return self._write(ids, rows, insert=True)

    def assign(self, ids, rows) -> torch.Tensor:
        """Write rows for IDs that are present; returns which were."""
        return self._write(ids, rows, insert=False)

    def _write(self, ids, rows, insert: bool) -> torch.Tensor:
        self._require_storage()
        rows = torch.as_tensor(rows).detach().cpu().contiguous()
        verb = self.storage.insert_or_assign if insert else self.storage.assign
        return torch.from_numpy(np.array(verb(ids, rows), dtype=bool))

    def reserve(self, n_rows: int) -> None:
        self._require_storage()
        self.storage.reserve(n_rows)

    # --- state ----------------------------------------------------------------------------------

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.placement.kind == "meta":
            return
        for name, value in self.export().items():
            destination[prefix + name] = value
        destination[prefix + "step"] = torch.tensor(self.storage.step, dtype=torch.int64)
        save_evicted_count(self.storage, destination, prefix)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        """All or nothing (see cncore_torch.state): the table changes only when every entry is valid."""
        def load_rest(rest, missing, unexpected, errors):
            super(_DynamicTable, self)._load_from_state_dict(rest, prefix, local_metadata, strict, missing,
                                                             unexpected, errors)

        if self.placement.kind == "meta":  # no rows to load into, as none were saved
            if any(is_store_entry(k, prefix) for k in state_dict):
                error_msgs.append(f"{prefix}rows: this table is on the meta device and holds no rows; materialise it "
                                  "with to_empty(device='cpu') before loading rows")
            load_rest({k: v for k, v in state_dict.items() if not is_store_entry(k, prefix)}, missing_keys,
                      unexpected_keys, error_msgs)
            return
        load_tables(self._tables(prefix), load_rest, state_dict, missing_keys, unexpected_keys, error_msgs)

    def _tables(self, prefix: str) -> dict:
        """This module's table in a state_dict (see cncore_torch.state.TableSpec)."""
        return {prefix: (self.config, self._replace_rows)}

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows={self.num_rows}"


def _as_ids(input, name="input") -> torch.Tensor:
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of IDs, got {type(input).__name__}")
    if input.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name} must hold int64 or int32 IDs, got {input.dtype}")
    return input


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

    >>> import torch, cncore
    >>> bag = CNEmbeddingBag(100, 4, mode="sum", optimizer=cncore.SGD(lr=0.1), max_rows=2, eviction=cncore.LRU(),
    ...                      headroom=0)
    >>> bag(torch.tensor([[5, 6]])).sum().backward()
    >>> bag(torch.tensor([[7]])).sum().backward()      # 5 and 6 were used alike: the smaller key goes
    >>> sorted(bag.keys().tolist()), bag.store.evicted_count
    ([6, 7], 1)
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, max_norm: Optional[float] = None,
                 norm_type: float = 2.0, scale_grad_by_freq: bool = False, mode: str = "mean", sparse: bool = False,
                 _weight: Optional[torch.Tensor] = None, include_last_offset: bool = False,
                 padding_idx: Optional[int] = None, device=None, dtype=None, *, optimizer=None, initializer=None,
                 seed: int = 0, max_load_factor: float = 0.7, max_rows: Optional[int] = None, eviction=None,
                 admission=None, headroom: Optional[int] = None, row_dtype="float32",
                 storage=None):
        _check_unsupported(max_norm, scale_grad_by_freq, sparse, device, dtype)
        if mode not in _MODES:
            raise ValueError(f"mode must be 'sum', 'mean' or 'max', got {mode!r}")
        check_flag("include_last_offset", include_last_offset)
        _check_padding_idx(padding_idx)
        super().__init__(num_embeddings, embedding_dim, optimizer, initializer, seed, max_load_factor, device,
                         module_options(max_rows, eviction, admission, headroom, row_dtype, storage))
        self.mode = mode
        self.include_last_offset = include_last_offset
        self.padding_idx = padding_idx
        if _weight is not None:
            _load_dense(self, _weight)

    @classmethod
    def from_pretrained(cls, embeddings: torch.Tensor, freeze: bool = True, **kwargs) -> "CNEmbeddingBag":
        """Rows 0..N-1 from a dense (N, dim) matrix (as nn.EmbeddingBag.from_pretrained); with
        freeze (the default) the module stays in eval mode: no insertions."""
        _check_dense("embeddings", embeddings)
        module = cls(embeddings.shape[0], embeddings.shape[1], _weight=embeddings, **kwargs)
        if freeze:
            module.eval()
        return module

    def forward(self, input: torch.Tensor, offsets: Optional[torch.Tensor] = None,
                per_sample_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        if per_sample_weights is None and _fast_ids(self, input):
            # The common eager calls go straight to the bridge (_ops.lookup_table), with the
            # keys as their NumPy view: a (B, L) batch with the shared offsets of its shape
            # (_fixed_offsets), or 1-D IDs with int64 CPU offsets (include_last_offset=False:
            # N appended, as the general path does; the core checks the offsets' values, as it
            # does there). Every check of embedding_bag_lookup holds for them (see _fast_ids;
            # no weights; offsets only with 1-D input), so they need none of it.
            if offsets is None:
                if input.ndim == 2:
                    n_bags, length = input.shape
                    return _ops.lookup_table(self, input.numpy().reshape(-1), _fixed_offsets(n_bags, length),
                                             _MODES[self.mode], self.training, inputs=(input,))
            elif (input.ndim == 1 and type(offsets) is torch.Tensor and offsets.dtype is torch.int64
                  and offsets.ndim == 1 and offsets.is_cpu and (not self.include_last_offset or len(offsets))):
                offsets_np = offsets.numpy()
                if not self.include_last_offset:
                    offsets_np = np.concatenate((offsets_np, [len(input)]))  # (np.append: 2.7 us, this 2.1)
                return _ops.lookup_table(self, input.numpy(), offsets_np, _MODES[self.mode], self.training,
                                         inputs=(input, offsets))
        return embedding_bag_lookup(self._anchor, self._handle, self.placement.kind, self.embedding_dim, input,
                                    offsets, per_sample_weights, self.mode, self.include_last_offset,
                                    self.padding_idx, self.training)


def _fast_ids(module: _DynamicTable, input) -> bool:
    """Whether `input` can go to the bridge as it is (the modules' fast path): a plain int64
    CPU tensor (not meta, as it is on the CPU; an int64 never needs a gradient), a table in
    the core with no padding ID to drop, in eager mode: not compiling (the graph takes the
    operator), not under torch.jit.trace (the general path refuses it: _ops.lookup) nor a
    functorch transform (torch.func.grad, vmap: there `.numpy()` of any tensor failed, "Cannot
    access data pointer of Tensor that doesn't have storage"; the general path's
    autograd.Function says what functorch needs). A torch.fx Proxy or a tensor subclass takes
    the general path. The module's input handling took 38 us of a training step through the
    general path, 7 here (perf_counter marks, batch 4096; README "The PyTorch layer")."""
    return (type(input) is torch.Tensor and input.dtype is torch.int64 and input.is_cpu
            and module.padding_idx is None and module.placement.kind == "core" and not torch.compiler.is_compiling()
            and not torch.jit.is_tracing() and not torch._C._are_functorch_transforms_active())


class CNEmbedding(_DynamicTable):
    """`torch.nn.Embedding` over a growable table: any input shape, output input.shape + (dim,).
    Positions holding `padding_idx` read as zeros and take no gradient."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: Optional[int] = None,
                 max_norm: Optional[float] = None, norm_type: float = 2.0, scale_grad_by_freq: bool = False,
                 sparse: bool = False, _weight: Optional[torch.Tensor] = None, _freeze: bool = False, device=None,
                 dtype=None, *, optimizer=None, initializer=None, seed: int = 0, max_load_factor: float = 0.7,
                 max_rows: Optional[int] = None, eviction=None, admission=None, headroom: Optional[int] = None,
                 row_dtype="float32", storage=None):
        _check_unsupported(max_norm, scale_grad_by_freq, sparse, device, dtype)
        _check_padding_idx(padding_idx)
        super().__init__(num_embeddings, embedding_dim, optimizer, initializer, seed, max_load_factor, device,
                         module_options(max_rows, eviction, admission, headroom, row_dtype, storage))
        self.padding_idx = padding_idx
        if _weight is not None:
            _load_dense(self, _weight)
        if _freeze:
            self.eval()

    @classmethod
    def from_pretrained(cls, embeddings: torch.Tensor, freeze: bool = True, **kwargs) -> "CNEmbedding":
        _check_dense("embeddings", embeddings)
        return cls(embeddings.shape[0], embeddings.shape[1], _weight=embeddings, _freeze=freeze, **kwargs)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if _fast_ids(self, input):  # the fast path (see CNEmbeddingBag.forward): each ID a bag of one
            keys = input.numpy().reshape(-1)
            return _ops.lookup_table(self, keys, _unit_offsets(len(keys)), _MODES["sum"], self.training,
                                     input.shape + (self.embedding_dim,), inputs=(input,))
        return embedding_lookup(self._anchor, self._handle, self.placement.kind, self.embedding_dim, input,
                                self.padding_idx, self.training)


@torch.fx.wrap
def embedding_bag_lookup(anchor: torch.Tensor, handle: int, placement: str, dim: int, input: torch.Tensor,
                         offsets: Optional[torch.Tensor], per_sample_weights: Optional[torch.Tensor], mode: str,
                         include_last_offset: bool, padding_idx: Optional[int], training: bool) -> torch.Tensor:
    """CNEmbeddingBag's forward: nn.EmbeddingBag's input conventions turned into (keys, B+1
    offsets, weights) for the core. One node under torch.fx (`torch.fx.wrap`)."""
    input = _as_ids(input)
    if offsets is not None:
        offsets = _as_ids(offsets, "offsets")
    if per_sample_weights is not None and (not isinstance(per_sample_weights, torch.Tensor)
                                           or not per_sample_weights.is_floating_point()):
        raise TypeError("per_sample_weights must be a floating point torch.Tensor, got "
                        f"{getattr(per_sample_weights, 'dtype', type(per_sample_weights).__name__)}")
    _check_device(placement, input=input, offsets=offsets, per_sample_weights=per_sample_weights)
    if per_sample_weights is not None:
        if mode == "max":
            raise ValueError("per_sample_weights work with mode='sum' or 'mean', not 'max'")
        if per_sample_weights.shape != input.shape:
            raise ValueError(f"per_sample_weights must have the shape of input {tuple(input.shape)}, got "
                             f"{tuple(per_sample_weights.shape)}")
    if input.dim() == 2:
        if offsets is not None:
            raise ValueError("offsets must be None when input is 2-D (each row is a bag)")
        n_bags, length = input.shape
        offsets = torch.arange(n_bags + 1, dtype=torch.int64) * length
        keys = input.reshape(-1)
        weights = None if per_sample_weights is None else per_sample_weights.reshape(-1)
    elif input.dim() == 1:
        if offsets is None:
            raise ValueError("offsets is required when input is 1-D")
        if offsets.dim() != 1:
            raise ValueError(f"offsets must be 1-D, got shape {tuple(offsets.shape)}")
        keys, weights = input, per_sample_weights
        if not include_last_offset:
            offsets = torch.cat([offsets.to(torch.int64), torch.tensor([keys.numel()], dtype=torch.int64,
                                                                       device=offsets.device)])
        elif offsets.numel() == 0:
            raise ValueError("offsets must hold B+1 entries with include_last_offset=True (at least [0]), got none")
    else:
        raise ValueError(f"input must be 1-D (with offsets) or 2-D, got shape {tuple(input.shape)}")
    keys = keys.to(torch.int64).contiguous()
    offsets = offsets.to(torch.int64).contiguous()
    if weights is not None:
        weights = weights.to(torch.float32).contiguous()
    if placement == "meta":  # shape inference: no values to read
        return _lookup(anchor, handle, placement, dim, keys, offsets, weights, _MODES[mode], training)
    if placement == "device" or padding_idx is not None:
        _check_offsets(offsets, keys.numel())  # the core checks its own input; PyTorch ops do not
    if padding_idx is not None:
        keys, offsets, weights = _drop_padding(keys, offsets, weights, padding_idx)
    return _lookup(anchor, handle, placement, dim, keys, offsets, weights, _MODES[mode], training)


_FIXED_OFFSETS = {}  # (B, L): the read-only offsets 0, L, ..., B * L


def _fixed_offsets(n_bags: int, length: int) -> np.ndarray:
    """The offsets of B bags of L IDs each (a 2-D input), one read-only array per shape, made
    once: a training loop sees one or two shapes. Building them per call (torch.arange * L)
    cost 10 us warm (B = 4096); nothing writes to them (the core, the contexts and the backward
    only read offsets; the array is read-only besides). At most 64 shapes kept."""
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
    so no call builds them: the general path's torch.arange(n + 1) took 6.5 us at n = 4096,
    the slice takes 0.2 (timeit, warm, load 1.7)."""
    offsets = _UNIT_OFFSETS[0]
    if len(offsets) <= n:
        offsets = np.arange(max(n + 1, 2 * len(offsets)), dtype=np.int64)
        offsets.flags.writeable = False
        _UNIT_OFFSETS[0] = offsets
    return offsets[:n + 1]


def _check_offsets(offsets: torch.Tensor, n_keys: int) -> None:
    """B+1 offsets: from 0, never decreasing, to the number of IDs."""
    if int(offsets[0]) != 0 or int(offsets[-1]) != n_keys or bool((offsets[1:] < offsets[:-1]).any()):
        raise ValueError(f"offsets must start at 0, never decrease and stay within the {n_keys} IDs of input "
                         f"(with include_last_offset=True, end at {n_keys}); got {offsets.tolist()[:10]}")


@torch.fx.wrap
def embedding_lookup(anchor: torch.Tensor, handle: int, placement: str, dim: int, input: torch.Tensor,
                     padding_idx: Optional[int], training: bool) -> torch.Tensor:
    """CNEmbedding's forward: each ID its own bag of one. One node under torch.fx."""
    input = _as_ids(input)
    _check_device(placement, input=input)
    keys = input.reshape(-1).to(torch.int64).contiguous()
    offsets = torch.arange(keys.numel() + 1, dtype=torch.int64)
    if padding_idx is not None and placement != "meta":
        keys, offsets, _ = _drop_padding(keys, offsets, None, padding_idx)
    out = _lookup(anchor, handle, placement, dim, keys, offsets, None, _MODES["sum"], training)
    return out.reshape(*input.shape, dim)


def _check_device(placement: str, **tensors) -> None:
    """Inputs a table can read: not meta (no values), and on the CPU for a table in the core
    (device rows take their inputs from anywhere; a meta table does shape inference only)."""
    if placement == "meta":
        return
    for name, t in tensors.items():
        if t is None:
            continue
        if t.is_meta:
            raise ValueError(f"{name} is a meta tensor, which holds no values: expected {name} on the CPU"
                             + ("" if placement == "core" else " or the table's device") + " (build the "
                             "module with device='meta' for shape inference)")
        if placement == "core" and t.device.type != "cpu":
            raise ValueError(f"{name} is on {t.device}, but this table's rows are in the core (cpu): move "
                             f"{name} to the CPU, or the table with move_to('cncard')")


def _lookup(anchor, handle, placement, dim, keys, offsets, weights, mode, training):
    if placement == "core":
        if torch.compiler.is_compiling():  # one opaque operator in the graph
            return torch.ops.cncore.lookup(anchor, handle, [keys], [offsets], [weights], [mode], training)[0]
        return _ops.lookup(anchor, _ops.table_of(handle), [keys], [offsets], [weights], [mode], training)
    if placement == "meta":  # shape inference only
        return torch.empty((offsets.shape[0] - 1, dim), device="meta")
    return _device_lookup(anchor, handle, keys, offsets, weights, mode, training)


@torch.compiler.disable  # the accelerator path: a clean graph break around PyTorch ops on device rows
def _device_lookup(anchor, handle, keys, offsets, weights, mode, training):
    return _ops.lookup(anchor, _ops.table_of(handle), [keys], [offsets], [weights], [mode], training)


def _drop_padding(keys, offsets, weights, padding_idx):
    """Remove the padding ID from the bags (it neither adds to a bag nor counts in its mean)."""
    keep = keys != padding_idx
    if bool(keep.all()):
        return keys, offsets, weights
    lengths = offsets[1:] - offsets[:-1]
    bag = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    kept = torch.bincount(bag[keep], minlength=len(lengths))
    new_offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(kept, 0)])
    return keys[keep], new_offsets, None if weights is None else weights[keep]


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

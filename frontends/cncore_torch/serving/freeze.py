"""`freeze`: a model with dynamic tables becomes plain torch, its rows in tensors.

>>> import torch, cncore
>>> from cncore_torch import CNEmbeddingBag
>>> bag = CNEmbeddingBag(10, 2, mode="sum", initializer=cncore.Constant(0.5))
>>> _ = bag.store.find_or_insert(torch.tensor([3, 2**60]).numpy())
>>> model = torch.nn.Sequential(bag, torch.nn.Linear(2, 1))
>>> frozen = freeze(model)
>>> type(frozen[0]).__name__, frozen[0](torch.tensor([[3, 2**60, 4]])).tolist()   # 4 is unseen
('FrozenEmbeddingBag', [[1.0, 1.0]])
"""
from __future__ import annotations

import copy

import numpy as np
from torch import nn

from cncore_torch.base import TableModule
from cncore_torch.serving.collection import FrozenEmbeddingBagCollection, FrozenEmbeddingCollection
from cncore_torch.serving.lock import ReadHooks, ServingLock
from cncore_torch.serving.modules import FrozenEmbedding, FrozenEmbeddingBag

__all__ = ["freeze", "FROZEN_TYPES", "serving_lock"]

FROZEN_TYPES = (FrozenEmbeddingBagCollection, FrozenEmbeddingCollection, FrozenEmbeddingBag, FrozenEmbedding)


def _rows_of(store, where: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A store's keys, rows and fallback rows (None without them)."""
    mode = getattr(getattr(store, "config", None), "fallback_mode", "miss")
    shared = getattr(store, "fallback_rows", 0)
    if shared and mode != "miss":
        raise ValueError(f"model: {where} has fallback_mode={mode!r}: every key reads its own row plus its fallback "
                         f"row, which freeze does not build; freeze tables with fallback_mode='miss' (or "
                         f"fallback_rows=0), or serve the live module in eval mode")
    batch = store.export()
    fallback = np.asarray(store.export_fallback()[0], dtype=np.float32) if shared else None
    return np.asarray(batch.keys, dtype=np.int64), np.asarray(batch.rows, dtype=np.float32), fallback


def _frozen(module: TableModule, where: str) -> nn.Module:
    """The frozen twin of one live module (its rows read through the stores' export)."""
    from cncore_torch.collection import CNEmbeddingBagCollection, CNEmbeddingCollection
    from cncore_torch.modules import CNEmbedding, CNEmbeddingBag

    if isinstance(module, (CNEmbeddingBagCollection, CNEmbeddingCollection)):
        if module.is_meta:
            raise ValueError(f"model: {where} is on the meta device and holds no rows; freeze a model whose "
                             f"tables were trained or loaded (to_empty(device='cpu') then load_state_dict)")
        keys, rows, fallback = {}, {}, {}
        for name, store in module.stores.items():
            keys[name], rows[name], fallback[name] = _rows_of(store, f"{where}, table {name!r},")
        if isinstance(module, CNEmbeddingBagCollection):
            return FrozenEmbeddingBagCollection(module.embedding_bag_configs(), module.is_weighted(), keys, rows,
                                                fallback)
        return FrozenEmbeddingCollection(module.embedding_configs(), module.need_indices(), keys, rows, fallback)
    if isinstance(module, (CNEmbeddingBag, CNEmbedding)):
        if module.store is None:
            raise ValueError(f"model: {where} is on the meta device and holds no rows; freeze a trained model")
        ids, weight, shared = _rows_of(module.store, where)
        if isinstance(module, CNEmbeddingBag):
            return FrozenEmbeddingBag(ids, weight, module.mode, module.include_last_offset, module.padding_idx, shared)
        return FrozenEmbedding(ids, weight, module.padding_idx, shared)
    raise TypeError(f"model: {where} is a {type(module).__name__}, which freeze cannot read; it freezes "
                    f"CNEmbeddingBagCollection, CNEmbeddingCollection, CNEmbeddingBag and CNEmbedding")


def freeze(model: nn.Module) -> nn.Module:
    """A copy of `model` in plain torch: every dynamic table (`CNEmbeddingBagCollection`,
    `CNEmbeddingCollection`, `CNEmbeddingBag`, `CNEmbedding`) replaced by its frozen twin
    holding the rows as tensors behind an in-graph ID lookup (`cncore_torch.serving.table`),
    the rest deep-copied (a snapshot: training the original changes nothing here), in eval
    mode with no gradients. Outputs equal the live model's in eval mode, bit for bit; IDs the
    tables never saw read the zero row, as they do there, or, in a table with fallback rows
    (`fallback_rows=N`), their fallback row `cn_hash_key(id) % N`, computed in-graph. `torch.export.export` (see
    `cncore_torch.serving.export_program`) packages it, rows included, into one file that
    runs without cncore; TorchRec's `quantize_embeddings` / `quantize_inference_model`
    quantize its collections; `cncore_torch.serving.apply_delta` updates it in place while it
    serves (a lock held around each forward keeps every request at one version).

    Args:
        model (nn.Module): a model holding dynamic tables, or one table module itself.

    Returns:
        nn.Module: the frozen copy (`model` is left as it was).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    for where, module in model.named_modules():
        if type(module).__name__.startswith("ShardedCN"):
            raise TypeError(f"model: {where or 'the model'} is a {type(module).__name__} (sharded by DMP); freeze "
                            f"the unsharded model: load the checkpoint into a one-process model first "
                            f"(docs/distributed.md, checkpoints across world sizes)")
    memo: dict = {}
    frozen_paths: list[str] = []
    for where, module in model.named_modules():
        inside = any(where.startswith(f"{p}.") or not p for p in frozen_paths)
        if isinstance(module, TableModule) and not inside:  # (a collection's per-table views go with it)
            memo[id(module)] = _frozen(module, where or type(module).__name__)
            frozen_paths.append(where)
    frozen = memo[id(model)] if id(model) in memo else copy.deepcopy(model, memo)
    frozen.eval().requires_grad_(False)
    lock = ServingLock()
    for module in frozen.modules():
        if isinstance(module, FROZEN_TYPES):
            setattr(module, "serving_lock", lock)  # noqa: B010 (nn.Module's __setattr__ is typed for tensors)
    setattr(frozen, "serving_lock", lock)  # noqa: B010
    ReadHooks(lock).install(frozen)
    return frozen


def serving_lock(model: nn.Module) -> ServingLock:
    """The lock `freeze` put on `model` (its requests read under it, deltas write under it)."""
    lock = getattr(model, "serving_lock", None)
    if not isinstance(lock, ServingLock):
        raise TypeError(f"model: a {type(model).__name__} that freeze did not make (no serving_lock); "
                        f"pass the model cncore_torch.serving.freeze returned")
    return lock

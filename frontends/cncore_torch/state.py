"""A store inside a torch `state_dict`: keys, rows, optimizer state, counts, last steps, step.

Shared by the modules and the TorchRec collection, so every checkpoint carries a table the
same way.
"""
from __future__ import annotations

import numpy as np
import torch

import cncore

FIELDS = ("keys", "rows", "optimizer_state", "counts", "last_steps")


def export_tensors(store: cncore.EmbeddingStore) -> dict:
    batch = store.export()
    return {name: torch.from_numpy(np.asarray(getattr(batch, name), dtype=np.int64)
                                   if name in ("counts", "last_steps") else getattr(batch, name))
            for name in FIELDS}


def save_store(store: cncore.EmbeddingStore, destination: dict, prefix: str) -> None:
    for name, value in export_tensors(store).items():
        destination[prefix + name] = value
    destination[prefix + "step"] = torch.tensor(store.step, dtype=torch.int64)


def load_store(store: cncore.EmbeddingStore, state_dict: dict, prefix: str, missing_keys: list,
               error_msgs: list) -> None:
    """Replace the store's rows with those under `prefix` in `state_dict`."""
    values = {name: state_dict.get(prefix + name) for name in FIELDS + ("step",)}
    missing = [prefix + name for name, value in values.items() if value is None]
    if missing:
        missing_keys.extend(missing)
        return
    rows = values["rows"]
    if rows.dim() != 2 or rows.shape[1] != store.dim:
        error_msgs.append(f"{prefix}rows: expected shape (N, {store.dim}), got {tuple(rows.shape)}")
        return
    state = values["optimizer_state"].detach().cpu().contiguous()
    store.clear()
    store.load(values["keys"].cpu().numpy(), rows.detach().cpu().contiguous().numpy(),
               state.numpy() if state.numel() else None, values["counts"].cpu().numpy(),
               values["last_steps"].cpu().numpy())
    store.step = int(values["step"])


def is_store_entry(key: str, prefix: str) -> bool:
    return key.startswith(prefix) and key[len(prefix):] in FIELDS + ("step",)

"""Checkpoints that survive a change of world size.

A sharded collection's `state_dict()` holds this rank's shard of every table, under the same
names as the single-process collection (`<path>.tables.<name>.keys`, `.rows`, `.optimizer_state`,
`.counts`, `.last_steps`, `.step`). Its `load_state_dict` accepts entries with any keys and keeps
the ones this rank owns (`owner_of(key, world_size) == rank`), so:

- N ranks -> M ranks: every new rank loads `merge_shards([the N state_dicts])`;
- N ranks -> one process: a plain `CNEmbeddingBagCollection` loads `merge_shards(...)`;
- one process -> M ranks: every rank loads the single-process state_dict as it is.

Rows, optimizer state, counts, last steps and the step carry over exactly (no arithmetic).
"""
from __future__ import annotations

from typing import Dict, List

import torch

from cncore_torch.state import ENTRIES, FIELDS

__all__ = ["merge_shards"]


def merge_shards(state_dicts: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """One state_dict holding every table whole, from the state_dicts of the ranks of one
    checkpoint (any order). Table entries are concatenated (the ranks' keys are disjoint, which
    is checked); the step must agree; every other entry (dense parameters, identical on every
    rank under DDP) is taken from the first."""
    if not isinstance(state_dicts, (list, tuple)) or not state_dicts:
        raise ValueError("state_dicts: expected a non-empty list of the ranks' state_dicts")
    first = state_dicts[0]
    prefixes = sorted(k[:-len("keys")] for k in first if k.endswith(".keys")
                      and all(k[:-len("keys")] + e in first for e in ENTRIES))
    merged = {k: v for k, v in first.items() if not any(k.startswith(p) and k[len(p):] in ENTRIES for p in prefixes)}
    for prefix in prefixes:
        for i, sd in enumerate(state_dicts):
            missing = [prefix + e for e in ENTRIES if prefix + e not in sd]
            if missing:
                raise ValueError(f"state_dicts[{i}]: has no {missing[0]} (not a shard of the same model)")
        steps = {int(sd[prefix + "step"]) for sd in state_dicts}
        if len(steps) > 1:
            raise ValueError(f"{prefix}step: the shards disagree ({sorted(steps)}); were they saved at one step?")
        for name in FIELDS:
            merged[prefix + name] = torch.cat([sd[prefix + name] for sd in state_dicts])
        merged[prefix + "step"] = first[prefix + "step"].clone()
        counts = [sd[prefix + "evicted_count"] for sd in state_dicts if prefix + "evicted_count" in sd]
        if counts:  # a bounded table's evictions: each shard counted its own
            merged[prefix + "evicted_count"] = torch.stack([c.to(torch.int64) for c in counts]).sum()
        keys = merged[prefix + "keys"]
        if torch.unique(keys).numel() != keys.numel():
            raise ValueError(f"{prefix}keys: a key appears in two shards; pass the shards of one checkpoint, each once")
    return merged

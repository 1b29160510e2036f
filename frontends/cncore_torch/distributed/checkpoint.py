"""Checkpoints that survive a change of world size.

A sharded collection's `state_dict()` holds this rank's shard of every table, under the same
names as the single-process collection (`<path>.tables.<name>.keys`, `.rows`, `.optimizer_state`,
`.counts`, `.last_steps`, `.step`). Its `load_state_dict` accepts entries with any keys and keeps
the ones this rank owns (`owner_of(key, world_size) == rank`), so:

- N ranks -> M ranks: every new rank loads `merge_shards([the N state_dicts])`;
- N ranks -> one process: a plain `CNEmbeddingBagCollection` loads `merge_shards(...)`;
- one process -> M ranks: every rank loads the single-process state_dict as it is.

Rows, optimizer state, counts, last steps and the step carry over exactly (no arithmetic).

Through table files (`cncore.tablefile`), one per rank and table, so that no process ever holds
another rank's rows: `save_shard_tables(module, DIR)` writes this rank's shard of every table to
``DIR/<table>/shard-<rank>-of-<world size>`` (`cncore.routing.shard_name`); `cn-table reshard`
re-splits a table's N shard files into M offline (`cn-table merge-shards`: into one table), and
`load_shard_tables(module, DIR)` loads them into a sharded collection on any number of ranks or
into a plain `CNEmbeddingBagCollection` (one process: rank 0 of 1): it reads this rank's file
when the world size matches, and otherwise every shard file, keeping the keys this rank owns.
"""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from cncore.routing import owner_of, parse_shard_name, shard_name
from cncore.tablefile import chain_length, load_store, open_table, save_table
from cncore_torch.state import ENTRIES, FIELDS

__all__ = ["merge_shards", "save_shard_tables", "load_shard_tables"]


def _place(module) -> Tuple[int, int]:
    """(rank, world size) of a sharded collection; (0, 1) for a plain one."""
    return int(getattr(module, "_rank", 0)), int(getattr(module, "_world_size", 1))


def _stores(module) -> dict:
    stores = getattr(module, "stores", None)
    if not isinstance(stores, dict) or not stores:
        raise TypeError(f"module must be a collection of dynamic tables (a CNEmbeddingBagCollection, sharded or "
                        f"not), got {type(module).__name__}")
    return stores


def save_shard_tables(module, directory: str) -> List[str]:
    """Write this rank's shard of every table of `module` (a sharded collection, pooled or not,
    or a plain `CNEmbeddingBagCollection` / `CNEmbeddingCollection`: shard 0 of 1) to
    ``directory/<table>/shard-<rank>-of-<world size>``: keys, rows, optimizer state, counts,
    last steps, step, config (this shard's budget) and eviction count, as
    `cncore.tablefile.save_table` writes one table. Each rank calls it (no collective: the
    caller puts a barrier after it if another process reads the files next). Returns the
    paths written."""
    rank, world_size = _place(module)
    written = []
    for name, store in _stores(module).items():
        path = os.path.join(directory, name, shard_name(rank, world_size))
        save_table(store, path)
        written.append(path)
    return written


def _shard_files(directory: str, table: str) -> Tuple[int, Dict[int, str]]:
    """(N, {rank: path}) of the shard tables of `table` in `directory`; ValueError if they are
    not every shard of one split."""
    folder = os.path.join(directory, table)
    if not os.path.isdir(folder):
        raise ValueError(f"{folder}: no such directory (no shard tables of table {table!r})")
    found: Dict[int, Dict[int, str]] = {}
    for entry in sorted(os.listdir(folder)):
        place = parse_shard_name(entry)
        if place is not None:
            found.setdefault(place[1], {})[place[0]] = os.path.join(folder, entry)
    if not found:
        raise ValueError(f"{folder}: holds no shard tables (shard-R-of-N)")
    if len(found) > 1:
        raise ValueError(f"{folder}: holds shards of {len(found)} splits ({', '.join(f'{n}-way' for n in found)}); "
                         f"keep one save's shards in a directory")
    (n, shards), = found.items()
    missing = [r for r in range(n) if r not in shards]
    if missing:
        raise ValueError(f"{folder}: shard{'s' * (len(missing) > 1)} {', '.join(map(str, missing))} of {n} missing")
    return n, shards


def load_shard_tables(module, directory: str, verify: bool = True) -> None:
    """Load every table of `module` from its shard tables in ``directory/<table>/`` (written by
    `save_shard_tables` on any number of ranks, or by `cn-table reshard`). Every file is opened
    and checked (dim and optimizer state against this module's table, one step) before any
    table changes; a table's rows are replaced whole, as `load_state_dict` does. With as many
    shards as ranks, each rank reads its own file, and the shard's eviction count comes back
    too; otherwise each rank reads every shard file and keeps the keys it owns
    (`owner_of(key, world size) == rank`), and rank 0 takes the summed eviction count (their
    total over ranks stays what it was). A table chain (incremental saves) is read whole.
    Call it on every rank of a sharded collection (no collective is used)."""
    rank, world_size = _place(module)
    stores = _stores(module)
    entries, evicted = {}, {}
    for name, store in stores.items():
        n, shards = _shard_files(directory, name)
        parts, steps, evicted[name] = [], {}, 0
        for r in ([rank] if n == world_size else range(n)):
            arrays, step, count, config = _read_shard(shards[r], verify)
            if config.dim != store.config.dim or config.state_floats != store.config.state_floats:
                raise ValueError(f"{shards[r]}: dim {config.dim} with {config.state_floats} optimizer state floats; "
                                 f"table {name!r} here has dim {store.config.dim} with {store.config.state_floats}; "
                                 f"nothing was loaded")
            steps[shards[r]] = step
            evicted[name] += count
            if n != world_size:
                mine = owner_of(arrays["keys"], world_size) == rank
                arrays = {f: a[mine] for f, a in arrays.items()}
            parts.append(arrays)
        if len(set(steps.values())) > 1:
            raise ValueError(f"{os.path.join(directory, name)}: the shards disagree on the step ("
                             f"{', '.join(f'{os.path.basename(p)}: {s}' for p, s in steps.items())}); were they "
                             f"saved at one step? nothing was loaded")
        for f in FIELDS:
            joined = np.concatenate([p[f] for p in parts])
            entries[f"tables.{name}.{f}"] = torch.from_numpy(
                joined.astype(np.int64) if f in ("counts", "last_steps") else joined)
        entries[f"tables.{name}.step"] = torch.tensor(next(iter(steps.values())), dtype=torch.int64)
        if n != world_size and rank != 0:
            evicted[name] = 0
    missing, unexpected = module.load_state_dict(entries, strict=False)
    if unexpected:
        raise ValueError(f"unexpected entries {unexpected[:3]}: not this module's tables")
    for name, count in evicted.items():
        stores[name].evicted_count = count


def _read_shard(path: str, verify: bool):
    """(arrays by field, step, evicted count, config) of one shard table (a chain: read whole)."""
    if chain_length(path):
        store = load_store(path, verify)
        e = store.export()
        return {f: np.asarray(getattr(e, f)) for f in FIELDS}, store.step, int(store.evicted_count), store.config
    t = open_table(path, verify)
    return {f: t.read(f, 0, len(t)) for f in FIELDS}, t.step, t.evicted_count, t.config


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

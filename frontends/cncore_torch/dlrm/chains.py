"""Incremental checkpoints of the DLRM job (`--checkpoint DIR --incremental-checkpoint-every K`).

    DIR/
      tables/<table>/   each table as a table file chain (`cncore.tablefile`): a full base, then
                        a delta every K steps with only the rows trained or inserted since the
                        previous save and the keys evicted or erased since
      dense.pt          the model's other weights, the optimizers, the step, and each table's step
                        and eviction count (table files do not hold it)

On W processes (`--nproc W`, torchrun) each rank writes its own shard of every table as its own
chain, ``tables/<table>/shard-<rank>-of-<W>/`` (the names of
`cncore_torch.distributed.checkpoint.save_shard_tables`, so `cn-table compact` then `cn-table
reshard` / `merge-shards` work on them); rank 0 writes dense.pt once every rank has saved.

Each table's save is atomic (a crash leaves the chain's last complete state); dense.pt is
replaced atomically after every table is saved, and names the step each table must be at, so a
resume refuses a directory whose last save was cut off between the tables and dense.pt (the
tables would be ahead of the dense weights) instead of mixing two steps. `open_checkpoint(DIR)`
reads it back as one ordinary state_dict (the tables' chains loaded as one table each), and
`cn-table` reads every table directory (`cn-table compact` merges a chain into a new base).
The first save of a run (a resumed one too) is a full base; saves after it are deltas.
A sharded directory opens the same way, the shards' chains merged (`merge_shards`): any number
of processes resumes from it, each keeping the keys it owns.
"""
from __future__ import annotations

import os
from typing import Dict, Optional

import torch

import cncore
from cncore.routing import shard_name
from cncore.tablefile import Checkpoint, load_store, save_table
from cncore_torch.checkpoint import table_prefixes
from cncore_torch.dlrm.data import InputError
from cncore_torch.state import save_store

__all__ = ["TableChains", "open_checkpoint", "is_incremental_checkpoint"]

DENSE = "dense.pt"
TABLES = "tables"


def atomic_torch_save(state: dict, path: str) -> None:
    """torch.save to `path` through a synced temporary file and a rename."""
    tmp = f"{path}.tmp-{os.getpid()}"
    torch.save(state, tmp)
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)  # a crash leaves the old file or the new one, never half of one


class TableChains:
    """Saves a run's tables as chains and its dense part beside them, every `every` steps.

    `save(model, optimizers, stores, step, extra)`: `stores` is {table name: store} (the
    collection's `stores`), `model.state_dict()`'s table entries are left out of dense.pt.
    With world_size > 1, every rank calls `save` at the same step (it has collectives): each
    writes its shards, and rank 0 writes dense.pt after all of them (see the module docstring)."""

    def __init__(self, directory: str, every: int, rank: int = 0, world_size: int = 1):
        self.directory, self.every = directory, every
        self.rank, self.world_size = rank, world_size
        self.last: Dict[str, Checkpoint] = {}
        self.saves = 0
        self.deltas = 0

    def table_path(self, name: str) -> str:
        path = os.path.join(self.directory, TABLES, name)
        return path if self.world_size == 1 else os.path.join(path, shard_name(self.rank, self.world_size))

    def save(self, model: torch.nn.Module, optimizers, stores: Dict[str, cncore.EmbeddingStore], step: int,
             extra: Optional[dict] = None) -> None:
        os.makedirs(os.path.join(self.directory, TABLES), exist_ok=True)
        for name, store in stores.items():
            self.last[name] = save_table(store, self.table_path(name), since=self.last.get(name))
            self.deltas += self.last[name].delta
        steps = {name: store.step for name, store in stores.items()}
        # table files do not hold the eviction counter: it travels here (per shard on W processes)
        evicted = {name: int(store.evicted_count) for name, store in stores.items()}
        state = model.state_dict()  # (under DMP: a collective, so before rank 0 goes its own way)
        if self.world_size > 1:
            import torch.distributed as dist
            ranks = [None] * self.world_size
            dist.all_gather_object(ranks, (steps, evicted))  # also the barrier: every shard is saved
            evicted = {name: [r[1][name] for r in ranks] for name in evicted}
            if self.rank != 0:
                self.saves += 1
                return
        for prefix in table_prefixes(state):
            for key in [k for k in state if k.startswith(prefix)]:
                del state[key]
        atomic_torch_save({"dense": state, "optimizers": [o.state_dict() for o in optimizers], "step": step,
                            "table_steps": steps, "table_evicted": evicted, "world_size": self.world_size,
                            **(extra or {})},
                           os.path.join(self.directory, DENSE))
        self.saves += 1


def is_incremental_checkpoint(path: str) -> bool:
    return os.path.isdir(path)


def open_checkpoint(directory: str, table_prefix: str) -> dict:
    """The checkpoint in `directory` as the job's single-file checkpoint dict ("model": a full
    state_dict, "optimizers", "step", "args"): the tables under `table_prefix` + name + ".".
    `InputError` when it is not one, or when its last save was cut off."""
    dense_path = os.path.join(directory, DENSE)
    if not os.path.isfile(dense_path):
        raise InputError(f"--resume {directory}: a folder, but not an incremental checkpoint of cn-dlrm "
                         f"(no {DENSE})")
    try:
        state = torch.load(dense_path, weights_only=False)
        steps, dense = dict(state["table_steps"]), state["dense"]
    except Exception as e:  # a damaged file: torch.load raises many kinds
        raise InputError(f"--resume {directory}: {DENSE} is not cn-dlrm's ({type(e).__name__})") from None
    model = dict(dense)
    world_size = int(state.get("world_size", 1))
    for name, step in steps.items():
        path = os.path.join(directory, TABLES, name)
        evicted = state.get("table_evicted", {}).get(name, 0)
        shards = []
        for rank in range(world_size):
            where = path if world_size == 1 else os.path.join(path, shard_name(rank, world_size))
            try:
                store = load_store(where)
            except (ValueError, OSError) as e:
                raise InputError(f"--resume {directory}: table {name}: {e}") from None
            if store.step != step:
                raise InputError(f"--resume {directory}: table {name}{'' if world_size == 1 else f' (shard {rank})'} "
                                 f"is at step {store.step:,} but {DENSE} at {step:,}: the last save was cut off "
                                 f"between the tables and {DENSE}; resume from another checkpoint")
            store.evicted_count = int(evicted[rank] if isinstance(evicted, list) else evicted)
            shard: dict = {}
            save_store(store, shard, f"{table_prefix}{name}.")
            shards.append(shard)
        if world_size == 1:
            model.update(shards[0])
        else:
            from cncore_torch.distributed.checkpoint import merge_shards
            model.update(merge_shards(shards))
    return {**state, "model": model}

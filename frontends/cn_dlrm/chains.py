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

dense.pt is the checkpoint's commit point. It names, for each table (each shard), the step
and the version of the table's chain that go with it, and it is replaced atomically only
after every table is saved. A table's save moves its CURRENT to the new version but keeps the
versions of the chain dense.pt names (`save_table(keep=...)`), so a crash at any point of a
save (in a table, between tables, before dense.pt) leaves the previous checkpoint whole: a
resume reads each table at the version dense.pt names, never the newer one the cut-off save
left. Once dense.pt names the new versions, the next save drops the old ones. (dense.pt files
written before it named versions: each table is read at its CURRENT, which must be at
dense.pt's step, or the resume is refused.) `open_checkpoint(DIR)` reads it back as one
ordinary state_dict (the tables' chains loaded as one table each), and `cn-table` reads every
table directory (`cn-table compact` merges a chain into a new base; a resume then reads the
compacted table, at the same step).
The first save of a run (a resumed one too) is a full base; saves after it are deltas.
A sharded directory opens the same way, the shards' chains merged (`merge_shards`): any number
of processes resumes from it, each keeping the keys it owns.
"""
from __future__ import annotations

import os
import re
from typing import Any

import torch

import cncore
from cn_dlrm.options import InputError
from cncore.routing import shard_name
from cncore.tablefile import Checkpoint, TableFormatError, chain_versions, check_path_name, load_store, save_table
from cncore_torch.checkpoint import table_prefixes
from cncore_torch.state import save_store

__all__ = ["TableChains", "open_checkpoint", "is_incremental_checkpoint"]

DENSE = "dense.pt"
TABLES = "tables"


def atomic_torch_save(state: dict, path: str) -> None:
    """torch.save to `path` through a synced temporary file and a rename."""
    tmp = f"{path}.tmp-{os.getpid()}"
    folder, name = os.path.split(os.path.abspath(path))
    for entry in os.listdir(folder):  # what a save killed here before left (its process is gone)
        pid = entry[len(name) + 5:] if entry.startswith(name + ".tmp-") else ""
        if pid.isdigit() and pid.isascii() and not _alive(int(pid)):
            os.remove(os.path.join(folder, entry))
    torch.save(state, tmp)
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)  # a crash leaves the old file or the new one, never half of one


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # someone else's process
        return True
    return True


class TableChains:
    """Saves a run's tables as chains and its dense part beside them, every `every` steps.

    `save(model, optimizers, stores, step, extra)`: `stores` is {table name: store} (the
    collection's `stores`), `model.state_dict()`'s table entries are left out of dense.pt.
    With world_size > 1, every rank calls `save` at the same step (it has collectives): each
    writes its shards, and rank 0 writes dense.pt after all of them (see the module docstring)."""

    def __init__(self, directory: str, every: int, rank: int = 0, world_size: int = 1):
        self.directory, self.every = directory, every
        self.rank, self.world_size = rank, world_size
        self.last: dict[str, Checkpoint] = {}
        # {table: this rank's version that dense.pt names}: kept by every save until dense.pt
        # names newer ones (None: not read yet)
        self.committed: dict[str, str | None] | None = None
        self.saves = 0
        self.deltas = 0

    def table_path(self, name: str) -> str:
        path = os.path.join(self.directory, TABLES, name)
        return path if self.world_size == 1 else os.path.join(path, shard_name(self.rank, self.world_size))

    def _read_committed(self, names) -> dict[str, str | None]:
        """The versions the directory's dense.pt names for this rank's tables: from dense.pt
        (None where it names none, or is of another world size, whose shards live in other
        folders), or, for a dense.pt written before it named versions, each table's CURRENT."""
        dense = os.path.join(self.directory, DENSE)
        if not os.path.isfile(dense):
            return dict.fromkeys(names)
        try:
            state = torch.load(dense, weights_only=False)
        except Exception:  # not cn-dlrm's: nothing of it to keep
            return dict.fromkeys(names)
        if int(state.get("world_size", 1)) != self.world_size:
            return dict.fromkeys(names)
        if "table_versions" not in state:
            return {name: _current(self.table_path(name)) for name in names}
        named = state["table_versions"]
        out = {}
        for name in names:
            version = named.get(name)  # one version (one process), or one per rank
            out[name] = version[self.rank] if isinstance(version, list) else version
        return out

    def _keep(self, path: str, version: str | None):
        """The versions of the chain ending at `version` (every version present when that
        chain cannot be read: nothing is dropped that a resume might need)."""
        if version is None:
            return ()
        try:
            return chain_versions(path, version)
        except (TableFormatError, OSError):
            return tuple(e for e in (os.listdir(path) if os.path.isdir(path) else ()) if re.fullmatch(r"v[0-9]{6,}", e))

    def save(self, model: torch.nn.Module, optimizers, stores: dict[str, cncore.EmbeddingStore], step: int,
             extra: dict | None = None) -> None:
        for name in stores:
            check_path_name(name, "table name")
        os.makedirs(os.path.join(self.directory, TABLES), exist_ok=True)
        if self.committed is None:
            self.committed = self._read_committed(list(stores))
        versions: dict[str, str | None] = {}
        for name, store in stores.items():
            path = self.table_path(name)
            self.last[name] = save_table(store, path, since=self.last.get(name),
                                         keep=self._keep(path, self.committed.get(name)))
            versions[name] = self.last[name].version
            self.deltas += self.last[name].delta
        steps = {name: store.step for name, store in stores.items()}
        # table files do not hold the eviction counter: it travels here (per shard on W processes)
        evicted: dict[str, Any] = {name: int(store.evicted_count) for name, store in stores.items()}
        state = model.state_dict()  # (under DMP: a collective, so before rank 0 goes its own way)
        if self.world_size > 1:
            import torch.distributed as dist
            ranks: list[Any] = [None] * self.world_size
            dist.all_gather_object(ranks, (steps, evicted, versions))  # also the barrier: every shard is saved
            evicted = {name: [r[1][name] for r in ranks] for name in evicted}
            # Rank 0 writes dense.pt next; the others reach their next save only through the
            # training steps' collectives with rank 0, i.e. after it did.
            self.committed = versions
            if self.rank != 0:
                self.saves += 1
                return
            all_versions: dict[str, Any] = {name: [r[2][name] for r in ranks] for name in versions}
        else:
            all_versions = versions
        for prefix in table_prefixes(state):
            for key in [k for k in state if k.startswith(prefix)]:
                del state[key]
        atomic_torch_save({"dense": state, "optimizers": [o.state_dict() for o in optimizers], "step": step,
                            "table_steps": steps, "table_evicted": evicted, "world_size": self.world_size,
                            "table_versions": all_versions, **(extra or {})},
                           os.path.join(self.directory, DENSE))
        self.committed = versions
        self.saves += 1


def _current(path: str) -> str | None:
    """The version a table directory's CURRENT names (None: no table there yet)."""
    try:
        with open(os.path.join(path, "CURRENT")) as fh:
            return fh.read(64).strip() or None
    except OSError:
        return None


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
    table_versions = state.get("table_versions", {})
    for name, step in steps.items():
        path = os.path.join(directory, TABLES, name)
        evicted = state.get("table_evicted", {}).get(name, 0)
        shards = []
        for rank in range(world_size):
            where = path if world_size == 1 else os.path.join(path, shard_name(rank, world_size))
            version = table_versions.get(name)
            version = version[rank] if isinstance(version, list) else version
            if version is not None and not os.path.isdir(os.path.join(where, version)):
                version = None  # compacted since (cn-table compact): CURRENT, checked against the step below
            try:
                store = load_store(where, version=version)
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

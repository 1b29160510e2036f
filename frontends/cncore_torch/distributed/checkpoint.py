"""Checkpoints that survive a change of world size.

A sharded collection's `state_dict()` holds this rank's shard of every table, under the same
names as the single-process collection (`<path>.tables.<name>.keys`, `.rows`, `.optimizer_state`,
`.counts`, `.last_steps`, `.step`). Its `load_state_dict` accepts entries with any keys and keeps
the ones this rank owns (`owner_of(key, world_size) == rank`), so:

- N ranks -> M ranks: every new rank loads `merge_shards([the N state_dicts])`;
- N ranks -> one process: a plain `CNEmbeddingBagCollection` loads `merge_shards(...)`;
- one process -> M ranks: every rank loads the single-process state_dict as it is.

Rows, optimizer state, counts, last steps and the step carry over exactly (no arithmetic).
Shards' trained fallback rows do not: a key reads the fallback row of the shard that owns it, so
they load back at the saved world size only (each rank its own state_dict, or its own shard
file), and `merge_shards`, `load_shard_tables` at another world size and `cn-table reshard`
refuse them by name before anything changes (`cncore_torch.state.drop_fallback_rows` leaves
them out of a state_dict, to move the keyed rows alone).

Through table files (`cncore.tablefile`), one per rank and table, so that no process ever holds
another rank's rows: `save_shard_tables(module, DIR)` writes this rank's shard of every table to
``DIR/<table>/shard-<rank>-of-<world size>`` (`cncore.routing.shard_name`); `cn-table reshard`
re-splits a table's N shard files into M offline (`cn-table merge-shards`: into one table), and
`load_shard_tables(module, DIR)` loads them into a sharded collection on any number of ranks or
into a plain `CNEmbeddingBagCollection` (one process: rank 0 of 1): it reads this rank's file
when the world size matches, and otherwise every shard file, keeping the keys this rank owns.

Each part says where it belongs, so that a load or merge missing a part, or mixing two saves,
is refused before anything changes: a sharded module's state_dict holds, per table, the entry
``shard`` = (rank, world size, run id), and each shard file records its rank, world size and
save id (`cncore.tablefile.check_shard`). The run id is agreed by the ranks when the sharded
module is built (`agree_run_id`); a save is the run id with the table's step. State_dicts and
files written before these records existed carry none: they load as before, their keys
checked against their rank where a file is read.
"""
from __future__ import annotations

import os
import secrets

import numpy as np
import torch
from torch import nn

from cncore.routing import owner_of, parse_shard_name, shard_name
from cncore.store_fallback import unplaceable_fallback_error
from cncore.tablefile import (
    TableFile,
    chain_head,
    chain_length,
    check_path_name,
    check_shard,
    load_store,
    open_table,
    save_table,
)
from cncore_torch.dcp import FALLBACK_ENTRIES
from cncore_torch.state import ENTRIES, FALLBACK_WITH_COUNT, FIELDS, held_fallback_rows

__all__ = ["merge_shards", "save_shard_tables", "load_shard_tables", "agree_run_id"]


def agree_run_id(env) -> int:
    """A random id (62 bits) that every rank of `env` (a TorchRec ShardingEnv) gets the same
    of: rank 0 draws it and broadcasts it (a collective: every rank builds its sharded modules
    in the same order). Without a process group (one rank), drawn here."""
    run = [secrets.randbits(62)]
    group = getattr(env, "process_group", None)
    if env.world_size > 1 and group is not None:
        import torch.distributed as dist
        dist.broadcast_object_list(run, group=group, group_src=0)
    return int(run[0])


def _place(module) -> tuple[int, int]:
    """(rank, world size) of a sharded collection; (0, 1) for a plain one."""
    return int(getattr(module, "_rank", 0)), int(getattr(module, "_world_size", 1))


def _stores(module) -> dict:
    stores = getattr(module, "stores", None)
    if not isinstance(stores, dict) or not stores:
        raise TypeError(f"module must be a collection of dynamic tables (a CNEmbeddingBagCollection, sharded or "
                        f"not), got {type(module).__name__}")
    return stores


def save_shard_tables(module: nn.Module, directory: str) -> list[str]:
    """Write this rank's shard of every table of `module` (a sharded collection, pooled or not,
    or a plain `CNEmbeddingBagCollection` / `CNEmbeddingCollection`: shard 0 of 1) to
    ``directory/<table>/shard-<rank>-of-<world size>``: keys, rows, optimizer state, counts,
    last steps, step, config (this shard's budget) and eviction count, as
    `cncore.tablefile.save_table` writes one table. Each rank calls it (no collective: the
    caller puts a barrier after it if another process reads the files next). Returns the
    paths written.

    Each file records its place and the save (``{"rank", "world_size", "save"}``: the
    module's run id and the table's step), which `load_shard_tables` and `cn-table reshard`
    check. Table names are directory names here: a name that is not one plain path component
    (``../x``, ``a/b``, an absolute path) is refused before anything is written.

    Args:
        module (nn.Module): a sharded collection, or a plain one.
        directory (str): where each table's folder goes.

    Returns:
        list[str]: the paths written, one per table.
    """
    rank, world_size = _place(module)
    stores = _stores(module)
    for name in stores:
        check_path_name(name, "table name")
    run = getattr(module, "_run_id", None)
    run = f"{run:016x}" if run is not None else secrets.token_hex(8)  # a plain collection: one file a save
    written = []
    for name, store in stores.items():
        path = os.path.join(directory, name, shard_name(rank, world_size))
        save_table(store, path, shard={"rank": rank, "world_size": world_size, "save": f"{run}-step{store.step}"})
        written.append(path)
    return written


def _shard_files(directory: str, table: str) -> tuple[int, dict[int, str]]:
    """(N, {rank: path}) of the shard tables of `table` in `directory`; ValueError if they are
    not every shard of one split."""
    folder = os.path.join(directory, table)
    if not os.path.isdir(folder):
        raise ValueError(f"{folder}: no such directory (no shard tables of table {table!r})")
    found: dict[int, dict[int, str]] = {}
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


def load_shard_tables(module: nn.Module, directory: str, verify: bool = True) -> None:
    """Load every table of `module` from its shard tables in ``directory/<table>/`` (written by
    `save_shard_tables` on any number of ranks, or by `cn-table reshard`). Every file is opened
    and checked (dim and optimizer state against this module's table, one step) before any
    table changes; a table's rows are replaced whole, as `load_state_dict` does. With as many
    shards as ranks, each rank reads its own file, and the shard's eviction count comes back
    too; otherwise each rank reads every shard file and keeps the keys it owns
    (`owner_of(key, world size) == rank`), and rank 0 takes the summed eviction count (their
    total over ranks stays what it was). A table chain (incremental saves) is read whole.
    Call it on every rank of a sharded collection (no collective is used).

    Every rank checks every shard file of a table, so all ranks refuse alike, before any
    table changes: each file's recorded place must be its name's and every file must be of
    one save (`save_shard_tables` records both); a file without records (written before
    them) has its keys checked against its rank instead.

    Args:
        module (nn.Module): a sharded collection, or a plain one.
        directory (str): what `save_shard_tables` (or `cn-table reshard`) wrote.
        verify (bool): check every array's SHA-256 too.
    """
    rank, world_size = _place(module)
    stores = _stores(module)
    entries, evicted = {}, {}
    for name, store in stores.items():
        n, shards = _shard_files(directory, name)
        heads = _check_shard_set(os.path.join(directory, name), n, shards)
        budget = store.config.max_rows  # each rank's share: the same on every rank
        if budget is not None and n == world_size:  # each rank loads its own file: all within the budget?
            for r, head in heads.items():
                if head.delta is None and len(head) > budget:
                    raise ValueError(f"{shards[r]}: holds {len(head)} rows, more than table {name!r}'s max_rows per "
                                     f"rank ({budget}) here; build the module with a larger max_rows; nothing was "
                                     f"loaded")
        if n != world_size:
            held = {r: len(head.fallback[0]) for r, head in heads.items() if head.fallback is not None}
            if sum(held.values()):
                raise ValueError(unplaceable_fallback_error(
                    os.path.join(directory, name),
                    f"the {n} shard files hold {sum(held.values())} trained fallback rows",
                    f"this table is split over {world_size} rank{'s' * (world_size > 1)}",
                    [f"load them on {n} ranks (the world size they were saved at)",
                     "train the table with fallback_rows=0 to reshard it"], "loaded"))
        parts, steps, evicted[name] = [], {}, 0
        shares = np.zeros(world_size, np.int64)  # rows each rank keeps (files re-split on load)
        for r in ([rank] if n == world_size else range(n)):
            arrays, step, count, config, fallback = _read_shard(shards[r], verify)
            check_shard(heads[r], shards[r], r, n, keys_of=[arrays["keys"]])
            if config.dim != store.config.dim or config.state_floats != store.config.state_floats:
                raise ValueError(f"{shards[r]}: dim {config.dim} with {config.state_floats} optimizer state floats; "
                                 f"table {name!r} here has dim {store.config.dim} with {store.config.state_floats}; "
                                 f"nothing was loaded")
            steps[shards[r]] = step
            evicted[name] += count
            if n != world_size:
                owners = owner_of(arrays["keys"], world_size)
                shares += np.bincount(owners, minlength=world_size)
                arrays = {f: a[owners == rank] for f, a in arrays.items()}
            parts.append(arrays)
            if fallback is not None and n == world_size:  # this rank's own shard: its fallback rows are its own
                entries[f"tables.{name}.fallback_rows"] = torch.from_numpy(fallback[0])
                entries[f"tables.{name}.fallback_optimizer_state"] = torch.from_numpy(fallback[1])
                entries[f"tables.{name}.shard"] = torch.tensor([rank, world_size, getattr(module, "_run_id", 0)],
                                                               dtype=torch.int64)
        if n != world_size and budget is not None and shares.max() > budget:
            # every rank reads every file, so every rank sees every rank's share and refuses alike
            j = int(shares.argmax())
            raise ValueError(f"{os.path.join(directory, name)}: rank {j} of {world_size} would hold {int(shares[j])} "
                             f"rows, more than table {name!r}'s max_rows per rank ({budget}); build the module with "
                             f"a larger max_rows (or reshard with cn-table reshard --max-rows); nothing was loaded")
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
    _missing, unexpected = module.load_state_dict(entries, strict=False)
    if unexpected:
        raise ValueError(f"unexpected entries {unexpected[:3]}: not this module's tables")
    for name, count in evicted.items():
        stores[name].evicted_count = count


def _check_shard_set(folder: str, n: int, shards: dict[int, str]) -> dict[int, TableFile]:
    """The N shard files of one table (`_shard_files`) are of one save: each file's recorded
    place is its name's, and all record one save id, or none does (files written before
    they were recorded: their keys are checked against their rank), one step and one dim
    and optimizer state width. Returns {rank: the file's live version}; ValueError otherwise."""
    heads = {r: chain_head(path) for r, path in sorted(shards.items())}
    for r, head in heads.items():
        if head.shard is None:
            check_shard(head, shards[r], r, n)  # keys only: nothing else was recorded
        elif (head.shard["rank"], head.shard["world_size"]) != (r, n):
            check_shard(head, shards[r], r, n)  # refuses, naming the recorded place
    if len({head.step for head in heads.values()}) > 1:
        raise ValueError(f"{folder}: the shards disagree on the step ("
                         f"{', '.join(f'{os.path.basename(shards[r])}: {h.step}' for r, h in heads.items())}); were "
                         f"they saved at one step? nothing was loaded")
    widths = {r: (h.config.dim, h.config.state_floats) for r, h in heads.items()}
    if len(set(widths.values())) > 1:
        r = next(r for r, w in widths.items() if w != widths[0])
        raise ValueError(f"{shards[r]}: dim {widths[r][0]} with {widths[r][1]} optimizer state floats, "
                         f"{os.path.basename(shards[0])}: dim {widths[0][0]} with {widths[0][1]}; the shards of one "
                         f"table share them; nothing was loaded")
    saves = {r: (head.shard or {}).get("save") for r, head in heads.items()}
    if len(set(saves.values())) > 1:
        first = saves[0]
        r = next(r for r, s in saves.items() if s != first)
        raise ValueError(f"{folder}: the shard files are of different saves ({os.path.basename(shards[0])}: "
                         f"{first or 'not recorded'}, {os.path.basename(shards[r])}: {saves[r] or 'not recorded'}); "
                         f"keep one save's shards in a directory; nothing was loaded")
    return heads


def _read_shard(path: str, verify: bool):
    """(arrays by field, step, evicted count, config, fallback rows and their state or None) of
    one shard table (a chain: read whole)."""
    if chain_length(path):
        store = load_store(path, verify)
        e = store.export()
        fallback = store.export_fallback() if getattr(store, "fallback_rows", 0) else None
        return ({f: np.asarray(getattr(e, f)) for f in FIELDS}, store.step, int(store.evicted_count), store.config,
                fallback)
    t = open_table(path, verify)
    return {f: t.read(f, 0, len(t)) for f in FIELDS}, t.step, t.evicted_count, t.config, t.fallback


def merge_shards(state_dicts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One state_dict holding every table whole, from the state_dicts of the ranks of one
    checkpoint (any order). Table entries are concatenated (the ranks' keys are disjoint, which
    is checked); the step must agree; every other entry (dense parameters, identical on every
    rank under DDP) is taken from the first.

    Sharded modules' state_dicts say which shard they hold (each table's ``shard`` entry:
    rank, world size, run id): every rank of one world size and one run must be there, each
    once, or the merge is refused (ValueError) naming what is missing or mixed. The merged
    table is whole: its ``shard`` entry is (0, 1, run id). State_dicts without the entry
    (written before it existed, or by a plain collection) merge as they are.

    Args:
        state_dicts (list[dict[str, torch.Tensor]]): every rank's state_dict of one checkpoint.

    Returns:
        dict[str, torch.Tensor]: one state_dict, every table whole (shard 0 of 1).
    """
    if not isinstance(state_dicts, (list, tuple)) or not state_dicts:
        raise ValueError("state_dicts: expected a non-empty list of the ranks' state_dicts")
    first = state_dicts[0]
    prefixes = sorted(k[:-len("keys")] for k in first if k.endswith(".keys")
                      and all(k[:-len("keys")] + e in first for e in ENTRIES))
    table_entries = ENTRIES + FALLBACK_WITH_COUNT
    merged = {k: v for k, v in first.items()
              if not any(k.startswith(p) and k[len(p):] in table_entries for p in prefixes)}
    for prefix in prefixes:
        for i, sd in enumerate(state_dicts):
            missing = [prefix + e for e in ENTRIES if prefix + e not in sd]
            if missing:
                raise ValueError(f"state_dicts[{i}]: has no {missing[0]} (not a shard of the same model)")
        run = _check_shard_entries(prefix, state_dicts)
        held = [held_fallback_rows(sd, prefix) for sd in state_dicts]
        whole = len(state_dicts) == 1 and (prefix + "shard" not in first or int(first[prefix + "shard"][1]) == 1)
        if whole:  # one whole table: its fallback rows are the merged table's
            merged.update({prefix + e: first[prefix + e] for e in FALLBACK_ENTRIES if prefix + e in first})
        elif sum(held):
            raise ValueError(unplaceable_fallback_error(
                f"{prefix}fallback_rows",
                f"the shards hold {sum(held)} trained fallback rows ({', '.join(map(str, held))} per state_dict)",
                "merged they would be a whole table's",
                [f"load each rank's state_dict on {len(state_dicts)} ranks (the world size they were saved at)",
                 "merge [cncore_torch.state.drop_fallback_rows(sd) for sd in state_dicts] (the keyed rows merge, the "
                 "fallback rows start afresh)"], "merged"))
        steps = {int(sd[prefix + "step"]) for sd in state_dicts}
        if len(steps) > 1:
            raise ValueError(f"{prefix}step: the shards disagree ({sorted(steps)}); were they saved at one step?")
        for name in FIELDS:
            merged[prefix + name] = torch.cat([sd[prefix + name] for sd in state_dicts])
        merged[prefix + "step"] = first[prefix + "step"].clone()
        counts = [sd[prefix + "evicted_count"] for sd in state_dicts if prefix + "evicted_count" in sd]
        if counts:  # a bounded table's evictions: each shard counted its own
            merged[prefix + "evicted_count"] = torch.stack([c.to(torch.int64) for c in counts]).sum()
        merged.pop(prefix + "shard", None)
        if run is not None:
            merged[prefix + "shard"] = torch.tensor([0, 1, run], dtype=torch.int64)
        keys = merged[prefix + "keys"]
        if torch.unique(keys).numel() != keys.numel():
            raise ValueError(f"{prefix}keys: a key appears in two shards; pass the shards of one checkpoint, each once")
    return merged


def _check_shard_entries(prefix: str, state_dicts) -> int | None:
    """The run id of the shards of table `prefix`, after checking that the state_dicts hold
    each rank of one world size and one run once; None when none has a ``shard`` entry."""
    places = [sd.get(prefix + "shard") for sd in state_dicts]
    if all(p is None for p in places):
        return None
    for i, p in enumerate(places):
        if not (isinstance(p, torch.Tensor) and p.shape == (3,) and not p.is_floating_point()):
            what = "has no shard entry" if p is None else f"has a shard entry {p!r}, not (rank, world size, run id)"
            raise ValueError(f"state_dicts[{i}]: {prefix}shard: {what}, the others have one: not shards of one "
                             f"save; nothing was merged")
    places = [tuple(int(v) for v in p) for p in places]
    r0, w, run = places[0]
    for i, (r, wi, ri) in enumerate(places):
        if wi != w or ri != run:
            raise ValueError(f"state_dicts[{i}]: {prefix}shard: rank {r} of {wi} of run {ri:x}, but state_dicts[0] is "
                             f"rank {r0} of {w} of run {run:x}: shards of different saves; pass the state_dicts of "
                             f"one save; nothing was merged")
    seen: dict[int, int] = {}
    for i, (r, _, _) in enumerate(places):
        if r in seen:
            raise ValueError(f"state_dicts[{i}]: {prefix}shard: rank {r} of {w} given twice (also as "
                             f"state_dicts[{seen[r]}]); pass each rank's state_dict once; nothing was merged")
        seen[r] = i
    missing = [r for r in range(w) if r not in seen]
    if missing:
        raise ValueError(f"{prefix}shard: rank{'s' * (len(missing) > 1)} {', '.join(map(str, missing))} of {w} "
                         f"missing: a table split over {w} ranks needs every rank's state_dict, {len(seen)} given; "
                         f"nothing was merged")
    return run

"""Torch checkpoints <-> table files (`cncore.tablefile`), without loss.

In a `state_dict` a dynamic table is the group of entries ``PREFIX{keys, rows,
optimizer_state, counts, last_steps, step}`` (see `state.py`), whichever module wrote it
(`CNEmbeddingBag`, `CNEmbedding`, the TorchRec collections, a DLRM around them). These
functions turn every such group into a table directory named after its prefix, and back;
the other entries (dense weights) stay torch's business.

>>> import os, tempfile, torch, cncore, cncore_torch
>>> from cncore_torch.checkpoint import checkpoint_to_tables, tables_to_checkpoint, table_configs
>>> bag = cncore_torch.CNEmbeddingBag(10, 4, optimizer=cncore.Adagrad())
>>> _ = bag(torch.tensor([1, 2**40]), torch.tensor([0]))
>>> model = torch.nn.ModuleDict({"users": bag}); d = tempfile.mkdtemp()
>>> checkpoint_to_tables(model.state_dict(), d, table_configs(model))
['users']
>>> restored = tables_to_checkpoint(d)
>>> sorted(restored)[:2], torch.equal(restored["users.rows"], model.state_dict()["users.rows"])
(['users.counts', 'users.keys'], True)
"""
from __future__ import annotations

import os
import sys

import numpy as np
import torch

import cncore
from cncore.tablefile import TableWriter, infer_config, open_table
from cncore_torch.state import FIELDS

__all__ = ["checkpoint_to_tables", "tables_to_checkpoint", "table_configs", "table_prefixes"]

_ROOT = "@root"  # the directory name of a table whose prefix is empty (a bare module's state_dict)


def table_prefixes(state_dict: dict) -> list[str]:
    """The prefixes under which `state_dict` holds a dynamic table."""
    found = [k[: -len("rows")] for k in state_dict if k.endswith("rows")]
    return [p for p in found if all(p + name in state_dict for name in FIELDS + ("step",))]


def table_configs(module: torch.nn.Module) -> dict[str, cncore.StoreConfig]:
    """{state_dict prefix: StoreConfig} of every dynamic table in `module`: the configs the
    state_dict itself does not carry (initializer, seed, optimizer hyperparameters)."""
    configs = {}
    for name, sub in module.named_modules():
        at = f"{name}." if name else ""
        config = getattr(sub, "config", None)
        if isinstance(config, cncore.StoreConfig):
            configs[at] = config
        for table, store in (getattr(sub, "_stores", None) or {}).items():
            configs[f"{at}tables.{table}."] = store.config
    return configs


def _directory_name(prefix: str) -> str:
    """The table directory of a state_dict prefix: one plain path component, never a path
    (state_dict keys come from a file, and a key like ``../x.rows`` must not write outside)."""
    name = prefix[:-1] if prefix else _ROOT
    if name in ("", ".", "..") or any(c in name for c in "/\\\0") or (prefix and name == _ROOT):
        raise ValueError(f"state_dict prefix {prefix!r}: a table name must be one plain path component "
                         f"(no '/', '\\', NUL, not '.', '..', empty or {_ROOT!r}); nothing was written")
    return name


def checkpoint_to_tables(state_dict: dict, directory: str,
                         configs: dict[str, cncore.StoreConfig] | None = None) -> list[str]:
    """Write each table of `state_dict` to ``directory/<prefix without its last dot>``.
    `configs` (from `table_configs(model)`) supplies each table's config; a table without
    one gets a config inferred from its shapes (`cncore.tablefile.infer_config`).
    Returns the directory names written. Every table is checked (its name: one plain path
    component; its shapes and value ranges; whole, not one rank's shard) before the first is
    written.

    >>> try:
    ...     checkpoint_to_tables({f"../x.{f}": torch.zeros(0) for f in FIELDS + ("step",)}, "out")
    ... except ValueError as exc:
    ...     print(str(exc)[:72])
    state_dict prefix '../x.': a table name must be one plain path component
    """
    plans = []
    for prefix in table_prefixes(state_dict):
        table = _directory_name(prefix)
        values = {name: state_dict[prefix + name].detach().cpu() for name in FIELDS}
        shapes = {name: tuple(v.shape) for name, v in values.items()}
        n = shapes["keys"][0] if len(shapes["keys"]) == 1 else None
        for name, shape in shapes.items():
            ndim = 2 if name in ("rows", "optimizer_state") else 1
            if len(shape) != ndim or shape[0] != n:
                raise ValueError(f"{prefix}{name}: shape {shape}; expected {ndim}-D with one entry per key "
                                 f"(keys: {shapes['keys']})")
        rows = values["rows"]
        config = (configs or {}).get(prefix) or infer_config(rows.shape[1], values["optimizer_state"].shape[1])
        if config.dim != rows.shape[1] or config.state_floats != values["optimizer_state"].shape[1]:
            raise ValueError(f"configs[{prefix!r}]: dim {config.dim} / {config.state_floats} state floats do not "
                             f"match the checkpoint's rows {tuple(rows.shape)} / state "
                             f"{tuple(values['optimizer_state'].shape)}")
        for name in ("counts", "last_steps"):
            v = values[name]
            if v.numel() and (int(v.min()) < 0 or int(v.max()) > 2**32 - 1):
                raise ValueError(f"{prefix}{name}: values outside [0, 2**32 - 1] cannot be stored")
        shard = state_dict.get(prefix + "shard")  # a sharded module's (rank, world size, run id)
        if isinstance(shard, torch.Tensor) and shard.shape == (3,) and int(shard[1]) > 1:
            raise ValueError(f"{prefix}shard: these entries are rank {int(shard[0])}'s shard of a table split over "
                             f"{int(shard[1])} ranks, not the whole table; merge every rank's state_dict with "
                             f"cncore_torch.distributed.merge_shards first (or write shard files with "
                             f"save_shard_tables); nothing was written")
        evicted = state_dict.get(prefix + "evicted_count")
        evicted = 0 if evicted is None else int(evicted)
        if evicted < 0:
            raise ValueError(f"{prefix}evicted_count: must be >= 0, got {evicted}")
        plans.append((table, config, values, int(state_dict[prefix + "step"]), evicted))
    written = []
    for table, config, values, step, evicted in plans:
        with TableWriter(os.path.join(directory, table), config, len(values["keys"]), step,
                         evicted_count=evicted) as writer:
            writer.write(*(values[f].numpy() for f in FIELDS))
        written.append(table)
    return written


def tables_to_checkpoint(directory: str, verify: bool = True) -> dict[str, torch.Tensor]:
    """The state_dict entries of every table directory in `directory` (as the modules write
    them: counts and last steps as int64), ready for ``model.load_state_dict(..., strict=False)``
    or to be merged with the dense entries of a checkpoint."""
    entries = {}
    for name in sorted(os.listdir(directory)):
        if not os.path.exists(os.path.join(directory, name, "CURRENT")):
            continue
        table = open_table(os.path.join(directory, name), verify)
        prefix = "" if name == _ROOT else name + "."
        for field in FIELDS:
            values = table.read(field, 0, len(table))
            if field in ("counts", "last_steps"):
                values = values.astype(np.int64)
            entries[prefix + field] = torch.from_numpy(values)
        entries[prefix + "step"] = torch.tensor(table.step, dtype=torch.int64)
        if table.config.eviction is not None or table.evicted_count:  # as the modules' state_dicts hold it
            entries[prefix + "evicted_count"] = torch.tensor(table.evicted_count, dtype=torch.int64)
    return entries


def main(argv=None) -> int:
    """python -m cncore_torch.checkpoint to-tables CKPT DIR [--entry model] | from-tables DIR OUT

    to-tables: every dynamic table in a torch checkpoint (a state_dict, or a dict holding one
    under --entry, as cn-dlrm's checkpoints do under "model") becomes a table directory in DIR
    (configs inferred from the shapes: hyperparameters are not in a state_dict).
    from-tables: the table directories in DIR become a state_dict saved with torch.save to OUT.
    """
    import argparse
    ap = argparse.ArgumentParser(prog="python -m cncore_torch.checkpoint", description=main.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    to = sub.add_parser("to-tables")
    to.add_argument("checkpoint")
    to.add_argument("directory")
    to.add_argument("--entry", help="the key of the state_dict inside the checkpoint (cn-dlrm: model)")
    back = sub.add_parser("from-tables")
    back.add_argument("directory")
    back.add_argument("out")
    args = ap.parse_args(argv)
    try:
        return _run(args)
    except (ValueError, OSError, KeyError, RuntimeError) as exc:  # RuntimeError: torch.load's
        print(f"python -m cncore_torch.checkpoint {args.command}: error: {exc}", file=sys.stderr)
        return 2


def _run(args) -> int:
    if args.command == "to-tables":
        state = torch.load(args.checkpoint, map_location="cpu", weights_only=True)
        if args.entry:
            state = state[args.entry]
        names = checkpoint_to_tables(state, args.directory)
        print(f"wrote {len(names)} tables to {args.directory}: {', '.join(names)}")
    else:
        entries = tables_to_checkpoint(args.directory)
        torch.save(entries, args.out)
        print(f"wrote {len(entries)} state_dict entries to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

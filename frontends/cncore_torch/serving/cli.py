"""`python -m cncore_torch.serving` (also `cn-serve`): serving files from the command line.

    freeze MODEL.pt -o SERVING.pt [--chain TABLE=DIR ...]   a torch.save'd model -> a frozen one;
                                                           with --chain, each table's rows are
                                                           read from its table file chain (the
                                                           version is recorded for `apply`)
    apply SERVING.pt --chain TABLE=DIR ... [-o OUT.pt]     the chains' versions since the ones
                                                           recorded, applied (in place by default)
    export SERVING.pt --example ARGS.pt -o MODEL.pt2       one torch.export file (runs without cncore)
    inspect FILE                                           tables, rows, bytes, versions (.pt or .pt2)

MODEL.pt and SERVING.pt are whole pickled modules (`torch.save(model)`), loaded with
`weights_only=False`: open only files you trust. ARGS.pt is a torch.save'd tuple of example
inputs. Exit status 0 on success, 2 with one line on stderr for bad input.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch

from cncore_torch.serving.delta import TableDelta, apply_delta, frozen_tables
from cncore_torch.serving.export import export_program
from cncore_torch.serving.freeze import freeze, serving_lock

__all__ = ["main"]

VERSIONS = "serving_versions"  # {table name: the chain version its rows are at}, on the frozen model


class InputError(Exception):
    """Bad input: reported as one line, exit status 2."""


def _load(path: str):
    if not os.path.isfile(path):
        raise InputError(f"{path}: no such file")
    try:
        return torch.load(path, weights_only=False)
    except Exception as e:  # torch.load raises many kinds for a file that is not its own
        first = str(e).splitlines()[0][:120] if str(e) else ""
        raise InputError(f"{path}: not a torch.save file ({type(e).__name__}: {first})") from None


def _save(model, path: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    torch.save(model, tmp)
    os.replace(tmp, path)  # a reader sees the old file or the new one, whole


def _chains(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        name, sep, path = pair.partition("=")
        if not sep or not name or not path:
            raise InputError(f"--chain {pair!r}: expected TABLE=DIR, e.g. --chain t_user=ckpt/tables/t_user")
        if not os.path.isdir(path):
            raise InputError(f"--chain {pair!r}: {path} is not a table directory")
        out[name] = path
    return out


def _head(path: str) -> str:
    from cncore.tablefile import chain_versions

    return chain_versions(path)[-1]


def _follow(model, chains: dict[str, str], fresh: bool) -> str:
    """Apply each chain's versions after the recorded one (all of it when `fresh`)."""
    versions = dict(getattr(model, VERSIONS, {}))
    tables = frozen_tables(model)
    deltas = {}
    for name, path in chains.items():
        if not fresh and name not in versions:
            raise InputError(f"--chain {name}: the serving file records no version of {name} (it records "
                             f"{sorted(versions) or 'none'}); freeze it with --chain {name}=DIR first")
        head = _head(path)
        try:
            delta = TableDelta.from_chain(path, None if fresh else versions[name], head)
        except ValueError as e:
            raise InputError(f"--chain {name}: {e}") from None
        if fresh:  # the chain is the whole table: drop what the model held and the chain does not
            held = [t for full, t in tables.items() if full == name or full.rsplit(".", 1)[-1] == name]
            if held:
                ids = held[0].slots.ids.numpy()
                delta = TableDelta(delta.keys, delta.rows, np.setdiff1d(ids, delta.keys))
        deltas[name], versions[name] = delta, head
    try:
        report = apply_delta(model, deltas)
    except (KeyError, ValueError, TypeError) as e:
        raise InputError(str(e).strip('"')) from None
    setattr(model, VERSIONS, versions)  # a plain attribute (nn.Module's __setattr__ is typed for tensors)
    return (f"{report.rows_written} rows written, {report.ids_added} IDs added, {report.ids_removed} removed, "
            f"{report.bytes_written} bytes, swapped in {report.locked_seconds * 1e3:.1f} ms")


def _fallback_note(n: int) -> str:
    return f", {n} fallback" if n else ""


def _inspect(path: str) -> list[str]:
    if path.endswith(".pt2"):
        if not os.path.isfile(path):
            raise InputError(f"{path}: no such file")
        program = torch.export.load(path)
        lines = [f"{path}: torch.export program, inputs {program.call_spec.in_spec.num_leaves} tensors"]
        for name, t in program.state_dict.items():
            lines.append(f"  {name}: {tuple(t.shape)} {str(t.dtype).replace('torch.', '')} {t.nbytes} bytes")
        return lines
    model = _load(path)
    versions = getattr(model, VERSIONS, {})
    lines = [f"{path}: {type(model).__name__}, serving version {serving_lock(model).version}"]
    for name, table in frozen_tables(model).items():
        w, version = table.weight, versions.get(name, versions.get(name.rsplit(".", 1)[-1]))
        note = _fallback_note(table.slots.fallback_rows)
        lines.append(f"  {name}: {table.slots.ids.numel()} IDs, dim {w.shape[1]}, {w.shape[0]} rows allocated "
                     f"({table.slots.free.numel()} free{note}), {w.nbytes + table.slots.ids.nbytes * 2} bytes"
                     + (f", chain version {version}" if version else ""))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cncore_torch.serving", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("freeze", help="a torch.save'd model -> a frozen serving file")
    p.add_argument("model")
    p.add_argument("-o", "--out", required=True)
    p.add_argument("--chain", action="append", default=[], metavar="TABLE=DIR")
    p = sub.add_parser("apply", help="apply table file chains' new versions to a serving file")
    p.add_argument("serving")
    p.add_argument("--chain", action="append", required=True, metavar="TABLE=DIR")
    p.add_argument("-o", "--out")
    p = sub.add_parser("export", help="a serving file -> one torch.export .pt2")
    p.add_argument("serving")
    p.add_argument("--example", required=True, help="a torch.save'd tuple of example inputs")
    p.add_argument("-o", "--out", required=True)
    p = sub.add_parser("inspect", help="tables, rows, bytes and versions of a .pt or .pt2")
    p.add_argument("file")
    args = parser.parse_args(argv)
    try:
        if args.command == "freeze":
            chains = _chains(args.chain)
            model = _load(args.model)
            if not isinstance(model, torch.nn.Module):
                raise InputError(f"{args.model}: holds a {type(model).__name__}, not a torch.nn.Module "
                                 f"(save the model with torch.save(model, path))")
            frozen = freeze(model)
            if chains:
                print(_follow(frozen, chains, fresh=True))
            _save(frozen, args.out)
        elif args.command == "apply":
            chains = _chains(args.chain)
            model = _load(args.serving)
            print(_follow(model, chains, fresh=False))
            _save(model, args.out or args.serving)
        elif args.command == "export":
            example = _load(args.example)
            if not isinstance(example, tuple):
                raise InputError(f"--example {args.example}: holds a {type(example).__name__}, expected a tuple "
                                 f"of the model's positional inputs")
            export_program(_load(args.serving), example, args.out)
        else:
            print("\n".join(_inspect(args.file)))
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (TypeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0

"""cn-table: offline tools for table files (see `cncore.tablefile`).

    cn-table inspect TABLE [--json]            rows, dim, dtype, bytes, key range, histograms,
                                               the policy of a bounded table, which shard
    cn-table export TABLE OUT.{npz,npy,parquet}
    cn-table import SRC.{npz,npy,parquet} TABLE [--config-from TABLE2] [--step S]
    cn-table prune TABLE OUT [--min-count N] [--min-step S] [--min-norm X] [--top-k K]
    cn-table merge LEFT RIGHT OUT --policy {left,right,newer,average}
    cn-table diff OLD NEW [--tolerance T] [--out DIFF.npz] [--json]
    cn-table to-fixed TABLE OUT.npz            sorted ids + dense weight (last row: zeros)
    cn-table compact TABLE [OUT]               a chain (base + incremental saves) as one version
    cn-table reshard SHARD... OUT --world-size M   N shard tables of one table (shard-R-of-N, as a
                                               sharded collection saves them) re-split into
                                               OUT/shard-0-of-M .. by the owner hash
    cn-table merge-shards SHARD... OUT         N shard tables as one table (what one process loads)

All of them stream through the tables in batches, so tables larger than memory work, except
compact, which holds the table in memory (it loads the chain as a store and saves it in full).
A chain is read by compact only: the other tools refuse it and say to compact it first.
A flushed SSD-tier directory (cncore.Tiered) reads as the table of its last flush.
Tables are checked (SHA-256, unique keys) when opened; --no-verify skips that. A refused
command prints one line, `cn-table CMD: error: ...`, exits with status 2 and changes nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import zipfile
from functools import partial

import numpy as np
from tqdm import tqdm

from cncore.tablefile import TableFormatError, chain_length, compact_table, open_table
from cncore_numpy import exchange, tools
from cncore_numpy.exchange import NpzStreamWriter


def _progress(quiet: bool, desc: str):
    return partial(tqdm, desc=desc, unit="batch", disable=quiet, file=sys.stderr, leave=False)


def _print_summary(path: str, s: dict) -> None:
    print(f"{path}: {s['rows']:,} rows of dim {s['dim']} ({s['dtype']}), optimizer {s['optimizer']}, "
          f"{s['bytes']:,} bytes, step {s['step']}")
    print(f"keys from {s['key_min']} to {s['key_max']}")
    if s.get("shard"):
        r, n = s["shard"]
        print(f"shard {r} of {n}: the keys of a table sharded over {n} ranks that rank {r} owns "
              f"(cn-table reshard / merge-shards take all {n})")
    if any(s[name] is not None for name in tools.POLICY_FIELDS):
        print(f"policy: max_rows {s['max_rows']}, eviction {_spelled(s['eviction'])}, headroom {s['headroom']}, "
              f"admission {_spelled(s['admission'])}; {s['evicted_count']:,} rows evicted so far")
    print(f"rows holding NaN: {s['nan_rows']:,}, holding an infinity: {s['inf_rows']:,}")
    for name in ("row_norm", "access_count", "age"):
        h = s[name]
        print(f"{name}: " + ", ".join(f"[{a:g}, {b:g}): {c}" for a, b, c in zip(h["edges"][:-1], h["edges"][1:],
                                                                                   h["counts"])))


def _spelled(d) -> str:
    """A policy as the manifest holds it ({"type": "TTL", "steps": 5}), as Python spells it: TTL(steps=5)."""
    if d is None:
        return "None"
    return d["type"] + "(" + ", ".join(f"{k}={v!r}" for k, v in d.items() if k != "type") + ")"


def _open_base(path: str, verify: bool):
    """open_table, with a chain refused in one line that says what to run."""
    try:
        return open_table(path, verify)
    except TableFormatError as exc:
        refused = exc
    try:
        deltas = chain_length(path)
    except TableFormatError:  # damaged: open_table's message names what
        deltas = 0
    if not deltas:
        raise refused
    raise TableFormatError(f"{path}: a chain of a base and {deltas} delta{'s' * (deltas != 1)} (incremental "
                           f"saves); run `cn-table compact {path}` first (or `cn-table compact {path} OUT` "
                           f"to leave it as it is)")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="cn-table", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    p = {}
    p["inspect"] = sub.add_parser("inspect", help="summary statistics of a table")
    p["inspect"].add_argument("table")
    p["inspect"].add_argument("--json", action="store_true", help="print the summary as JSON")
    p["export"] = sub.add_parser("export", help="write a table as .npz, .npy or .parquet")
    p["export"].add_argument("table")
    p["export"].add_argument("out")
    p["import"] = sub.add_parser("import", help="make a table from a .npz, .npy or .parquet export")
    p["import"].add_argument("src")
    p["import"].add_argument("table")
    p["import"].add_argument("--config-from", metavar="TABLE", help="take the config from this table (for .npy)")
    p["import"].add_argument("--step", type=int)
    p["prune"] = sub.add_parser("prune", help="drop rows by access count, age, norm, or keep the top K by count")
    p["prune"].add_argument("table")
    p["prune"].add_argument("out")
    p["prune"].add_argument("--min-count", type=int)
    p["prune"].add_argument("--min-step", type=int, help="keep rows last accessed at this step or later")
    p["prune"].add_argument("--min-norm", type=float)
    p["prune"].add_argument("--top-k", type=int)
    p["merge"] = sub.add_parser("merge", help="the union of two tables of one dim")
    p["merge"].add_argument("left")
    p["merge"].add_argument("right")
    p["merge"].add_argument("out")
    p["merge"].add_argument("--policy", choices=tools.POLICIES, required=True,
                            help="keys in both: left's, right's, the newer by last step, or the average")
    p["diff"] = sub.add_parser("diff", help="keys added, removed and changed between two tables")
    p["diff"].add_argument("old")
    p["diff"].add_argument("new")
    p["diff"].add_argument("--tolerance", type=float, default=0.0, help="ignore changes up to this (max abs)")
    p["diff"].add_argument("--out", help="write the key lists and change sizes to this .npz")
    p["diff"].add_argument("--json", action="store_true")
    p["to-fixed"] = sub.add_parser("to-fixed", help="dense weight + sorted ids for a fixed serving table")
    p["to-fixed"].add_argument("table")
    p["to-fixed"].add_argument("out")
    p["compact"] = sub.add_parser("compact", help="merge a delta chain (incremental saves) into one full version")
    p["compact"].add_argument("table")
    p["compact"].add_argument("out", nargs="?", help="write the merged table here (default: replace TABLE, atomically)")
    p["reshard"] = sub.add_parser("reshard", help="re-split the N shard tables of one table into M by the owner hash")
    p["merge-shards"] = sub.add_parser("merge-shards", help="the N shard tables of one table as one table")
    for name in ("reshard", "merge-shards"):
        p[name].add_argument("shards", nargs="+", metavar="SHARD",
                             help="every shard table of one save: directories named shard-R-of-N, R = 0..N-1")
        p[name].add_argument("out", help="a new or empty directory (reshard), the table to write (merge-shards)")
        p[name].add_argument("--max-rows", type=_positive_int, metavar="N",
                             help="row budget of each output table of a bounded table (default: the inputs' budgets "
                                  "added and split between the outputs)")
    p["reshard"].add_argument("--world-size", type=_positive_int, required=True, metavar="M",
                              help="the number of shards to write")
    for q in p.values():
        q.add_argument("--quiet", action="store_true", help="no progress bar")
        q.add_argument("--no-verify", action="store_true", help="skip the SHA-256 check of the input tables")
    return ap


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def main(argv=None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    try:
        return _run(ap, args)
    except (TableFormatError, ValueError, ImportError, OSError, zipfile.BadZipFile) as exc:
        print(f"cn-table {args.command}: error: {exc}", file=sys.stderr)
        return 2


def _run(ap: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    progress = _progress(args.quiet, args.command)
    verify = not args.no_verify
    cmd = args.command
    if cmd == "inspect":
        summary = tools.inspect(_open_base(args.table, verify), progress)
        print(json.dumps(summary, indent=1)) if args.json else _print_summary(args.table, summary)
    elif cmd == "export":
        table = _open_base(args.table, verify)
        exchange.export_table(table, args.out, progress=progress)
        print(f"wrote {len(table):,} rows to {args.out}")
    elif cmd == "import":
        config = _open_base(args.config_from, verify).config if args.config_from else None
        exchange.import_table(args.src, args.table, config, args.step, progress=progress)
        print(f"wrote {len(open_table(args.table, verify=False)):,} rows to {args.table}")
    elif cmd == "prune":
        if all(v is None for v in (args.min_count, args.min_step, args.min_norm, args.top_k)):
            ap.error("prune: give at least one of --min-count, --min-step, --min-norm, --top-k")
        table = _open_base(args.table, verify)
        keep, failing = tools.prune_mask(table, args.min_count, args.min_step, args.min_norm, args.top_k, progress)
        removed = tools.prune(table, args.out, keep, progress)
        why = "; ".join(f"{label}: {n:,}" for label, n in failing.items())
        print(f"removed {removed:,} of {len(table):,} rows ({why}); kept {int(keep.sum()):,} in {args.out}")
    elif cmd == "merge":
        parts = tools.merge(_open_base(args.left, verify), _open_base(args.right, verify), args.out, args.policy,
                            progress)
        print(f"wrote {parts['rows']:,} rows to {args.out}: {parts['left_only']:,} only in left, "
              f"{parts['right_only']:,} only in right, {parts['both']:,} in both (policy {args.policy})")
    elif cmd == "diff":
        d = tools.diff(_open_base(args.old, verify), _open_base(args.new, verify), args.tolerance, progress)
        if args.out:
            with NpzStreamWriter(args.out) as npz:
                for name, values in d.items():
                    npz.write(name, values.dtype, values.shape, [values])
        finite = d["change_l2"][np.isfinite(d["change_l2"])]  # to or from NaN: a change with no size
        summary = {"added": len(d["added"]), "removed": len(d["removed"]), "changed": len(d["changed"]),
                   "changed_to_or_from_nan": int(np.isnan(d["change_l2"]).sum()),
                   "change_l2_max": float(finite.max()) if len(finite) else 0.0,
                   "change_l2_mean": float(finite.mean()) if len(finite) else 0.0}
        if args.json:
            print(json.dumps(summary, indent=1))
        else:
            print(f"{summary['added']:,} keys added, {summary['removed']:,} removed, {summary['changed']:,} changed "
                  f"({summary['changed_to_or_from_nan']:,} to or from NaN; L2 of the other changes: mean "
                  f"{summary['change_l2_mean']:.4g}, max {summary['change_l2_max']:.4g})")
    elif cmd == "to-fixed":
        table = _open_base(args.table, verify)
        tools.to_fixed(table, args.out, progress)
        print(f"wrote ids ({len(table):,}) and weight ({len(table) + 1:,} x {table.dim}) to {args.out}")
    elif cmd == "compact":
        if args.out is not None and os.path.realpath(args.out) == os.path.realpath(args.table):
            args.out = None
        deltas = chain_length(args.table)
        merged = f"{deltas} delta{'s' * (deltas != 1)} merged into one version" if deltas else "not a chain"
        if args.out is None and not deltas:
            rows = len(_open_base(args.table, verify))
            print(f"{args.table}: not a chain (one full version, {rows:,} rows); left as it is")
        elif args.out is None:
            compact_table(args.table, verify)
            print(f"wrote {len(open_table(args.table, verify=False)):,} rows to {args.table} ({merged})")
        else:
            compact_table(args.table, verify, out=args.out)
            print(f"wrote {len(open_table(args.out, verify=False)):,} rows to {args.out} ({merged}; "
                  f"{args.table} left as it is)")
    elif cmd in ("reshard", "merge-shards"):
        tables = [_open_base(path, verify) for path in args.shards]
        single = cmd == "merge-shards"
        if args.max_rows is not None and any(t.config.max_rows is None for t in tables):
            raise ValueError(f"--max-rows {args.max_rows}: {args.shards[0]} is a shard of an unbounded table (no "
                             f"max_rows), which has no row budget to set; leave --max-rows out")
        done = tools.reshard(args.shards, tables, args.out, 1 if single else args.world_size, single=single,
                             max_rows=args.max_rows, progress=progress)
        if single:
            print(f"wrote {done['rows']:,} rows of {done['world_size_in']} shards to {args.out}")
        else:
            print(f"wrote {done['rows']:,} rows of {done['world_size_in']} shards as {done['world_size']} to "
                  f"{args.out}: " + ", ".join(f"shard-{j}-of-{done['world_size']} {n:,}"
                                               for j, n in enumerate(done["rows_per_shard"])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

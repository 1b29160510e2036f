"""cn-table: offline tools for table directories (see cncore_numpy.format).

    cn-table inspect TABLE                      rows, dim, dtype, bytes, key range, histograms
    cn-table prune TABLE OUT [--min-count N] [--min-step S] [--min-norm X] [--top-k K]

Both stream through the memory-mapped arrays in batches, so tables larger than memory work.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Iterator, List, Optional, Tuple

import numpy as np
from tqdm import tqdm

import cncore
from cncore_numpy.format import ARRAYS, TableFile, open_table, save_table

BATCH = 1 << 18


def _batches(n: int, desc: str, quiet: bool) -> Iterator[Tuple[int, int]]:
    with tqdm(total=n, desc=desc, unit="row", disable=quiet or n < BATCH, file=sys.stderr) as bar:
        for start in range(0, n, BATCH):
            stop = min(start + BATCH, n)
            yield start, stop
            bar.update(stop - start)


def inspect(table: TableFile, quiet: bool = False) -> dict:
    """Summary statistics, streamed: rows, dim, dtype, bytes, key range, and histograms of row
    norms, access counts and age (table step - last step)."""
    n = len(table)
    lo, hi = None, None
    norms, counts, ages = [], [], []
    for start, stop in _batches(n, "inspect", quiet):
        keys = np.asarray(table.keys[start:stop])
        lo = keys.min() if lo is None else min(lo, keys.min())
        hi = keys.max() if hi is None else max(hi, keys.max())
        norms.append(np.linalg.norm(np.asarray(table.rows[start:stop], dtype=np.float64), axis=1))
        counts.append(np.asarray(table.counts[start:stop]))
        ages.append(table.step - np.asarray(table.last_steps[start:stop], dtype=np.int64))
    def hist(values: List[np.ndarray], bins) -> dict:
        v = np.concatenate(values) if values else np.zeros(0)
        h, edges = np.histogram(v, bins=bins)
        return {"edges": edges.tolist(), "counts": h.tolist()}
    size = sum(os.path.getsize(os.path.join(table.path, f)) for f in _files(table))
    return {"rows": n, "dim": table.config.dim, "dtype": table.config.dtype,
            "optimizer": type(table.config.optimizer).__name__ if table.config.optimizer else None,
            "bytes": size, "step": table.step,
            "key_min": int(lo) if n else None, "key_max": int(hi) if n else None,
            "row_norm": hist(norms, 10), "access_count": hist(counts, [0, 1, 2, 5, 10, 100, 1000, 2**32]),
            "age": hist(ages, [0, 1, 10, 100, 1000, 10**4, 10**5, 2**32])}


def _files(table: TableFile) -> List[str]:
    version = open(os.path.join(table.path, "CURRENT")).read().strip()
    return [os.path.join(version, f"{name}.npy") for name in ARRAYS] + [os.path.join(version, "manifest.json")]


def prune_mask(table: TableFile, min_count: Optional[int] = None, min_step: Optional[int] = None,
               min_norm: Optional[float] = None, top_k: Optional[int] = None, quiet: bool = False) -> np.ndarray:
    """Which rows to keep: every given criterion must hold (count >= min_count, last step >=
    min_step, row norm >= min_norm), then at most top_k of them by access count (ties: lower key)."""
    n = len(table)
    keep = np.ones(n, dtype=bool)
    for start, stop in _batches(n, "prune", quiet):
        k = keep[start:stop]
        if min_count is not None:
            k &= np.asarray(table.counts[start:stop]) >= min_count
        if min_step is not None:
            k &= np.asarray(table.last_steps[start:stop]) >= min_step
        if min_norm is not None:
            k &= np.linalg.norm(np.asarray(table.rows[start:stop], dtype=np.float64), axis=1) >= min_norm
    if top_k is not None and keep.sum() > top_k:
        idx = np.flatnonzero(keep)
        order = np.lexsort((np.asarray(table.keys)[idx], -np.asarray(table.counts, dtype=np.int64)[idx]))
        keep[:] = False
        keep[idx[order[:top_k]]] = True
    return keep


def prune(table: TableFile, out: str, keep: np.ndarray) -> int:
    """Write the kept rows (with state and metadata) as a new table at `out`; returns rows removed."""
    store = cncore.EmbeddingStore(table.config)
    store.reserve(int(keep.sum()))
    sf = table.config.state_floats
    for start, stop in _batches(len(table), "write", True):
        k = keep[start:stop]
        if not k.any():
            continue
        store.load(np.asarray(table.keys[start:stop])[k], np.asarray(table.rows[start:stop])[k],
                   np.asarray(table.optimizer_state[start:stop])[k] if sf else None,
                   np.asarray(table.counts[start:stop])[k], np.asarray(table.last_steps[start:stop])[k])
    store.step = table.step
    save_table(store, out)
    return int(len(table) - keep.sum())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="cn-table", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    p_inspect = sub.add_parser("inspect", help="summary statistics of a table")
    p_inspect.add_argument("table")
    p_inspect.add_argument("--json", action="store_true", help="print the summary as JSON")
    p_prune = sub.add_parser("prune", help="drop rows by access count, age, norm, or keep the top K by count")
    p_prune.add_argument("table")
    p_prune.add_argument("out")
    p_prune.add_argument("--min-count", type=int)
    p_prune.add_argument("--min-step", type=int, help="keep rows last accessed at this step or later")
    p_prune.add_argument("--min-norm", type=float)
    p_prune.add_argument("--top-k", type=int)
    for p in (p_inspect, p_prune):
        p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    table = open_table(args.table)
    if args.command == "inspect":
        summary = inspect(table, args.quiet)
        if args.json:
            import json
            print(json.dumps(summary, indent=1))
        else:
            print(f"{args.table}: {summary['rows']:,} rows of dim {summary['dim']} ({summary['dtype']}), "
                  f"optimizer {summary['optimizer']}, {summary['bytes']:,} bytes, step {summary['step']}")
            print(f"keys from {summary['key_min']} to {summary['key_max']}")
            for name in ("row_norm", "access_count", "age"):
                h = summary[name]
                print(f"{name}: " + ", ".join(f"[{a:g}, {b:g}): {c}" for a, b, c in
                                               zip(h["edges"][:-1], h["edges"][1:], h["counts"])))
        return 0
    if all(v is None for v in (args.min_count, args.min_step, args.min_norm, args.top_k)):
        ap.error("prune: give at least one of --min-count, --min-step, --min-norm, --top-k")
    keep = prune_mask(table, args.min_count, args.min_step, args.min_norm, args.top_k, args.quiet)
    removed = prune(table, args.out, keep)
    print(f"removed {removed:,} of {len(table):,} rows; kept {int(keep.sum()):,} in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

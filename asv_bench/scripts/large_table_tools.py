"""cn-table on a table larger than the memory it may use: peak resident memory of each tool.

Writes a table of --gib GiB on disk (dim 128, row-wise Adagrad, access counts drawn from a
Zipf law) with `TableWriter`, then runs each `cn-table` command in its own process under
`/usr/bin/time -v` and reports its wall time and "Maximum resident set size". The tools read
the table in batches with plain file reads, so their peak is the batch buffers plus per-row
bookkeeping (a keep mask, keys for merge/diff/to-fixed), not the table.

    python asv_bench/scripts/large_table_tools.py --gib 5 --dir /tmp/cn-large
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time

import numpy as np

import cncore
from cncore_numpy import TableWriter

ROW_BYTES = lambda dim: 8 + 4 * dim + 4 + 4 + 4  # noqa: E731  key, row, row-wise state, count, last step


def write_table(path: str, gib: float, dim: int, seed: int = 0) -> int:
    n = int(gib * 2**30 / ROW_BYTES(dim))
    rng = np.random.default_rng(seed)
    config = cncore.StoreConfig(dim=dim, optimizer=cncore.RowWiseAdagrad())
    batch = 1 << 18
    with TableWriter(path, config, n, step=1000) as writer:
        for start in range(0, n, batch):
            k = min(batch, n - start)
            keys = np.arange(start, start + k, dtype=np.int64) * 2654435761  # distinct, spread out
            writer.write(keys, rng.standard_normal((k, dim), dtype=np.float32),
                         rng.random((k, 1), dtype=np.float32),
                         np.minimum(rng.zipf(1.5, k), 2**32 - 1).astype(np.uint32),
                         rng.integers(0, 1001, k).astype(np.uint32))
    return n


DONE_WITH = {"export .npy": ["t.npy"], "import .npz": ["t.npz", "imported"], "to-fixed": ["fixed.npz"]}


def measure(args: list) -> tuple:
    """(wall seconds, peak RSS MiB) of `cn-table args` in a fresh process."""
    cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "cncore_numpy.cli"] + args + ["--quiet"]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")
    peak = re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr)
    if peak is None:
        raise RuntimeError(f"/usr/bin/time -v printed no peak RSS for {' '.join(args)}:\n{done.stderr}")
    peak_kib = int(peak.group(1))
    return wall, peak_kib / 1024, done.stdout.strip().splitlines()[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=5.0)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--dir", default="/tmp/cn-large")
    ap.add_argument("--keep", action="store_true", help="keep the files afterwards")
    args = ap.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    table = os.path.join(args.dir, "table")
    start = time.perf_counter()
    n = write_table(table, args.gib, args.dim)
    size = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(table) for f in fs)
    print(f"table: {n:,} rows of dim {args.dim}, {size / 2**30:.2f} GiB on disk, written in "
          f"{time.perf_counter() - start:.0f} s")
    commands = [
        ("inspect", ["inspect", table]),
        ("prune --min-count 2", ["prune", table, os.path.join(args.dir, "pruned"), "--min-count", "2"]),
        ("prune --top-k 1000000", ["prune", table, os.path.join(args.dir, "top"), "--top-k", "1000000"]),
        ("export .npy", ["export", table, os.path.join(args.dir, "t.npy")]),
        ("export .npz", ["export", table, os.path.join(args.dir, "t.npz")]),
        ("import .npz", ["import", os.path.join(args.dir, "t.npz"), os.path.join(args.dir, "imported")]),
        ("to-fixed", ["to-fixed", table, os.path.join(args.dir, "fixed.npz")]),
        ("diff (table vs pruned)", ["diff", table, os.path.join(args.dir, "pruned")]),
        ("merge (pruned + top, average)", ["merge", os.path.join(args.dir, "pruned"), os.path.join(args.dir, "top"),
                                           os.path.join(args.dir, "merged"), "--policy", "average"]),
    ]
    print("\n| command | wall s | peak RSS MiB | peak RSS / table size |\n|---|---:|---:|---:|")
    for label, cmd in commands:
        wall, peak, said = measure(cmd)
        print(f"| `{label}` | {wall:.1f} | {peak:.0f} | {peak * 2**20 / size:.3f} |", flush=True)
        print(f"<!-- {said} -->", file=sys.stderr)
        for leftover in DONE_WITH.get(label, ()):  # keep the disk use bounded
            p = os.path.join(args.dir, leftover)
            shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)
    if not args.keep:
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Eviction policies on a long stream, table by table (no model): which IDs each policy keeps.

The synthetic Criteo-like stream (cncore.synthetic.SyntheticCriteo), --steps batches of
--batch-size, with --drift-per-batch (default: the standard stream's drift per sample, 2.0 per
2,048 samples, scaled to the batch). Each of the 26 features gets one bounded table per policy
(`max_rows` = P% of its distinct training IDs, rounded up, at least 1; no fallback rows, so the
order alone decides), and every training batch is a training lookup plus an update on every
policy's table (dim 1, SGD at lr 0: only the keys, counts and last steps matter). Reported per
policy and budget, over all 26 tables:

- ``hit test``: the share of the lookups of the next --test-batches batches (not trained on)
  whose ID holds a row at the end of training (what a model's test reads as trained rows);
- ``hit late``: the share of the lookups of the last half of the training stream that found
  a row before their call (the online hit rate once the tables are full);
- ``same as LFU`` / ``same as LRU``: the share of the rows held at the end that plain LFU's /
  LRU's tables also hold (|A & B| / |A|; the tables are all full, so the sizes match).

Usage::

    python asv_bench/scripts/bounded_long_stream.py --steps 10000 --batch-size 256 --budgets 50 25 10

One process generates each batch once and feeds it to every policy's tables.
"""
from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np

import cncore
from cncore import policies
from cncore.synthetic import N_SPARSE, SyntheticCriteo

POLICIES = ["lfu", "lfu32", "lfu128", "lfu1024", "lru", "auto4", "auto16"]


def eviction(name: str):
    """The cncore policy of a --policies name: lfu, lfuN (LFU(halve_every=N)), lru, autoK
    (LFU(halve_every="auto") at K turnovers per halving)."""
    if name == "lru":
        return cncore.LRU()
    if name == "lfu":
        return cncore.LFU()
    if name.startswith("lfu"):
        return cncore.LFU(halve_every=int(name[3:]))
    if name.startswith("auto"):
        return cncore.LFU(halve_every="auto")
    raise ValueError(f"unknown policy {name!r}")


def make_table(name: str, max_rows: int) -> cncore.EmbeddingStore:
    saved = policies.AUTO_HALVE_TURNOVERS
    if name.startswith("auto"):
        policies.AUTO_HALVE_TURNOVERS = int(name[4:])
    try:
        return cncore.EmbeddingStore(dim=1, max_rows=max_rows, eviction=eviction(name), fallback_rows=0,
                                     optimizer=cncore.SGD(lr=0.0))
    finally:
        policies.AUTO_HALVE_TURNOVERS = saved


def distinct_ids(gen: SyntheticCriteo, steps: int) -> list[int]:
    seen: list[set] = [set() for _ in range(N_SPARSE)]
    for i in range(steps):
        for f, v in enumerate(gen.arrays(i).values):
            seen[f].update(v.tolist())
    return [len(s) for s in seen]


def run(args, seed: int) -> list[dict]:
    drift = args.drift_per_batch if args.drift_per_batch is not None else 2.0 * args.batch_size / 2048
    gen = SyntheticCriteo(seed=seed, batch_size=args.batch_size, drift_per_batch=drift)
    t0 = time.perf_counter()
    distinct = distinct_ids(gen, args.steps)
    budgets = {p: [max(1, math.ceil(d * p / 100)) for d in distinct] for p in args.budgets}
    tables = {(p, name): [make_table(name, r) for r in budgets[p]] for p in args.budgets for name in args.policies}
    hits = {key: [0, 0] for key in tables}  # (found, looked up) over the last half
    ones = np.ones((1, 1), np.float32)
    for i in range(args.steps):
        values = gen.arrays(i).values
        late = i >= args.steps // 2
        for key, stores in tables.items():
            for store, v in zip(stores, values):
                if len(v) == 0:
                    continue
                if late:
                    hits[key][0] += int(store.contains(v).sum())
                    hits[key][1] += len(v)
                _, ctx = store.pooled_lookup(v, lengths=np.array([len(v)]))
                store.apply_gradients(ctx, ones)
    test = [gen.arrays(args.steps + k).values for k in range(args.test_batches)]
    out = []
    for p in args.budgets:
        held = {name: [set(s.export(with_rows=False).keys.tolist()) for s in tables[(p, name)]]
                for name in args.policies}
        for name in args.policies:
            stores = tables[(p, name)]
            found = sum(int(s.contains(vals[f]).sum()) for vals in test for f, s in enumerate(stores))
            looked = sum(len(vals[f]) for vals in test for f in range(N_SPARSE))
            mine = sum(len(h) for h in held[name])

            def same(other, mine=mine, name=name):
                if other not in held:
                    return None
                return sum(len(a & b) for a, b in zip(held[name], held[other])) / max(1, mine)
            out.append({"seed": seed, "budget": p, "policy": name, "rows": sum(budgets[p]), "held": mine,
                        "hit_test": found / looked, "hit_late": hits[(p, name)][0] / max(1, hits[(p, name)][1]),
                        "same_as_lfu": same("lfu"), "same_as_lru": same("lru"),
                        "evicted": sum(int(s.evicted_count) for s in stores)})
    print(f"# seed {seed}: {time.perf_counter() - t0:.0f} s", flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10000)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--drift-per-batch", type=float, default=None,
                    help="default: 2.0 * batch size / 2048 (the standard stream's drift per sample)")
    ap.add_argument("--budgets", type=float, nargs="+", default=[50, 25, 10])
    ap.add_argument("--policies", nargs="+", default=POLICIES)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0], help="data seeds")
    ap.add_argument("--test-batches", type=int, default=64)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    for name in args.policies:
        eviction(name)
    cncore.set_num_threads(1)
    rows = []
    for seed in args.seeds:
        rows += run(args, seed)
    print(f"# {args.steps} steps x {args.batch_size}, drift {args.drift_per_batch or 2.0 * args.batch_size / 2048:g} "
          f"per batch, seeds {args.seeds}: mean over seeds")
    print("| budget | policy | hit test | hit late | same as LFU | same as LRU | evicted |")
    print("|---|---|---|---|---|---|---|")
    for p in args.budgets:
        for name in args.policies:
            rs = [r for r in rows if r["budget"] == p and r["policy"] == name]

            def mean(k, rs=rs):
                xs = [r[k] for r in rs if r[k] is not None]
                return "-" if not xs else f"{np.mean(xs):.4f}"
            print(f"| {p:g}% | {name} | {mean('hit_test')} | {mean('hit_late')} | {mean('same_as_lfu')} | "
                  f"{mean('same_as_lru')} | {np.mean([r['evicted'] for r in rs]):,.0f} |", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "rows": rows}, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

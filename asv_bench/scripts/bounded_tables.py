"""Bounded tables under a stream with 10x more distinct IDs than the row budget.

For each stream (Zipf and uniform over `--distinct` IDs) and each policy (none, LRU, LFU,
TTL, LRU + MinCount(2); also lfu+fb90 and lfu+rfb90: the same budget as 10% keyed rows under
LFU and 90% fallback rows, miss or residual mode), one training run in its own process (so that its peak RSS is its
own, for its memory; the step times come from one process per stream that runs every policy's
store a step at a time in turn, so that noise from other processes falls on all alike):
`--steps` steps of a pooled lookup (`--batch` bags of `--bag` IDs) plus the fused
row-wise Adagrad backward on a dim `--dim` table. Reported per run, from the steady state
(the last half of the steps, when a bounded table is full and evicts every few steps):
the mean step time and its ratio to the unbounded table's (medians over --repeat runs), the rows held, the store's own
bytes per row (index + rows + metadata + keys + sketch) and the process's peak RSS over
its RSS before the store existed, per row of the budget. Then eviction throughput: explicit
`evict(n)` rounds on a full table, with and without an on_evict callback (which makes the
core copy the rows out). Then an incremental save: bytes and time of a delta after 1 % of
the rows were trained, against a full save.

    python asv_bench/scripts/bounded_tables.py                      # 200k budget, 2M IDs
    python asv_bench/scripts/bounded_tables.py --max-rows 1000000 --distinct 10000000
    python asv_bench/scripts/bounded_tables.py --streams zipf --policies none,lfu,lfu+fb90,lfu+rfb90 \
        --checkpoint-gib 0                                          # what fallback rows cost a step
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from typing import Any

import numpy as np

import cncore

# Policy name -> its eviction (a class name), admission (a MinCount count) and fallback rows (the
# share of the budget that is fallback rows, and their mode), where it has them.
POLICIES: dict[str, dict[str, Any]] = {
    "none": {},
    "lru": {"eviction": "LRU"},
    "lfu": {"eviction": "LFU"},
    "ttl": {"eviction": "TTL"},
    "lru+mincount2": {"eviction": "LRU", "admission": 2},
    "lfu+fb90": {"eviction": "LFU", "fallback": (0.9, "miss")},  # the budget: 10% keyed rows, 90% fallback
    "lfu+rfb90": {"eviction": "LFU", "fallback": (0.9, "residual")},
}


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * resource.getpagesize()


def peak_rss_bytes() -> int:
    """This process's peak RSS (VmHWM: getrusage's ru_maxrss also counts the parent's RSS at
    the fork that started it, so a run started from a large parent read as large)."""
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmHWM:"))


def stream(kind: str, distinct: int, n: int, rng, max_rows: int = 0) -> np.ndarray:
    """n IDs out of `distinct`, uniform or Zipf(1.1) by rank, ranks scattered over int64;
    "fits": uniform over max_rows // 2 IDs, so a bounded table never evicts (what its
    bookkeeping alone costs)."""
    if kind == "fits":
        ranks = rng.integers(0, max_rows // 2, n)
    elif kind == "uniform":
        ranks = rng.integers(0, distinct, n)
    else:  # inverse CDF of a Zipf law truncated to `distinct` ranks
        s = 1.1
        u = rng.random(n)
        ranks = np.minimum(((u * (distinct ** (1 - s) - 1) + 1) ** (1 / (1 - s))).astype(np.int64) - 1, distinct - 1)
    return (ranks.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)).view(np.int64)  # odd: a bijection


def make_config(args, policy: str) -> cncore.StoreConfig:
    spec = POLICIES[policy]
    kw: dict[str, Any] = {}
    if "eviction" in spec:
        kw["max_rows"] = args.max_rows
        kw["eviction"] = {"LRU": cncore.LRU(), "LFU": cncore.LFU(), "TTL": cncore.TTL(args.ttl)}[spec["eviction"]]
        kw["capacity"] = args.max_rows
        kw["fallback_rows"] = 0  # each policy as named: one row per key (a split is its own policy, below)
    if "fallback" in spec:  # the same budget of rows, split (bounded_auc.py's +fbPCT / +rfbPCT)
        share, mode = spec["fallback"]
        kw["fallback_rows"] = round(args.max_rows * share)
        kw["max_rows"] = kw["capacity"] = args.max_rows - kw["fallback_rows"]
        kw["fallback_mode"] = mode
    if "admission" in spec:
        kw["admission"] = cncore.MinCount(spec["admission"])
    return cncore.StoreConfig(dim=args.dim, optimizer=cncore.RowWiseAdagrad(lr=0.01), **kw)


def run_one(args, kind: str, policy: str) -> dict:
    """One store through the whole stream, alone in its process: its memory."""
    cncore.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    batches = [stream(kind, args.distinct, args.batch * args.bag, rng, args.max_rows) for _ in range(args.steps)]
    lens = np.full(args.batch, args.bag)
    grad = np.ones((args.batch, args.dim), np.float32)
    rss0 = rss_bytes()
    store = cncore.EmbeddingStore(make_config(args, policy))
    for keys in batches:
        _, ctx = store.pooled_lookup(keys, lengths=lens)
        store.apply_gradients(ctx, grad)
        if policy == "ttl" and store.step % 10 == 0:
            store.evict_expired()
    peak = peak_rss_bytes()
    return {"rows": len(store), "evicted": store.evicted_count,
            "store_bytes_per_row": store.nbytes / max(len(store) + store.fallback_rows, 1),
            "peak_rss_over_start_per_budget_row": (peak - rss0) / args.max_rows}


def time_interleaved(args, kind: str, policies: list) -> dict:
    """Every policy's store through the same stream in one process, a step of each in turn, so
    that the machine's noise (other processes on its cores) falls on all of them alike; the
    mean step time of the steady state (the last half of the steps) per policy."""
    cncore.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    lens = np.full(args.batch, args.bag)
    grad = np.ones((args.batch, args.dim), np.float32)
    stores = {p: cncore.EmbeddingStore(make_config(args, p)) for p in policies}
    times: dict[str, list[float]] = {p: [] for p in policies}
    for step in range(args.steps):
        keys = stream(kind, args.distinct, args.batch * args.bag, rng, args.max_rows)
        for p in policies[step % len(policies):] + policies[:step % len(policies)]:  # rotate who goes first
            store = stores[p]
            t = time.perf_counter()
            _, ctx = store.pooled_lookup(keys, lengths=lens)
            store.apply_gradients(ctx, grad)
            if p == "ttl" and store.step % 10 == 0:
                store.evict_expired()
            times[p].append(time.perf_counter() - t)
    return {p: 1e3 * float(np.mean(t[len(t) // 2:])) for p, t in times.items()}


def eviction_throughput(args) -> list:
    cncore.set_num_threads(args.threads)
    out = []
    for sink in (False, True):
        for policy in ("LRU", "LFU"):
            store = cncore.EmbeddingStore(dim=args.dim, optimizer=cncore.RowWiseAdagrad(), capacity=args.max_rows,
                                          eviction=getattr(cncore, policy)())
            rng = np.random.default_rng(1)
            keys = rng.choice(2**62, args.max_rows, replace=False).astype(np.int64)
            store.load(keys, np.zeros((args.max_rows, args.dim), np.float32),
                       counts=rng.integers(0, 50, args.max_rows), last_steps=rng.integers(0, 1000, args.max_rows))
            if sink:
                store.on_evict(lambda batch: None)
            k = max(1, args.max_rows // 32)
            t = time.perf_counter()
            rounds = 0
            while len(store) >= k and rounds < 16:
                store.evict(k)
                rounds += 1
            dt = time.perf_counter() - t
            out.append({"policy": policy, "sink": sink, "round_rows": k,
                        "ms_per_round": 1e3 * dt / rounds, "rows_per_s": rounds * k / dt})
    return out


def checkpoint_sizes(args) -> dict:
    """A table of --checkpoint-gib GiB (dim 128, row-wise Adagrad, every row trained once), a full
    save, 1 % of the rows trained again, then a delta save and a full save: bytes and seconds."""
    import shutil
    import tempfile

    from cncore.tablefile import save_table
    cncore.set_num_threads(args.threads)
    dim = 128
    n = int(args.checkpoint_gib * 2**30 / (4 * dim + 4 + 8 + 8))
    store = cncore.EmbeddingStore(dim=dim, optimizer=cncore.RowWiseAdagrad(), capacity=n)
    grad_rows = 4096
    for start in range(0, n, grad_rows * 4):
        keys = np.arange(start, min(start + grad_rows * 4, n), dtype=np.int64)
        lens = np.full(grad_rows, 4)[: (len(keys) + 3) // 4]
        lens[-1] = len(keys) - 4 * (len(lens) - 1)
        _, ctx = store.pooled_lookup(keys, lengths=lens)
        store.apply_gradients(ctx, np.ones((len(lens), dim), np.float32))
    root = tempfile.mkdtemp(dir=args.dir)
    path = os.path.join(root, "t.cnt")

    def size(version):
        d = os.path.join(path, version)
        return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
    try:
        # os.sync() before each timed save: a save fsyncs its files, and behind a previous save's
        # gigabytes of dirty pages that fsync waits for them too (a 51 MiB delta "took" 21 s).
        os.sync()
        t = time.perf_counter()
        base = save_table(store, path)
        full_s, full_b = time.perf_counter() - t, size(base.version)
        rng = np.random.default_rng(2)
        changed = rng.choice(n, n // 100, replace=False)
        _, ctx = store.pooled_lookup(changed, lengths=np.ones(len(changed), np.int64))
        store.apply_gradients(ctx, np.ones((len(changed), dim), np.float32))
        os.sync()
        t = time.perf_counter()
        delta = save_table(store, path, since=base)
        delta_s, delta_b = time.perf_counter() - t, size(delta.version)
        assert delta.delta
        os.sync()
        t = time.perf_counter()
        save_table(store, path)
        full2_s = time.perf_counter() - t
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"rows": n, "full_bytes": full_b, "full_s": min(full_s, full2_s), "delta_bytes": delta_b, "delta_s": delta_s}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-rows", type=int, default=200_000)
    ap.add_argument("--distinct", type=int, default=2_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--bag", type=int, default=16)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--ttl", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3, help="runs per cell; the median step time is shown")
    ap.add_argument("--streams", default="zipf,uniform,fits")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--one", nargs=2, metavar=("STREAM", "POLICY"), help=argparse.SUPPRESS)
    ap.add_argument("--throughput-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--checkpoint-gib", type=float, default=0.5, help="table size for the incremental save (0: skip)")
    ap.add_argument("--dir", default=None, help="where the checkpoint table is written (default: the temp dir)")
    args = ap.parse_args()
    if args.one:
        print(json.dumps(run_one(args, *args.one)))
        return
    if args.throughput_only:
        print(json.dumps(eviction_throughput(args)))
        return
    passthrough = list(sys.argv[1:])
    print(f"budget {args.max_rows} rows, {args.distinct} distinct IDs, dim {args.dim}, {args.batch} x {args.bag} "
          f"IDs per step, {args.steps} steps, {args.threads} thread(s); steady state = the last half\n")
    print(f"{'stream':8} {'policy':14} {'step ms':>8} {'vs none':>8} {'rows':>9} {'evicted':>9} "
          f"{'store B/row':>11} {'peak RSS B/budget row':>21}")
    policies = args.policies.split(",")
    for kind in args.streams.split(","):
        runs = [time_interleaved(args, kind, policies) for _ in range(args.repeat)]
        for policy in policies:
            ms = float(np.median([r[policy] for r in runs]))
            ratio = float(np.median([r[policy] / r["none"] for r in runs])) if "none" in policies else float("nan")
            mem = json.loads(subprocess.run([sys.executable, __file__, *passthrough, "--one", kind, policy],
                                            check=True, capture_output=True, text=True).stdout)
            print(f"{kind:8} {policy:14} {ms:8.2f} {ratio:8.3f} {mem['rows']:9d} {mem['evicted']:9d} "
                  f"{mem['store_bytes_per_row']:11.1f} {mem['peak_rss_over_start_per_budget_row']:21.1f}")
    res = json.loads(subprocess.run([sys.executable, __file__, *passthrough, "--throughput-only"],
                                    check=True, capture_output=True, text=True).stdout)
    print(f"\neviction throughput: evict(max_rows // 32) rounds on a full table of {args.max_rows} rows")
    print(f"{'policy':6} {'sink':>5} {'rows/round':>10} {'ms/round':>9} {'rows/s':>12}")
    for r in res:
        print(f"{r['policy']:6} {r['sink']!s:>5} {r['round_rows']:10d} {r['ms_per_round']:9.2f} "
              f"{r['rows_per_s']:12.0f}")
    if args.checkpoint_gib > 0:
        c = checkpoint_sizes(args)
        print(f"\nincremental save: {c['rows']} rows of dim 128 (row-wise Adagrad), 1 % of them trained since the base")
        print(f"{'save':6} {'MiB written':>12} {'seconds':>8}")
        print(f"{'full':6} {c['full_bytes'] / 2**20:12.1f} {c['full_s']:8.2f}")
        print(f"{'delta':6} {c['delta_bytes'] / 2**20:12.1f} {c['delta_s']:8.2f}")


if __name__ == "__main__":
    main()

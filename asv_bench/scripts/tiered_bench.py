"""The SSD tier against the same table held in memory: training-step time, cache hit rate, rows
read and written per step, peak RSS against the cache budget, write amplification and disk
space after compaction.

For each table size (a multiple of the cache's rows) and each ID stream (Zipf 1.05, Zipf 1.2 by
rank over the table's keys, uniform), two processes (so each peak RSS is its own): one trains a
TieredStore, one the in-memory EmbeddingStore, on the same batches (`--batch` bags of `--bag`
IDs, fused row-wise Adagrad, dim `--dim`). Each first fills the table with one pass over all its
keys, then `--warmup` steps (unmeasured: right after the fill the cache holds the last keys filled,
not the hot ones, and the first steps fault in far more than the steady state), then `--steps`
measured steps. Throughput is the mean step time (eviction and spills come in rounds, every few
steps, so the median would leave them out); the median is printed too. Then, for the smallest
multiple: `--passes` passes of uniform updates over every key (write amplification: bytes
written to the file over the bytes of the rows and optimizer state the passes updated), and
`compact()` (file bytes over live rows x record bytes).

Peak RSS is reported twice: from the imports ("peak RSS", the benchmark's own ID arrays
included) and from a baseline taken after those arrays with the peak reset ("store peak", the
store's own, against its cache and disk index). `--capacity-hint` gives both stores
`StoreConfig(capacity=rows of the table)` (the tier then sizes its disk index once). Each run's
tier files are removed when it ends.

Say where the file lives: on this machine the file sits in the page cache (RAM is larger than
the files), so a read is a memory copy, not a device read; the numbers are the tier's own cost.

    python asv_bench/scripts/tiered_bench.py                 # 32 MiB cache, tables 3x and 10x
    python asv_bench/scripts/tiered_bench.py --quick         # a smoke run
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bounded_tables import peak_rss_bytes, rss_bytes


def reset_peak_rss() -> None:
    """Set this process's VmHWM to its current RSS (Linux: clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def batches(stream: str, n_keys: int, steps: int, ids_per_step: int, seed: int, drift_every: int = 100):
    """`steps` batches of IDs: Zipf(a) by rank (rank r with probability ~ 1/r^a) or uniform,
    over n_keys keys scattered over int64. "zipf-A-drift": the popular keys change every
    `drift_every` steps (the ranks move to other keys: the key list rolled by a random quarter
    to three quarters of its length), as trending items come and go; the set of keys stays."""
    rng = np.random.default_rng(seed)
    keys = np.random.default_rng(99).integers(-2**62, 2**62, n_keys)
    if stream == "uniform":
        for _ in range(steps):
            yield keys[rng.integers(0, n_keys, ids_per_step)]
        return
    a = float(stream.split("-")[1])
    drift = stream.endswith("-drift")
    cdf = np.cumsum(1.0 / np.arange(1, n_keys + 1) ** a)
    cdf /= cdf[-1]
    for step in range(steps):
        if drift and step and step % drift_every == 0:
            keys = np.roll(keys, int(rng.integers(n_keys // 4, 3 * n_keys // 4)))
        yield keys[np.searchsorted(cdf, rng.random(ids_per_step))]


def run_one(kind: str, stream: str, multiple: float, args) -> dict:
    """One training run in this process (called in a child): JSON-able results. Its tier files
    (hundreds of MiB at 10x) are removed when it ends, however it ends."""
    directory = tempfile.mkdtemp(prefix="cn-tier-", dir=args.dir)
    try:
        return _run_one(kind, stream, multiple, args, directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _run_one(kind: str, stream: str, multiple: float, args, directory: str) -> dict:
    import cncore
    import cncore.tier  # imported in both runs, so that the baseline RSS holds it
    from cncore.tier import TieredStore
    start_rss = rss_bytes()
    opt = cncore.RowWiseAdagrad(lr=0.05)
    from cncore.tier.records import _cache_rows
    cache_rows = _cache_rows(cncore.StoreConfig(dim=args.dim, optimizer=opt), args.cache_mib << 20)
    n_keys = int(cache_rows * multiple)
    ids = args.batch * args.bag
    lengths = np.full(args.batch, args.bag)
    grad = np.full((args.batch, args.dim), 0.01, np.float32)
    # The benchmark's own arrays first (the keys, every step's IDs: 14 MiB at 3x, 25 at 10x), then
    # the baseline and a reset of the peak (VmHWM, /proc/self/clear_refs), so that "store peak"
    # is the store's alone; "peak RSS" counts from the imports, the IDs included, as before.
    all_keys = np.random.default_rng(99).integers(-2**62, 2**62, n_keys)
    stream_batches = list(batches(stream, n_keys, args.warmup + args.steps + 1, ids, seed=1,
                                  drift_every=args.drift_every))
    peak_before_store = peak_rss_bytes()
    base_rss = rss_bytes()
    reset_peak_rss()
    storage = cncore.Tiered(os.path.join(directory, "t"), args.cache_mib << 20) if kind == "tiered" else None
    fields: dict[str, Any] = {"capacity": n_keys} if args.capacity_hint else {}
    # The policy of the tier's cache (its eviction). The in-memory store has none, as before (the
    # fastest in-memory table: no metadata kept for a policy).
    if kind == "tiered":
        fields["eviction"] = cncore.LFU(halve_every=args.lfu_halve_every) if args.eviction == "lfu" else cncore.LRU()
    store = cncore.make_store(cncore.StoreConfig(dim=args.dim, optimizer=opt, storage=storage, **fields))
    tier = store if isinstance(store, TieredStore) else None  # kind == "tiered": its counters and disk verbs
    assert tier is None or tier.cache_rows == cache_rows
    for start in range(0, n_keys, ids):  # fill: every key once
        chunk = all_keys[start:start + ids]
        _, ctx = store.pooled_lookup(chunk, lengths=np.array([len(chunk)]))
        store.apply_gradients(ctx, grad[:1])
    times: list[float] = []
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            before = dict(tier.stats) if tier is not None else {}
            times = []
        keys = stream_batches[step]
        t0 = time.perf_counter()
        _, ctx = store.pooled_lookup(keys, lengths=lengths)
        if tier is not None and args.prefetch:  # the next batch's reads overlap the rest of this step
            tier.prefetch(stream_batches[step + 1])
        store.apply_gradients(ctx, grad)
        times.append(time.perf_counter() - t0)
    out = {"kind": kind, "stream": stream, "multiple": multiple, "rows": len(store), "cache_rows": cache_rows,
           "step_ms": float(np.mean(times) * 1e3), "median_step_ms": float(np.median(times) * 1e3),
           "peak_rss_mib": (max(peak_before_store, peak_rss_bytes()) - start_rss) / 2**20,
           "store_peak_mib": (peak_rss_bytes() - base_rss) / 2**20}
    if tier is not None:
        s = tier.stats
        d = {k: s[k] - before.get(k, 0) for k in s}
        out["memory_parts_mib"] = (tier.cache.nbytes + tier.disk_index_bytes) / 2**20
        out.update(hit_rate=d["hits"] / max(1, d["hits"] + d["misses"]),
                   read_per_step=d["rows_read"] / args.steps, written_per_step=d["rows_written"] / args.steps,
                   mib_read_per_step=d["bytes_read"] / args.steps / 2**20,
                   mib_written_per_step=d["bytes_written"] / args.steps / 2**20)
        if args.passes and multiple == min(args.multiples):
            written0 = s["bytes_written"]
            row_bytes = 4 * (args.dim + tier.config.state_floats)
            updated = 0
            for _ in range(args.passes):
                order = np.random.default_rng(7).permutation(all_keys)
                for start in range(0, n_keys, ids):
                    chunk = order[start:start + ids]
                    _, ctx = tier.pooled_lookup(chunk, lengths=np.array([len(chunk)]))
                    tier.apply_gradients(ctx, grad[:1])
                    updated += len(chunk)
                tier.flush()
            out["write_amplification"] = (tier.stats["bytes_written"] - written0) / (updated * row_bytes)
            file_bytes = os.path.getsize(os.path.join(directory, "t", "rows.dat"))
            tier.compact()
            after = os.path.getsize(os.path.join(directory, "t", "rows.dat"))
            live = len(tier) * tier.record_bytes
            out.update(file_over_live_before_compact=file_bytes / live, file_over_live_after_compact=after / live,
                       record_bytes=tier.record_bytes)
    return out


def child(args) -> None:
    print(json.dumps(run_one(args.kind, args.stream, args.multiple, args)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache-mib", type=int, default=32)
    ap.add_argument("--multiples", type=float, nargs="+", default=[3, 10])
    ap.add_argument("--streams", nargs="+", default=["zipf-1.05", "zipf-1.2", "uniform"])
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--bag", type=int, default=16)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=30, help="unmeasured steps after the fill")
    ap.add_argument("--passes", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3,
                    help="runs of each kind per cell, alternating; the cell shows the median (shared machines)")
    ap.add_argument("--no-prefetch", dest="prefetch", action="store_false",
                    help="do not hand the next batch's keys to prefetch() during each step")
    ap.add_argument("--dir", default=None, help="where the tier files go (default: the temp dir)")
    ap.add_argument("--eviction", choices=["lru", "lfu"], default="lru",
                    help="the tier cache's policy (StoreConfig.eviction; LRU is the tier's default)")
    ap.add_argument("--lfu-halve-every", type=int, default=None, metavar="STEPS",
                    help="with --eviction lfu: LFU(halve_every=STEPS), counts aged (a power of two)")
    ap.add_argument("--drift-every", type=int, default=100, metavar="STEPS",
                    help="the zipf-A-drift streams: the popular keys change every STEPS steps")
    ap.add_argument("--capacity-hint", action="store_true",
                    help="StoreConfig(capacity=rows of the table) in both runs (the tier sizes its disk index once)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 1 MiB cache, 3x, 4 steps, 2 passes")
    ap.add_argument("--kind", help=argparse.SUPPRESS)
    ap.add_argument("--stream", help=argparse.SUPPRESS)
    ap.add_argument("--multiple", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.cache_mib, args.multiples, args.steps, args.passes, args.batch, args.warmup = 1, [3], 4, 2, 128, 2
        args.repeat = 1
        args.streams = ["zipf-1.05", "uniform"]
    if args.kind:
        import cncore
        cncore.set_num_threads(args.threads)
        child(args)
        return 0
    rows = []
    load_before = os.getloadavg()[0]
    for multiple in args.multiples:
        for stream in args.streams:
            runs: dict[str, list[dict]] = {"tiered": [], "memory": []}
            for rep in range(args.repeat):  # the two kinds alternate, so that a noisy neighbour hits both
                for kind in ("tiered", "memory"):
                    argv_child = [sys.executable, __file__, "--kind", kind, "--stream", stream, "--multiple",
                                  str(multiple), "--cache-mib", str(args.cache_mib), "--dim", str(args.dim),
                                  "--batch", str(args.batch), "--bag", str(args.bag), "--steps", str(args.steps),
                                  "--passes", str(args.passes if rep == 0 else 0), "--warmup", str(args.warmup),
                                  "--threads", str(args.threads), "--eviction", args.eviction,
                                  "--drift-every", str(args.drift_every),
                                  "--multiples", *map(str, args.multiples)]
                    if args.capacity_hint:
                        argv_child.append("--capacity-hint")
                    if args.lfu_halve_every:
                        argv_child += ["--lfu-halve-every", str(args.lfu_halve_every)]
                    if not args.prefetch:
                        argv_child.append("--no-prefetch")
                    if args.dir:
                        argv_child += ["--dir", args.dir]
                    done = subprocess.run(argv_child, capture_output=True, text=True)
                    if done.returncode:
                        raise SystemExit(f"{kind} {stream} {multiple:g}x failed:\n{done.stderr}")
                    runs[kind].append(json.loads(done.stdout.strip().splitlines()[-1]))
            pair = {}
            for kind, got in runs.items():  # the run of the median step time, with the first run's extras
                median = sorted(got, key=lambda r: r["step_ms"])[len(got) // 2]
                pair[kind] = {**got[0], **median, "all_step_ms": [r["step_ms"] for r in got]}
            rows.append(pair)
    t0 = rows[0]["tiered"]
    print(f"cache {args.cache_mib} MiB = {t0['cache_rows']:,} rows of dim {args.dim} (row-wise Adagrad), "
          f"{args.batch} x {args.bag} IDs per step, {args.threads} thread(s), prefetch "
          f"{'on' if args.prefetch else 'off'}, {args.warmup} warm-up + {args.steps} measured steps, the median of "
          f"{args.repeat} alternating runs of each kind; capacity hint {'on' if args.capacity_hint else 'off'}; "
          f"cache eviction {args.eviction.upper()}"
          f"{f' (halve_every={args.lfu_halve_every})' if args.lfu_halve_every else ''}; "
          f"{f'drift every {args.drift_every} steps; ' if any(s.endswith('-drift') for s in args.streams) else ''}"
          f"load average "
          f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after\n")
    print("| table / cache | stream | rows | tiered step ms (mean) | in-memory step ms (mean) | tiered / in-memory "
          "speed | hit rate (IDs) | rows read / step | rows written / step | MiB read / step | MiB written / step | "
          "tiered median / in-memory median ms | tiered peak RSS MiB | cache + disk index MiB | "
          "in-memory peak RSS MiB | tiered store peak MiB | store peak / (cache + disk index) | "
          "in-memory store peak MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for p in rows:
        t, m = p["tiered"], p["memory"]
        print(f"| {t['multiple']:g}x | {t['stream']} | {t['rows']:,} | {t['step_ms']:.1f} | {m['step_ms']:.1f} | "
              f"{m['step_ms'] / t['step_ms']:.2f}x | {t['hit_rate']:.3f} | {t['read_per_step']:,.0f} | "
              f"{t['written_per_step']:,.0f} | {t['mib_read_per_step']:.2f} | {t['mib_written_per_step']:.2f} | "
              f"{t['median_step_ms']:.1f} / {m['median_step_ms']:.1f} | {t['peak_rss_mib']:.0f} | "
              f"{t['memory_parts_mib']:.0f} | {m['peak_rss_mib']:.0f} | {t['store_peak_mib']:.1f} | "
              f"{t['store_peak_mib'] / t['memory_parts_mib']:.2f} | {m['store_peak_mib']:.0f} |")
    print("\nevery run's mean step ms (tiered; in memory): " + "; ".join(
        f"{p['tiered']['multiple']:g}x {p['tiered']['stream']}: "
        f"{'/'.join(f'{v:.1f}' for v in p['tiered']['all_step_ms'])}"
        f"; {'/'.join(f'{v:.1f}' for v in p['memory']['all_step_ms'])}" for p in rows))
    extra = [p["tiered"] for p in rows if "write_amplification" in p["tiered"]]
    if extra:
        e = extra[0]
        print(f"\n{args.passes} uniform passes over the {e['multiple']:g}x table ({e['rows']:,} rows), a flush after "
              f"each: write amplification {e['write_amplification']:.2f} (bytes written / bytes of rows and state "
              f"updated); file {e['file_over_live_before_compact']:.2f}x the live records before compact(), "
              f"{e['file_over_live_after_compact']:.2f}x after (record {e['record_bytes']} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The pooled forward on tables far larger than the last-level cache (and on the 1M-row shape, for
continuity): our float32, float16 and bfloat16 rows against torch.nn.EmbeddingBag (float32) and
FBGEMM's table-batched embedding (TBE) with float16 weights on CPU, all holding the same rows,
measured in one run.

Rules, so that no contender measures cache hits it would not get in a real step:
- the table sizes are printed against the last-level cache read from the machine;
- every round draws fresh IDs (uniform, or Zipf with the hot rows scattered over the table), and
  all contenders of a round get the same IDs, in a rotating order;
- a buffer twice the last-level cache is read and written before every timed call;
- the streaming read bandwidth is measured in the same run (on 1 and on every thread, the
  better kept), and each forward is printed as the share of it that the bytes it must read
  take at that speed: rows, the ID, and for us the 16-byte index bucket.
Cells: M IDs/s (median of the rounds after two warm-ups) and that share of bandwidth; then our
speed over each reference's. Threads: the libraries' defaults unless --threads; cncore_torch is
imported first, so torch's OpenMP threads spin as briefly as they do for a user of our modules
(README, "Threads on a shared machine") for every contender alike.

    python asv_bench/scripts/forward_large.py                      # 8M and 1M rows, dims 16/64/128
    python asv_bench/scripts/forward_large.py --background-load    # the same beside a busy process per core
    python asv_bench/scripts/forward_large.py --quick              # small shapes, a smoke run
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
import time
import warnings

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from benchmarks import machine  # noqa: E402
from benchmarks.common import positions  # noqa: E402

warnings.filterwarnings("ignore")

OURS = {"ours fp32": "float32", "ours fp16": "float16", "ours bf16": "bfloat16"}
# contender -> bytes per row element (a row is dim of them)
ROW_BYTES = {"EB fp32": 4, "TBE fp16": 2, "TBE-inf fp16": 2, "ours fp32": 4, "ours fp16": 2, "ours bf16": 2}
CONTENDERS = list(ROW_BYTES)
# (ours, reference): the ratio columns, kept when both ran
RATIOS = [("ours fp32", "EB fp32"), ("ours fp16", "EB fp32"), ("ours bf16", "EB fp32"),
          ("ours fp16", "TBE fp16"), ("ours bf16", "TBE fp16"), ("ours fp16", "TBE-inf fp16")]
ID_BYTES, BUCKET_BYTES, META_BYTES = 8, 16, 96  # META_BYTES: our per-row metadata and index, generously


def bytes_per_id(name: str, dim: int) -> int:
    """What the forward must read for one ID: the row, the ID, and for us the index bucket."""
    return dim * ROW_BYTES[name] + ID_BYTES + (BUCKET_BYTES if name in OURS else 0)


def memory_needed(rows: int, dim: int, names) -> int:
    return sum(rows * (dim * ROW_BYTES[n] + (META_BYTES if n in OURS else 0)) for n in names)


def table_keys(rows: int) -> np.ndarray:
    """rows distinct int64 keys spread over all of int64 (an odd multiplier permutes 2^64)."""
    with np.errstate(over="ignore"):
        return (np.arange(1, rows + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)).view(np.int64)


class Tables:
    """The same rows (uniform in +-0.05, drawn in chunks) in every contender: ours at each dtype
    under table_keys(rows), the references at positions 0..rows-1."""

    def __init__(self, rows: int, dim: int, names, seed: int = 0, max_load_factor: float = 0.7):
        import torch

        import cncore
        from compare_reference import tbe, tbe_inference

        self.rows, self.dim, self.names = rows, dim, list(names)
        self.keys = table_keys(rows)
        self.stores = {n: cncore.EmbeddingStore(cncore.StoreConfig(dim=dim, dtype=OURS[n], capacity=rows,
                                                                max_load_factor=max_load_factor))
                       for n in self.names if n in OURS}
        self.eb = torch.nn.EmbeddingBag(rows, dim, mode="sum", include_last_offset=True) \
            if "EB fp32" in self.names else None
        self.tbe = tbe(rows, dim, "sgd", 0.01, precision="fp16") if "TBE fp16" in self.names else None
        self.tbe_inf = tbe_inference(rows, dim) if "TBE-inf fp16" in self.names else None
        gen = np.random.default_rng(seed)
        chunk = 1 << 20
        with torch.no_grad():
            for start in range(0, rows, chunk):
                stop = min(rows, start + chunk)
                w = gen.uniform(-0.05, 0.05, (stop - start, dim)).astype(np.float32)
                for store in self.stores.values():
                    store.insert_or_assign(self.keys[start:stop], w)
                wt = torch.from_numpy(w)
                if self.eb is not None:
                    self.eb.weight[start:stop] = wt
                if self.tbe is not None:
                    self.tbe.split_embedding_weights()[0][start:stop] = wt.half()
                if self.tbe_inf is not None:
                    self.tbe_inf.split_embedding_weights()[0][0][start:stop, :2 * dim] = \
                        wt.half().view(torch.uint8)

    def calls(self, idx: np.ndarray, pooling: int) -> dict:
        """For one batch of row positions: a no-argument forward per contender, its inputs
        prepared here (untimed), each returning its (batch, dim) float32 output."""
        import torch
        n = len(idx)
        offsets_np = np.arange(0, n + 1, pooling, dtype=np.int64)
        idx_t, offsets = torch.from_numpy(idx), torch.from_numpy(offsets_np)
        idx32, offsets32 = idx_t.int(), offsets.int()
        keys = self.keys[idx]
        eb, tbe, tbe_inf = self.eb, self.tbe, self.tbe_inf  # each built when its name is in self.names
        fns = {}
        for name in self.names:
            if name == "EB fp32":
                assert eb is not None
                fns[name] = lambda: eb(idx_t, offsets)
            elif name == "TBE fp16":
                assert tbe is not None
                fns[name] = lambda: tbe(idx_t, offsets)
            elif name == "TBE-inf fp16":
                assert tbe_inf is not None
                fns[name] = lambda: tbe_inf(idx32, offsets32)
            else:
                out = np.empty((n // pooling, self.dim), np.float32)
                fns[name] = (lambda s, o: lambda: s.pooled_lookup(keys, offsets_np, insert_missing=False, out=o)[0])(
                    self.stores[name], out)
        return fns


def check_same_rows(fns: dict, pooling: int) -> None:
    """Every contender's output equals EmbeddingBag's within its rows' rounding (a benchmark that
    reads the wrong rows would otherwise go unnoticed)."""
    import torch
    with torch.no_grad():
        outs = {name: np.asarray(fn()) for name, fn in fns.items()}
    ref = outs.get("EB fp32", next(iter(outs.values())))
    for name, out in outs.items():
        eps = 2.0 ** -8 if "bf16" in name else 2.0 ** -11 if "16" in name else 2.0 ** -22
        tol = pooling * 0.05 * eps * 2 + 1e-6
        err = float(np.abs(out - ref).max())
        if not err <= tol:
            raise SystemExit(f"{name}: output differs from EmbeddingBag's by {err:.3g} (allowed {tol:.3g}): "
                             "the contenders do not hold the same rows")


# The smoke run's cache flush and bandwidth buffer (x4): it checks that every cell prints, so it need
# not evict a large LLC.
SMOKE_BYTES = 16 << 20


def measure(tables: Tables, dist: str, pooling: int, batch: int, rounds: int, flush, gen) -> dict:
    """Median seconds per forward of each contender over `rounds` rounds (after two warm-ups)."""
    import torch
    samples: dict[str, list[float]] = {name: [] for name in tables.names}
    for r in range(rounds + 2):
        fns = tables.calls(positions(dist, batch * pooling, tables.rows, gen), pooling)
        if r == 0:
            check_same_rows(fns, pooling)
        order = tables.names[r % len(fns):] + tables.names[:r % len(fns)]
        with torch.no_grad():
            for name in order:
                flush()
                t = time.perf_counter()
                fns[name]()
                if r >= 2:
                    samples[name].append(time.perf_counter() - t)
    return {name: statistics.median(v) for name, v in samples.items()}


def header(names) -> str:
    ratios = [f"{a.split()[1]}/{b}" for a, b in RATIOS if a in names and b in names]
    cols = ["rows", "dim", "pooling", "IDs", *names, *ratios, "load"]
    return "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols)


def row(rows, dim, pooling, dist, names, times, n_ids, bandwidth) -> str:
    rate = {name: n_ids / times[name] for name in names}
    cells = [f"{rows / 1e6:g}M", str(dim), str(pooling), dist]
    cells += [f"{rate[n] / 1e6:.1f} · {rate[n] * bytes_per_id(n, dim) / bandwidth:.0%}" for n in names]
    cells += [f"**{rate[a] / rate[b]:.2f}x**" for a, b in RATIOS if a in names and b in names]
    cells.append(f"{os.getloadavg()[0]:.1f}")
    return "| " + " | ".join(cells) + " |"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=float, nargs="+", default=[8e6, 1e6],
                   help="table rows (each scaled down to half the available memory if needed)")
    p.add_argument("--dims", type=int, nargs="+", default=[16, 64, 128])
    p.add_argument("--poolings", type=int, nargs="+", default=[1, 20])
    p.add_argument("--dists", nargs="+", default=["uniform", "zipf1.05"], help="uniform or zipf<exponent>")
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--contenders", nargs="+", default=CONTENDERS, choices=CONTENDERS)
    p.add_argument("--threads", type=int, default=None,
                   help="threads for torch and the core (default: each library's own default)")
    p.add_argument("--background-load", action="store_true",
                   help="measure beside one busy process per core (the threading defaults on a shared machine)")
    p.add_argument("--max-load-factor", type=float, default=0.7,
                   help="our tables' index load (StoreConfig.max_load_factor; default the store's 0.7)")
    p.add_argument("--quick", action="store_true", help="small shapes and few rounds: a smoke run")
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.dims, args.poolings, args.batch, args.rounds = [2e5], [16], [20], 256, 2
        args.dists = args.dists[-1:]

    import cncore_torch  # noqa: F401  (first: bounds torch's OpenMP spin, as every user of our modules gets it)

    # isort: split
    import torch

    import cncore
    if args.threads is not None:
        torch.set_num_threads(args.threads)
        cncore.set_num_threads(args.threads)
    threads = max(torch.get_num_threads(), cncore.get_num_threads())
    names = [n for n in CONTENDERS if n in args.contenders]
    flush = machine.Flush(2, nbytes=SMOKE_BYTES if args.quick else None)
    gen = np.random.default_rng(1)
    print(f"# Pooled forward, tables beyond the cache: {machine.describe()}")
    print(f"# threads: torch {torch.get_num_threads()}, cncore {cncore.get_num_threads()}"
          f"{' (defaults)' if args.threads is None else ''}, {machine.openmp_wait()}; batch {args.batch}; "
          f"{args.rounds} rounds; "
          f"flush {flush.buf.nbytes >> 20} MiB before every call; our index load {args.max_load_factor}"
          f"{'; background load: one busy process per core' if args.background_load else ''}")
    lines = []
    for rows in args.rows:
        for dim in args.dims:
            rows_here = int(rows)
            budget = machine.available_memory() // 2
            if memory_needed(rows_here, dim, names) > budget:
                rows_here = int(rows_here * budget / memory_needed(rows_here, dim, names)) // 1000 * 1000
            tables = Tables(rows_here, dim, names, max_load_factor=args.max_load_factor)
            fp32_bytes = rows_here * dim * 4
            load = machine.background_load() if args.background_load else contextlib.nullcontext()
            with load:
                bandwidth = max(machine.read_bandwidth(SMOKE_BYTES * 4 if args.quick else None, threads=t)
                                for t in {1, threads})
                print(f"# {rows_here:,} rows x dim {dim}: float32 table {fp32_bytes / 2**30:.2f} GiB = "
                      f"{fp32_bytes / machine.llc_bytes():.1f}x the LLC"
                      f"{' (scaled down to fit half the available memory)' if rows_here != int(rows) else ''}; "
                      f"read bandwidth {bandwidth / 1e9:.1f} GB/s", flush=True)
                for pooling in args.poolings:
                    for dist in args.dists:
                        times = measure(tables, dist, pooling, args.batch, args.rounds, flush, gen)
                        lines.append(row(rows_here, dim, pooling, dist, names, times,
                                         args.batch * pooling, bandwidth))
                        print(lines[-1], flush=True)
            del tables
            gc.collect()
    print()
    print(header(names))
    print("\n".join(lines))
    print(f"\nCells: M IDs/s · share of the read bandwidth that the bytes the forward must read take at "
          f"that speed. Ratios: ours over the reference, same rows, same IDs, same run. "
          f"Load average at the end: {machine.load_average()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

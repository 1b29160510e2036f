"""The pooled forward on a table far larger than the last-level cache, rows in float32, float16
and bfloat16, against torch.nn.EmbeddingBag (float32) on the same rows, in one run.

Every round draws fresh IDs (uniform, Zipf 1.05 and 1.2 with the hot keys scattered over the
table), and a buffer twice the LLC is written between calls so no call starts with the previous
one's rows in cache. Prints M IDs/s (median of the rounds after two warm-ups), each against
EmbeddingBag, and the fraction of the machine's streaming read bandwidth (measured in the same
run, one thread) that the bytes the forward must read would take at that speed.

    python asv_bench/scripts/forward_large.py                 # 8M rows x dim 64 (scaled to memory)
    python asv_bench/scripts/forward_large.py --rows 1e6 --threads 2
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np


def llc_bytes() -> int:
    best = 0
    base = "/sys/devices/system/cpu/cpu0/cache"
    for entry in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        try:
            with open(f"{base}/{entry}/size") as fh:
                text = fh.read().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1], 1)
        best = max(best, int(text.rstrip("KMG")) * scale)
    return best or 32 << 20


def read_bandwidth(nbytes: int) -> float:
    """Bytes/s of a streaming sum over nbytes, best of 5 (one thread)."""
    buf = np.ones(nbytes // 8, np.float64)
    best = 0.0
    for _ in range(5):
        t = time.perf_counter()
        buf.sum()
        best = max(best, nbytes / (time.perf_counter() - t))
    return best


def ids_for(kind: str, n: int, rows: int, perm: np.ndarray, rng) -> np.ndarray:
    if kind == "uniform":
        return perm[rng.integers(0, rows, n)]
    a = float(kind[len("zipf"):])
    out = np.empty(0, np.int64)
    while len(out) < n:
        r = rng.zipf(a, 2 * n) - 1
        out = np.concatenate([out, r[r < rows]])
    return perm[out[:n]]


def main(argv=None) -> int:
    import torch

    import cncore
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=float, default=8e6)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--pooling", type=int, default=20)
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--kinds", nargs="+", default=["uniform", "zipf1.05", "zipf1.2"])
    args = p.parse_args(argv)
    rows, dim = int(args.rows), args.dim
    avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    need = rows * dim * 4 * 3.5  # EB + float32 + two 16-bit tables, with their metadata and index
    if need > 0.7 * avail:
        rows = int(rows * 0.7 * avail / need)
        print(f"(scaled down to {rows:,} rows to fit the free memory)")
    torch.set_num_threads(args.threads)
    cncore.set_num_threads(args.threads)
    llc = llc_bytes()
    bw = read_bandwidth(max(8 * llc, 256 << 20))
    rng = np.random.default_rng(0)
    keys = rng.integers(-2**63, 2**63 - 1, rows, dtype=np.int64)
    init = cncore.Uniform(-0.05, 0.05)
    stores = {}
    for dtype in ("float32", "float16", "bfloat16"):
        store = cncore.EmbeddingStore(cncore.StoreConfig(dim=dim, dtype=dtype, capacity=rows, initializer=init))
        for i in range(0, rows, 1 << 20):
            store.find_or_insert(keys[i:i + (1 << 20)])
        stores[dtype] = store
    eb = torch.nn.EmbeddingBag(rows, dim, mode="sum")
    with torch.no_grad():
        eb.weight.copy_(torch.from_numpy(stores["float32"].lookup(keys)))
    perm = rng.permutation(rows)
    flush = np.zeros(2 * llc // 8, np.float64)
    n = args.batch * args.pooling
    offsets = torch.arange(0, n, args.pooling)
    lengths = np.full(args.batch, args.pooling, np.int64)
    print(f"rows {rows:,} x dim {dim} (float32 table {rows * dim * 4 / 2**30:.2f} GiB), LLC {llc >> 20} MiB, "
          f"batch {args.batch} x pooling {args.pooling}, {args.threads} thread(s), load {os.getloadavg()[0]:.1f}, "
          f"read bandwidth {bw / 1e9:.1f} GB/s")
    print("| IDs | rows | M IDs/s | vs EmbeddingBag fp32 | share of read bandwidth |")
    print("|---|---|---|---|---|")
    for kind in args.kinds:
        times = {name: [] for name in ("EmbeddingBag fp32", "float32", "float16", "bfloat16")}
        for r in range(args.rounds + 2):
            idx = ids_for(kind, n, rows, perm, rng)
            k = keys[idx]
            for name in times:
                flush += 1.0
                t = time.perf_counter()
                if name == "EmbeddingBag fp32":
                    with torch.no_grad():
                        eb(torch.from_numpy(idx), offsets)
                else:
                    stores[name].pooled_lookup(k, lengths=lengths, insert_missing=False)
                if r >= 2:
                    times[name].append(time.perf_counter() - t)
        eb_rate = n / np.median(times["EmbeddingBag fp32"])
        for name, ts in times.items():
            rate = n / np.median(ts)
            row_bytes = dim * (2 if name in ("float16", "bfloat16") else 4)
            index = 0 if name.startswith("Embedding") else 16
            share = rate * (row_bytes + index + 8) / bw
            print(f"| {kind} | {name} | {rate / 1e6:.1f} | {rate / eb_rate:.2f}x | {share:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

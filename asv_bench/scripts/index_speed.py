"""The key index alone (cn_index.h): its bytes a key and its speed, on tables past the caches.

For each shape (rows, dim): fill an empty store (default capacity, so every growth rehash is
in the time) with `rows` random int64 keys, `--batch` keys a `find_or_insert` call; then
`--rounds` rounds, each on freshly drawn keys of the table (uniform, and Zipf(1.05) over a
shuffled order of them): `find` of `--batch` keys and a sum-pooled `pooled_lookup` of the same
keys in bags of 20 (no inserts). Printed: the index's bytes a key (16 x buckets / keys) and the
store's (nbytes / keys), the fill's M keys/s, and per verb the median and the 25th percentile of
the rounds in microseconds. Then a bounded table (max_rows = `--budget`, LRU) fed `--distinct`
distinct IDs: its index bytes a key once full. One thread (`cncore.set_num_threads(1)`) unless
--threads, so two builds can be compared on a shared machine by alternating runs.

    python asv_bench/scripts/index_speed.py                        # 1M x 64 and 8M x 16
    python asv_bench/scripts/index_speed.py --shapes 1000000x64 --rounds 5
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

import cncore


def timed(fn, rounds):
    out = []
    for r in range(rounds):
        arg = fn(r, None)
        t = time.perf_counter()
        fn(r, arg)
        out.append((time.perf_counter() - t) * 1e6)
    return float(np.median(out)), float(np.percentile(out, 25))


def shape(rows: int, dim: int, batch: int, rounds: int) -> dict:
    rng = np.random.default_rng(0)
    keys = rng.integers(-2**63, 2**63 - 1, size=rows, dtype=np.int64)
    store = cncore.EmbeddingStore(dim=dim, optimizer=cncore.RowWiseAdagrad(lr=0.01))
    t = time.perf_counter()
    for start in range(0, rows, batch):
        store.find_or_insert(keys[start:start + batch])
    fill = time.perf_counter() - t
    n_buckets = store._table.n_buckets
    res = {"rows": len(store), "dim": dim, "index_bytes_per_key": 16 * n_buckets / len(store),
           "store_bytes_per_key": store.nbytes / len(store), "fill_Mkeys_s": rows / fill / 1e6}
    order = rng.permutation(rows)
    zipf_p = 1.0 / np.arange(1, rows + 1) ** 1.05
    zipf_p /= zipf_p.sum()
    offsets = np.arange(0, batch + 1, 20, dtype=np.int64)
    for dist in ("uniform", "zipf"):
        def draw(r):
            g = np.random.default_rng(1000 + r)
            if dist == "uniform":
                return keys[g.integers(0, rows, batch)]
            return keys[order[g.choice(rows, batch, p=zipf_p)]]

        def find(r, arg):
            if arg is None:
                return draw(r)
            store.find(arg)

        def pooled(r, arg):
            if arg is None:
                return draw(r)
            store.pooled_lookup(arg, offsets)

        res[f"find_{dist}_us"] = timed(find, rounds)
        res[f"pooled_{dist}_us"] = timed(pooled, rounds)
    return res


def bounded(budget: int, distinct: int, batch: int, dim: int) -> dict:
    rng = np.random.default_rng(2)
    store = cncore.EmbeddingStore(dim=dim, optimizer=cncore.RowWiseAdagrad(lr=0.01), max_rows=budget,
                                  eviction=cncore.LRU(), fallback_rows=0)  # one row per key: the index measured
    ids = rng.permutation(distinct).astype(np.int64)
    for start in range(0, distinct, batch):
        store.find_or_insert(ids[start:start + batch])
    return {"budget": budget, "rows": len(store), "index_bytes_per_key": 16 * store._table.n_buckets / len(store),
            "index_bytes_per_budget_row": 16 * store._table.n_buckets / budget,
            "store_bytes_per_row": store.nbytes / len(store)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["1000000x64", "8000000x16"])
    ap.add_argument("--batch", type=int, default=81920)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--budget", type=int, default=140872)
    ap.add_argument("--distinct", type=int, default=1000000)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    cncore.set_num_threads(args.threads)
    for s in args.shapes:
        rows, dim = (int(x) for x in s.split("x"))
        print(json.dumps(shape(rows, dim, args.batch, args.rounds)), flush=True)
    print(json.dumps(bounded(args.budget, args.distinct, 8192, 16)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

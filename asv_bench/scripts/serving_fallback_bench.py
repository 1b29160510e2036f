"""What fallback rows cost a frozen collection's request: the in-graph mixer and modulo.

    python asv_bench/scripts/serving_fallback_bench.py [--scale 0.01] [--dim 16] [--requests 300]

The cn-dlrm job's 26 Criteo tables at `--scale` of their cardinalities, every row the first 20
batches reach inserted, frozen three ways from the same rows: no fallback rows (the graph of a
table without them), every table with 1009 fallback rows (one N: the mixer, an unsigned modulo
and one select over the request's IDs), and half the tables with 1009 (N per feature: one
`repeat_interleave` more). One request = one forward of the frozen `EmbeddingBagCollection` on a
synthetic Criteo batch of B samples (B = 1, 32, 512; about half its IDs unseen), one thread, no
gradients; the variants take turns request by request, each on requests of its own; p50 / p99
in ms and the p50 ratio against no fallback rows.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

from cn_dlrm.data import SyntheticCriteo
from cn_dlrm.train import prefill_tables, table_configs
from cncore_torch import CNEmbeddingBagCollection
from cncore_torch.serving import freeze


def frozen_variants(args) -> dict:
    gen = SyntheticCriteo(seed=0, batch_size=512, scale=args.scale)
    configs = table_configs(args.dim, gen.cardinalities)
    half = {c.name: (1009 if i % 2 else 0) for i, c in enumerate(configs)}
    out = {}
    for name, fallback in (("none", 0), ("N=1009 all", 1009), ("N=1009 half", half)):
        ebc = CNEmbeddingBagCollection(tables=table_configs(args.dim, gen.cardinalities), fallback_rows=fallback)
        prefill_tables(ebc, gen, 20)
        out[name] = freeze(ebc.eval())
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=float, default=0.01)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--requests", type=int, default=300)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    variants = frozen_variants(args)
    print(f"load average before: {os.getloadavg()}")
    print("| batch | " + " | ".join(f"{n} p50 / p99 ms" for n in variants) + " | p50 ratio all / half |")
    print("|---" * (len(variants) + 2) + "|")
    for batch in (1, 32, 512):
        gen = SyntheticCriteo(seed=batch, batch_size=batch, scale=args.scale)
        times: dict[str, list[float]] = {n: [] for n in variants}
        names = list(variants)
        with torch.no_grad():
            for r in range(args.requests + 20):
                for k in range(len(names)):
                    name = names[(r + k) % len(names)]
                    kjt = gen.batch(1000 + r * len(names) + k).sparse
                    start = time.perf_counter()
                    variants[name](kjt)
                    if r >= 20:  # (the first requests warm the caches)
                        times[name].append(time.perf_counter() - start)
        p = {n: (np.percentile(t, 50) * 1e3, np.percentile(t, 99) * 1e3) for n, t in times.items()}
        base = p["none"][0]
        print(f"| {batch} | " + " | ".join(f"{a:.3f} / {b:.3f}" for a, b in p.values())
              + f" | {p['N=1009 all'][0] / base:.2f}x / {p['N=1009 half'][0] / base:.2f}x |")
    print(f"load average after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

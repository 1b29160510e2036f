"""Serving latency of the cn-dlrm DLRM, frozen vs live vs TorchRec's QuantEBC, and the cost of a delta.

    python asv_bench/scripts/serving_bench.py [--scale 0.01] [--dim 16] [--requests 200]
                                              [--delta-rows 2000000] [--delta-dim 64] [--remaps]

Latency: the job's DLRM (cn_dlrm.train.build_dlrm over the 26 Criteo tables at `--scale` of
their cardinalities, every row the first batches reach inserted), one request = one forward of
a synthetic Criteo batch of B samples (B = 1, 32, 512), one thread, no gradients:

- live: the trained model in eval mode (CNEmbeddingBagCollection, the core's lookup);
- frozen: `cncore_torch.serving.freeze(model)` (the in-graph remap + TorchRec's EBC, float32);
- frozen int8: the frozen model after TorchRec's `quantize_embeddings(dtype=torch.qint8)`;
- QuantEBC: TorchRec's QuantEmbeddingBagCollection (int8) in the DLRM on IDs remapped to rows
  before the clock starts (what a TorchRec deployment with an external remap pays).

The variants take turns request by request (each request's batch is timed on every variant in
a rotating order), so a busy neighbour slows all of them alike. p50 / p99 over `--requests`.

Remap alone (`--remaps`): the frozen collection's ID remap of each request (FBGEMM's pruned-index
hash, one operator call) against two layouts of plain tensor operations, on the same values: one
`searchsorted` over all tables' merged sorted IDs plus a table compare, and one `searchsorted` per
feature over its table's sorted IDs. All three give the same rows (checked on every request).

Delta: a frozen table of `--delta-rows` x `--delta-dim` float32 rows (the issue's 5 GiB table,
scaled to what a shared machine holds quickly), one delta of 1% of its rows: (a) changed rows
only, (b) half changed, a quarter new IDs, a quarter evicted. Time of `apply_delta` (prepared
aside + swapped under the lock), the part under the lock, and the bytes written.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

from cn_dlrm.data import SyntheticCriteo
from cn_dlrm.train import build_dlrm, prefill_tables, table_configs
from cncore_torch import CNEmbeddingBagCollection
from cncore_torch.serving import FrozenEmbeddingBag, TableDelta, apply_delta, freeze
from cncore_torch.serving.hashmap import lookup


def models(args):
    gen = SyntheticCriteo(seed=0, batch_size=512, scale=args.scale)
    ebc = CNEmbeddingBagCollection(tables=table_configs(args.dim, gen.cardinalities))
    rows = prefill_tables(ebc, gen, 50)
    live = build_dlrm(ebc, args.dim).eval()
    frozen = freeze(live)
    from torchrec.inference.modules import quantize_embeddings
    frozen_int8 = quantize_embeddings(freeze(live), dtype=torch.qint8, inplace=False)
    # TorchRec's own deployment: QuantEBC in the DLRM, IDs remapped before the request
    quant = quantize_embeddings(freeze(live), dtype=torch.qint8, inplace=False)
    remap = quant.sparse_arch.embedding_bag_collection.remap
    quant.sparse_arch.embedding_bag_collection = quant.sparse_arch.embedding_bag_collection.embedding_bag_collection
    variants = {"live": live, "frozen": frozen, "frozen int8": frozen_int8, "QuantEBC (pre-remapped)": quant}
    return gen, rows, variants, remap


def latency(args) -> list[str]:
    gen, rows, variants, remap = models(args)
    lines = [f"DLRM: 26 tables, {rows:,} rows, dim {args.dim}; torch threads 1",
             "| batch | variant | p50 ms | p99 ms | p50 / QuantEBC | p99 / QuantEBC |", "|---|---|---|---|---|---|"]
    for batch_size in (1, 32, 512):
        gen.batch_size = batch_size
        times: dict[str, list[float]] = {name: [] for name in variants}
        names = list(variants)
        with torch.no_grad():
            for i in range(args.requests + 5):
                batch = gen.batch(1000 + i)
                remapped = remap(batch.sparse)
                order = names[i % len(names):] + names[:i % len(names)]
                for name in order:
                    sparse = remapped if name.startswith("QuantEBC") else batch.sparse
                    start = time.perf_counter()
                    variants[name](batch.dense, sparse)
                    if i >= 5:
                        times[name].append(time.perf_counter() - start)
        p50q, p99q = (np.percentile(times["QuantEBC (pre-remapped)"], q) for q in (50, 99))
        for name in names:
            p50, p99 = np.percentile(times[name], 50), np.percentile(times[name], 99)
            lines.append(f"| {batch_size} | {name} | {p50 * 1e3:.3f} | {p99 * 1e3:.3f} | {p50 / p50q:.2f} "
                         f"| {p99 / p99q:.2f} |")
    return lines


def _merged_searchsorted(remap):
    """The earlier remap: every table's IDs sorted together, one searchsorted, one compare."""
    tables = list(remap.tables.values())
    ids = np.concatenate([t.ids.numpy() for t in tables])
    which = np.repeat(np.arange(len(tables)), [t.ids.numel() for t in tables])
    order = np.lexsort((which, ids))
    ids, which = torch.from_numpy(ids[order]), torch.from_numpy(which[order])
    slots = torch.from_numpy(np.concatenate([t.slots.numpy() for t in tables])[order])
    assert bool((ids[1:] != ids[:-1]).all()), "an ID in two tables needs more than one probe"
    names = list(remap.tables)
    feature_tables = torch.tensor([names.index(remap.table_of_feature[f]) for f in remap.feature_order])

    def run(kjt):
        values = kjt.values()
        per_key = kjt.lengths().view(len(kjt.keys()), -1).sum(dim=1)
        table = torch.repeat_interleave(feature_tables, per_key, output_size=values.numel())
        at = torch.searchsorted(ids, values).clamp(max=ids.numel() - 1)
        hit = (torch.take(ids, at) == values) & (torch.take(which, at) == table)
        return torch.where(hit, torch.take(slots, at), 0)
    return run


def _pruned_hash(remap):
    """The remap's own lookup (IdRemap.forward less the KJT around it, as the others)."""
    def run(kjt):
        return lookup(remap.hash_table, remap.hash_offsets, remap.key_mask, kjt.values(), kjt.offsets())
    return run


def _per_table_searchsorted(remap):
    """One searchsorted per feature over its own table's sorted IDs."""
    tables = [remap.tables[remap.table_of_feature[f]] for f in remap.feature_order]

    def run(kjt):
        parts = torch.split(kjt.values(), kjt.length_per_key())
        out = []
        for t, v in zip(tables, parts):
            at = torch.searchsorted(t.ids, v).clamp(max=t.ids.numel() - 1)
            out.append(torch.where(torch.take(t.ids, at) == v, torch.take(t.slots, at), 0))
        return torch.cat(out)
    return run


def remaps(args) -> list[str]:
    gen, _, _, remap = models(args)
    ways = {"FBGEMM pruned hash (freeze's)": _pruned_hash(remap),
            "merged searchsorted": _merged_searchsorted(remap),
            "per-table searchsorted": _per_table_searchsorted(remap)}
    lines = ["| batch | IDs / request | remap | p50 ms | p99 ms | p50 / hash |", "|---|---|---|---|---|---|"]
    for batch_size in (1, 32, 512):
        gen.batch_size = batch_size
        times: dict[str, list[float]] = {name: [] for name in ways}
        names = list(ways)
        for i in range(args.requests + 5):
            kjt = gen.batch(1000 + i).sparse
            order = names[i % len(names):] + names[:i % len(names)]
            got = {}
            for name in order:
                start = time.perf_counter()
                got[name] = ways[name](kjt)
                if i >= 5:
                    times[name].append(time.perf_counter() - start)
            assert all(torch.equal(got[names[0]], g) for g in got.values())
        p50h = np.percentile(times[names[0]], 50)
        for name in names:
            p50, p99 = np.percentile(times[name], 50), np.percentile(times[name], 99)
            lines.append(f"| {batch_size} | {kjt.values().numel():,} | {name} | {p50 * 1e3:.3f} | {p99 * 1e3:.3f} "
                         f"| {p50 / p50h:.2f} |")
    return lines


def delta_cost(args) -> list[str]:
    rng = np.random.default_rng(0)
    n, dim = args.delta_rows, args.delta_dim
    keys = rng.choice(2**62, size=n, replace=False).astype(np.int64)
    model = freeze(torch.nn.Sequential(FrozenEmbeddingBag(keys, rng.standard_normal((n, dim), np.float32),
                                                          mode="sum")))
    m = n // 100
    lines = [f"table: {n:,} rows x {dim} float32 = {n * dim * 4 / 2**30:.2f} GiB; delta: {m:,} rows (1%)",
             "| delta | apply s | under the lock ms | bytes written |", "|---|---|---|---|"]
    cases = {"1% changed rows": (rng.choice(keys, m, replace=False), np.empty(0, np.int64))}
    live = np.setdiff1d(keys, cases["1% changed rows"][0])
    changed = rng.choice(live, m // 2, replace=False)
    evicted = rng.choice(np.setdiff1d(live, changed), m // 4, replace=False)
    new = rng.integers(2**62, 2**63 - 1, m // 4, dtype=np.int64)
    cases["1%: 1/2 changed, 1/4 new, 1/4 evicted"] = (np.concatenate([changed, new]), evicted)
    for name, (write, removed) in cases.items():
        delta = TableDelta(write, rng.standard_normal((len(write), dim), np.float32), removed)
        start = time.perf_counter()
        report = apply_delta(model, {"0": delta})
        took = time.perf_counter() - start
        lines.append(f"| {name} | {took:.3f} | {report.locked_seconds * 1e3:.2f} | {report.bytes_written:,} |")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=float, default=0.01)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--delta-rows", type=int, default=2_000_000)
    ap.add_argument("--delta-dim", type=int, default=64)
    ap.add_argument("--remaps", action="store_true", help="time the remap layouts alone instead")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(f"load average at start: {os.getloadavg()}")
    if args.remaps:
        print("\n".join(remaps(args)))
    else:
        print("\n".join(latency(args)))
        print("\n".join(delta_cost(args)))
    print(f"load average at end: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

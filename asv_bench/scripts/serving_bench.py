"""Serving latency of the cn-dlrm DLRM, frozen vs live vs TorchRec's QuantEBC, and the cost of a delta.

    python asv_bench/scripts/serving_bench.py [--scale 0.01] [--dim 16] [--requests 200]
                                              [--delta-rows 2000000 | --delta-gib 5] [--delta-dim 64]
                                              [--delta-repeats 3]
                                              [--remaps [--cuckoo-from COMMIT]] [--no-delta]
                                              [--modules [--modules-from COMMIT] [--module-rows N]]

Latency: the job's DLRM (cn_dlrm.train.build_dlrm over the 26 Criteo tables at `--scale` of
their cardinalities, every row the first batches reach inserted), one request = one forward of
a synthetic Criteo batch of B samples (B = 1, 32, 512), one thread, no gradients:

- live: the trained model in eval mode (CNEmbeddingBagCollection, the core's lookup);
- frozen: `cncore_torch.serving.freeze(model)` (the in-graph remap + TorchRec's EBC, float32);
- frozen fp32 TBE: the frozen model after TorchRec's `quantize_embeddings(dtype=torch.float32)`:
  the same float32 rows in FBGEMM's inference TBE (`IntNBitTableBatchedEmbeddingBagsCodegen`,
  QuantEBC's kernel), outputs bit-equal to frozen's;
- frozen int8: the frozen model after TorchRec's `quantize_embeddings(dtype=torch.qint8)`;
- QuantEBC: TorchRec's QuantEmbeddingBagCollection (int8) in the DLRM on IDs remapped to rows
  before the clock starts (what a TorchRec deployment with an external remap pays);
- QuantEBC + remap outside (floor): a copy of that QuantEBC model, a frozen collection's remap
  called on the raw IDs before it, both timed: the least a request with raw IDs can cost with
  this remap, whatever wraps it.

The variants take turns request by request in a rotating order, so a busy neighbour slows all
of them alike; each gets requests of its own from the same generator (a request just run on one
variant would find its rows in the cache on the next). p50 / p99 over `--requests`.

Remap alone (`--remaps`): the frozen collection's ID remap of each request (FBGEMM's pruned-index
hash, one operator call) against two layouts of plain tensor operations, on the same values: one
`searchsorted` over all tables' merged sorted IDs plus a table compare, and one `searchsorted` per
feature over its table's sorted IDs; with `--cuckoo-from 7040fbb`, also the static cuckoo hash of
tensor operations the collections read at that commit, eager and compiled by `torch.compile`
(inductor). All give the same rows (checked on every request).

Modules (`--modules [--modules-from COMMIT]`): one frozen `CNEmbeddingBag` (sum) of
`--module-rows` x `--dim` rows, a request a (B, 8) batch of IDs (B = 1, 32, 512; one in ten
unseen), its forward as `freeze` builds it now (the collections' FBGEMM hash remap) against the
same module at COMMIT (default 79836ae: `torch.searchsorted` over its sorted IDs, read with
`git show`), and each one's remap alone. Same rows, same outputs (checked on every request).

Delta: a frozen table of `--delta-rows` x `--delta-dim` float32 rows, or `--delta-gib` GiB of
them (the issue's 5 GiB table: the delta part alone, no latency table; the frozen module is built
directly from the IDs with its rows drawn in place, so the process holds the table once), and
deltas of 1% of its rows: (a) changed rows only, (b) half changed, a quarter new IDs, a quarter
evicted. Each case `--delta-repeats` times with each way of landing it, in alternating order on the
same model, every delta drawn from the table's IDs at that moment: `apply_delta` now (new and
evicted IDs inserted into the live FBGEMM hash under the lock) and `apply_delta(rebuild=True)`
(the hash rebuilt whole aside, then swapped: what every delta did before). Time of the call
(prepared aside + under the lock), the part under the lock, and the bytes written into the model
(rows, hash entries; or the whole rebuilt hash and the sorted ID arrays); medians. Then the time
of merging the IDs one more in-place delta left pending into the sorted ID arrays (`TableSlots.merge`).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import types

import numpy as np
import torch

from cn_dlrm.data import SyntheticCriteo
from cn_dlrm.train import build_dlrm, prefill_tables, table_configs
from cncore_torch import CNEmbeddingBagCollection
from cncore_torch.serving import FrozenEmbeddingBag, TableDelta, apply_delta, freeze
from cncore_torch.serving.hashmap import lookup

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # asv_bench, for its benchmarks package
from benchmarks.common import delta_ids


def models(args):
    gen = SyntheticCriteo(seed=0, batch_size=512, scale=args.scale)
    ebc = CNEmbeddingBagCollection(tables=table_configs(args.dim, gen.cardinalities))
    rows = prefill_tables(ebc, gen, 50)
    live = build_dlrm(ebc, args.dim).eval()
    frozen = freeze(live)
    from torchrec.inference.modules import quantize_embeddings
    frozen_int8 = quantize_embeddings(freeze(live), dtype=torch.qint8, inplace=False)
    # float32 rows in FBGEMM's inference TBE (QuantEBC's kernel) instead of one nn.EmbeddingBag per table
    frozen_tbe = quantize_embeddings(freeze(live), dtype=torch.float32, inplace=False)
    # TorchRec's own deployment: QuantEBC in the DLRM, IDs remapped before the request
    quant = quantize_embeddings(freeze(live), dtype=torch.qint8, inplace=False)
    remap = quant.sparse_arch.embedding_bag_collection.remap
    quant.sparse_arch.embedding_bag_collection = quant.sparse_arch.embedding_bag_collection.embedding_bag_collection
    variants = {"live": live, "frozen": frozen, "frozen fp32 TBE": frozen_tbe, "frozen int8": frozen_int8,
                "QuantEBC (pre-remapped)": quant}
    return gen, rows, variants, remap


FLOOR = "QuantEBC + remap outside (floor)"


def latency(args) -> list[str]:
    gen, rows, variants, remap = models(args)
    # the floor's own copy of the QuantEBC model and remap: variants sharing rows or a hash would
    # warm each other's cache
    from torchrec.inference.modules import quantize_embeddings
    floor = quantize_embeddings(variants["frozen"], dtype=torch.qint8, inplace=False)
    floor_arch = floor.sparse_arch
    floor_remap = floor_arch.embedding_bag_collection.remap
    floor_arch.embedding_bag_collection = floor_arch.embedding_bag_collection.embedding_bag_collection
    start = time.perf_counter()
    remap.rebuilt({})
    rebuild = time.perf_counter() - start
    lines = [f"DLRM: 26 tables, {rows:,} rows, dim {args.dim}; torch threads 1; the remap's hash rebuilt "
             f"(as a delta does, aside) in {rebuild:.3f} s",
             "| batch | variant | p50 ms | p99 ms | p50 / QuantEBC | p99 / QuantEBC |", "|---|---|---|---|---|---|"]
    for batch_size in (1, 32, 512):
        gen.batch_size = batch_size
        names = [*variants, FLOOR]
        times: dict[str, list[float]] = {name: [] for name in names}
        quant = variants["QuantEBC (pre-remapped)"]
        with torch.no_grad():
            for i in range(args.requests + 5):
                # each variant its own request: one that just ran on another variant would find its
                # IDs' rows (QuantEBC and the floor share their weights) in the cache
                batches = {name: gen.batch(1000 + i * len(names) + k) for k, name in enumerate(names)}
                reference = batches["QuantEBC (pre-remapped)"]
                remapped = remap(reference.sparse)
                order = names[i % len(names):] + names[:i % len(names)]
                for name in order:
                    batch = batches[name]
                    start = time.perf_counter()
                    if name == FLOOR:
                        floor(batch.dense, floor_remap(batch.sparse))
                    elif batch is reference:
                        quant(batch.dense, remapped)
                    else:
                        variants[name](batch.dense, batch.sparse)
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


def _cuckoo_from(commit: str, remap, compiled: bool):
    """The static cuckoo hash of tensor operations the collections read at `commit` (its
    `serving/hashmap.py`, read with `git show`), built over the same tables; `compiled`: its
    lookup through `torch.compile` (inductor, dynamic shapes)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    source = subprocess.run(["git", "show", f"{commit}:frontends/cncore_torch/serving/hashmap.py"], cwd=root,
                            capture_output=True, text=True, check=True).stdout
    old = sys.modules.setdefault("cuckoo_hashmap", types.ModuleType("cuckoo_hashmap"))  # dynamo imports it by name
    exec(compile(source, f"{commit}:hashmap.py", "exec"), old.__dict__)
    names = list(remap.tables)
    built = old.StaticHash([(remap.tables[n].ids.numpy(), remap.tables[n].slots.numpy()) for n in names])
    feature_tables = torch.tensor([names.index(remap.table_of_feature[f]) for f in remap.feature_order])

    def core(values, per_key, entries, params):
        params = torch.repeat_interleave(params.index_select(1, feature_tables), per_key, dim=1,
                                         output_size=values.numel())
        return old.lookup(entries, params, values)
    core = torch.compile(core, dynamic=True) if compiled else core

    def run(kjt):
        per_key = kjt.lengths().view(len(kjt.keys()), -1).sum(dim=1)
        return core(kjt.values(), per_key, built.entries, built.params)
    return run


def remaps(args) -> list[str]:
    gen, _, _, remap = models(args)
    ways = {"FBGEMM pruned hash (freeze's)": _pruned_hash(remap),
            "merged searchsorted": _merged_searchsorted(remap),
            "per-table searchsorted": _per_table_searchsorted(remap)}
    if args.cuckoo_from:
        ways[f"static cuckoo hash ({args.cuckoo_from})"] = _cuckoo_from(args.cuckoo_from, remap, False)
        ways[f"static cuckoo hash ({args.cuckoo_from}), torch.compile"] = compiled = \
            _cuckoo_from(args.cuckoo_from, remap, True)
        start = time.perf_counter()
        for batch_size in (1, 32, 512):    # compiled before the clock: one graph for every size
            gen.batch_size = batch_size
            compiled(gen.batch(batch_size).sparse)
        print(f"torch.compile of the cuckoo lookup: {time.perf_counter() - start:.1f} s")
    lines = ["| batch | IDs / request | remap | p50 ms | p99 ms | p50 / hash | p99 / hash |",
             "|---|---|---|---|---|---|---|"]
    for batch_size in (1, 32, 512):
        gen.batch_size = batch_size
        times: dict[str, list[float]] = {name: [] for name in ways}
        names = list(ways)
        for i in range(args.requests + 5):
            kjt = gen.batch(1000 + i).sparse
            kjt.offsets()   # ready for every layout, as the TBE after the remap reads them anyway
            order = names[i % len(names):] + names[:i % len(names)]
            got = {}
            for name in order:
                start = time.perf_counter()
                got[name] = ways[name](kjt)
                if i >= 5:
                    times[name].append(time.perf_counter() - start)
            assert all(torch.equal(got[names[0]], g) for g in got.values())
        p50h, p99h = (np.percentile(times[names[0]], q) for q in (50, 99))
        for name in names:
            p50, p99 = np.percentile(times[name], 50), np.percentile(times[name], 99)
            lines.append(f"| {batch_size} | {kjt.values().numel():,} | {name} | {p50 * 1e3:.3f} | {p99 * 1e3:.3f} "
                         f"| {p50 / p50h:.2f} | {p99 / p99h:.2f} |")
    return lines


def _module_from(commit: str):
    """`FrozenEmbeddingBag` as `serving/modules.py` and `serving/table.py` were at `commit`."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    def source(name):
        return subprocess.run(["git", "show", f"{commit}:frontends/cncore_torch/serving/{name}"], cwd=root,
                              capture_output=True, text=True, check=True).stdout
    table = sys.modules.setdefault("serving_table_before", types.ModuleType("serving_table_before"))
    exec(compile(source("table.py"), f"{commit}:table.py", "exec"), table.__dict__)
    modules = types.ModuleType("serving_modules_before")
    text = source("modules.py").replace("from cncore_torch.serving.table import", "from serving_table_before import")
    exec(compile(text, f"{commit}:modules.py", "exec"), modules.__dict__)
    return modules.FrozenEmbeddingBag


def modules(args) -> list[str]:
    rng = np.random.default_rng(0)
    n, dim, length = args.module_rows, args.dim, 8
    keys = rng.choice(2**62, size=n, replace=False).astype(np.int64)
    rows = rng.standard_normal((n, dim), np.float32)
    # each variant its own copy of the rows, so neither warms the other's cache
    before = _module_from(args.modules_from)(keys, rows, mode="sum").eval()
    after = FrozenEmbeddingBag(keys, rows, mode="sum").eval()
    remap_before = before.table
    remap_after = after.remap
    ways = {f"module at {args.modules_from} (searchsorted)": before, "module now (FBGEMM hash)": after,
            f"remap alone at {args.modules_from} (searchsorted)": lambda x: remap_before(x.reshape(-1)),
            "remap alone now (FBGEMM hash)":
                lambda x: remap_after.rows(x.reshape(-1), torch.tensor([0, x.numel()], dtype=torch.int64))}
    names = list(ways)
    lines = [f"one table: {n:,} rows x {dim} float32, mode sum, requests (B, {length}) IDs, 10% unseen; "
             f"torch threads 1", "| batch | variant | p50 ms | p99 ms | p50 / now | p99 / now |",
             "|---|---|---|---|---|---|"]
    for batch_size in (1, 32, 512):
        times: dict[str, list[float]] = {name: [] for name in names}
        with torch.no_grad():
            for i in range(args.requests + 5):
                # each variant its own request (one just run on another would find its IDs in the cache)
                requests = {}
                for name in names:
                    ids = rng.choice(keys, (batch_size, length))
                    unseen = rng.random((batch_size, length)) < 0.1
                    ids[unseen] = rng.integers(2**62, 2**63 - 1, int(unseen.sum()), dtype=np.int64)
                    requests[name] = torch.from_numpy(ids)
                got = {}
                for name in names[i % len(names):] + names[:i % len(names)]:
                    start = time.perf_counter()
                    got[name] = ways[name](requests[name])
                    if i >= 5:
                        times[name].append(time.perf_counter() - start)
                if i < 5:       # every variant on one request: the same rows and outputs
                    same = requests[names[0]]
                    assert torch.equal(before(same), after(same))
                    assert torch.equal(remap_before(same.reshape(-1)), ways[names[3]](same))
        ref = {q: np.percentile(times["module now (FBGEMM hash)"], q) for q in (50, 99)}
        for name in names:
            p50, p99 = np.percentile(times[name], 50), np.percentile(times[name], 99)
            lines.append(f"| {batch_size} | {name} | {p50 * 1e3:.3f} | {p99 * 1e3:.3f} | {p50 / ref[50]:.2f} "
                         f"| {p99 / ref[99]:.2f} |")
    return lines


def _big_frozen(keys: np.ndarray, dim: int, seed: int) -> torch.nn.Sequential:
    """A frozen module over `keys` with standard normal rows, drawn into its weight in chunks,
    with the table in memory once: the rows go in as one broadcast zero row (`dense_rows`
    copies them into the weight), and `freeze` (a deep copy) sees a stand-in weight."""
    zero = np.broadcast_to(np.zeros((1, dim), np.float32), (len(keys), dim))
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)   # from_numpy of the read-only broadcast view
        bag = FrozenEmbeddingBag(keys, zero, mode="sum")
    weight, bag.weight = bag.weight, torch.zeros((0, dim))
    model = freeze(torch.nn.Sequential(bag))
    assert isinstance(model, torch.nn.Sequential)  # (freeze keeps the container's class)
    del bag
    model[0].weight = weight
    gen = torch.Generator().manual_seed(seed)
    for at in range(2, weight.shape[0], 1 << 20):
        weight[at:min(at + (1 << 20), weight.shape[0])].normal_(generator=gen)
    return model


def delta_cost(args) -> list[str]:
    rng = np.random.default_rng(0)
    dim = args.delta_dim
    n = int(args.delta_gib * 2**30) // (dim * 4) if args.delta_gib else args.delta_rows
    keys = rng.choice(2**62, size=n, replace=False).astype(np.int64)
    start = time.perf_counter()
    model = _big_frozen(keys, dim, 0)
    del keys
    built = time.perf_counter() - start
    frozen_bag = model[0]
    assert isinstance(frozen_bag, FrozenEmbeddingBag)
    table = frozen_bag.table
    m = n // 100
    lines = [f"table: {n:,} rows x {dim} float32 = {n * dim * 4 / 2**30:.2f} GiB (built in {built:.1f} s); "
             f"delta: {m:,} rows (1%); torch threads {torch.get_num_threads()}; medians of {args.delta_repeats}",
             "| delta | hash | apply s | under the lock ms | bytes written | hash rebuilt |",
             "|---|---|---|---|---|---|"]

    def draw(case: str) -> TableDelta:
        write, removed = delta_ids(rng, table.ids.numpy(), m, case)
        return TableDelta(write, rng.standard_normal((len(write), dim), np.float32), removed)

    ways = {"in place (now)": False, "rebuilt whole (before)": True}
    names = {"changed": "1% changed rows", "mixed": "1%: 1/2 changed, 1/4 new, 1/4 evicted"}
    for case in names:
        got: dict[str, list] = {w: [] for w in ways}
        for i in range(args.delta_repeats):
            order = list(ways) if i % 2 == 0 else list(ways)[::-1]
            for way in order:
                delta = draw(case)
                start = time.perf_counter()
                report = apply_delta(model, {"0": delta}, rebuild=ways[way])
                got[way].append((time.perf_counter() - start, report.locked_seconds, report.bytes_written,
                                 report.hashes_rebuilt))
        for way, runs in got.items():
            took, locked, written, rebuilt = (np.median([r[k] for r in runs]) for k in range(4))
            lines.append(f"| {names[case]} | {way} | {took:.3f} | {locked * 1e3:.2f} | {int(written):,} "
                         f"| {int(rebuilt)} of 1 |")
    apply_delta(model, {"0": draw("mixed")})     # leaves its IDs pending
    pending = sum(len(r) + len(a) for r, a, _ in table.__dict__.get("_pending") or [])
    start = time.perf_counter()
    table.merge()
    lines.append(f"the sorted ID arrays' merge of {pending:,} pending IDs (a delta pays it once per N / 4 IDs its "
                 f"deltas name, or a read of the arrays): {time.perf_counter() - start:.3f} s")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=float, default=0.01)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--delta-rows", type=int, default=2_000_000)
    ap.add_argument("--delta-dim", type=int, default=64)
    ap.add_argument("--delta-gib", type=float, default=None,
                    help="the delta table at this size in GiB instead of --delta-rows; the delta part only")
    ap.add_argument("--delta-repeats", type=int, default=3)
    ap.add_argument("--remaps", action="store_true", help="time the remap layouts alone instead")
    ap.add_argument("--cuckoo-from", metavar="COMMIT", default=None,
                    help="with --remaps: also the static cuckoo hash the collections read at COMMIT (7040fbb), "
                         "eager and through torch.compile")
    ap.add_argument("--modules", action="store_true", help="time one frozen module now and at --modules-from")
    ap.add_argument("--modules-from", metavar="COMMIT", default="79836ae",
                    help="with --modules: the commit whose frozen module is the baseline (searchsorted remap)")
    ap.add_argument("--module-rows", type=int, default=1_000_000)
    ap.add_argument("--no-delta", action="store_true", help="the latency table only")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(f"load average at start: {os.getloadavg()}")
    if args.remaps:
        print("\n".join(remaps(args)))
    elif args.modules:
        print("\n".join(modules(args)))
    elif args.delta_gib:
        print("\n".join(delta_cost(args)))
    else:
        print("\n".join(latency(args)))
        if not args.no_delta:
            print("\n".join(delta_cost(args)))
    print(f"load average at end: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

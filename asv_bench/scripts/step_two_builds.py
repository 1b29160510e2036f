"""The training step of two builds of the core and FBGEMM's TBE in one process: a change to the
C kernels timed against the unchanged build on a shared machine.

Each build's `cncore/_core*.so` (under OLD_DIR and NEW_DIR) is loaded beside the imported
package and gets a store of its own with the same rows; TBE (row-wise Adagrad, float32 rows, as
step_large.py makes it) holds them too. Every round the three take one step (a training lookup,
then the fused backward) on the same IDs and gradient, in a rotating order, each after a flush
of twice the last-level cache. Medians of the rounds after two warm-ups, in microseconds; the
ratios come from the same rounds. At the end both builds' rows are compared bit for bit (a
change that keeps the order of adds must keep them). `--build-order new-first` builds the new
build's store first: on a loaded machine the store built second can run faster (the physical
pages it gets), so run both orders.

    python asv_bench/scripts/step_two_builds.py OLD_DIR NEW_DIR --dist uniform
    THP_MEM_ALLOC_ENABLE=1 python asv_bench/scripts/step_two_builds.py /tmp/old /tmp/new --dim 64

(OLD_DIR/cncore/_core*.so: a build_ext -b OLD_DIR output, or a copy of the .so.)
"""
from __future__ import annotations

import argparse
import glob
import importlib.machinery
import importlib.util
import os
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from benchmarks import machine  # noqa: E402
from benchmarks.common import positions  # noqa: E402


def load_build(path: str):
    """The _core extension under path/cncore/, loaded as a module of its own."""
    so = glob.glob(os.path.join(path, "cncore", "_core*.so"))[0]
    loader = importlib.machinery.ExtensionFileLoader("cncore._core", so)
    spec = importlib.util.spec_from_file_location("cncore._core", so, loader=loader)
    if spec is None:
        raise SystemExit(f"cannot load {so}")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


class using:
    """Route cncore's Python layer to one build's _core for the duration."""

    def __init__(self, module):
        self.module = module

    def __enter__(self):
        import cncore.grouped
        import cncore.store
        self.saved = cncore.store._core
        cncore.store._core = cncore.grouped._core = self.module

    def __exit__(self, *exc):
        import cncore.grouped
        import cncore.store
        cncore.store._core = cncore.grouped._core = self.saved


def huge_page_mib() -> int:
    with open("/proc/self/smaps_rollup") as fh:
        for line in fh:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) >> 10
    return -1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("old")
    p.add_argument("new")
    p.add_argument("--rows", type=float, default=8e6)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--pooling", type=int, default=20)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--dist", default="zipf1.05", help="uniform or zipf<a>")
    p.add_argument("--build-order", choices=["old-first", "new-first"], default="old-first")
    args = p.parse_args(argv)

    import cncore_torch  # noqa: F401  (first: bounds torch's OpenMP spin, as step_large.py does)

    # isort: split
    import torch

    import cncore
    from compare_reference import tbe

    rows, dim, pooling, batch = int(args.rows), args.dim, args.pooling, args.batch
    builds = {"old": load_build(args.old), "new": load_build(args.new)}
    with np.errstate(over="ignore"):
        keys_all = (np.arange(1, rows + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)).view(np.int64)

    def filled(fill):
        gen = np.random.default_rng(0)
        for start in range(0, rows, 1 << 20):
            stop = min(rows, start + (1 << 20))
            fill(start, stop, gen.uniform(-0.05, 0.05, (stop - start, dim)).astype(np.float32))

    stores = {}
    for name in (["old", "new"] if args.build_order == "old-first" else ["new", "old"]):
        with using(builds[name]):
            store = cncore.EmbeddingStore(dim=dim, capacity=rows, optimizer=cncore.RowWiseAdagrad(lr=0.01, eps=1e-8))
            filled(lambda a, b, w, s=store: s.insert_or_assign(keys_all[a:b], w))
        stores[name] = store
    tb = tbe(rows, dim, "rowwise", 0.01)
    with torch.no_grad():
        weight = tb.split_embedding_weights()[0]
        filled(lambda a, b, w: weight[a:b].copy_(torch.from_numpy(w)))
    print(f"# {machine.describe()}; process on huge pages {huge_page_mib()} MiB; "
          f"torch on huge pages: {os.environ.get('THP_MEM_ALLOC_ENABLE') == '1'}", flush=True)

    flush = machine.Flush(2)
    offsets = np.arange(0, batch * pooling + 1, pooling, dtype=np.int64)
    offsets_t = torch.from_numpy(offsets)
    outs = {name: np.empty((batch, dim), np.float32) for name in builds}
    gen = np.random.default_rng(1)
    samples: dict[str, list[float]] = {}
    for r in range(args.rounds + 2):
        pos = positions(args.dist, batch * pooling, rows, gen).astype(np.int64)
        keys = keys_all[pos]
        grad = (gen.standard_normal((batch, dim)) * 1e-3).astype(np.float32)
        order = ["old", "new", "TBE"]
        for name in order[r % 3:] + order[:r % 3]:
            flush()
            if name == "TBE":
                idx_t, grad_t = torch.from_numpy(pos), torch.from_numpy(grad)
                t0 = time.perf_counter()
                y = tb(idx_t, offsets_t)
                t1 = time.perf_counter()
                y.backward(grad_t)
            else:
                with using(builds[name]):
                    t0 = time.perf_counter()
                    _, ctx = stores[name].pooled_lookup(keys, offsets, out=outs[name])
                    t1 = time.perf_counter()
                    stores[name].apply_gradients(ctx, grad)
            t2 = time.perf_counter()
            if r >= 2:
                samples.setdefault(f"fwd {name}", []).append((t1 - t0) * 1e6)
                samples.setdefault(f"bwd {name}", []).append((t2 - t1) * 1e6)
        if not np.array_equal(outs["old"], outs["new"]):
            raise SystemExit(f"the builds' forwards differ by {np.abs(outs['old'] - outs['new']).max()}")
    probe = keys_all[positions(args.dist, 200_000, rows, np.random.default_rng(7))]
    same = np.array_equal(stores["old"].lookup(probe), stores["new"].lookup(probe))
    med = {k: statistics.median(v) for k, v in samples.items()}
    step = {name: med[f"fwd {name}"] + med[f"bwd {name}"] for name in ("old", "new", "TBE")}
    print(f"| {rows / 1e6:g}M x {dim} | {pooling} | {args.dist} | {args.build_order} "
          f"| {med['fwd old']:.0f} | {med['fwd new']:.0f} | {med['fwd TBE']:.0f} "
          f"| {med['bwd old']:.0f} | {med['bwd new']:.0f} | {med['bwd TBE']:.0f} "
          f"| {med['bwd new'] / med['bwd old']:.2f} | {step['TBE'] / step['old']:.2f}x "
          f"| {step['TBE'] / step['new']:.2f}x "
          f"| {'yes' if same else 'NO'} | {machine.load_average()} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

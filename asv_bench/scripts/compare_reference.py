"""One-run comparison of cncore against torch.nn.EmbeddingBag and FBGEMM's CPU TBE.

Prints a Markdown table of throughputs (M IDs/s) and ratios, all measured in this run on the
same rows: 1M rows, dim 64 and 128, batch 4096, pooling 1 and 20, uniform and Zipf(1.05) IDs
(fresh every round), the libraries' default threads; plus insertion of new keys, a stream that
starts from an empty table, and memory per row. The forward on tables far larger than the
cache, and at 16-bit rows, is forward_large.py's.

    python asv_bench/scripts/compare_reference.py            # the full table (a few minutes)
    python asv_bench/scripts/compare_reference.py --quick    # small shapes, a smoke run
    python asv_bench/scripts/compare_reference.py --background-load --table-only   # beside a busy process per core
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
import warnings

import cncore_torch  # noqa: F401  (before torch: bounds torch's OpenMP spin as for a user of our modules)

# isort: split
import numpy as np
import torch

import cncore

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import machine
from benchmarks.common import positions

warnings.filterwarnings("ignore")


# Evicts the caches (twice the last-level cache the machine reports), so that every contender
# starts cold, as a lookup does in a real step (after the dense network and the other tables), and
# none inherits another's warm rows. main() sizes it: a smoke run (--quick) flushes 16 MiB, as it
# checks that every cell prints, not what it measures.
flush_caches = machine.Flush(nbytes=0)


def timed_round_robin(fns: dict, reps: int, warmup: int = 2, before_round=None) -> dict:
    """Median seconds per call of each function, measured in interleaved rounds so that the
    machine's drifting background load hits every contender alike; caches are flushed
    (untimed) before every call, and before_round(r), when given, runs (untimed) before each
    round r (warm-ups included): it draws that round's fresh IDs."""
    for w in range(warmup):
        if before_round is not None:
            before_round(w)
        for fn in fns.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(reps):
        if before_round is not None:
            before_round(warmup + r)
        for name, fn in fns.items():
            flush_caches()
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
    return {name: statistics.median(v) for name, v in samples.items()}


def timed(fn, reps, warmup=2):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def make_ids(dist, n, n_rows, rng):
    """Row positions: "uniform", or "zipf" (Zipf 1.05, hot rows scattered over the table)."""
    return positions(dist, n, n_rows, rng)


def tbe(n_rows, dim, optim, lr, weights=None, precision="fp32"):
    """FBGEMM's training TBE on CPU, one table, sum pooling, float32 output; weights (float32,
    n_rows x dim) copied in when given; optim "sgd", "adagrad" or "rowwise" (EXACT_SGD,
    EXACT_ADAGRAD, EXACT_ROWWISE_ADAGRAD, the ones TBE runs on CPU); precision "fp32" or "fp16"
    (the weights' storage)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )
    kind = {"sgd": EmbOptimType.EXACT_SGD, "adagrad": EmbOptimType.EXACT_ADAGRAD,
            "rowwise": EmbOptimType.EXACT_ROWWISE_ADAGRAD}[optim]
    m = SplitTableBatchedEmbeddingBagsCodegen([(n_rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)],
                                              optimizer=kind, learning_rate=lr, eps=1e-8,
                                              pooling_mode=PoolingMode.SUM,
                                              weights_precision=SparseType(precision),
                                              output_dtype=SparseType.FP32)
    if weights is not None:
        with torch.no_grad():
            m.split_embedding_weights()[0].copy_(weights)
    return m


def tbe_inference(n_rows, dim):
    """FBGEMM's inference TBE on CPU (IntNBitTableBatchedEmbeddingBagsCodegen), one float16
    table, sum pooling, float32 output; its weights are bytes: row i is
    split_embedding_weights()[0][0][i, :2 * dim] (the float16 values' bytes), zero until set."""
    from fbgemm_gpu.split_embedding_configs import SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_inference import IntNBitTableBatchedEmbeddingBagsCodegen
    m = IntNBitTableBatchedEmbeddingBagsCodegen([("t", n_rows, dim, SparseType.FP16, EmbeddingLocation.HOST)],
                                                device="cpu", pooling_mode=PoolingMode.SUM,
                                                output_dtype=SparseType.FP32)
    m.initialize_weights()
    return m


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small shapes, for a smoke test")
    ap.add_argument("--threads", type=int, default=None,
                    help="threads for torch and the core (default: each library's own default)")
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--poolings", type=int, nargs="+", default=[1, 20])
    ap.add_argument("--dists", nargs="+", default=["uniform", "zipf"], choices=["uniform", "zipf"])
    ap.add_argument("--table-only", action="store_true", help="skip insertion, stream and memory")
    ap.add_argument("--background-load", action="store_true",
                    help="measure beside one busy process per core (the threading defaults on a shared machine)")
    args = ap.parse_args(argv)
    with machine.background_load() if args.background_load else contextlib.nullcontext():
        run(args)


def run(args):
    global flush_caches
    flush_caches = machine.Flush(2, nbytes=16 << 20 if args.quick else None)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
        cncore.set_num_threads(args.threads)
    threads = f"threads: torch {torch.get_num_threads()}, cncore {cncore.get_num_threads()}"
    n_rows = 20_000 if args.quick else 1_000_000
    batch = 256 if args.quick else 4096
    dims = [64] if args.quick else args.dims
    poolings = [20] if args.quick else args.poolings
    dists = ["zipf"] if args.quick else args.dists
    reps = 3 if args.quick else args.reps
    rng = np.random.default_rng(0)
    # Raw IDs: arbitrary int64 values, one per dense row, so both sides hold the same rows.
    raw_ids = rng.choice(2**62, n_rows, replace=False).astype(np.int64) * 2 - 2**62
    lr = 0.01

    rows_out = []
    print(f"# cncore vs torch.nn.EmbeddingBag and FBGEMM TBE (CPU), {threads}, {n_rows:,} rows, batch {batch}")
    print(f"# {machine.describe()}; {machine.openmp_wait()}"
          f"{'; background load: one busy process per core' if args.background_load else ''}")
    for dim in dims:
        weights = torch.from_numpy(rng.uniform(-0.05, 0.05, (n_rows, dim)).astype(np.float32))
        stores = {}
        for name, opt in [("sgd", cncore.SGD(lr=lr)), ("rowwise", cncore.RowWiseAdagrad(lr=lr, eps=1e-8))]:
            s = cncore.EmbeddingStore(dim=dim, capacity=n_rows, optimizer=opt)
            s.insert_or_assign(raw_ids, weights.numpy())
            stores[name] = s
        bag = torch.nn.EmbeddingBag(n_rows, dim, mode="sum", sparse=True, include_last_offset=True)
        with torch.no_grad():
            bag.weight.copy_(weights)
        bag_opt = torch.optim.SGD(bag.parameters(), lr=lr)
        tbes = {name: tbe(n_rows, dim, name, lr, weights) for name in ("sgd", "rowwise")}
        for pooling in poolings:
            for dist in dists:
                n = batch * pooling
                cur = {}

                def fresh_ids(r):  # every round, the same fresh batch for every contender
                    cur["idx_np"] = make_ids(dist, n, n_rows, rng).astype(np.int64)
                    cur["idx"] = torch.from_numpy(cur["idx_np"])
                    cur["keys"] = raw_ids[cur["idx_np"]]

                offsets_np = np.arange(0, n + 1, pooling, dtype=np.int64)
                offsets = torch.from_numpy(offsets_np)
                grad_np = rng.standard_normal((batch, dim)).astype(np.float32) * 1e-3
                grad = torch.from_numpy(grad_np)

                def torch_fwd():
                    with torch.no_grad():
                        bag(cur["idx"], offsets)

                fwd_out = np.empty((batch, dim), dtype=np.float32)

                def ours_fwd():
                    stores["sgd"].pooled_lookup(cur["keys"], offsets_np, insert_missing=True, out=fwd_out)

                def torch_step():
                    bag_opt.zero_grad()
                    bag(cur["idx"], offsets).backward(grad)
                    bag_opt.step()

                def tbe_step(name):
                    def run():
                        tbes[name](cur["idx"], offsets).backward(grad)
                    return run

                def ours_step(name):
                    s = stores[name]

                    def run():
                        _, ctx = s.pooled_lookup(cur["keys"], offsets_np)
                        s.apply_gradients(ctx, grad_np)
                    return run

                t = timed_round_robin({
                    "torch_fwd": torch_fwd, "ours_fwd": ours_fwd, "torch_step": torch_step,
                    "tbe_sgd": tbe_step("sgd"), "ours_sgd": ours_step("sgd"),
                    "tbe_rw": tbe_step("rowwise"), "ours_rw": ours_step("rowwise"),
                }, reps, before_round=fresh_ids)
                m = {k: n / v / 1e6 for k, v in t.items()}
                rows_out.append((dim, pooling, dist, m))
        stores = bag = tbes = None  # this dim's tables go before the next dim's are built

    print()
    print("| dim | pooling | IDs | fwd: EB | fwd: ours | ours/EB | step: EB+sparse SGD | TBE SGD | ours SGD "
          "| ours/EB | ours/TBE | TBE rw-Adagrad | ours rw-Adagrad | ours/TBE |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for dim, pooling, dist, m in rows_out:
        print(f"| {dim} | {pooling} | {dist} | {m['torch_fwd']:.1f} | {m['ours_fwd']:.1f} | "
              f"**{m['ours_fwd'] / m['torch_fwd']:.2f}x** | {m['torch_step']:.1f} | {m['tbe_sgd']:.1f} | "
              f"{m['ours_sgd']:.1f} | **{m['ours_sgd'] / m['torch_step']:.2f}x** | "
              f"**{m['ours_sgd'] / m['tbe_sgd']:.2f}x** | {m['tbe_rw']:.1f} | {m['ours_rw']:.1f} | "
              f"**{m['ours_rw'] / m['tbe_rw']:.2f}x** |")
    print("\nThroughputs in M IDs/s (median of the interleaved runs, fresh IDs every round, caches flushed before "
          f"each call; load average at the end {machine.load_average()}); "
          "EB = torch.nn.EmbeddingBag. Our forward "
          "is a training lookup (hash lookup and insertion check included); access counts are recorded by "
          "the backward, inside the step columns.")

    if args.table_only:
        return

    # --- inserting new keys ---------------------------------------------------------------
    n_new = 200_000 if args.quick else 4_000_000
    new_keys = rng.integers(-(2**63), 2**63 - 1, n_new, dtype=np.int64)

    def insert_new():
        s = cncore.EmbeddingStore(dim=64, optimizer=cncore.SGD())
        for part in np.array_split(new_keys, 20):
            s.find_or_insert(part)

    t_insert = timed(insert_new, 3, warmup=1)
    print(f"\nInsert new keys (find_or_insert with initialisation, dim 64, growing from empty): "
          f"{n_new / t_insert / 1e6:.1f} M keys/s")

    # --- a stream from an empty table ---------------------------------------------------------
    steps = 10 if args.quick else 60
    pooling, dim = 20, 64
    space = 10**7
    stream_raw = []
    for _ in range(steps):
        ranks = rng.zipf(1.05, batch * pooling) % space
        with np.errstate(over="ignore"):  # raw 64-bit IDs: the ranks scrambled over all of int64
            stream_raw.append((ranks.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)).view(np.int64))
    uniq, inverse = np.unique(np.concatenate(stream_raw), return_inverse=True)
    remapped = np.split(inverse.astype(np.int64), steps)
    offsets_np = np.arange(0, batch * pooling + 1, pooling, dtype=np.int64)
    offsets = torch.from_numpy(offsets_np)
    grad_np = rng.standard_normal((batch, dim)).astype(np.float32) * 1e-3
    grad = torch.from_numpy(grad_np)

    def stream_ours():
        s = cncore.EmbeddingStore(dim=dim, optimizer=cncore.SGD(lr=lr))
        for ids in stream_raw:
            _, ctx = s.pooled_lookup(ids, offsets_np)
            s.apply_gradients(ctx, grad_np)
        return s

    def stream_torch():
        eb = torch.nn.EmbeddingBag(len(uniq), dim, mode="sum", sparse=True, include_last_offset=True)
        opt = torch.optim.SGD(eb.parameters(), lr=lr)
        for ids in remapped:
            opt.zero_grad()
            eb(torch.from_numpy(ids), offsets).backward(grad)
            opt.step()

    t_stream = timed_round_robin({"ours": stream_ours, "torch": stream_torch}, 3 if not args.quick else 1, warmup=1)
    t_ours, t_torch = t_stream["ours"], t_stream["torch"]
    total = steps * batch * pooling
    print(f"\nStream from an empty table ({steps} steps, pooling {pooling}, dim {dim}, SGD, {len(uniq):,} distinct "
          f"IDs): ours {total / t_ours / 1e6:.1f} M IDs/s, EmbeddingBag on pre-remapped IDs (table preallocated) "
          f"{total / t_torch / 1e6:.1f} M IDs/s: **{t_torch / t_ours:.2f}x**")

    # --- memory per row --------------------------------------------------------------------------
    print("\nMemory per row (nbytes / rows, against dim x 4 + optimizer state):")
    for dim, opt in [(64, cncore.SGD()), (64, cncore.RowWiseAdagrad()), (128, cncore.RowWiseAdagrad())]:
        s = cncore.EmbeddingStore(dim=dim, optimizer=opt)
        for n_rows_m in ([20_000] if args.quick else [700_000, 1_000_000]):
            s.find_or_insert(rng.integers(-(2**63), 2**63 - 1, n_rows_m - len(s), dtype=np.int64))
            payload = (dim + s.config.state_floats) * 4
            print(f"  dim {dim}, {type(opt).__name__}, {len(s):,} rows (load {s.load_factor:.2f}): "
                  f"{s.nbytes / len(s):.0f} B/row = {s.nbytes / len(s) / payload:.3f}x of {payload} B")


if __name__ == "__main__":
    main()

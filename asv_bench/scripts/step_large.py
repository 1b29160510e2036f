"""The training step on tables far larger than the last-level cache: our fused optimizers against
FBGEMM's TBE (SplitTableBatchedEmbeddingBagsCodegen on CPU, float32 rows) with the same optimizer and
hyperparameters (`--optimizer`: row-wise Adagrad by default; SGD and Adagrad too, the fused optimizers
TBE has on CPU: fbgemm_gpu 1.8 refuses ADAM, LAMB, LARS_SGD and PARTIAL_ROWWISE_ADAM in CPU mode and
calls SGD and ROWWISE_ADAGRAD deprecated there, so there is no Adam row), the forward against both
TBE and torch.nn.EmbeddingBag, and every forward against the machine's ceiling: a plain C random-row
gather (sum pooling over a flat float32 array, the rows prefetched 32 IDs ahead, as many threads as
the core uses) over EmbeddingBag's own weight.

All contenders hold the same rows and get the same fresh IDs every round, in a rotating order,
with a buffer twice the last-level cache read and written before every timed call; they run
interleaved in one process, so the machine's drifting load hits each alike and the ratios stay
meaningful on a shared machine. torch allocates its weights on 2 MiB pages only when
THP_MEM_ALLOC_ENABLE=1 is set before it loads (our rows always are): `--thp both` (the default)
runs the whole comparison twice, in two child processes, with and without it, and each table
says which (and how much of the process sits on huge pages).

Cells: M IDs/s (median of the rounds after two warm-ups). `bwd` is the step's time less its
forward's, timed inside the same step. Ratios: ours over the reference, same rows, same IDs, same run.

    python asv_bench/scripts/step_large.py                 # the issue's shapes, torch with and without huge pages
    python asv_bench/scripts/step_large.py --thp on --shapes 8e6:64:20:zipf1.05
    python asv_bench/scripts/step_large.py --thp on --optimizer sgd adagrad rowwise-adagrad
    python asv_bench/scripts/step_large.py --quick         # small shapes, a smoke run
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from benchmarks import machine  # noqa: E402
from benchmarks.common import positions  # noqa: E402

warnings.filterwarnings("ignore")

SHAPES = ["8e6:64:20:zipf1.05", "8e6:64:20:uniform", "8e6:64:1:zipf1.05", "1e6:64:20:zipf1.05",
          "8e6:16:20:zipf1.05", "8e6:16:20:uniform", "4e6:128:20:zipf1.05"]
LR = 0.01
EPS = 1e-8
# Our optimizer and TBE's (compare_reference.tbe's name) for each --optimizer, same lr and eps.
# Element-wise Adagrad doubles the bytes per row (a state float per value) on both sides.
OPTIMIZERS = {"sgd": ("SGD", "sgd"), "adagrad": ("Adagrad", "adagrad"),
              "rowwise-adagrad": ("RowWiseAdagrad", "rowwise")}


def our_optimizer(name: str):
    """cncore's optimizer for --optimizer `name`, with TBE's hyperparameters."""
    import cncore
    cls = getattr(cncore, OPTIMIZERS[name][0])
    return cls(lr=LR) if name == "sgd" else cls(lr=LR, eps=EPS)

# The ceiling: what a forward over a flat array, addressed by row position, reads at best. Sum
# pooling, bags split between threads in two halves, each row prefetched 32 IDs ahead.
GATHER_C = r"""
#include <pthread.h>
#include <stdint.h>
#include <string.h>
typedef struct { const float *w; int64_t dim; const int64_t *idx, *off; float *out; int64_t b0, b1; } job;
static void *run(void *p) {
    const job *j = (const job *)p;
    const int64_t dim = j->dim, lines = (dim * 4 + 63) / 64, end = j->off[j->b1];
    for (int64_t b = j->b0; b < j->b1; b++) {
        float acc[512];
        memset(acc, 0, (size_t)dim * 4);
        for (int64_t i = j->off[b]; i < j->off[b + 1]; i++) {
            if (i + 32 < end) {
                const char *r = (const char *)(j->w + j->idx[i + 32] * dim);
                for (int64_t l = 0; l < lines; l++) __builtin_prefetch(r + 64 * l, 0, 2);
            }
            const float *r = j->w + j->idx[i] * dim;
            for (int64_t d = 0; d < dim; d++) acc[d] += r[d];
        }
        memcpy(j->out + b * dim, acc, (size_t)dim * 4);
    }
    return 0;
}
void gather_pool(const float *w, int64_t dim, const int64_t *idx, const int64_t *off, int64_t n_bags,
                 float *out, int nthreads) {
    job jobs[64];
    pthread_t th[64];
    if (nthreads < 1) nthreads = 1;
    if (nthreads > 64) nthreads = 64;
    for (int t = 0; t < nthreads; t++) {
        jobs[t] = (job){w, dim, idx, off, out, n_bags * t / nthreads, n_bags * (t + 1) / nthreads};
        if (t) pthread_create(&th[t], 0, run, &jobs[t]);
    }
    run(&jobs[0]);
    for (int t = 1; t < nthreads; t++) pthread_join(th[t], 0);
}
"""


def gather_kernel():
    """The ceiling's kernel, compiled here (gcc -O3 -march=native) and loaded with ctypes (whose
    calls release the GIL)."""
    d = tempfile.mkdtemp(prefix="cn_gather_")
    src, lib = os.path.join(d, "gather.c"), os.path.join(d, "gather.so")
    with open(src, "w") as fh:
        fh.write(GATHER_C)
    subprocess.run(["gcc", "-O3", "-march=native", "-shared", "-fPIC", "-pthread", src, "-o", lib], check=True)
    fn = ctypes.CDLL(lib).gather_pool
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                   ctypes.c_void_p, ctypes.c_int]
    return fn


def huge_page_mib() -> int:
    """MiB of this process's anonymous memory on transparent huge pages."""
    try:
        with open("/proc/self/smaps_rollup") as fh:
            for line in fh:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) >> 10
    except OSError:
        pass
    return -1


def table_keys(rows: int) -> np.ndarray:
    """rows distinct int64 keys spread over all of int64 (an odd multiplier permutes 2^64)."""
    with np.errstate(over="ignore"):
        return (np.arange(1, rows + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)).view(np.int64)


class Contenders:
    """The same rows (uniform in +-0.05) in EmbeddingBag, TBE and our store (both with the
    optimizer `optimizer`, an OPTIMIZERS key): ours under table_keys(rows), the references at
    positions 0..rows-1."""

    def __init__(self, rows: int, dim: int, optimizer: str = "rowwise-adagrad", seed: int = 0):
        import torch

        import cncore
        from compare_reference import tbe

        self.rows, self.dim = rows, dim
        self.keys = table_keys(rows)
        self.store = cncore.EmbeddingStore(dim=dim, capacity=rows, optimizer=our_optimizer(optimizer))
        self.eb = torch.nn.EmbeddingBag(rows, dim, mode="sum", include_last_offset=True)
        self.tbe = tbe(rows, dim, OPTIMIZERS[optimizer][1], LR)
        gen = np.random.default_rng(seed)
        chunk = 1 << 20
        with torch.no_grad():
            for start in range(0, rows, chunk):
                stop = min(rows, start + chunk)
                w = gen.uniform(-0.05, 0.05, (stop - start, dim)).astype(np.float32)
                self.store.insert_or_assign(self.keys[start:stop], w)
                self.eb.weight[start:stop] = torch.from_numpy(w)
                self.tbe.split_embedding_weights()[0][start:stop] = torch.from_numpy(w)
        self.weight = self.eb.weight.detach().numpy()
        self.trained = False  # whether TBE's and our rows have taken a step (EmbeddingBag's never do)

    def calls(self, idx: np.ndarray, pooling: int, gather, threads: int) -> dict:
        """For one batch of row positions: a no-argument call per contender, inputs prepared
        here (untimed). The steps return (forward seconds, backward seconds)."""
        import torch
        n = len(idx)
        batch = n // pooling
        offsets_np = np.arange(0, n + 1, pooling, dtype=np.int64)
        idx_t, offsets = torch.from_numpy(idx), torch.from_numpy(offsets_np)
        keys = self.keys[idx]
        grad_np = np.random.default_rng(n).standard_normal((batch, self.dim)).astype(np.float32) * 1e-3
        grad = torch.from_numpy(grad_np)
        out = np.empty((batch, self.dim), np.float32)
        g_out = np.empty((batch, self.dim), np.float32)
        eb, tb, store, w = self.eb, self.tbe, self.store, self.weight

        def eb_fwd():
            with torch.no_grad():
                return eb(idx_t, offsets).numpy()

        def tbe_fwd():
            with torch.no_grad():
                return tb(idx_t, offsets).numpy()

        def ours_fwd():
            return store.pooled_lookup(keys, offsets_np, insert_missing=False, out=out)[0]

        def ceiling():
            gather(w.ctypes.data, self.dim, idx.ctypes.data, offsets_np.ctypes.data, batch, g_out.ctypes.data,
                   threads)
            return g_out

        def tbe_step():
            t0 = time.perf_counter()
            y = tb(idx_t, offsets)
            t1 = time.perf_counter()
            y.backward(grad)
            return t1 - t0, time.perf_counter() - t1

        def ours_step():
            t0 = time.perf_counter()
            _, ctx = store.pooled_lookup(keys, offsets_np)
            t1 = time.perf_counter()
            store.apply_gradients(ctx, grad_np)
            return t1 - t0, time.perf_counter() - t1

        return {"EB fwd": eb_fwd, "TBE fwd": tbe_fwd, "ours fwd": ours_fwd, "gather": ceiling,
                "TBE step": tbe_step, "ours step": ours_step}


def check_same_rows(fns: dict, pooling: int, trained: bool) -> None:
    """The forwards agree (a benchmark reading the wrong rows would go unnoticed): the gather with
    EmbeddingBag (neither trains), ours with TBE (both take the same optimizer's steps on the
    same rows, so they differ by rounding only: within 1e-5 per pooled row, against rows of
    +-0.05 that each step moves by up to lr = 0.01), and before any step TBE with EmbeddingBag."""
    outs = {name: np.asarray(fns[name]()).copy() for name in ("EB fwd", "TBE fwd", "ours fwd", "gather")}
    pairs = [("gather", "EB fwd", 1e-6), ("ours fwd", "TBE fwd", 1e-5 if trained else 1e-6)]
    if not trained:
        pairs.append(("TBE fwd", "EB fwd", 1e-6))
    for name, ref, tol in pairs:
        err = float(np.abs(outs[name] - outs[ref]).max())
        if not err <= pooling * tol + 1e-6:
            raise SystemExit(f"{name}: output differs from {ref}'s by {err:.3g}: not the same rows")


# The smoke run's cache flush: it checks that every cell prints, so it need not evict a large LLC.
SMOKE_FLUSH_BYTES = 16 << 20


def measure(c: Contenders, dist: str, pooling: int, batch: int, rounds: int, flush, gen, gather, threads):
    """Median seconds of each contender (and of the steps' forward and backward parts)."""
    samples: dict[str, list[float]] = {}
    for r in range(rounds + 2):
        fns = c.calls(positions(dist, batch * pooling, c.rows, gen).astype(np.int64), pooling, gather, threads)
        if r == 0:
            check_same_rows(fns, pooling, c.trained)
            c.trained = True
        names = list(fns)
        for name in names[r % len(names):] + names[:r % len(names)]:
            flush()
            t = time.perf_counter()
            parts = fns[name]()
            total = time.perf_counter() - t
            if r < 2:
                continue
            samples.setdefault(name, []).append(total)
            if name.endswith("step"):
                samples.setdefault(name.replace("step", "bwd"), []).append(parts[1])
    return {name: statistics.median(v) for name, v in samples.items()}


COLS = ["EB fwd", "TBE fwd", "ours fwd", "gather", "TBE step", "ours step", "TBE bwd", "ours bwd"]


def header() -> str:
    cols = ["rows", "dim", "pooling", "IDs", "optimizer", *COLS, "fwd ours/EB", "fwd ours/TBE", "fwd ours/gather",
            "EB/gather", "step ours/TBE", "load"]
    return "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols)


def row(rows, dim, pooling, dist, optimizer, t, n_ids) -> str:
    rate = {k: n_ids / v / 1e6 for k, v in t.items()}
    cells = [f"{rows / 1e6:g}M", str(dim), str(pooling), dist, optimizer] + [f"{rate[k]:.3g}" for k in COLS]
    cells += [f"**{rate['ours fwd'] / rate['EB fwd']:.2f}x**", f"**{rate['ours fwd'] / rate['TBE fwd']:.2f}x**",
              f"{rate['ours fwd'] / rate['gather']:.2f}", f"{rate['EB fwd'] / rate['gather']:.2f}",
              f"**{rate['ours step'] / rate['TBE step']:.2f}x**", machine.load_average()]
    return "| " + " | ".join(cells) + " |"


def run(args) -> int:
    import cncore_torch  # noqa: F401  (first: bounds torch's OpenMP spin, as every user of our modules gets it)

    # isort: split
    import torch

    import cncore
    if args.threads is not None:
        torch.set_num_threads(args.threads)
        cncore.set_num_threads(args.threads)
    threads = max(torch.get_num_threads(), cncore.get_num_threads())
    gather = gather_kernel()
    flush = machine.Flush(2, nbytes=SMOKE_FLUSH_BYTES if args.quick else None)
    gen = np.random.default_rng(1)
    thp = os.environ.get("THP_MEM_ALLOC_ENABLE") == "1"
    print(f"# Training step and forward, tables beyond the cache: {machine.describe()}")
    print(f"# torch weights on huge pages: {'yes (THP_MEM_ALLOC_ENABLE=1)' if thp else 'no (4 KiB pages)'}; "
          f"threads: torch {torch.get_num_threads()}, cncore {cncore.get_num_threads()}, gather {threads}; "
          f"batch {args.batch}; {args.rounds} rounds; optimizers {', '.join(args.optimizer)} (lr {LR}, eps {EPS}); "
          f"flush {flush.buf.nbytes >> 20} MiB before every call; "
          f"all contenders interleaved in this one process", flush=True)
    lines = []
    by_table: dict[tuple[int, int], list[tuple[int, str]]] = {}
    for spec in args.shapes:
        rows, dim, pooling, dist = spec.split(":")
        by_table.setdefault((int(float(rows)), int(dim)), []).append((int(pooling), dist))
    for (rows, dim), runs in by_table.items():
        for optimizer in args.optimizer:
            c = Contenders(rows, dim, optimizer)
            print(f"# {rows:,} rows x dim {dim}, {optimizer}: float32 table {rows * dim * 4 / 2**30:.2f} GiB = "
                  f"{rows * dim * 4 / machine.llc_bytes():.1f}x the LLC; process on huge pages "
                  f"{huge_page_mib()} MiB", flush=True)
            for pooling, dist in runs:
                t = measure(c, dist, pooling, args.batch, args.rounds, flush, gen, gather, threads)
                lines.append(row(rows, dim, pooling, dist, optimizer, t, args.batch * pooling))
                print(lines[-1], flush=True)
            del c
            gc.collect()
    print()
    print(header())
    print("\n".join(lines))
    print(f"\nM IDs/s, medians; torch on huge pages: {'yes' if thp else 'no'}. Load average at the end: "
          f"{machine.load_average()}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=SHAPES, help="rows:dim:pooling:ids, ids uniform or zipf<a>")
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--optimizer", nargs="+", default=["rowwise-adagrad"], choices=list(OPTIMIZERS),
                   help="the fused optimizers to compare, each on tables of its own (TBE has no Adam on CPU)")
    p.add_argument("--threads", type=int, default=None, help="threads for torch and the core (default: theirs)")
    p.add_argument("--thp", choices=["on", "off", "both"], default="both",
                   help="torch's weights on 2 MiB pages (THP_MEM_ALLOC_ENABLE=1); both: one child run each")
    p.add_argument("--quick", action="store_true", help="small shapes and few rounds: a smoke run")
    args = p.parse_args(argv)
    if args.quick:
        args.shapes, args.batch, args.rounds = ["2e5:16:20:zipf1.05"], 256, 2
    # torch reads THP_MEM_ALLOC_ENABLE once, when it loads: each setting runs in a child of its own.
    wanted = ["on", "off"] if args.thp == "both" else [args.thp]
    if wanted == ["on" if os.environ.get("THP_MEM_ALLOC_ENABLE") == "1" else "off"]:
        return run(args)
    rest = [a for a in (argv if argv is not None else sys.argv[1:]) if a not in ("--thp", "on", "off", "both")]
    for value in wanted:
        env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
        if value == "on":
            env["THP_MEM_ALLOC_ENABLE"] = "1"
        rc = subprocess.run([sys.executable, os.path.abspath(__file__), *rest, "--thp", value], env=env).returncode
        if rc:
            return rc
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

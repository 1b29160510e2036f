"""The cost of the JAX boundary: `python asv_bench/scripts/jax_boundary.py` prints a Markdown table.

For pooling 1 and 20 (B bags of that many IDs from a vocabulary already in the table), the
median time of
- the bare core call: `store.pooled_lookup` (eval: insert_missing=False), and a training step
  `pooled_lookup` + `apply_gradients` (row-wise Adagrad);
- the same through `cncore_jax` in a jitted function, timed to `block_until_ready` (dispatch,
  the host call, the copies), once through each route (`cncore_jax.set_boundary`): the ordered
  `io_callback` and the XLA FFI call;
- the boundary alone: a jitted ordered `io_callback` that does nothing with the same IDs, and
  an XLA FFI call that does nothing, in C, without Python (compiled here against
  `jax.ffi.include_dir()`, declared with side effects): the floor of each route.
And the whole train step (`measure_steps`): the usual Flax NNX step (the collection's lookup
inside the model, `nnx.value_and_grad` over the model, `nnx.Optimizer`, the tables' update in
the lookup's backward), under `nnx.jit` and under `jax.jit` with `nnx.split` / `nnx.merge`,
against the explicit step on the same model (lookup outside the loss, `jax.value_and_grad`
with respect to the pooled activations, optax, `cj.apply_gradients`).
The functions are measured interleaved, so load from other processes falls on all alike;
FFI columns read "-" where no C++ compiler is found (tests/test_jax_dlrm.py runs `measure` on
small shapes and checks every column).
"""
from __future__ import annotations

import argparse
import ctypes
import functools
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

import cncore
import cncore_jax as cj
from cncore_jax import _ffi

_FFI_SOURCE = r"""
#include "xla/ffi/api/ffi.h"
namespace ffi = xla::ffi;
static ffi::Error Noop(ffi::Buffer<ffi::S64> ids, ffi::ResultBuffer<ffi::F32> out) {
  return ffi::Error::Success();
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(cn_noop, Noop,
    ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::S64>>().Ret<ffi::Buffer<ffi::F32>>());
"""


def _medians_ms(fns: dict[str, Callable[[], object]], repeats: int, number: int) -> dict[str, float]:
    """Median ms per call of each function, measured interleaved (one round of `number` calls of
    each, `repeats` rounds), so that load from other processes falls on all of them alike."""
    for fn in fns.values():  # warm up: compiles, and a first round (the first calls through a
        for _ in range(number):  # route ran slower, whichever pooling was measured first)
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(number):
                fn()
            times[name].append((time.perf_counter() - t0) / number)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


@functools.cache  # a target is registered once per process
def ffi_noop() -> Callable | None:
    """A jitted no-op FFI call over int64 IDs, or None where it cannot be compiled here."""
    if shutil.which("g++") is None:
        return None
    folder = tempfile.mkdtemp(prefix="cncore_jax_ffi_")
    try:  # the build folder goes once the library is loaded (a loaded library outlives its file)
        src, lib = os.path.join(folder, "noop.cc"), os.path.join(folder, "noop.so")
        with open(src, "w") as fh:
            fh.write(_FFI_SOURCE)
        done = subprocess.run(["g++", "-O2", "-std=c++17", "-shared", "-fPIC", f"-I{jax.ffi.include_dir()}", src,
                               "-o", lib], capture_output=True)
        if done.returncode != 0:
            return None
        handler = ctypes.cdll.LoadLibrary(lib).cn_noop
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    jax.ffi.register_ffi_target("cn_noop", jax.ffi.pycapsule(handler), platform="cpu")

    def call(ids, n_bags, dim):
        return jax.ffi.ffi_call("cn_noop", jax.ShapeDtypeStruct((n_bags, dim), jnp.float32),
                                has_side_effect=True)(ids)

    return call


def measure(n_bags: int = 4096, poolings=(1, 20), dim: int = 64, vocab: int = 100_000, repeats: int = 7,
            number: int = 20) -> list[dict[str, float]]:
    jax.config.update("jax_enable_x64", True)
    rng = np.random.default_rng(0)
    ffi = ffi_noop()
    rows = []
    for pooling in poolings:
        store = cncore.EmbeddingStore(dim=dim, optimizer=cncore.RowWiseAdagrad(lr=0.01), capacity=vocab)
        store.find_or_insert(np.arange(vocab))
        table = cj.Table.from_store(store)
        keys = rng.integers(0, vocab, n_bags * pooling)
        lengths = np.full(n_bags, pooling, dtype=np.int64)
        grad = np.ones((n_bags, dim), np.float32)
        ids_j, lengths_j, grad_j = jnp.asarray(keys), jnp.asarray(lengths), jnp.asarray(grad)

        def core_train():
            _, ctx = store.pooled_lookup(keys, lengths=lengths)
            store.apply_gradients(ctx, grad)

        def train_step(i, n, g):
            out, ctx = cj.lookup(table, i, n)
            cj.apply_gradients(ctx, g)
            return out

        cj.set_boundary("callback")
        jax_eval = jax.jit(lambda i, n: cj.lookup(table, i, n, training=False)[0])
        jax_train = jax.jit(train_step)
        if _ffi.available():
            cj.set_boundary("ffi")  # read when tracing: the functions below go through FFI
            ffi_eval = jax.jit(lambda i, n: cj.lookup(table, i, n, training=False)[0])
            ffi_train = jax.jit(train_step)
            ffi_eval(ids_j, lengths_j), ffi_train(ids_j, lengths_j, grad_j)  # trace now
            cj.set_boundary("callback")
        noop = jax.jit(lambda i: io_callback(lambda x: np.zeros((n_bags, dim), np.float32),
                                             jax.ShapeDtypeStruct((n_bags, dim), jnp.float32), i, ordered=True))
        fns = {
            "core_eval_ms": lambda: store.pooled_lookup(keys, lengths=lengths, insert_missing=False),
            "jax_eval_ms": lambda: jax_eval(ids_j, lengths_j).block_until_ready(),
            "core_train_ms": core_train,
            "jax_train_ms": lambda: jax_train(ids_j, lengths_j, grad_j).block_until_ready(),
            "callback_noop_ms": lambda: noop(ids_j).block_until_ready(),
        }
        if _ffi.available():
            fns["ffi_eval_ms"] = lambda: ffi_eval(ids_j, lengths_j).block_until_ready()
            fns["ffi_train_ms"] = lambda: ffi_train(ids_j, lengths_j, grad_j).block_until_ready()
        if ffi is not None:
            ffi_jit = jax.jit(lambda i: ffi(i, n_bags, dim))
            fns["ffi_noop_ms"] = lambda: ffi_jit(ids_j).block_until_ready()
        row = {"pooling": pooling, "ids": len(keys), "ffi_noop_ms": float("nan"), "ffi_eval_ms": float("nan"),
               "ffi_train_ms": float("nan"), **_medians_ms(fns, repeats, number)}
        rows.append(row)
    return rows


def measure_steps(n_bags: int = 2048, n_tables: int = 8, pooling: int = 4, dim: int = 16, vocab: int = 100_000,
                  repeats: int = 7, number: int = 10) -> dict[str, float]:
    """Median ms per train step of the explicit step and the usual NNX step (two ways), on
    `n_tables` tables of `dim` (row-wise Adagrad, every ID already in its table) and a linear
    head (Adagrad): {"explicit_ms", "nnx_jit_ms", "jax_jit_split_ms"}."""
    import optax
    from flax import nnx

    from cncore_jax.modules import EmbeddingBagCollection

    jax.config.update("jax_enable_x64", True)
    rng = np.random.default_rng(0)
    names = [f"t{k}" for k in range(n_tables)]

    def tables():
        out = {}
        for n in names:
            store = cncore.EmbeddingStore(dim=dim, optimizer=cncore.RowWiseAdagrad(lr=0.01), capacity=vocab)
            store.find_or_insert(np.arange(vocab))
            out[n] = cj.Table.from_store(store)
        return out

    class Model(nnx.Module):
        def __init__(self):
            self.ebc = EmbeddingBagCollection(tables())
            self.head = nnx.Linear(n_tables * dim, 1, rngs=nnx.Rngs(0))

        def __call__(self, ids, lengths):
            return self.head(self.ebc(ids, lengths))[:, 0]

    ids = {n: jnp.asarray(rng.integers(0, vocab, n_bags * pooling)) for n in names}
    lengths = {n: jnp.full(n_bags, pooling, jnp.int64) for n in names}
    y = jnp.asarray(rng.random(n_bags) < 0.5, jnp.float32)
    tx = optax.adagrad(0.01)

    def loss_of(model, ids, lengths, y):
        return optax.sigmoid_binary_cross_entropy(model(ids, lengths), y).mean()

    # the usual NNX step, under nnx.jit
    model = Model()
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def nnx_step(model, optimizer, ids, lengths, y):
        loss, grads = nnx.value_and_grad(loss_of)(model, ids, lengths, y)
        optimizer.update(model, grads)
        return loss

    # the same step under jax.jit, the model split once
    graphdef, params, *others = nnx.split(Model(), nnx.Param, ...)
    rest = others[0]
    state = [params, tx.init(params)]

    @jax.jit
    def split_step(params, opt_state, ids, lengths, y):
        loss, grads = jax.value_and_grad(lambda p: loss_of(nnx.merge(graphdef, p, rest), ids, lengths, y))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def run_split():
        state[0], state[1], loss = split_step(state[0], state[1], ids, lengths, y)
        return loss

    # the explicit step: lookup outside the loss, apply_gradients with the pooled gradient
    explicit_tables = list(tables().values())
    head = {"w": jnp.zeros((n_tables * dim, 1)), "b": jnp.zeros(1)}
    explicit_state = [head, tx.init(head)]

    @jax.jit
    def explicit_step(head, opt_state, ids, lengths, y):
        pooled, ctx = cj.grouped_lookup(explicit_tables, [ids[n] for n in names], [lengths[n] for n in names])

        def loss(head, pooled):
            return optax.sigmoid_binary_cross_entropy((pooled @ head["w"] + head["b"])[:, 0], y).mean()

        value, (g_head, g_pooled) = jax.value_and_grad(loss, argnums=(0, 1))(head, pooled)
        updates, opt_state = tx.update(g_head, opt_state, head)
        cj.apply_gradients(ctx, g_pooled)
        return optax.apply_updates(head, updates), opt_state, value

    def run_explicit():
        explicit_state[0], explicit_state[1], loss = explicit_step(explicit_state[0], explicit_state[1], ids,
                                                                   lengths, y)
        return loss

    fns = {"explicit_ms": lambda: run_explicit().block_until_ready(),
           "nnx_jit_ms": lambda: nnx_step(model, optimizer, ids, lengths, y).block_until_ready(),
           "jax_jit_split_ms": lambda: run_split().block_until_ready()}
    result = _medians_ms(fns, repeats, number)
    jax.effects_barrier()
    return result


def steps_table(r: dict[str, float], n_bags: int, n_tables: int, pooling: int, dim: int) -> str:
    load = f", load average {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
    base = r["explicit_ms"]
    return "\n".join([
        f"Train step: B = {n_bags} bags, {n_tables} tables of dim {dim}, pooling {pooling}, row-wise Adagrad on the "
        f"tables, a linear head with Adagrad; median ms per step, measured interleaved ({os.cpu_count()} cores{load})",
        "", "| step | ms | against the explicit step |", "|---|---|---|",
        f"| explicit: lookup outside the loss, `cj.apply_gradients` (jax.jit) | {base:.3f} | 1.00x |",
        f"| usual NNX: `nnx.value_and_grad(loss_fn)(model)`, `nnx.Optimizer`, under `nnx.jit` | "
        f"{r['nnx_jit_ms']:.3f} | {r['nnx_jit_ms'] / base:.2f}x |",
        f"| usual NNX under `jax.jit`, the model split once (`nnx.split` / `nnx.merge`) | "
        f"{r['jax_jit_split_ms']:.3f} | {r['jax_jit_split_ms'] / base:.2f}x |"])


def _over(ms: float, base: float) -> str:
    return "-" if ms != ms else f"{ms:.3f} (+{ms - base:.3f}, {ms / base:.2f}x)"


def table(rows: list[dict[str, float]], n_bags: int, dim: int) -> str:
    load = f", load average {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
    lines = [f"B = {n_bags} bags, dim {dim}, row-wise Adagrad; median ms per call, measured interleaved "
             f"({os.cpu_count()} cores, {cncore.get_num_threads()} core threads{load})", "",
             "| pooling | IDs | call | bare core | JAX, ordered io_callback (+ms, x) | JAX, FFI (+ms, x) |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        head = f"| {r['pooling']} | {r['ids']:,} "
        lines.append(head + f"| eval lookup | {r['core_eval_ms']:.3f} | {_over(r['jax_eval_ms'], r['core_eval_ms'])} "
                            f"| {_over(r['ffi_eval_ms'], r['core_eval_ms'])} |")
        lines.append(head + f"| train step (lookup + fused update) | {r['core_train_ms']:.3f} | "
                            f"{_over(r['jax_train_ms'], r['core_train_ms'])} | "
                            f"{_over(r['ffi_train_ms'], r['core_train_ms'])} |")
        lines.append(head + f"| no-op boundary (nothing but the call) | - | {r['callback_noop_ms']:.3f} | "
                            f"{r['ffi_noop_ms']:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="jax_boundary.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--bags", type=int, default=4096)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--number", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None, help="core threads (default: all cores)")
    ap.add_argument("--steps-only", action="store_true", help="only the train step table (usual NNX vs explicit)")
    args = ap.parse_args(argv)
    if args.threads:
        cncore.set_num_threads(args.threads)
    if not args.steps_only:
        rows = measure(args.bags, (1, 20), args.dim, repeats=args.repeats, number=args.number)
        print(table(rows, args.bags, args.dim))
        print()
    steps = measure_steps(repeats=args.repeats, number=args.number)
    print(steps_table(steps, 2048, 8, 4, 16))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

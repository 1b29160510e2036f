"""A DLRM trained with Flax NNX and optax on growable cncore tables: `python examples/jax_dlrm.py`.

The model and run of `cn-dlrm` (TorchRec's DLRM), written in JAX: 26 tables of dim 16 with
row-wise Adagrad fused in the core (lr 0.05), a dense arch 13 -> 64 -> 16, the pairwise dot
interaction of the 27 vectors, an over arch 367 -> 128 -> 64 -> 1, Adagrad on the dense
network (lr 0.01), binary cross-entropy; 800 batches of 2048 from the synthetic Criteo-like
stream (`jax_criteo.py` beside this file, the same stream as cn-dlrm's for the same seed), evaluated on
the 8 batches after the training range. The tables are configured as cn-dlrm's (TorchRec's
default init bounds, the same per-table seeds), so they start from the same rows.

The model is an `nnx.Module` whose `EmbeddingBagCollection` holds the 26 tables, and the
train step is the usual NNX one: `nnx.value_and_grad(loss_fn)(model)`, then
`optimizer.update(model, grads)` (an `nnx.Optimizer` with optax's Adagrad for the dense
network), under `nnx.jit`. The grouped lookup (one core call for the 26 tables) runs inside
`model.__call__`; the tables' fused update runs in its backward pass, once per step. The
last line printed is ``AUC 0.xxxx``.

>>> main(["--steps", "2", "--batch-size", "64", "--eval-batches", "1", "--no-progress"])  # doctest: +ELLIPSIS
[cncore_jax] step 2: AUC ...
AUC 0...
0
"""
from __future__ import annotations

import argparse
import math
import sys
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax_criteo import N_DENSE, SPARSE_KEYS, SyntheticCriteo

import cncore
import cncore_jax as cj
from cncore_jax.modules import EmbeddingBagCollection

MAX_INITIAL_ROWS = 1 << 16  # as cn-dlrm: tables start at what the run can reach, at most this, and grow


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="jax_dlrm.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--steps", type=int, default=800, help="training batches")
    ap.add_argument("--batch-size", type=int, default=2048, help="samples per batch")
    ap.add_argument("--embedding-dim", type=int, default=16, help="row width of every table")
    ap.add_argument("--sparse-lr", type=float, default=0.05, help="row-wise Adagrad on the tables")
    ap.add_argument("--dense-lr", type=float, default=0.01, help="Adagrad on the dense network")
    ap.add_argument("--eval-every", type=int, default=200, help="evaluate every this many steps")
    ap.add_argument("--eval-batches", type=int, default=8, help="evaluation batches (after the training range)")
    ap.add_argument("--seed", type=int, default=0, help="data and initialisation seed")
    ap.add_argument("--boundary", choices=("callback", "ffi"), default="callback",
                    help="how the jitted step reaches the core: ordered io_callback, or the XLA FFI call")
    ap.add_argument("--save", metavar="DIR", default=None, help="save the tables here at the end (table files)")
    ap.add_argument("--no-progress", action="store_true", help="only evaluations, no progress lines")
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    for name in ("steps", "batch_size", "embedding_dim", "eval_every", "eval_batches"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    for name in ("sparse_lr", "dense_lr"):
        if not 0 < getattr(args, name) < math.inf:
            ap.error(f"--{name.replace('_', '-')} must be a positive number, got {getattr(args, name)}")
    if args.seed < 0:
        ap.error(f"--seed must be >= 0, got {args.seed}")
    return args


# --- tables -------------------------------------------------------------------------------------

def make_tables(args, gen: SyntheticCriteo) -> list[cj.Table]:
    """cn-dlrm's tables: TorchRec's default init (uniform +-sqrt(1 / num_embeddings)), seeds
    derived from (seed, table name) as `cncore_torch.collection.make_stores` does, capacities
    as cn-dlrm's `Data.initial_rows`."""
    reach = gen.items_by_batch(args.steps + args.eval_batches)
    ids_per_feature = (args.steps + args.eval_batches) * args.batch_size
    tables = []
    for key, card, n in zip(SPARSE_KEYS, gen.cardinalities, reach):
        name = f"t_{key}"
        bound = math.sqrt(1.0 / card)
        tables.append(cj.Table(dim=args.embedding_dim, initializer=cncore.Uniform(-bound, bound),
                               optimizer=cncore.RowWiseAdagrad(lr=args.sparse_lr),
                               seed=(args.seed * 1_000_003 + zlib.crc32(name.encode())) % 2**64,
                               capacity=max(1, min(n, ids_per_feature, MAX_INITIAL_ROWS))))
    return tables


# --- the model ----------------------------------------------------------------------------------

def _linear(rng: np.random.Generator, fan_in: int, fan_out: int) -> nnx.Linear:
    """torch.nn.Linear's default init: weight and bias uniform +-1/sqrt(fan_in)."""
    bound = 1.0 / math.sqrt(fan_in)
    layer = nnx.Linear(fan_in, fan_out, rngs=nnx.Rngs(0))
    layer.kernel[...] = jnp.asarray(rng.uniform(-bound, bound, (fan_in, fan_out)), jnp.float32)
    layer.bias[...] = jnp.asarray(rng.uniform(-bound, bound, fan_out), jnp.float32)
    return layer


class DLRM(nnx.Module):
    """TorchRec's DLRM: dense arch (ReLU after every layer), dot interactions of the dense
    vector and the 26 pooled vectors (upper triangle), over arch (ReLU but after the last)."""

    def __init__(self, tables: list[cj.Table], seed: int, dim: int):
        rng = np.random.default_rng([seed, 7])
        n_sparse = len(tables)
        n_inter = (n_sparse + 1) * n_sparse // 2
        self.sparse = EmbeddingBagCollection({f"t_{key}": t for key, t in zip(SPARSE_KEYS, tables)})
        self.dense = nnx.List([_linear(rng, a, b) for a, b in [(N_DENSE, 64), (64, dim)]])
        self.over = nnx.List([_linear(rng, a, b) for a, b in [(dim + n_inter, 128), (128, 64), (64, 1)]])

    def __call__(self, dense, ids, lengths):
        names = self.sparse.names
        pooled = self.sparse(dict(zip(names, ids)), dict(zip(names, lengths)))  # inserts unseen IDs
        x = dense
        for layer in self.dense:
            x = jax.nn.relu(layer(x))
        b, dim = x.shape
        combined = jnp.concatenate([x[:, None, :], pooled.reshape(b, -1, dim)], axis=1)
        inter = jnp.einsum("bid,bjd->bij", combined, combined)
        i, j = np.triu_indices(combined.shape[1], k=1)
        z = jnp.concatenate([x, inter[:, i, j]], axis=1)
        for layer in self.over[:-1]:
            z = jax.nn.relu(layer(z))
        return self.over[-1](z)[:, 0]


def dense_optimizer(lr: float) -> optax.GradientTransformation:
    """torch.optim.Adagrad(lr): accumulator from 0, eps 1e-10 (optax's defaults differ)."""
    return optax.adagrad(lr, initial_accumulator_value=0.0, eps=1e-10)


def loss_fn(model: DLRM, dense, ids, lengths, labels):
    return optax.sigmoid_binary_cross_entropy(model(dense, ids, lengths), labels).mean()


@nnx.jit
def train_step(model: DLRM, optimizer: nnx.Optimizer, dense, ids, lengths, labels):
    loss, grads = nnx.value_and_grad(loss_fn)(model, dense, ids, lengths, labels)  # tables updated here
    optimizer.update(model, grads)                                                 # Adagrad, dense network
    return loss


@nnx.jit
def predict(model: DLRM, dense, ids, lengths):
    return jax.nn.sigmoid(model(dense, ids, lengths))


# --- evaluation ------------------------------------------------------------------------------------

def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve (Mann-Whitney, ties counted half), as torchmetrics' BinaryAUROC."""
    scores, labels = np.asarray(scores, np.float64), np.asarray(labels) > 0.5
    order = np.argsort(scores, kind="mergesort")
    s = scores[order]
    ranks = np.empty(len(s))
    edges = np.flatnonzero(np.diff(s)) + 1
    starts, ends = np.r_[0, edges], np.r_[edges, len(s)]
    ranks[order] = np.repeat((starts + ends + 1) / 2.0, ends - starts)
    pos = labels.sum()
    neg = len(labels) - pos
    if pos == 0 or neg == 0:
        return float("nan")
    return float((ranks[labels].sum() - pos * (pos + 1) / 2) / (pos * neg))


def _arrays(batch):
    return (jnp.asarray(batch.dense), tuple(jnp.asarray(i) for i in batch.ids),
            tuple(jnp.asarray(n) for n in batch.lengths))


def evaluate(model: DLRM, batches):
    model.eval()  # deterministic: the lookups read, insert nothing, update nothing
    probs, labels = [], []
    for b in batches:
        probs.append(np.asarray(predict(model, *_arrays(b))))
        labels.append(b.labels)
    model.train()
    p, y = np.concatenate(probs), np.concatenate(labels)
    eps = 1e-7
    logloss = float(-np.mean(y * np.log(np.clip(p, eps, 1)) + (1 - y) * np.log(np.clip(1 - p, eps, 1))))
    return auc(p, y), logloss


def run(args) -> int:
    jax.config.update("jax_enable_x64", True)  # raw IDs are arbitrary int64 values
    cj.set_boundary(args.boundary)
    gen = SyntheticCriteo(seed=args.seed, batch_size=args.batch_size)
    eval_set = [gen.batch(args.steps + k) for k in range(args.eval_batches)]
    tables = make_tables(args, gen)
    model = DLRM(tables, args.seed, args.embedding_dim)
    optimizer = nnx.Optimizer(model, dense_optimizer(args.dense_lr), wrt=nnx.Param)
    seen, t_train, every = 0, 0.0, max(1, args.steps // 10)
    score = float("nan")
    for step, batch in enumerate(gen.batches(0, args.steps), start=1):
        t0 = time.perf_counter()
        loss = train_step(model, optimizer, *_arrays(batch), jnp.asarray(batch.labels))
        loss = float(loss)  # waits for the step, so samples/s times whole steps, as cn-dlrm's does
        t_train += time.perf_counter() - t0
        seen += args.batch_size
        if not args.no_progress and (step % every == 0 or step == args.steps):
            print(f"[cncore_jax] step {step}/{args.steps}: loss {loss:.4f}, {seen / t_train:,.0f} samples/s",
                  file=sys.stderr, flush=True)
        if step % args.eval_every == 0 or step == args.steps:
            score, logloss = evaluate(model, eval_set)
            rows = sum(len(t) for t in tables)
            print(f"[cncore_jax] step {step}: AUC {score:.4f}, log loss {logloss:.4f}, {rows:,} rows, "
                  f"{seen / t_train:,.0f} samples/s", flush=True)
    if args.save:
        import os
        os.makedirs(args.save, exist_ok=True)
        for key, table in zip(SPARSE_KEYS, tables):
            table.save(os.path.join(args.save, f"t_{key}"))
    print(f"AUC {score:.4f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())

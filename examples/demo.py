"""A short NumPy-only training run on a growing table (`make demo`): the library without PyTorch.

A click model over a stream whose item IDs are raw 64-bit values, with new items appearing
every batch: one store holds a row per item, a logistic regression reads the sum-pooled rows
of each sample's items, and the store's fused row-wise Adagrad updates the rows in backward.

    python examples/demo.py --steps 200
"""
from __future__ import annotations

import argparse
import time

import numpy as np

import cncore


def synthetic_stream(rng, batch, items_per_sample, n_steps, dim):
    """Batches of (item IDs, labels); each item has a hidden taste vector that sets the label."""
    hidden_user = rng.standard_normal(dim)
    for step in range(n_steps):
        # Zipf-popular items, with the catalogue drifting: later steps see newer item ranges.
        ranks = rng.zipf(1.2, batch * items_per_sample) + step * 50
        ids = (ranks.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)).view(np.int64)
        taste = np.sin(ranks[:, None] * np.arange(1, dim + 1)[None, :] * 0.37)  # a fixed function of the item
        logits = (taste @ hidden_user).reshape(batch, items_per_sample).mean(axis=1)
        labels = (rng.random(batch) < 1 / (1 + np.exp(-2 * logits))).astype(np.float32)
        yield ids, labels


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    rng = np.random.default_rng(args.seed)
    store = cncore.EmbeddingStore(dim=args.dim, seed=args.seed, initializer=cncore.Normal(0, 0.01),
                                  optimizer=cncore.RowWiseAdagrad(lr=0.2))
    w = np.zeros(args.dim, dtype=np.float32)
    items = 8
    lengths = np.full(args.batch, items, dtype=np.int64)
    losses, start = [], time.perf_counter()
    for step, (ids, labels) in enumerate(synthetic_stream(rng, args.batch, items, args.steps, 8)):
        pooled, ctx = store.pooled_lookup(ids, lengths=lengths, mode="mean")
        p = 1 / (1 + np.exp(-(pooled @ w)))
        loss = -np.mean(labels * np.log(p + 1e-7) + (1 - labels) * np.log(1 - p + 1e-7))
        d_logit = ((p - labels) / args.batch).astype(np.float32)
        grad_pooled = np.outer(d_logit, w).astype(np.float32)
        w -= 0.5 * (pooled.T @ d_logit)
        store.apply_gradients(ctx, grad_pooled)
        losses.append(loss)
        if step % 50 == 0 or step == args.steps - 1:
            rate = (step + 1) * args.batch * items / (time.perf_counter() - start)
            print(f"step {step:4d}  loss {np.mean(losses[-50:]):.4f}  rows {len(store):8,d}  "
                  f"{store.nbytes / 2**20:7.1f} MiB  {rate / 1e6:5.2f} M IDs/s")
    print(f"done: {len(store):,} rows after {args.steps} steps; loss {np.mean(losses[:20]):.4f} -> "
          f"{np.mean(losses[-20:]):.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Seeded data for every benchmark, in one place.

CNCORE_ASV_SMOKE=1 (set by the test that runs every benchmark once) shrinks the tables so the
smoke run is quick; every benchmark and parameter still runs.
"""
import os

import numpy as np

import cncore

SMOKE = os.environ.get("CNCORE_ASV_SMOKE") == "1"
N_ROWS = 20_000 if SMOKE else 1_000_000
BATCH = 256 if SMOKE else 4096
THREADS = 2


def rng(seed=0):
    return np.random.default_rng(seed)


def raw_keys(n, seed=0):
    """n distinct arbitrary int64 IDs."""
    return rng(seed).choice(2**62, n, replace=False).astype(np.int64) * 2 - 2**62


def positions(dist, n, n_rows, gen):
    """n row positions in 0..n_rows-1 drawn by `gen` (a numpy Generator): "uniform", or
    "zipf<a>" (Zipf-skewed popularity with exponent a, "zipf" meaning 1.05, the skew of real
    recommendation IDs). Zipf ranks past the table are redrawn, not folded onto the hot head,
    and ranks are scattered over the table (a bijection), so hot rows are not neighbours."""
    if dist == "uniform":
        return gen.integers(0, n_rows, n)
    if not dist.startswith("zipf"):
        raise ValueError(f"unknown ID distribution {dist!r}: use 'uniform' or 'zipf<exponent>'")
    a = float(dist[len("zipf"):] or 1.05)
    ranks = np.empty(0, np.int64)
    while len(ranks) < n:
        r = gen.zipf(a, 2 * (n - len(ranks)) + 16) - 1
        ranks = np.concatenate([ranks, r[r < n_rows]])
    return (ranks[:n] * _SCATTER) % n_rows


_SCATTER = 2654435761  # a prime: multiplying by it permutes 0..n_rows-1 unless it divides n_rows


def zipf_positions(n, n_rows, seed=1):
    return positions("zipf1.05", n, n_rows, rng(seed))


OPTIMIZERS = {
    "sgd": cncore.SGD(lr=0.01),
    "rowwise_adagrad": cncore.RowWiseAdagrad(lr=0.01),
    "adagrad": cncore.Adagrad(lr=0.01),
    "adam": cncore.Adam(lr=0.001),
}


def filled_store(dim, optimizer="sgd", n_rows=None, seed=0):
    """A store holding n_rows rows under raw_keys(n_rows, seed), and those keys."""
    n_rows = N_ROWS if n_rows is None else n_rows
    cncore.set_num_threads(THREADS)
    keys = raw_keys(n_rows, seed)
    store = cncore.EmbeddingStore(dim=dim, capacity=n_rows, optimizer=OPTIMIZERS[optimizer])
    store.find_or_insert(keys)
    return store, keys


def bags(keys, pooling, batch=None, seed=2):
    """A batch of `batch` bags of `pooling` keys drawn Zipf-skewed from `keys`."""
    batch = BATCH if batch is None else batch
    picked = keys[zipf_positions(batch * pooling, len(keys), seed)]
    offsets = np.arange(0, batch * pooling + 1, pooling, dtype=np.int64)
    return picked, offsets

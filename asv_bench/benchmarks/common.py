"""Seeded data for every benchmark, in one place, and the rules that keep timings honest.

CNCORE_ASV_SMOKE=1 (set by the test that runs every benchmark once) shrinks the tables so the
smoke run is quick; every benchmark and parameter still runs.

Lookups are timed cold, as they run in a training step (after the dense network and the other
tables): asv (0.6) runs a benchmark's setup before every timed call, and the setups of the
lookup benchmarks draw a fresh batch of IDs (fresh_bags) and end with flush(), which evicts the
last-level cache. N_ROWS is the 1M-row shape kept for continuity; LARGE_ROWS is far beyond the
cache (bench_large.py).
"""
import os

import numpy as np

import cncore

from . import machine

SMOKE = os.environ.get("CNCORE_ASV_SMOKE") == "1"
N_ROWS = 20_000 if SMOKE else 1_000_000
# A float32 table of dim 64 32 times the last-level cache (4M rows, 1 GiB, for a 32 MiB LLC), at
# most an eighth of the memory available.
LARGE_ROWS = 20_000 if SMOKE else min(32 * machine.llc_bytes() // 256, machine.available_memory() // 8 // 300)
BATCH = 256 if SMOKE else 4096
THREADS = 2


def rng(seed=0):
    return np.random.default_rng(seed)


def delta_ids(gen, held, m, case):
    """The IDs of a serving delta of m rows over a table holding `held`, drawn by `gen`:
    "changed" (m held IDs rewritten, none removed), else half rewritten, a quarter new (above
    2**62, so never held) and a quarter removed. Returns (written IDs, removed IDs)."""
    if case == "changed":
        return gen.choice(held, m, replace=False), np.empty(0, np.int64)
    picked = gen.choice(held, m // 2 + m // 4, replace=False)
    new = gen.integers(2**62, 2**63 - 1, m // 4, dtype=np.int64)
    return np.concatenate([picked[:m // 2], new]), picked[m // 2:]


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


_FRESH = rng(5)


def fresh_bags(keys, pooling, dist="zipf1.05", batch=None):
    """Like bags, but a new batch every call (one seeded stream for the process), so no timed
    call finds the rows of the previous one in cache."""
    batch = BATCH if batch is None else batch
    picked = keys[positions(dist, batch * pooling, len(keys), _FRESH)]
    return picked, np.arange(0, batch * pooling + 1, pooling, dtype=np.int64)


_FLUSH: list[machine.Flush] = []


def flush():
    """Read and write a buffer twice the last-level cache (allocated on first use)."""
    if not _FLUSH:
        _FLUSH.append(machine.Flush(2))
    _FLUSH[0]()


_SHARED: dict[tuple, tuple[cncore.EmbeddingStore, np.ndarray]] = {}


def shared_store(dim, n_rows=None, dtype="float32", optimizer="sgd"):
    """A store of n_rows rows (OPTIMIZERS[optimizer]) under raw_keys(n_rows), and those keys,
    built once per process and kept, for benchmarks that do not change rows or whose updates
    leave their timing alone (a training step on it). Only the last one asked for is kept, so
    two large tables never sit in memory together."""
    n_rows = N_ROWS if n_rows is None else n_rows
    spec = (dim, n_rows, dtype, optimizer)
    if spec not in _SHARED:
        _SHARED.clear()
        cncore.set_num_threads(THREADS)
        keys = raw_keys(n_rows)
        store = cncore.EmbeddingStore(cncore.StoreConfig(dim=dim, dtype=dtype, capacity=n_rows,
                                                         optimizer=OPTIMIZERS[optimizer]))
        for part in np.array_split(keys, max(1, n_rows >> 20)):
            store.find_or_insert(part)
        _SHARED[spec] = (store, keys)
    return _SHARED[spec]

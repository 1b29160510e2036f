"""A deterministic, streaming Criteo-like data generator in NumPy: the data of the DLRM jobs
(`cn-dlrm`, `examples/jax_dlrm.py`) and of benchmarks, framework-neutral so every front
end trains on the same stream (each wraps `arrays(i)` in its own types).

Every batch is drawn from (seed, batch index) alone, so a run is reproducible and resumable at
any batch. Each of the 26 categorical features has a Criteo-like (scaled-down) cardinality,
Zipf-skewed popularity, items that drift (new IDs keep appearing), at most one ID per sample
(2 % missing) and raw IDs that are arbitrary 64-bit values. Labels come from a hidden logistic
model over per-item effects and the 13 dense features, so the best attainable AUC (that of the
true probabilities) is known.

>>> gen = SyntheticCriteo(seed=0, batch_size=4)
>>> a = gen.arrays(0)
>>> a.dense.shape, len(a.values), a.lengths.shape, a.labels.shape
((4, 13), 26, (26, 4), (4,))
>>> bool(all((x == y).all() for x, y in zip(gen.arrays(0).values, a.values)))   # a pure function of (seed, i)
True
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["SyntheticCriteo", "CriteoArrays", "N_DENSE", "N_SPARSE", "SPARSE_KEYS", "DENSE_KEYS",
           "CRITEO_CARDINALITIES"]

N_DENSE, N_SPARSE = 13, 26
SPARSE_KEYS = [f"cat_{i}" for i in range(N_SPARSE)]
DENSE_KEYS = [f"int_{i}" for i in range(N_DENSE)]
# Criteo Kaggle cardinalities; the generator's default scale is 1/100 of them (at least 3).
CRITEO_CARDINALITIES = [1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27,
                        14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572]


@dataclass
class CriteoArrays:
    """One batch of B samples as NumPy arrays."""
    dense: np.ndarray          # (B, 13) float32, log(1 + count)
    values: list[np.ndarray]   # 26 arrays of int64 raw IDs: feature f's present IDs, in sample order
    lengths: np.ndarray        # (26, B) int64, 0 or 1: how many IDs sample b has in feature f
    labels: np.ndarray         # (B,) float32
    probabilities: np.ndarray  # (B,) float32, the hidden model's click probability


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on uint64 arrays (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


class SyntheticCriteo:
    """Criteo-like batches; `arrays(i)` is a pure function of (seed, i). Front ends subclass it
    and add `batch(i)` in their own types."""

    def __init__(self, seed: int = 0, batch_size: int = 2048, scale: float = 0.01, zipf_alpha: float = 1.2,
                 drift_per_batch: float = 2.0, missing_rate: float = 0.02, signal: float = 1.0):
        self.seed, self.batch_size = seed, batch_size
        self.cardinalities = [max(3, int(c * scale)) for c in CRITEO_CARDINALITIES]
        self.alpha, self.drift, self.missing_rate, self.signal = zipf_alpha, drift_per_batch, missing_rate, signal
        hidden = np.random.default_rng([seed, 10**6])
        self.dense_weights = hidden.normal(0, 0.3, N_DENSE)
        self.feature_scale = hidden.uniform(0.2, 1.0, N_SPARSE)
        self.bias = -1.2

    def _item_effect(self, feature: int, items: np.ndarray) -> np.ndarray:
        """The hidden per-item effect: N(0, 1)-like, a pure function of (seed, feature, item)."""
        h = _mix(items.astype(np.uint64) ^ np.uint64((self.seed * 1_000_003 + feature * 7919) & 0xFFFFFFFFFFFF))
        u1 = ((h >> np.uint64(40)).astype(np.float64) + 1) / 2.0**24
        u2 = ((h & np.uint64(0xFFFFFF)).astype(np.float64)) / 2.0**24
        return np.sqrt(-2 * np.log(u1)) * np.cos(2 * np.pi * u2)

    def _raw_id(self, feature: int, items: np.ndarray) -> np.ndarray:
        return _mix(items.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(feature + 1)).view(np.int64)

    def arrays(self, index: int) -> CriteoArrays:
        """Batch `index` as NumPy arrays."""
        rng = np.random.default_rng([self.seed, index])
        b = self.batch_size
        counts = np.floor(rng.lognormal(1.0, 1.5, (b, N_DENSE))).astype(np.float32)
        dense = np.log1p(counts)
        logit = self.bias + dense @ self.dense_weights / 3.0
        values, lengths = [], np.zeros((N_SPARSE, b), dtype=np.int64)
        for f, card in enumerate(self.cardinalities):
            rank = (rng.zipf(self.alpha, b) - 1) % card
            # Drift: popularity slides towards newer items, so new IDs keep arriving.
            items = rank + int(self.drift * index * card / 1000)
            present = rng.random(b) >= self.missing_rate
            logit += self.signal * self.feature_scale[f] * self._item_effect(f, items) * present / np.sqrt(N_SPARSE / 4)
            values.append(self._raw_id(f, items[present]))
            lengths[f] = present
        p = 1 / (1 + np.exp(-logit))
        labels = (rng.random(b) < p).astype(np.float32)
        return CriteoArrays(dense, values, lengths, labels, p.astype(np.float32))

    def items_by_batch(self, n_batches: int) -> list[int]:
        """How many item indices each feature can reach within n_batches (0 .. n-1)."""
        return [card + int(self.drift * (n_batches - 1) * card / 1000) for card in self.cardinalities]

    def raw_ids(self, feature: int, n_items: int, start: int = 0) -> np.ndarray:
        """The raw IDs of items start .. n_items-1 of a feature (for collision-free baselines and
        for prefilled tables)."""
        return self._raw_id(feature, np.arange(start, n_items))

"""The synthetic Criteo-like stream of `cn-dlrm` (`cncore.synthetic`, shared by the front ends)
with each feature's IDs padded to one shape, as jit wants: the data of `jax_dlrm.py`.

`batch(i)` is a pure function of (seed, i). Each of the 26 features has at most one ID per
sample (2% missing): `ids[f]` holds the present IDs first and padding after them, so every batch
has one shape.

>>> gen = SyntheticCriteo(seed=0, batch_size=4)
>>> b = gen.batch(0)
>>> b.dense.shape, len(b.ids), b.ids[0].shape, b.lengths.shape, b.labels.shape
((4, 13), 26, (4,), (26, 4), (4,))
>>> bool((gen.batch(0).ids[3] == b.ids[3]).all())   # a pure function of (seed, index)
True
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from cncore import synthetic
from cncore.synthetic import CRITEO_CARDINALITIES, N_DENSE, N_SPARSE, SPARSE_KEYS  # noqa: F401


@dataclass
class Batch:
    dense: np.ndarray          # (B, 13) float32, log(1 + count)
    ids: list[np.ndarray]      # 26 arrays (B,) int64: the present IDs, then zeros (padding)
    lengths: np.ndarray        # (26, B) int64, 0 or 1: the bag of sample b in feature f
    labels: np.ndarray         # (B,) float32
    probabilities: np.ndarray  # (B,) float32, the hidden model's click probability


class SyntheticCriteo(synthetic.SyntheticCriteo):
    """`cncore.synthetic.SyntheticCriteo` with padded per-feature IDs."""

    def batch(self, index: int) -> Batch:
        a = self.arrays(index)
        ids = []
        for raw in a.values:
            padded = np.zeros(self.batch_size, dtype=np.int64)
            padded[:len(raw)] = raw
            ids.append(padded)
        return Batch(a.dense, ids, a.lengths, a.labels, a.probabilities)

    def batches(self, start: int = 0, stop: int | None = None) -> Iterator[Batch]:
        i = start
        while stop is None or i < stop:
            yield self.batch(i)
            i += 1

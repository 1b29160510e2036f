"""Data for the DLRM job: a deterministic, streaming Criteo-like generator, and a reader of the
Criteo Kaggle / 1TB text format. Both yield `Batch`es of 13 dense and 26 categorical features.

The generator draws every batch from (seed, batch index) alone, so a run is reproducible and
resumable at any batch. Each categorical feature has a Criteo-like (scaled-down) cardinality,
Zipf-skewed popularity, items that drift (new IDs keep appearing), and raw IDs that are
arbitrary 64-bit values. Labels come from a hidden logistic model over per-item effects and the
dense features, so the best attainable AUC (that of the true probabilities) is known.

>>> gen = SyntheticCriteo(seed=0, batch_size=4)
>>> b = gen.batch(0)
>>> b.dense.shape, len(b.sparse.keys()), b.labels.shape
(torch.Size([4, 13]), 26, torch.Size([4]))
>>> bool((gen.batch(0).sparse.values() == b.sparse.values()).all())   # a pure function of (seed, index)
True
"""
from __future__ import annotations

import gzip
from dataclasses import dataclass
from typing import Iterator, List, Optional

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

N_DENSE, N_SPARSE = 13, 26
SPARSE_KEYS = [f"cat_{i}" for i in range(N_SPARSE)]
DENSE_KEYS = [f"int_{i}" for i in range(N_DENSE)]
# Criteo Kaggle cardinalities, the generator's default scale is 1/100 of them (at least 3).
CRITEO_CARDINALITIES = [1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27,
                        14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572]
M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


@dataclass
class Batch:
    dense: torch.Tensor         # (B, 13) float32, log(1 + count)
    sparse: KeyedJaggedTensor   # 26 keys, raw int64 IDs, one ID per sample and feature (empty allowed)
    labels: torch.Tensor        # (B,) float32
    probabilities: Optional[torch.Tensor] = None  # the hidden model's click probability (synthetic data)


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on uint64 arrays (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


class SyntheticCriteo:
    """Criteo-like batches; `batch(i)` is a pure function of (seed, i)."""

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

    def batch(self, index: int) -> Batch:
        rng = np.random.default_rng([self.seed, index])
        b = self.batch_size
        counts = np.floor(rng.lognormal(1.0, 1.5, (b, N_DENSE))).astype(np.float32)
        dense = np.log1p(counts)
        logit = self.bias + dense @ self.dense_weights / 3.0
        values, lengths = [], []
        for f, card in enumerate(self.cardinalities):
            rank = (rng.zipf(self.alpha, b) - 1) % card
            # Drift: popularity slides towards newer items, so new IDs keep arriving.
            items = rank + int(self.drift * index * card / 1000)
            present = rng.random(b) >= self.missing_rate
            logit += self.signal * self.feature_scale[f] * self._item_effect(f, items) * present / np.sqrt(N_SPARSE / 4)
            values.append(self._raw_id(f, items[present]))
            lengths.append(present.astype(np.int64))
        p = 1 / (1 + np.exp(-logit))
        labels = (rng.random(b) < p).astype(np.float32)
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=SPARSE_KEYS, values=torch.from_numpy(np.concatenate(values)),
                                                  lengths=torch.from_numpy(np.concatenate(lengths)))
        return Batch(torch.from_numpy(dense), kjt, torch.from_numpy(labels), torch.from_numpy(p.astype(np.float32)))

    def items_by_batch(self, n_batches: int) -> List[int]:
        """How many item indices each feature can reach within n_batches (0 .. n-1)."""
        return [card + int(self.drift * (n_batches - 1) * card / 1000) for card in self.cardinalities]

    def raw_ids(self, feature: int, n_items: int) -> np.ndarray:
        """The raw IDs of items 0 .. n_items-1 of a feature (for collision-free baselines)."""
        return self._raw_id(feature, np.arange(n_items))

    def batches(self, start: int = 0, stop: Optional[int] = None) -> Iterator[Batch]:
        i = start
        while stop is None or i < stop:
            yield self.batch(i)
            i += 1


class InputError(ValueError):
    """Bad input data (a Criteo file, a checkpoint): `cn-dlrm` prints the message as one line and
    exits with code 2. Raised while training too, since the file is read as the run goes."""


def read_criteo_tsv(path: str, batch_size: int, skip_batches: int = 0) -> Iterator[Batch]:
    r"""Stream a Criteo Kaggle / 1TB text file (optionally .gz): label (0 or 1), 13 integers, 26
    hex categories per line, tab-separated, empty fields allowed. Categories become raw IDs (their
    hex value, up to 64 bits; values of 2^63 and above wrap to negative int64, which are valid
    keys); an empty category is an empty bag; an empty or negative integer reads as 0 (Criteo's
    second column has negative values). A line that breaks these rules raises `InputError`
    naming the file and the line.

    >>> import tempfile
    >>> with tempfile.NamedTemporaryFile("w", suffix=".tsv", delete=False) as fh:
    ...     _ = fh.write("1\t5" + "\t" * 13 + "\t".join(["ff"] * 26) + "\n" + "2" + "\t" * 39 + "\n")
    >>> next(read_criteo_tsv(fh.name, batch_size=1)).labels.tolist()
    [1.0]
    >>> list(read_criteo_tsv(fh.name, batch_size=1))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    cncore_torch.dlrm.data.InputError: ...tsv, line 2: the label is '2', it must be 0 or 1
    """
    opener = gzip.open if path.endswith(".gz") else open
    line_no = 0
    try:
        with opener(path, "rt", encoding="utf-8") as fh:
            lines: List[str] = []
            n_batches = 0
            for line in fh:
                line_no += 1
                lines.append(line)
                if len(lines) == batch_size:
                    if n_batches >= skip_batches:
                        yield _parse(lines, path, line_no - len(lines) + 1)
                    n_batches += 1
                    lines = []
            if lines and n_batches >= skip_batches:
                yield _parse(lines, path, line_no - len(lines) + 1)
    except UnicodeDecodeError as e:
        raise InputError(f"{path}, line {line_no + 1}: not UTF-8 text ({e.reason})") from None
    except (OSError, EOFError) as e:  # gzip.BadGzipFile is an OSError; a cut-off .gz ends in EOFError
        raise InputError(f"{path}: cannot read it after line {line_no}: {e}") from None


N_FIELDS = 1 + N_DENSE + N_SPARSE


def _parse(lines: List[str], path: str, first_line: int) -> Batch:
    b = len(lines)
    labels = np.zeros(b, dtype=np.float32)
    dense = np.zeros((b, N_DENSE), dtype=np.float32)
    per_feature: List[List[int]] = [[] for _ in range(N_SPARSE)]
    lengths = np.zeros((N_SPARSE, b), dtype=np.int64)
    for row, line in enumerate(lines):
        fields = line.rstrip("\r\n").split("\t")

        def bad(what: str) -> InputError:
            return InputError(f"{path}, line {first_line + row}: {what}")

        if len(fields) != N_FIELDS:
            raise bad(f"{len(fields)} tab-separated fields, a Criteo line has {N_FIELDS} "
                      f"(label, {N_DENSE} integers, {N_SPARSE} hex categories)")
        if fields[0] not in ("0", "1"):
            raise bad(f"the label is {fields[0][:20]!r}, it must be 0 or 1")
        labels[row] = float(fields[0])
        for j in range(N_DENSE):
            v = fields[1 + j]
            if v:
                try:
                    dense[row, j] = np.log1p(max(int(v), 0))
                except ValueError:
                    raise bad(f"integer feature {j + 1} is {v[:20]!r}, not a whole number") from None
        for f in range(N_SPARSE):
            v = fields[1 + N_DENSE + f]
            if v:
                try:
                    value = int(v, 16)
                except ValueError:
                    raise bad(f"category {f + 1} is {v[:20]!r}, not a hex number") from None
                if not 0 <= value < 1 << 64:
                    raise bad(f"category {f + 1} is {v[:20]!r}, outside 0 .. 2^64-1 (IDs are 64-bit)")
                per_feature[f].append(value - (1 << 64) if value >= 1 << 63 else value)
                lengths[f, row] = 1
    values = np.array([v for feature in per_feature for v in feature], dtype=np.int64)
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=SPARSE_KEYS, values=torch.from_numpy(values),
                                              lengths=torch.from_numpy(lengths.reshape(-1)))
    return Batch(torch.from_numpy(dense), kjt, torch.from_numpy(labels))

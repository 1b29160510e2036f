"""Lookups and pooling straight from a table file, in NumPy: offline scoring without loading
the table into a store (and without its memory).

The keys are sorted once per opened table (an index of 16 bytes per row); rows are gathered
from the memory map. Pooling follows `EmbeddingStore.pooled_lookup` exactly in meaning:
bags by offsets (B+1, the last len(keys)) or lengths (B); "sum", "mean" (a weighted mean
divides by the bag's length, as the core and FBGEMM do), "max"; empty bags and unknown keys
give zeros.
"""
from __future__ import annotations

import numpy as np

from cncore._interchange import as_floats, as_keys, as_offsets

MODES = ("sum", "mean", "max")


def key_index(table):
    """(sorted keys, their row numbers) of a TableFile, built on first use and kept."""
    index = getattr(table, "_key_index", None)
    if index is None:
        keys = table.read("keys", 0, len(table))
        order = np.argsort(keys, kind="stable")
        index = table._key_index = (keys[order], order)
    return index


def find_rows(table, keys: np.ndarray):
    """(hit mask over keys, row numbers of the hits) of int64 `keys` in a TableFile."""
    sorted_keys, order = key_index(table)
    if not len(sorted_keys):
        return np.zeros(len(keys), bool), np.zeros(0, np.int64)
    pos = np.minimum(np.searchsorted(sorted_keys, keys), len(sorted_keys) - 1)
    hit = sorted_keys[pos] == keys
    return hit, order[pos[hit]]


def file_lookup(table, keys) -> np.ndarray:
    keys = as_keys(keys)
    hit, rows = find_rows(table, keys)
    out = np.zeros((len(keys), table.dim), np.float32)
    out[hit] = table.take("rows", rows)
    return out


def bag_offsets(n_keys: int, offsets, lengths) -> np.ndarray:
    """Validated offsets (B+1) from offsets or lengths."""
    if (offsets is None) == (lengths is None):
        raise ValueError("give exactly one of offsets (B+1) or lengths (B)")
    if offsets is not None:
        o = as_offsets(offsets, "offsets")
        if len(o) == 0 or o[0] != 0 or o[-1] != n_keys or np.any(np.diff(o) < 0):
            raise ValueError(f"offsets: expected B+1 non-decreasing entries from 0 to len(keys)={n_keys}")
        return o
    ln = as_offsets(lengths, "lengths")
    if ln.size and ln.min() < 0:
        raise ValueError("lengths: must be >= 0")
    if ln.sum() != n_keys:
        raise ValueError(f"lengths: must sum to len(keys)={n_keys}, got {int(ln.sum())}")
    return np.concatenate([[0], np.cumsum(ln)]).astype(np.int64)


def pool(rows: np.ndarray, offsets: np.ndarray, mode: str, weights=None) -> np.ndarray:
    """Pool (N, dim) rows into (B, dim) bags given by offsets (B+1)."""
    if mode not in MODES:
        raise ValueError(f"mode: expected 'sum', 'mean' or 'max', got {mode!r}")
    lengths = np.diff(offsets)
    out = np.zeros((len(lengths), rows.shape[1]), np.float32)
    filled = lengths > 0
    if not filled.any():
        return out
    if weights is not None:
        rows = rows * weights[:, None]
    # reduceat over the starts of the non-empty bags: each segment runs to the next start.
    reduce = np.maximum if mode == "max" else np.add
    out[filled] = reduce.reduceat(rows, offsets[:-1][filled], axis=0)
    if mode == "mean":
        out[filled] /= lengths[filled, None].astype(np.float32)
    return out


def file_pooled_lookup(table, keys, offsets, lengths, mode, per_sample_weights) -> np.ndarray:
    keys = as_keys(keys)
    if mode not in MODES:
        raise ValueError(f"mode: expected 'sum', 'mean' or 'max', got {mode!r}")
    o = bag_offsets(len(keys), offsets, lengths)
    w = None
    if per_sample_weights is not None:
        if mode == "max":
            raise ValueError("per_sample_weights: weights apply to 'sum' and 'mean' pooling, not 'max'")
        w = as_floats(per_sample_weights, "per_sample_weights", (len(keys),))
    return pool(file_lookup(table, keys), o, mode, w)

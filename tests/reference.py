"""Plain references the tests compare the core against: a dict of NumPy rows, and the row
initialiser re-derived in NumPy from its specification (not from the C code's output)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np

M64 = (1 << 64) - 1
EDGE_KEYS = [0, -1, 1, -(2**63), 2**63 - 1, -(2**63) + 1, 2**63 - 2, 2**32, -(2**32), 2**31 - 1]


def _mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def _draws(seed: int, key: int, counters: np.ndarray) -> np.ndarray:
    stream = _mix64(_mix64(key & M64) ^ ((seed * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & M64))
    lo, hi = np.uint32(stream & 0xFFFFFFFF), np.uint32(stream >> 32)
    with np.errstate(over="ignore"):
        h = (lo + counters.astype(np.uint32) * np.uint32(0x9E3779B9)) ^ hi
        h ^= h >> np.uint32(16)
        h *= np.uint32(0x85EBCA6B)
        h ^= h >> np.uint32(13)
        h *= np.uint32(0xC2B2AE35)
        h ^= h >> np.uint32(16)
    return h


def uniform_row(seed: int, key: int, dim: int, low: float, high: float) -> np.ndarray:
    """The initial row of `key`: column d is low + (high - low) * (draw(seed, key, d) >> 8) / 2^24."""
    bits = _draws(seed, key, np.arange(dim))
    unit = (bits >> np.uint32(8)).astype(np.float32) * np.float32(1.0 / 16777216.0)
    return (np.float32(low) + (np.float32(high) - np.float32(low)) * unit).astype(np.float32)


class DictStore:
    """The reference store: a Python dict from key to (row, state, count, last_step)."""

    def __init__(self, dim: int, seed: int, low: float, high: float, state_floats: int = 0, state_init: float = 0.0):
        self.dim, self.seed, self.low, self.high = dim, seed, low, high
        self.state_floats, self.state_init = state_floats, state_init
        self.rows: dict[int, np.ndarray] = {}
        self.state: dict[int, np.ndarray] = {}
        self.counts: dict[int, int] = {}
        self.last_steps: dict[int, int] = {}
        self.step = 0

    def initial(self, key: int) -> np.ndarray:
        return uniform_row(self.seed, key, self.dim, self.low, self.high)

    def _new(self, k):
        self.state[k] = np.full(self.state_floats, self.state_init, dtype=np.float32)
        self.counts[k] = 0
        self.last_steps[k] = 0

    def find_or_insert(self, keys):
        found = [k in self.rows for k in keys]
        for k in keys:
            if k not in self.rows:
                self.rows[k] = self.initial(k)
                self._new(k)
        return np.array(found, dtype=bool)

    def write(self, keys, rows, insert: bool):
        found = np.array([k in self.rows for k in keys], dtype=bool)
        for k, r in zip(keys, rows):
            if k in self.rows or insert:
                if k not in self.rows:
                    self._new(k)
                self.rows[k] = np.array(r, dtype=np.float32)
        return found

    def erase(self, keys):
        erased = []
        for k in keys:
            erased.append(k in self.rows)
            for table in (self.rows, self.state, self.counts, self.last_steps):
                table.pop(k, None)
        return np.array(erased, dtype=bool)

    def clear(self):
        for table in (self.rows, self.state, self.counts, self.last_steps):
            table.clear()

    def backward(self, keys, offsets, grad_out, weights):
        """Sum pooling's backward by hand: each key's gradient is its bag's output gradient
        times its weight, summed per distinct key (float64). Returns (grads, occurrences),
        both in first-occurrence order."""
        grads: dict[int, np.ndarray] = {}
        occurrences: dict[int, int] = {}
        for b in range(len(offsets) - 1):
            for i in range(offsets[b], offsets[b + 1]):
                k = keys[i]
                w = 1.0 if weights is None else float(weights[i])
                grads[k] = grads.get(k, np.zeros(self.dim)) + w * grad_out[b].astype(np.float64)
                occurrences[k] = occurrences.get(k, 0) + 1
        return grads, occurrences

    def record_access(self, occurrences, lookup_step):
        for k, n in occurrences.items():
            self.counts[k] += n
            self.last_steps[k] = lookup_step

    def rowwise_adagrad(self, grads, lr, eps):
        """FBGEMM's EXACT_ROWWISE_ADAGRAD on each row with a gradient; advances the step."""
        self.step += 1
        for k, g in grads.items():
            self.state[k] = (self.state[k] + np.mean(g * g)).astype(np.float32)
            self.rows[k] = (self.rows[k] - lr / (np.sqrt(self.state[k][0]) + eps) * g).astype(np.float32)

    def lookup(self, keys) -> np.ndarray:
        return np.array([self.rows.get(k, np.zeros(self.dim, np.float32)) for k in keys],
                        dtype=np.float32).reshape(len(keys), self.dim)


def pooled_reference(rows: np.ndarray, offsets: np.ndarray, mode: str, weights=None) -> np.ndarray:
    """Pool rows (N, dim) by CSR offsets, with float64 accumulation."""
    n_bags = len(offsets) - 1
    out = np.zeros((n_bags, rows.shape[1]), dtype=np.float64)
    for b in range(n_bags):
        s, e = offsets[b], offsets[b + 1]
        if e == s:
            continue
        r = rows[s:e].astype(np.float64)
        if weights is not None:
            r = r * np.asarray(weights[s:e], dtype=np.float64)[:, None]
        out[b] = r.max(axis=0) if mode == "max" else r.sum(axis=0) / (e - s if mode == "mean" else 1)
    return out


def run_isolated(code: str, timeout: float = 60.0) -> dict:
    """Run `code` in a fresh interpreter; it prints one JSON object as its last line. A crash or
    a hang fails the calling test with what the process said."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, (f"exit {proc.returncode}\nstdout:\n{proc.stdout[-2000:]}\n"
                                  f"stderr:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def snapshot(store):
    """Everything a store holds, sorted by key: (len, keys, rows, state, counts, last steps, step)."""
    e = store.export()
    order = np.argsort(e.keys)
    return (len(store), e.keys[order], e.rows[order], e.optimizer_state[order], e.counts[order], e.last_steps[order],
            store.step)


def assert_unchanged(store, snap):
    """The store holds exactly what `snap` (a snapshot) recorded, bit for bit."""
    now = snapshot(store)
    assert now[0] == snap[0] and now[6] == snap[6]
    for a, b in zip(now[1:6], snap[1:6]):
        np.testing.assert_array_equal(a, b)


def tree(root) -> dict:
    """Every file (with its bytes) and directory under `root`."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(str(root)):
        out.update({os.path.join(dirpath, d): None for d in dirnames})
        out.update({os.path.join(dirpath, f): open(os.path.join(dirpath, f), "rb").read() for f in filenames})
    return out


def assert_same_table(a, b) -> None:
    """Two exports (TableBatch) hold the same keys with the same rows, optimizer state and
    counts, whatever their order."""
    oa, ob = np.argsort(a.keys), np.argsort(b.keys)
    for name in ("keys", "rows", "optimizer_state", "counts"):
        np.testing.assert_array_equal(getattr(a, name)[oa], getattr(b, name)[ob], err_msg=name)

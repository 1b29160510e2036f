"""MovieLens-100K as a click-through task, for `bounded_auc.py --data movielens`.

The ratings, users and items are RecBole's atomic files (`ml-100k.inter`, `.user`, `.item`,
`.kg`, `.link`), read straight from RecBole's wheel: the wheel is found in --cache (or
downloaded there with `pip download --no-deps recbole==1.2.1`) and never installed.

The task: label = rating >= 4; the ratings sorted by time, the first 80% train (in time order:
a stream), the last 20% test. Nine sparse features with their raw IDs: user, item, age,
gender, occupation, zip code, release year (one ID each; an item without a year has none),
genre (multi-hot, the item's genres) and people (multi-hot, the item's actors, directors,
writers and producers from RecBole's knowledge graph). Words (gender, zip, genre, entity
names) become IDs by a stable 63-bit hash of `feature:word`, so every ID is a raw,
unremapped int64 as in production. DLRM gets one dense input, a constant 1.
"""
from __future__ import annotations

import glob
import hashlib
import os
import subprocess
import sys
import zipfile

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from cn_dlrm.data import Batch  # the job's batch: dense (B, 1) here, sparse, labels (B,)

KEYS = ["user", "age", "gender", "occupation", "zip", "item", "year", "genre", "people"]  # the rows' order
PEOPLE = ("film.film.actor", "film.film.directed_by", "film.film.written_by", "film.film.produced_by")
WHEEL = "recbole-1.2.1-py3-none-any.whl"
DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "cn-embedding", "recbole")
ROOT = "recbole/dataset_example/ml-100k/"


def cached_archive(cache: str, name: str, requirement: str) -> str:
    """The package archive `name` (a wheel or sdist) in `cache`, downloaded there with `pip
    download --no-deps requirement` if absent: read, never installed.

    Args:
        cache: the folder that holds (or gets) the archive.
        name: its file name.
        requirement: what pip downloads (``package==version``).

    Returns:
        The archive's path.
    """
    found = sorted(glob.glob(os.path.join(cache, name)))
    if found:
        return found[0]
    os.makedirs(cache, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", requirement, "-d", cache],
                   check=True)
    return os.path.join(cache, name)


def find_wheel(cache: str) -> str:
    """RecBole's wheel in `cache`, downloaded there (no dependencies, not installed) if absent."""
    return cached_archive(cache, WHEEL, "recbole==1.2.1")


def _rows(zf: zipfile.ZipFile, name: str) -> list[list[str]]:
    text = zf.read(ROOT + name).decode("utf-8", errors="replace")
    return [line.split("\t") for line in text.splitlines()[1:] if line]


def word_id(feature: str, word: str) -> int:
    """A stable 63-bit ID of a word (the same in every process and run)."""
    return int.from_bytes(hashlib.blake2b(f"{feature}:{word}".encode(), digest_size=8).digest(), "little") >> 1


def make_batch(keys: list[str], rows: list[list[list[int]]], labels: np.ndarray) -> Batch:
    """One batch of `rows` (a row: per key, its IDs) with `labels[:len(rows)]`, a constant dense 1.

    Args:
        keys: the features, in the rows' order.
        rows: per sample, per key, a list of raw IDs (empty: none).
        labels: at least len(rows) labels.

    Returns:
        The Batch: dense (B, 1) ones, a KJT of `keys`, labels (B,).
    """
    b = len(rows)
    lengths = np.array([[len(r[f]) for r in rows] for f in range(len(keys))], dtype=np.int64)
    values = np.array([v for f in range(len(keys)) for r in rows for v in r[f]], dtype=np.int64)
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.from_numpy(values),
                                              lengths=torch.from_numpy(lengths.reshape(-1)))
    return Batch(torch.ones(b, 1), kjt, torch.from_numpy(labels[:b].copy()))


class RealBatches:
    """A real dataset's batches, as the bounded benchmark reads them: `batches` (training, in
    order), `eval_set`, and the features `keys`. The datasets' classes fill them."""

    keys: list[str]
    batches: list[Batch]
    eval_set: list[Batch]

    def train(self, start: int):
        return iter(self.batches[start:])

    def counts(self) -> tuple[list[int], list[int]]:
        """Per feature: distinct training IDs, and the most distinct IDs of one training batch."""
        distinct, peak = [], []
        for key in self.keys:
            per_batch = [np.unique(b.sparse[key].values().numpy()) for b in self.batches]
            distinct.append(len(np.unique(np.concatenate(per_batch))))
            peak.append(max(len(u) for u in per_batch))
        return distinct, peak


class MovieLens(RealBatches):
    """The task's batches: `batches` (training, in time order) and `eval_set` (the test range)."""

    keys = KEYS

    def __init__(self, wheel: str, batch_size: int = 256, train_fraction: float = 0.8):
        with zipfile.ZipFile(wheel) as zf:
            inter, users, items = _rows(zf, "ml-100k.inter"), _rows(zf, "ml-100k.user"), _rows(zf, "ml-100k.item")
            kg, link = _rows(zf, "ml-100k.kg"), _rows(zf, "ml-100k.link")
        user = {int(u): [[int(u)], [int(age)], [word_id("gender", g)], [word_id("occupation", o)],
                         [word_id("zip", z)]] for u, age, g, o, z in users}
        people: dict[str, list[int]] = {}
        for head, relation, tail in kg:
            if relation in PEOPLE:
                people.setdefault(head, []).append(word_id("people", tail))
        entity = {int(i): e for i, e in link}
        item = {}
        for i, _title, year, genres in items:
            ident = int(i)
            item[ident] = [[ident], [int(year)] if year.strip().isdigit() else [],
                           [word_id("genre", g) for g in genres.split()],
                           sorted(set(people.get(entity.get(ident, ""), [])))]
        table = np.array([[int(u), int(i), float(r), float(t)] for u, i, r, t in inter])
        table = table[np.lexsort((table[:, 1], table[:, 0], table[:, 3]))]  # by time, ties by user, item
        self.n_train = int(len(table) * train_fraction)
        self.batch_size = batch_size
        rows = [user[int(u)] + item[int(i)] for u, i, _, _ in table]
        labels = (table[:, 2] >= 4).astype(np.float32)
        self.batches = [self._batch(rows[a:a + batch_size], labels[a:a + batch_size])
                        for a in range(0, self.n_train, batch_size)]
        self.eval_set = [self._batch(rows[a:min(a + batch_size, len(rows))], labels[a:a + batch_size])
                         for a in range(self.n_train, len(rows), batch_size)]

    @staticmethod
    def _batch(rows: list[list[list[int]]], labels: np.ndarray) -> Batch:
        return make_batch(KEYS, rows, labels)

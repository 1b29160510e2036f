"""The key index's size (cn_index.h): a bounded table's index stops at exactly the buckets its
row budget needs at the maximum load, and stays there; a growing table's load stays within
(max_load / 1.25, max_load]; keys walked out of one table in bucket order and put into another
a chunk at a time do not crowd it (the salt)."""
import math
import time

import numpy as np
import pytest

import cncore

GROWTH = 1.25  # CN_INDEX_GROWTH


def budget_buckets(max_rows: int, max_load: float) -> int:
    """The fewest buckets (>= 4, CN_INDEX_MIN_BUCKETS) holding max_rows keys at max_load
    (cn_index_buckets_for)."""
    n = max(4, math.ceil(max_rows / max_load))
    while int(max_load * n) < max_rows:
        n += 1
    return n


@pytest.mark.parametrize("max_rows,max_load", [(1000, 0.7), (4099, 0.7), (3000, 0.5), (20000, 0.9)])
def test_a_bounded_index_stops_at_the_budget_and_never_rehashes(max_rows, max_load):
    store = cncore.EmbeddingStore(dim=4, max_rows=max_rows, eviction=cncore.LRU(), max_load_factor=max_load)
    rng = np.random.default_rng(0)
    sizes = set()
    for step in range(60):
        store.step = step
        store.find_or_insert(rng.integers(0, 50 * max_rows, max_rows // 7))
        if store.evicted_count > 0:  # full once: from here on the index must not change
            sizes.add(store._table.n_buckets)
    assert store.evicted_count > 0
    assert sizes == {budget_buckets(max_rows, max_load)}
    assert 16 * store._table.n_buckets <= 16 * max_rows / max_load + 16


def test_duplicate_new_keys_at_the_budget_do_not_grow_the_index():
    """A batch naming each new key several times counts it once against the budget's buckets."""
    store = cncore.EmbeddingStore(dim=4, max_rows=1000, eviction=cncore.LRU())
    store.find_or_insert(np.arange(1000))
    n = store._table.n_buckets
    assert n == budget_buckets(1000, 0.7) and len(store) == 1000
    slots, found = store.find_or_insert(np.repeat(np.arange(5000, 5400), 4))
    assert not found.any() and len(store) <= 1000 and store._table.n_buckets == n
    assert len(np.unique(slots)) == 400


def test_a_growing_index_keeps_its_load_within_a_growth_step():
    store = cncore.EmbeddingStore(dim=2)
    rng = np.random.default_rng(1)
    for _ in range(200):
        store.find_or_insert(rng.integers(-2**63, 2**63 - 1, int(rng.integers(1, 3000)), dtype=np.int64))
        if len(store) > 1000:
            assert 0.7 / GROWTH * (1 - 1e-3) <= store.load_factor <= 0.7


def test_capacity_sizes_the_index_exactly():
    store = cncore.EmbeddingStore(dim=2, capacity=100_000)
    assert store._table.n_buckets == budget_buckets(100_000, 0.7)
    assert store.capacity >= 100_000
    store.find_or_insert(np.arange(100_000))
    assert store._table.n_buckets == budget_buckets(100_000, 0.7)


def _load_time(dst_batches, keys):
    store = cncore.EmbeddingStore(dim=1)
    t = time.perf_counter()
    for part in np.array_split(keys, dst_batches):
        store.find_or_insert(part)
    return time.perf_counter() - t, store


def test_keys_in_another_tables_bucket_order_do_not_crowd_a_growing_table():
    """Walking a table's buckets yields its keys in hash order; without a salt that differs
    between index sizes, putting them a chunk at a time into a growing table put each chunk's
    keys into a narrow stretch of its buckets (one long cluster, quadratic time). Timed against
    the same keys shuffled, each the best of three."""
    src = cncore.EmbeddingStore(dim=1)
    src.find_or_insert(np.random.default_rng(2).integers(-2**63, 2**63 - 1, 30_000, dtype=np.int64))
    in_order = src.export().keys
    shuffled = np.random.default_rng(3).permutation(in_order)
    ordered_t = min(_load_time(300, in_order)[0] for _ in range(3))
    shuffled_t = min(_load_time(300, shuffled)[0] for _ in range(3))
    assert ordered_t < 4 * shuffled_t + 0.05, (ordered_t, shuffled_t)
    _, dst = _load_time(300, in_order)
    slots, found = dst.find(in_order)
    assert found.all() and len(dst) == len(in_order)

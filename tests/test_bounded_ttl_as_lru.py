"""What docs/bounded-tables.md ("Every policy against hashing (2026-12-08)") and TTL's docstring
state: between sweeps a TTL table evicts exactly as an LRU one (the same score, last_step), so
the same training stream leaves the same keys, rows, split, measures and eviction count, with
fallback_rows="auto" or a row per key; a sweep (evict_expired) is what tells them apart."""
import numpy as np
import pytest

import cncore


def run(eviction, fallback_rows, calls=120):
    store = cncore.EmbeddingStore(dim=2, seed=1, max_rows=40, eviction=eviction, fallback_rows=fallback_rows,
                                  optimizer=cncore.SGD(lr=0.1))
    sink = []
    store.on_evict(lambda batch: sink.append(batch.keys.copy()))
    rng = np.random.default_rng(0)
    for _ in range(calls):
        keys = rng.zipf(1.3, size=48) % 400
        out, ctx = store.pooled_lookup(keys, lengths=[1] * len(keys))
        store.apply_gradients(ctx, np.ones(out.shape, np.float32))
    return store, sink


@pytest.mark.parametrize("fallback_rows", ["auto", 0])
@pytest.mark.parametrize("ttl", [0, 5, 2**32 - 1])
def test_a_ttl_table_between_sweeps_evicts_as_lru(fallback_rows, ttl):
    lru, lru_sink = run(cncore.LRU(), fallback_rows)
    ttl_store, ttl_sink = run(cncore.TTL(ttl), fallback_rows)
    a, b = lru.export(), ttl_store.export()
    assert a.keys.tolist() == b.keys.tolist() and len(a.keys) > 0
    np.testing.assert_array_equal(a.rows, b.rows)
    assert [k.tolist() for k in lru_sink] == [k.tolist() for k in ttl_sink]
    assert lru.evicted_count == ttl_store.evicted_count > 0
    assert lru.split_measures == ttl_store.split_measures
    assert lru.fallback_rows == ttl_store.fallback_rows
    if fallback_rows == "auto":  # this stream churns: both split the same way
        assert lru.fallback_rows > 0
        np.testing.assert_array_equal(lru.export_fallback()[0], ttl_store.export_fallback()[0])


def test_a_sweep_is_what_tells_ttl_from_lru():
    """Keys 0-9 used at steps 0-2, keys 100-104 at steps 3-7 (the table never full): a TTL(2)
    sweep at step 8 evicts exactly the rows with step - last_step > 2, keys 0-9 (last step 2)."""
    store = cncore.EmbeddingStore(dim=2, max_rows=40, eviction=cncore.TTL(2), fallback_rows=0,
                                  optimizer=cncore.SGD(lr=0.1))
    for keys in [range(10)] * 3 + [range(100, 105)] * 5:
        out, ctx = store.pooled_lookup(np.array(list(keys)), lengths=[len(keys)])
        store.apply_gradients(ctx, np.ones(out.shape, np.float32))
    assert store.evict_expired() == 10
    assert sorted(store.export().keys.tolist()) == list(range(100, 105))

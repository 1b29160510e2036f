"""Admission by count (MinCount): every occurrence counts, duplicates in one batch included,
weights never; a key not admitted reads as zeros or its initial row and takes no update."""
import numpy as np
import pytest

import cncore


def store(count, unadmitted="zeros", **kw):
    return cncore.EmbeddingStore(dim=2, seed=9, optimizer=cncore.SGD(lr=1.0),
                                 admission=cncore.MinCount(count, unadmitted, **kw))


def test_duplicates_in_one_batch_each_count():
    s = store(3)
    _, ctx = s.pooled_lookup(np.array([7, 7, 7, 8, 8]), lengths=np.array([3, 2]))
    assert ctx.slots.tolist()[:3] == [ctx.slots[0]] * 3 and ctx.slots[0] >= 0  # 7 seen 3 times: admitted
    assert ctx.slots[3:].tolist() == [-1, -1] and len(s) == 1                   # 8 seen twice: not yet
    _, ctx = s.pooled_lookup(np.array([8]), lengths=np.array([1]))
    assert ctx.slots[0] >= 0 and len(s) == 2


def test_weights_never_touch_the_counters():
    s = store(2)
    _, ctx = s.pooled_lookup(np.array([5, 5]), lengths=np.array([2]), per_sample_weights=np.zeros(2, np.float32))
    assert ctx.slots[0] >= 0  # two occurrences of weight 0 still count twice
    s.apply_gradients(ctx, np.ones((1, 2), np.float32))
    assert s.read(np.array([5])).counts.tolist() == [2]
    np.testing.assert_array_equal(s.lookup(np.array([5])), cncore.initial_rows(s.config, np.array([5])))


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_a_key_not_admitted_reads_its_initial_row_and_takes_no_update(mode):
    s = store(5, "initial")
    keys = np.array([1, 2, 3])
    init = cncore.initial_rows(s.config, keys)
    out, ctx = s.pooled_lookup(keys, lengths=np.array([3]), mode=mode)
    want = {"sum": init.sum(0), "mean": init.mean(0), "max": init.max(0)}[mode]
    np.testing.assert_allclose(out[0], want, rtol=1e-6)
    assert ctx.slots.tolist() == [-1, -1, -1]
    s.apply_gradients(ctx, np.ones((1, 2), np.float32))
    assert len(s) == 0 and s.step == 1
    zeros = store(5)
    out, _ = zeros.pooled_lookup(keys, lengths=np.array([3]), mode=mode)
    assert out.tolist() == [[0.0, 0.0]]


def test_explicit_inserts_are_not_gated_and_a_lookup_past_the_budget_keeps_its_counts():
    s = cncore.EmbeddingStore(dim=2, admission=cncore.MinCount(2), max_rows=2, eviction=cncore.LRU(), headroom=0)
    s.find_or_insert(np.array([1]))
    assert len(s) == 1
    # 4 and 5 admitted (2 sightings each): 3 rows > 2, so 4 (seen first) gets the free row, 5 overflows
    _, ctx = s.pooled_lookup(np.array([1, 4, 4, 5, 5]), lengths=np.array([5]))
    assert (ctx.slots >= 0).tolist() == [True, True, True, False, False]
    assert sorted(s.export().keys.tolist()) == [1, 4]
    _, ctx = s.pooled_lookup(np.array([5]), lengths=np.array([1]))  # its counts stayed: a row at once
    assert ctx.slots.tolist()[0] >= 0 and 5 in s.export().keys.tolist() and len(s) == 2


def test_the_sketch_is_bounded_traced_and_saved(tmp_path):
    from cncore.tablefile import load_store, save_table
    base = cncore.EmbeddingStore(dim=2).nbytes
    s = cncore.EmbeddingStore(dim=2, admission=cncore.MinCount(2, width=2**16, depth=4))
    assert s.nbytes - base == 2**16 * 4 * 4
    with pytest.raises(ValueError, match="power of two"):
        cncore.MinCount(2, width=100)
    save_table(s, str(tmp_path / "t"))
    assert load_store(str(tmp_path / "t")).config.admission == cncore.MinCount(2, width=2**16, depth=4)

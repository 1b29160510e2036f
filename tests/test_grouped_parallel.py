"""The grouped lookup and backward run their distinct tables as parallel tasks (forward.pxi,
_lookup_units; backward.pxi, _update_units): the rows, outputs, optimizer state and evicted
rows are the same bit for bit on one thread or two, with the workers asleep or awake, and with
the tables run one after another (_core._set_serial_units)."""
import time

import numpy as np
import pytest
from reference import assert_same_table

import cncore
from cncore import _core, grouped_apply_gradients, grouped_pooled_lookup

N_TABLES = 26


@pytest.fixture
def restore():
    yield
    cncore.set_num_threads(None)
    _core._set_serial_units(False)


def _settle(wake, waker):
    """wake: a 40,000-key find just before, so the pool's workers spin (a grouped call then
    takes them even under 16384 keys); otherwise a 2 ms pause (past their 200 us spin), so
    they sleep and a call under 16384 keys stays on the calling thread."""
    if wake:
        waker.find(np.arange(40_000, dtype=np.int64))
    else:
        time.sleep(0.002)


def _train(threads, wake, serial, batch):
    """Three grouped training steps over the job's shape: 26 tables of dim 16, row-wise
    Adagrad, `batch` bags of one Zipf key each; features 24 and 25 share a store (one task
    with both), feature 3 pools by mean, and store 5 is bounded (it evicts, into a sink)."""
    cncore.set_num_threads(threads)
    _core._set_serial_units(serial)
    opt = cncore.RowWiseAdagrad(lr=0.1)
    stores = [cncore.EmbeddingStore(dim=16, seed=3 + t, optimizer=opt,
                                    **({"max_rows": 300, "eviction": cncore.LRU()} if t == 5 else {}))
              for t in range(N_TABLES - 1)]
    sink = []
    stores[5].on_evict(lambda b: sink.append((b.keys.tolist(), b.rows.tolist())))
    waker = cncore.EmbeddingStore(dim=4, capacity=40_000)
    waker.find_or_insert(np.arange(40_000, dtype=np.int64))
    features = stores + [stores[-1]]
    modes = ["mean" if f == 3 else "sum" for f in range(N_TABLES)]
    rng = np.random.default_rng(7)
    outs = []
    for _ in range(3):
        keys = [(rng.zipf(1.2, batch) % 3000).astype(np.int64) for _ in range(N_TABLES)]
        _settle(wake, waker)
        out, ctxs = grouped_pooled_lookup(features, keys, lengths=[np.ones(batch, np.int64)] * N_TABLES, modes=modes)
        grad = rng.standard_normal(out.shape).astype(np.float32)
        _settle(wake, waker)
        grouped_apply_gradients(ctxs, grad)
        outs.append(out.copy())
    return outs, [s.export() for s in stores], [s.step for s in stores], sink


@pytest.mark.parametrize("batch", [256, 2048], ids=["6656-keys", "53248-keys"])
def test_grouped_training_is_the_same_on_any_threads_wake_state_and_task_split(batch, restore):
    """6,656 keys a call: the workers asleep, the tables run on the calling thread; awake,
    as parallel tasks. 53,248 keys: parallel tasks either way (the call's total wakes them)."""
    want = _train(1, False, True, batch)
    assert want[3], "the bounded store should have evicted"
    for threads, wake, serial in [(1, False, False), (2, False, False), (2, True, False), (2, False, True),
                                  (2, True, True)]:
        outs, exports, steps, sink = _train(threads, wake, serial, batch)
        label = f"threads={threads} wake={wake} serial={serial}"
        for a, b in zip(want[0], outs):
            np.testing.assert_array_equal(a, b, err_msg=label)
        for a, b in zip(want[1], exports):
            assert_same_table(a, b)
        assert steps == want[2] and sink == want[3], label


@pytest.mark.parametrize("threads,serial", [(1, True), (2, False)])
def test_a_failing_table_leaves_the_others_looked_up_and_their_evicted_rows_delivered(threads, serial, restore):
    """A bad found slot on feature 1 of 3 (CN_EBADSLOT): its table is unchanged, tables 0 and 2
    are looked up (keys inserted; table 2, full, evicts into its sink), whether the tables ran
    one after another or as parallel tasks; the error names feature 1."""
    cncore.set_num_threads(threads)
    _core._set_serial_units(serial)
    a = cncore.EmbeddingStore(dim=4, seed=1)
    b = cncore.EmbeddingStore(dim=4, seed=2)
    c = cncore.EmbeddingStore(dim=4, seed=3, max_rows=4, eviction=cncore.LRU(), headroom=0)
    c.find_or_insert(np.arange(100, 104, dtype=np.int64))
    sink = []
    c.on_evict(lambda batch: sink.append(sorted(batch.keys.tolist())))
    b.find_or_insert(np.arange(5, dtype=np.int64))
    b_before = b.export()
    n = 20_000  # the call's total (60,000 keys) wakes the workers: parallel tasks unless serial
    keys = [np.arange(n, dtype=np.int64), np.arange(n, dtype=np.int64) % 5, np.arange(n, dtype=np.int64) % 2]
    offsets = [np.arange(n + 1, dtype=np.int64)] * 3
    outs = [np.zeros((n, 4), np.float32) for _ in range(3)]
    found = [None, np.full(n, 10**6, np.int64), None]
    with pytest.raises(ValueError, match=r"^found_slots\[1\]: a slot that holds no row of its table; the table is "
                                         r"unchanged; the other features' tables were looked up"):
        _core.grouped_forward([a._table, b._table, c._table], keys, offsets, [None] * 3, [0] * 3, outs, True, found)
    assert len(a) == n and sorted(a.export().keys.tolist()) == list(range(n))
    assert_same_table(b.export(), b_before)
    assert len(sink) == 1 and len(sink[0]) == 2 and set(sink[0]) <= {100, 101, 102, 103}
    assert sorted(c.export().keys.tolist()) == sorted({0, 1} | ({100, 101, 102, 103} - set(sink[0])))

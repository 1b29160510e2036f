"""Long randomised runs, skipped by `make test`; run them with `make soak`
(HYPOTHESIS_PROFILE=soak pytest -m soak tests)."""
import numpy as np
import pytest
from hypothesis import settings
from test_store_stateful import StoreMachine

import cncore

pytestmark = pytest.mark.soak


class SoakMachine(StoreMachine):
    pass


SoakMachine.TestCase.settings = settings(max_examples=2000, stateful_step_count=200, deadline=None)
TestSoakMachine = SoakMachine.TestCase


def test_growth_to_twenty_million_rows_changes_no_row():
    rng = np.random.default_rng(20)
    store = cncore.EmbeddingStore(dim=8, capacity=1, seed=3, optimizer=cncore.RowWiseAdagrad())
    probes = []
    for _ in range(200):
        keys = rng.integers(-(2**63), 2**63 - 1, 100_000, dtype=np.int64)
        store.find_or_insert(keys)
        probes.append((keys[:50], store.lookup(keys[:50])))
    assert len(store) >= 19_999_000
    for keys, rows in probes:
        np.testing.assert_array_equal(store.lookup(keys), rows)


def test_long_training_stream_matches_between_thread_counts():
    results = []
    for threads in (1, 2):
        cncore.set_num_threads(threads)
        rng = np.random.default_rng(21)
        store = cncore.EmbeddingStore(dim=16, seed=1, optimizer=cncore.Adam(lr=0.01))
        for _ in range(300):
            keys = (rng.zipf(1.1, 20_000) * 7919).astype(np.int64)
            out, ctx = store.pooled_lookup(keys, lengths=np.full(1000, 20))
            store.apply_gradients(ctx, rng.standard_normal(out.shape).astype(np.float32))
        batch = store.export()
        order = np.argsort(batch.keys)
        results.append((batch.keys[order], batch.rows[order], batch.optimizer_state[order], batch.counts[order]))
    cncore.set_num_threads(None)
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)

"""Random sequences of every verb, edge keys included, against a dict of NumPy rows."""
import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import cncore
from reference import EDGE_KEYS, DictStore

DIM = 5
SEED = 11
LOW, HIGH = -0.5, 0.5

# A small pool makes hits, duplicates and re-inserts after erase common; edge keys are always in it.
key_pool = st.one_of(st.sampled_from(EDGE_KEYS), st.integers(-40, 40),
                     st.integers(-(2**63), 2**63 - 1))
key_batches = st.lists(key_pool, min_size=0, max_size=24)


def rows_for(n, draw_seed):
    return np.random.default_rng(draw_seed).standard_normal((n, DIM)).astype(np.float32)


class StoreMachine(RuleBasedStateMachine):
    @initialize(capacity=st.sampled_from([0, 1, 3, 64]),
                load=st.sampled_from([0.3, 0.7, 0.9]))
    def setup(self, capacity, load):
        opt = cncore.RowWiseAdagrad(lr=0.1, initial_accumulator_value=0.25)
        self.store = cncore.EmbeddingStore(dim=DIM, seed=SEED, initializer=cncore.Uniform(LOW, HIGH),
                                           capacity=capacity, max_load_factor=load, optimizer=opt)
        self.ref = DictStore(DIM, SEED, LOW, HIGH, state_floats=1, state_init=0.25)

    @rule(keys=key_batches)
    def find_or_insert(self, keys):
        slots, found = self.store.find_or_insert(np.array(keys, dtype=np.int64))
        expected = np.array([k in self.ref.rows for k in keys], dtype=bool)
        self.ref.find_or_insert(keys)
        assert found.tolist() == expected.tolist()
        # Every occurrence of a key gets the same slot, distinct keys distinct slots.
        by_key = {}
        for k, s in zip(keys, slots.tolist()):
            assert by_key.setdefault(k, s) == s
        assert len(set(by_key.values())) == len(by_key)

    @rule(keys=key_batches, seed=st.integers(0, 1000))
    def insert_or_assign(self, keys, seed):
        rows = rows_for(len(keys), seed)
        found = self.store.insert_or_assign(np.array(keys, dtype=np.int64), rows)
        assert found.tolist() == self.ref.write(keys, rows, insert=True).tolist()

    @rule(keys=key_batches, seed=st.integers(0, 1000))
    def assign(self, keys, seed):
        rows = rows_for(len(keys), seed)
        found = self.store.assign(np.array(keys, dtype=np.int64), rows)
        assert found.tolist() == self.ref.write(keys, rows, insert=False).tolist()

    @rule(keys=key_batches)
    def erase(self, keys):
        erased = self.store.erase(np.array(keys, dtype=np.int64))
        # A key repeated in the batch is erased once: only its first occurrence reports it.
        assert erased.tolist() == self.ref.erase(keys).tolist()

    @rule(keys=key_batches)
    def find_and_contains(self, keys):
        arr = np.array(keys, dtype=np.int64)
        slots, found = self.store.find(arr)
        expected = [k in self.ref.rows for k in keys]
        assert found.tolist() == expected
        assert self.store.contains(arr).tolist() == expected
        assert ((slots >= 0) == found).all()

    @rule(keys=key_batches)
    def lookup(self, keys):
        got = self.store.lookup(np.array(keys, dtype=np.int64))
        np.testing.assert_allclose(got, self.ref.lookup(keys), rtol=0, atol=1e-7)

    @rule(n=st.integers(0, 300))
    def reserve(self, n):
        self.store.reserve(len(self.store) + n)
        assert self.store.capacity >= len(self.store) + n

    @precondition(lambda self: len(self.ref.rows) > 0)
    @rule(data=st.data())
    def clear(self, data):
        if data.draw(st.integers(0, 9)) == 0:  # rarely, so tables get big
            self.store.clear()
            self.ref.rows.clear()
            self.ref.state.clear()

    @rule(batch=st.integers(1, 7))
    def export_in_batches_and_load_into_a_copy(self, batch):
        batches = list(self.store.iter_export(batch))
        keys = np.concatenate([b.keys for b in batches]) if batches else np.zeros(0, np.int64)
        assert sorted(keys.tolist()) == sorted(self.ref.rows)
        rows = np.concatenate([b.rows for b in batches])
        state = np.concatenate([b.optimizer_state for b in batches])
        counts = np.concatenate([b.counts for b in batches])
        steps = np.concatenate([b.last_steps for b in batches])
        for k, r, s in zip(keys.tolist(), rows, state):
            np.testing.assert_allclose(r, self.ref.rows[k], rtol=0, atol=1e-7)
            np.testing.assert_array_equal(s, self.ref.state[k])
        copy = cncore.EmbeddingStore(self.store.config)
        copy.load(keys, rows, state, counts, steps)
        again = copy.read(keys)
        np.testing.assert_array_equal(again.rows, rows)
        np.testing.assert_array_equal(again.optimizer_state, state)
        np.testing.assert_array_equal(again.counts, counts)
        np.testing.assert_array_equal(again.last_steps, steps)

    @invariant()
    def sizes_and_rows_match(self):
        assert len(self.store) == len(self.ref.rows)
        assert self.store.load_factor <= self.store.config.max_load_factor + 1e-12
        if self.ref.rows:
            keys = list(self.ref.rows)
            got = self.store.read(np.array(keys, dtype=np.int64))
            assert got.found.all()
            np.testing.assert_allclose(got.rows, self.ref.lookup(keys), rtol=0, atol=1e-7)
            np.testing.assert_array_equal(got.optimizer_state[:, 0], [self.ref.state[k][0] for k in keys])


StoreMachine.TestCase.settings = __import__("hypothesis").settings(max_examples=60, stateful_step_count=40)
TestStoreMachine = StoreMachine.TestCase

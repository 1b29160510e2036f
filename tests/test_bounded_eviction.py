"""Bounded tables: random sequences of inserts, training steps, erases, evictions and admission
against a Python model that implements the stated policy literally (cncore/config.py,
cn_evict.h, cn_admit.h): rows leave in ascending (score, key) order, never rows the evicting
call uses, down to max_rows - headroom; the same keys leave in the same order with the same
rows, state and counters, and reach the sink; a key gets a row once its sketch estimate
reaches the count (a 16-wide sketch, so collisions and early admissions happen)."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from reference import DictStore, _mix64, assert_unchanged, pooled_reference, snapshot

import cncore

DIM = 3
SEED = 5
LOW, HIGH = -0.5, 0.5
LR, EPS = 0.1, 1e-8

keys_small = st.lists(st.one_of(st.integers(-12, 12), st.sampled_from([-(2**63), 2**63 - 1])), max_size=10)


class Full(Exception):
    pass


class BoundedModel(DictStore):
    """DictStore plus the budget, the policy and the sink, as the docs state them."""

    def __init__(self, policy, max_rows, headroom, ttl=0, min_count=0, width=16, depth=2, initial=False,
                 halve_every=None):
        super().__init__(DIM, SEED, LOW, HIGH, state_floats=1, state_init=0.25)
        self.min_count, self.width, self.depth, self.absent_initial = min_count, width, depth, initial
        self.sketch = np.zeros((depth, width), dtype=np.int64)
        self.policy, self.max_rows, self.low_water, self.ttl = policy, max_rows, max_rows - headroom, ttl
        self.halve_every = halve_every  # LFU's aging: the count halves for every halve_every steps unused
        self.sink = []  # one list of (key, row, state, count, last_step) per eviction
        self.evicted = self.admitted = self.erased = 0

    def order(self, k):
        if self.policy != "lfu":
            return self.last_steps[k], k
        count = self.counts[k]
        if self.halve_every:
            halvings = max(0, self.step - self.last_steps[k]) // self.halve_every
            count = 0 if halvings >= 32 else count >> halvings
        return count, self.last_steps[k], k

    def evict_keys(self, keys):
        out = [(k, self.rows[k], self.state[k], self.counts[k], self.last_steps[k]) for k in keys]
        for k in keys:
            for table in (self.rows, self.state, self.counts, self.last_steps):
                del table[k]
        if out:
            self.sink.append(out)
            self.evicted += len(out)
        return len(out)

    def evict_lowest(self, n, exclude=()):
        candidates = sorted((k for k in self.rows if k not in exclude), key=self.order)
        return self.evict_keys(candidates[:n])

    def make_room(self, keys):
        if self.max_rows is None:
            return
        new = {k for k in keys if k not in self.rows}
        if not new or len(self.rows) + len(new) <= self.max_rows:
            return
        used = {k for k in keys if k in self.rows}
        if len(used) + len(new) > self.max_rows:
            raise Full
        n = min(len(self.rows) + len(new) - self.low_water, len(self.rows) - len(used))
        self.evict_lowest(n, exclude=used)

    def overflow(self, keys):
        """A training lookup's keys that get (or have) a row. When its distinct keys exceed the
        budget, one round of eviction frees rows down to max_rows - headroom and at least one row
        (never the rows it uses), its new keys take the free rows in order of first occurrence,
        and the rest get none."""
        if self.max_rows is None:
            return keys
        used = {k for k in keys if k in self.rows}
        new = list(dict.fromkeys(k for k in keys if k not in self.rows))
        if len(used) + len(new) <= self.max_rows:
            return keys
        n = max(len(self.rows) - self.low_water, len(self.rows) + 1 - self.max_rows)
        self.evict_lowest(max(0, min(n, len(self.rows) - len(used))), exclude=used)
        over = set(new[self.max_rows - len(self.rows):])
        return [k for k in keys if k not in over]

    def insert(self, keys):
        self.make_room(keys)
        self.admitted += len({k for k in keys if k not in self.rows})
        return self.find_or_insert(keys)

    def counters(self, k):
        return [(i, _mix64((k + (i + 1) * 0x9E3779B97F4A7C15) % 2**64) % self.width) for i in range(self.depth)]

    def admit(self, keys):
        """The keys of a training lookup that get (or have) a row; counts the others."""
        self._counted = []
        if not self.min_count:
            return keys
        missing = [k for k in keys if k not in self.rows]
        for k in missing:  # every occurrence, before any decision
            for i, j in self.counters(k):
                self.sketch[i, j] += 1
        admitted = {k for k in missing if min(self.sketch[i, j] for i, j in self.counters(k)) >= self.min_count}
        self._counted = missing
        return [k for k in keys if k in self.rows or k in admitted]

    def take_back(self):
        for k in self._counted:
            for i, j in self.counters(k):
                self.sketch[i, j] -= 1

    def read(self, keys):
        return np.array([self.rows[k] if k in self.rows else self.initial_or_zero(k) for k in keys],
                        dtype=np.float32).reshape(len(keys), DIM)

    def initial_or_zero(self, k):
        return self.initial(k) if self.absent_initial else np.zeros(DIM, np.float32)

    def erase(self, keys):
        erased = super().erase(keys)
        self.erased += int(erased.sum())
        return erased


def batch_of(sink_entry):
    return (np.array([e[0] for e in sink_entry], dtype=np.int64),
            np.array([e[1] for e in sink_entry], dtype=np.float32).reshape(-1, DIM),
            np.array([e[2] for e in sink_entry], dtype=np.float32).reshape(-1, 1),
            [e[3] for e in sink_entry], [e[4] for e in sink_entry])


class BoundedMachine(RuleBasedStateMachine):
    @initialize(policy=st.sampled_from(["lru", "lfu", "ttl"]), max_rows=st.integers(3, 10),
                headroom=st.integers(0, 2), ttl=st.integers(0, 3), min_count=st.sampled_from([0, 2, 3]),
                initial=st.booleans(), halve_every=st.sampled_from([None, 1, 2, 4]))
    def setup(self, policy, max_rows, headroom, ttl, min_count, initial, halve_every):
        eviction = {"lru": cncore.LRU(), "lfu": cncore.LFU(halve_every), "ttl": cncore.TTL(ttl)}[policy]
        opt = cncore.RowWiseAdagrad(lr=LR, eps=EPS, initial_accumulator_value=0.25)
        admission = (cncore.MinCount(min_count, "initial" if initial else "zeros", width=16, depth=2)
                     if min_count else None)
        self.store = cncore.EmbeddingStore(dim=DIM, seed=SEED, initializer=cncore.Uniform(LOW, HIGH), optimizer=opt,
                                           max_rows=max_rows, eviction=eviction, headroom=min(headroom, max_rows - 1),
                                           admission=admission, fallback_rows=0)  # the literal model: a row per key
        self.ref = BoundedModel(policy, max_rows, min(headroom, max_rows - 1), ttl, min_count, 16, 2,
                                initial and bool(min_count), halve_every)
        self.sink = []
        self.store.on_evict(self.sink.append)
        self.unordered = set()  # sink entries from evict_if: export order, compared as sets

    def _refused(self, call, keys):
        before = snapshot(self.store)
        with pytest.raises(ValueError, match=r"exceed the table's max_rows|exceed its max_rows"):
            call()
        assert_unchanged(self.store, before)

    @rule(keys=keys_small)
    def find_or_insert(self, keys):
        arr = np.array(keys, dtype=np.int64)
        try:
            self.ref.insert(keys)
        except Full:
            return self._refused(lambda: self.store.find_or_insert(arr), keys)
        self.store.find_or_insert(arr)

    @rule(bags=st.lists(keys_small, min_size=1, max_size=3), seed=st.integers(0, 100), weighted=st.booleans())
    def train_step(self, bags, seed, weighted):
        keys = [k for b in bags for k in b]
        offsets = np.concatenate([[0], np.cumsum([len(b) for b in bags])]).astype(np.int64)
        rng = np.random.default_rng(seed)
        # Weights scale gradients only: counts are occurrences whatever the weights (0 included).
        weights = rng.choice([0.0, 0.5, 3.0], len(keys)).astype(np.float32) if weighted else None
        arr = np.array(keys, dtype=np.int64)
        # A training lookup never stops on the budget: the keys past it overflow (read as keys
        # without a row, no update); the model's insert would raise Full otherwise.
        self.ref.insert(self.ref.overflow(self.ref.admit(keys)))
        lookup_step = self.store.step
        out, ctx = self.store.pooled_lookup(arr, offsets, per_sample_weights=weights)
        assert ((ctx.slots >= 0) == [k in self.ref.rows for k in keys]).all()
        np.testing.assert_allclose(out, pooled_reference(self.ref.read(keys), offsets, "sum", weights),
                                   rtol=1e-5, atol=1e-6)
        grad = rng.standard_normal(out.shape).astype(np.float32)
        grads, occurrences = self.ref.backward(keys, offsets, grad, weights)
        # Keys without a row take no update and no access.
        grads = {k: g for k, g in grads.items() if k in self.ref.rows}
        occurrences = {k: n for k, n in occurrences.items() if k in self.ref.rows}
        self.store.apply_gradients(ctx, grad)
        self.ref.rowwise_adagrad(grads, LR, EPS)
        self.ref.record_access(occurrences, lookup_step)

    @rule(keys=keys_small)
    def erase(self, keys):
        assert self.store.erase(np.array(keys, dtype=np.int64)).tolist() == self.ref.erase(keys).tolist()

    @precondition(lambda self: len(self.ref.rows) > 0)
    @rule(data=st.data())
    def clear(self, data):
        """Rarely: clear forgets every row (not an eviction) and keeps the admission counts."""
        if data.draw(st.integers(0, 9)) == 0:
            self.store.clear()
            self.ref.erased += len(self.ref.rows)
            DictStore.clear(self.ref)

    @rule(n=st.integers(0, 4))
    def evict(self, n):
        assert self.store.evict(n) == self.ref.evict_lowest(min(n, len(self.ref.rows)))

    @precondition(lambda self: self.ref.policy == "ttl")
    @rule()
    def evict_expired(self):
        expired = sorted((k for k in self.ref.rows if self.ref.step - self.ref.last_steps[k] > self.ref.ttl),
                         key=self.ref.order)
        assert self.store.evict_expired() == self.ref.evict_keys(expired)

    @rule(threshold=st.integers(0, 4))
    def evict_if(self, threshold):
        chosen = [k for k in self.ref.rows if self.ref.counts[k] < threshold]
        n = self.store.evict_if(lambda b: b.counts < threshold)
        assert n == self.ref.evict_keys(chosen)
        if n:
            self.unordered.add(len(self.ref.sink) - 1)

    @precondition(lambda self: self.ref.min_count)
    @rule()
    def decay_admission(self):
        self.store.decay_admission()
        self.ref.sketch >>= 1

    @precondition(lambda self: self.ref.min_count)
    @rule(keys=keys_small)
    def evaluation_lookup(self, keys):
        """Absent keys read as zeros, or as their initial row with unadmitted="initial"."""
        out, ctx = self.store.pooled_lookup(np.array(keys, dtype=np.int64), lengths=np.array([len(keys)]),
                                            insert_missing=False)
        np.testing.assert_allclose(out, pooled_reference(self.ref.read(keys), np.array([0, len(keys)]), "sum"),
                                   rtol=1e-5, atol=1e-6)

    @invariant()
    def table_and_sink_match(self):
        assert len(self.store) == len(self.ref.rows) <= self.ref.max_rows
        assert self.store.evicted_count == self.ref.evicted
        # Nothing lost: every row ever admitted is in the table, in the sink, or was erased.
        assert sum(len(b.keys) for b in self.sink) + len(self.store) == self.ref.admitted - self.ref.erased
        assert len(self.sink) == len(self.ref.sink)
        for i, (got, want) in enumerate(zip(self.sink, self.ref.sink)):
            keys, rows, state, counts, steps = batch_of(want)
            order = np.argsort(got.keys) if i in self.unordered else np.arange(len(got.keys))
            if i in self.unordered:
                perm = np.argsort(keys)
                keys, rows, state = keys[perm], rows[perm], state[perm]
                counts, steps = [counts[j] for j in perm], [steps[j] for j in perm]
            assert got.keys[order].tolist() == keys.tolist()
            np.testing.assert_allclose(got.rows[order], rows, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(got.optimizer_state[order], state, rtol=1e-5)
            assert got.counts[order].tolist() == counts and got.last_steps[order].tolist() == steps
        if self.ref.rows:
            keys = list(self.ref.rows)
            got = self.store.read(np.array(keys, dtype=np.int64))
            assert got.found.all()
            np.testing.assert_allclose(got.rows, self.ref.lookup(keys), rtol=1e-5, atol=1e-6)
            assert got.counts.tolist() == [self.ref.counts[k] for k in keys]
            assert got.last_steps.tolist() == [self.ref.last_steps[k] for k in keys]


BoundedMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30)
TestBoundedMachine = BoundedMachine.TestCase


def lru_store(max_rows, headroom=0, **kw):
    return cncore.EmbeddingStore(dim=2, seed=3, max_rows=max_rows, eviction=cncore.LRU(), headroom=headroom,
                                 optimizer=cncore.SGD(lr=1.0), **kw, fallback_rows=0)


def test_an_evicted_key_that_comes_back_gets_its_initial_row_not_its_old_one():
    s = lru_store(2)
    sink = []
    s.on_evict(sink.append)
    out, ctx = s.pooled_lookup(np.array([1]), lengths=np.array([1]))
    s.apply_gradients(ctx, np.ones((1, 2), np.float32))  # row 1 moves away from its initial value
    trained = s.lookup(np.array([1]))
    s.find_or_insert(np.array([2, 3]))  # 1 (last step 0, key 1) goes first
    assert sink[0].keys.tolist() == [1]
    np.testing.assert_array_equal(sink[0].rows, trained)
    s.find_or_insert(np.array([1]))
    np.testing.assert_array_equal(s.lookup(np.array([1])), cncore.initial_rows(s.config, np.array([1])))
    assert s.read(np.array([1])).counts.tolist() == [0]


def test_the_batch_being_looked_up_is_never_evicted_and_an_insert_too_big_is_refused():
    s = lru_store(3)
    s.find_or_insert(np.array([10, 11, 12]))
    out, _ = s.pooled_lookup(np.array([10, 11, 13]), lengths=np.array([3]))  # 12 must go, not 10 or 11
    assert sorted(s.export().keys.tolist()) == [10, 11, 13]
    np.testing.assert_allclose(out, cncore.initial_rows(s.config, np.array([10, 11, 13])).sum(0, keepdims=True))
    before = snapshot(s)
    with pytest.raises(ValueError, match=r"max_rows \(3\).*the table is unchanged"):
        s.find_or_insert(np.array([1, 2, 3, 10]))
    assert_unchanged(s, before)


def test_a_training_batch_with_more_distinct_keys_than_the_budget_trains_and_its_tail_overflows():
    """max_rows 4, headroom 2, rows for 10..13 (LRU: 11 oldest, then 12); a training batch of 10
    and five new keys: one round of eviction frees 11 and 12 (down to 4 - 2 rows, never 10), 1
    and 2 (the first new keys in the batch) take the two free rows, 3 and 4 overflow: no row,
    zeros in the pooled sum, no update, no access."""
    s = lru_store(4, headroom=2)
    sink = []
    s.on_evict(sink.append)
    for key in (11, 12, 13, 10):
        _, ctx = s.pooled_lookup(np.array([key]), lengths=np.array([1]))
        s.apply_gradients(ctx, np.zeros((1, 2), np.float32))
    keys = np.array([10, 1, 2, 3, 2, 4, 1])
    out, ctx = s.pooled_lookup(keys, lengths=np.array([4, 3]))
    assert sorted(s.export().keys.tolist()) == [1, 2, 10, 13]
    assert sink[0].keys.tolist() == [11, 12] and s.evicted_count == 2
    assert (ctx.slots >= 0).tolist() == [True, True, True, False, True, False, True]
    initial = dict(zip([10, 1, 2], cncore.initial_rows(s.config, np.array([10, 1, 2]))))
    np.testing.assert_allclose(out, [initial[10] + initial[1] + initial[2], initial[2] + initial[1]], rtol=1e-6)
    s.apply_gradients(ctx, np.ones((2, 2), np.float32))  # SGD lr 1: a row moves by -(its bags' count)
    got = s.read(np.array([10, 1, 2]))
    np.testing.assert_allclose(got.rows, [initial[10] - 1, initial[1] - 2, initial[2] - 2], rtol=1e-6)
    assert got.counts.tolist() == [2, 2, 2]  # occurrences (10: one before, one now)
    assert len(s) == 4
    # An explicit insert of more keys than the budget still refuses: its rows could not all be kept.
    with pytest.raises(ValueError, match=r"exceed the table's max_rows \(4\)"):
        s.find_or_insert(np.array([5, 6, 7, 8, 9]))


def test_a_batch_past_the_budget_keeps_the_rows_lfu_ranks_above_its_new_keys():
    s = cncore.EmbeddingStore(dim=2, seed=3, fallback_rows=0, max_rows=4, eviction=cncore.LFU(), headroom=1,
                              optimizer=cncore.SGD(lr=1.0))
    for keys in ([1, 1, 1, 2, 2, 3, 4], [1, 2, 3]):  # counts: 1: 4, 2: 3, 3: 2, 4: 1
        out, ctx = s.pooled_lookup(np.array(keys), lengths=np.array([len(keys)]))
        s.apply_gradients(ctx, np.zeros_like(out))
    _, ctx = s.pooled_lookup(np.arange(100, 110), lengths=np.array([10]))  # ten new keys, no old one
    assert sorted(s.export().keys.tolist()) == [1, 2, 3, 100]  # one round: 4 (the lowest count) went
    assert (ctx.slots >= 0).tolist() == [True] + [False] * 9
    s = lru_store(2, headroom=0)  # headroom 0: a batch past the budget still frees one row
    s.find_or_insert(np.array([1, 2]))
    _, ctx = s.pooled_lookup(np.array([7, 8, 9]), lengths=np.array([3]))
    assert sorted(s.export().keys.tolist()) == [2, 7] and (ctx.slots >= 0).tolist() == [True, False, False]


def test_a_training_batch_whose_own_rows_fill_the_budget_gives_every_new_key_no_row():
    s = lru_store(2)
    s.find_or_insert(np.array([1, 2]))
    out, ctx = s.pooled_lookup(np.array([1, 2, 3]), lengths=np.array([3]))
    assert ctx.slots.tolist()[2] == -1 and sorted(s.export().keys.tolist()) == [1, 2] and s.evicted_count == 0
    np.testing.assert_allclose(out, cncore.initial_rows(s.config, np.array([1, 2])).sum(0, keepdims=True), rtol=1e-6)


def test_a_table_under_two_features_never_evicts_rows_the_other_feature_uses():
    s = lru_store(4)
    for _step, key in enumerate([1, 2, 3, 4]):  # last steps 0..3: 1 and 2 are the oldest
        _, ctx = s.pooled_lookup(np.array([key]), lengths=np.array([1]))
        s.apply_gradients(ctx, np.zeros((1, 2), np.float32))
    before = s.lookup(np.array([1, 2]))
    out, ctxs = cncore.grouped_pooled_lookup([s, s], [np.array([1, 2]), np.array([5, 6])],
                                             lengths=[np.array([2]), np.array([2])])
    assert sorted(s.export().keys.tolist()) == [1, 2, 5, 6]  # 3 and 4 went, though 1 and 2 are older
    np.testing.assert_array_equal(out[:, :2], before.sum(0, keepdims=True))
    cncore.grouped_apply_gradients(ctxs, np.ones((1, 4), np.float32))  # both contexts still valid
    np.testing.assert_allclose(s.lookup(np.array([1, 2])), before - 1.0)


def test_an_eviction_makes_earlier_contexts_stale():
    s = lru_store(2)
    _, ctx = s.pooled_lookup(np.array([1, 2]), lengths=np.array([2]))
    s.find_or_insert(np.array([3]))
    with pytest.raises(RuntimeError, match="erased"):
        s.apply_gradients(ctx, np.ones((1, 2), np.float32))


def test_lfu_orders_by_count_then_last_step_then_key_and_headroom_frees_beyond_the_need():
    s = cncore.EmbeddingStore(dim=1, max_rows=6, eviction=cncore.LFU(), headroom=2)
    s.load(np.arange(6), np.zeros((6, 1), np.float32), counts=np.array([5, 1, 1, 0, 9, 1]),
           last_steps=np.array([0, 7, 3, 9, 0, 3]))
    sink = []
    s.on_evict(sink.append)
    s.find_or_insert(np.array([100]))  # 7 rows would pass 6: down to 4 after the insert, so 3 go
    assert sink[0].keys.tolist() == [3, 2, 5]  # (0, 9), (1, 3) key 2, (1, 3) key 5
    assert s.evicted_count == 3 and len(s) == 4


def test_lfu_with_aging_halves_a_rows_count_for_every_period_it_goes_unused():
    """LFU(halve_every=2): at step 6, key 1 (count 9, unused since step 0: three halvings, 1) goes
    before key 2 (count 2, used at step 4: one halving, 1; the later last step breaks the tie);
    plain LFU evicts key 2. The stored counts are unchanged."""
    evicted = {}
    for aging in (None, 2):
        s = cncore.EmbeddingStore(dim=1, max_rows=2, eviction=cncore.LFU(halve_every=aging), headroom=0)
        s.load(np.array([1, 2]), np.zeros((2, 1), np.float32), counts=np.array([9, 2]), last_steps=np.array([0, 4]))
        s.step = 6
        sink = []
        s.on_evict(sink.append)
        s.find_or_insert(np.array([3]))
        evicted[aging] = sink[0].keys.tolist()
        assert sink[0].counts.tolist() == ([2] if aging is None else [9])
    assert evicted == {None: [2], 2: [1]}


@settings(max_examples=150, deadline=None)
@given(batches=st.lists(st.lists(st.integers(0, 7), min_size=1, max_size=6), min_size=1, max_size=30),
       halve_every=st.sampled_from([1, 2, 4]), max_rows=st.integers(2, 5), headroom=st.integers(0, 1))
def test_lfu_with_aging_evicts_in_the_models_order_over_training_steps(batches, halve_every, max_rows, headroom):
    """Training steps on few keys (so counts and idle times differ) against BoundedModel's literal
    order (count >> ((step - last_step) // halve_every), last_step, key): the same keys leave in
    the same order, and the same keys stay. (The state machine draws aging too, but its steps
    rarely make the aged order differ from the plain one.)"""
    from collections import Counter
    store = cncore.EmbeddingStore(dim=1, max_rows=max_rows, headroom=headroom, optimizer=cncore.SGD(lr=0.1),
                                  eviction=cncore.LFU(halve_every=halve_every), fallback_rows=0)
    sink = []
    store.on_evict(lambda b: sink.extend(b.keys.tolist()))
    ref = BoundedModel("lfu", max_rows, headroom, halve_every=halve_every)
    for keys in batches:
        if len(set(keys)) > max_rows:
            continue  # refused (the state machine covers it)
        lookup_step = store.step
        ref.insert(keys)
        _, ctx = store.pooled_lookup(np.array(keys), lengths=np.array([len(keys)]))
        store.apply_gradients(ctx, np.zeros((1, 1), np.float32))
        ref.record_access(Counter(keys), lookup_step)
        ref.step += 1
    assert sink == [e[0] for batch in ref.sink for e in batch]
    assert sorted(store.export().keys.tolist()) == sorted(ref.rows)


def test_no_callback_drops_but_counts_and_erase_is_not_an_eviction():
    s = lru_store(2)
    s.find_or_insert(np.array([1, 2]))
    s.find_or_insert(np.array([3]))
    s.erase(np.array([2, 3]))
    assert s.evicted_count == 1 and len(s) == 0


def test_config_is_validated_and_saved_with_the_table(tmp_path):
    from cncore.tablefile import load_store, save_table
    default = cncore.LFU(halve_every=128)  # the default policy (docs/bounded-tables.md, "Which eviction policy")
    assert cncore.StoreConfig(dim=2, max_rows=10).eviction == default
    assert cncore.EmbeddingStore(dim=2, max_rows=10).config.eviction == default
    assert cncore.StoreConfig(dim=2, max_rows=10, eviction=cncore.LFU()).eviction == cncore.LFU()  # asked for: kept
    assert cncore.StoreConfig(dim=2).eviction is None  # no budget, no policy
    with pytest.raises(ValueError, match=r"headroom must be an int in \[0, max_rows\)"):
        cncore.StoreConfig(dim=2, max_rows=10, eviction=cncore.LRU(), headroom=10)
    with pytest.raises(ValueError, match="TTL.steps"):
        cncore.TTL(-1)
    for bad in (0, 3, 1000, 2**32, True, 2.0, "64"):
        with pytest.raises(ValueError, match=r"LFU.halve_every must be None or a power of two in \[1, 2\*\*31\]"):
            cncore.LFU(halve_every=bad)
    aging = cncore.EmbeddingStore(dim=2, max_rows=8, eviction=cncore.LFU(halve_every=64))
    aging.find_or_insert(np.arange(3))
    save_table(aging, str(tmp_path / "aging"))
    assert load_store(str(tmp_path / "aging")).config.eviction == cncore.LFU(halve_every=64)
    # plain LFU is written as before (no halve_every: older readers refuse unknown fields), and read so
    from cncore.tablefile import config_from_dict, config_to_dict
    plain = config_to_dict(cncore.StoreConfig(dim=2, max_rows=8, eviction=cncore.LFU()))
    assert plain["eviction"] == {"type": "LFU"} and config_from_dict(plain).eviction == cncore.LFU()
    with pytest.raises(TypeError, match="eviction must be"):
        cncore.StoreConfig(dim=2, eviction="lru")
    assert cncore.StoreConfig(dim=2, max_rows=1000, eviction=cncore.LRU()).headroom == 31
    one = cncore.EmbeddingStore(dim=2, max_rows=1, eviction=cncore.LFU())  # headroom 0: a budget of one row
    one.find_or_insert(np.array([3]))
    one.find_or_insert(np.array([4]))
    assert one.export().keys.tolist() == [4] and one.evicted_count == 1
    s = cncore.EmbeddingStore(dim=2, max_rows=5, eviction=cncore.TTL(3), headroom=1)
    s.find_or_insert(np.arange(4))
    save_table(s, str(tmp_path / "t"))
    t = load_store(str(tmp_path / "t"))
    assert t.config == s.config and sorted(t.export().keys.tolist()) == [0, 1, 2, 3]


def test_evict_verbs_need_a_policy_and_say_so():
    s = cncore.EmbeddingStore(dim=2)
    with pytest.raises(TypeError, match="no eviction policy"):
        s.evict(1)
    with pytest.raises(TypeError, match="no eviction policy"):
        s.evict_if(lambda b: b.counts > 0)
    with pytest.raises(TypeError, match="not TTL"):
        cncore.EmbeddingStore(dim=2, eviction=cncore.LRU()).evict_expired()
    with pytest.raises(TypeError, match="no admission policy"):
        s.decay_admission()
    t = cncore.EmbeddingStore(dim=2, eviction=cncore.LRU())
    t.find_or_insert(np.arange(3))
    with pytest.raises(ValueError, match="bool mask of shape"):
        t.evict_if(lambda b: b.counts)
    assert len(t) == 3


def test_threads_training_on_one_bounded_table_keep_the_budget_and_lose_nothing():
    import threading
    s = cncore.EmbeddingStore(dim=4, max_rows=500, eviction=cncore.LFU(), optimizer=cncore.SGD(lr=0.1), headroom=7)
    sink, admitted, errors = [], [0], []
    s.on_evict(sink.append)
    lock = threading.Lock()

    def train(seed):
        rng = np.random.default_rng(seed)
        for _ in range(60):
            keys = rng.integers(0, 5000, 64)
            try:
                _, ctx = s.pooled_lookup(keys, lengths=np.full(8, 8))
                with lock:
                    admitted[0] += ctx.n_new
                s.apply_gradients(ctx, np.ones((8, 4), np.float32))
            except RuntimeError as exc:  # another thread's eviction made this context stale
                assert "erased" in str(exc)
            except Exception as exc:  # pragma: no cover - reported below
                errors.append(exc)
    threads = [threading.Thread(target=train, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(s) <= 500 and s.evicted_count == sum(len(b.keys) for b in sink)
    assert len(s) + s.evicted_count == admitted[0]

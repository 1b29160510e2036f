"""LFU(halve_every="auto"): aging in the table's own time. At each eviction the halving period
is 2^auto_halve_shift(step, max_rows, held, evicted): AUTO_HALVE_TURNOVERS turnovers, a turnover
being (step + 1) * max_rows / (held + evicted) steps, rounded down to a power of two
(cn_evict.h, cncore.policies). Checked against exact rational arithmetic and, through training
steps, explicit evictions and step jumps, against BoundedModel's literal eviction order with
that period recomputed at every eviction."""
from collections import Counter
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from test_bounded_eviction import BoundedModel

import cncore
from cncore import policies
from cncore.policies import auto_halve_shift


@settings(max_examples=200, deadline=None)
@given(step=st.integers(0, 2**32), max_rows=st.integers(1, 2**40), held=st.integers(0, 2**40),
       evicted=st.integers(0, 2**62), turnovers=st.sampled_from([1, 2, 16, 2**31]))
def test_auto_shift_is_the_turnover_rounded_down_to_a_power_of_two(step, max_rows, held, evicted, turnovers):
    """h = floor(log2(T)) for T = (step + 1) * max_rows / (held + evicted) >= 1 (0 below 1),
    capped at 31, plus log2(turnovers), capped at 31."""
    got = auto_halve_shift(step, max_rows, held, evicted, turnovers)
    if held + evicted == 0:
        assert got == 31
        return
    turnover = Fraction((step + 1) * max_rows, held + evicted)
    h = 0
    while h < 31 and 2 ** (h + 1) <= turnover:
        h += 1
    assert got == min(31, h + turnovers.bit_length() - 1)


def test_auto_shift_examples():
    # 100 steps brought in 5 budgets' worth of rows: a turnover is 20 steps, 16 rounded down
    assert auto_halve_shift(99, 1000, 1000, 4000, turnovers=1) == 4
    assert auto_halve_shift(99, 1000, 1000, 4000, turnovers=16) == 8
    assert auto_halve_shift(0, 10, 30, 0, turnovers=1) == 0  # a third of a step: every step
    assert auto_halve_shift(5, 10, 0, 0) == 31  # nothing taken yet


class AutoModel(BoundedModel):
    """BoundedModel with LFU's period recomputed at each eviction from the table's counters."""

    def __init__(self, max_rows, headroom, turnovers):
        super().__init__("lfu", max_rows, headroom)
        self.turnovers = turnovers
        self.shifts = []

    def evict_lowest(self, n, exclude=()):
        if n <= 0:
            return 0
        shift = auto_halve_shift(self.step, self.max_rows, len(self.rows), self.evicted, self.turnovers)
        self.halve_every = 2**shift
        self.shifts.append(shift)
        return super().evict_lowest(n, exclude)


def auto_store(max_rows, headroom, turnovers):
    """A store with LFU(halve_every="auto") at `turnovers` turnovers per halving (the constant is
    read when the table is built)."""
    saved = policies.AUTO_HALVE_TURNOVERS
    policies.AUTO_HALVE_TURNOVERS = turnovers
    try:
        return cncore.EmbeddingStore(dim=1, max_rows=max_rows, headroom=headroom, optimizer=cncore.SGD(lr=0.1),
                                     eviction=cncore.LFU(halve_every="auto"), fallback_rows=0)
    finally:
        policies.AUTO_HALVE_TURNOVERS = saved


class AutoAgingMachine(RuleBasedStateMachine):
    """Training steps on few keys (counts and idle times differ), explicit evictions, and jumps
    of the step (long idle times, so counts halve to 0): the same keys leave in the same order
    as the model's, and the same keys stay."""

    @initialize(max_rows=st.integers(2, 6), headroom=st.integers(0, 1), turnovers=st.sampled_from([1, 2, 4]))
    def setup(self, max_rows, headroom, turnovers):
        headroom = min(headroom, max_rows - 1)
        self.store = auto_store(max_rows, headroom, turnovers)
        self.ref = AutoModel(max_rows, headroom, turnovers)
        self.sink = []
        self.store.on_evict(lambda b: self.sink.extend(b.keys.tolist()))

    @rule(keys=st.lists(st.integers(0, 9), min_size=1, max_size=6))
    def train_step(self, keys):
        if len(set(keys)) > self.ref.max_rows:
            keys = keys[:1]
        lookup_step = self.store.step
        self.ref.insert(keys)
        _, ctx = self.store.pooled_lookup(np.array(keys), lengths=np.array([len(keys)]))
        self.store.apply_gradients(ctx, np.zeros((1, 1), np.float32))
        self.ref.record_access(Counter(keys), lookup_step)
        self.ref.step += 1

    @rule(n=st.integers(0, 3))
    def evict(self, n):
        assert self.store.evict(n) == self.ref.evict_lowest(min(n, len(self.ref.rows)))

    @rule(jump=st.integers(1, 40))
    def idle(self, jump):
        self.store.step = self.store.step + jump
        self.ref.step += jump

    @invariant()
    def same_victims_and_rows(self):
        assert self.sink == [e[0] for batch in self.ref.sink for e in batch]
        assert sorted(self.store.export(with_rows=False).keys.tolist()) == sorted(self.ref.rows)
        assert self.store.evicted_count == self.ref.evicted


AutoAgingMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=30, deadline=None)
TestAutoAging = pytest.mark.slow(AutoAgingMachine.TestCase)


def test_auto_ages_by_turnover_not_by_a_step_count():
    """Two keys, one popular long ago (count 9, last used at step 0), one used twice lately (step
    90), evicted at step 99 with one turnover per halving: a table of 2 rows that took 4 rows in
    100 steps turns over every 50 steps (period 32): the old key's count halves 3 times (9 -> 1)
    and it goes first, where plain LFU evicts the recent key."""
    def victim(eviction, evicted):
        saved = policies.AUTO_HALVE_TURNOVERS
        policies.AUTO_HALVE_TURNOVERS = 1
        try:
            s = cncore.EmbeddingStore(dim=1, max_rows=2, headroom=0, eviction=eviction, fallback_rows=0)
        finally:
            policies.AUTO_HALVE_TURNOVERS = saved
        s.load(np.array([1, 2]), np.zeros((2, 1), np.float32), counts=np.array([9, 2]), last_steps=np.array([0, 90]))
        s._table.evicted_count = evicted
        s.step = 99
        sink = []
        s.on_evict(sink.append)
        s.find_or_insert(np.array([3]))
        return sink[0].keys.tolist()

    assert victim(cncore.LFU(halve_every="auto"), 2) == [1]  # 100 * 2 / 4 = 50 steps: period 32
    assert victim(cncore.LFU(), 2) == [2]
    # with 8 budgets taken, a turnover is 100 * 2 / 18 = 11 steps (8): key 2 idle 9 steps halves once
    # (2 -> 1), key 1 twelve times (9 -> 0): key 1 still goes
    assert victim(cncore.LFU(halve_every="auto"), 16) == [1]


def test_auto_is_refused_without_a_budget_and_saved_with_the_table(tmp_path):
    from cncore.tablefile import config_from_dict, config_to_dict, load_store, save_table
    with pytest.raises(ValueError, match=r"LFU\(halve_every='auto'\).*set max_rows"):
        cncore.StoreConfig(dim=2, eviction=cncore.LFU(halve_every="auto"))
    for bad in ("Auto", "", "128"):
        with pytest.raises(ValueError, match=r"LFU.halve_every must be None or a power of two.*or 'auto'"):
            cncore.LFU(halve_every=bad)
    assert repr(cncore.LFU(halve_every="auto")) == "LFU(halve_every='auto')"
    assert repr(cncore.LFU(halve_every=128)) == "LFU(halve_every=128)"
    assert cncore.LFU(halve_every="auto").halve_shift == -2 - (policies.AUTO_HALVE_TURNOVERS.bit_length() - 1)
    config = cncore.StoreConfig(dim=2, max_rows=8, eviction=cncore.LFU(halve_every="auto"))
    assert config_to_dict(config)["eviction"] == {"type": "LFU", "halve_every": "auto"}
    assert config_from_dict(config_to_dict(config)).eviction == cncore.LFU(halve_every="auto")
    s = cncore.EmbeddingStore(config)
    s.find_or_insert(np.arange(3))
    save_table(s, str(tmp_path / "auto"))
    assert load_store(str(tmp_path / "auto")).config.eviction == cncore.LFU(halve_every="auto")

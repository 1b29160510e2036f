"""Admission by probability (cncore.Probability(p)) against a literal Python model of the rule
cn_admit.h states: a key without a row is admitted in a training lookup when
(mix64(key ^ mix64(seed ^ 0xD1B54A32D192ED03)) >> 11) < ceil(p * 2^53).

- A hypothesis state machine: training lookups (any int64 keys, duplicates, several batches),
  evaluation lookups, explicit writes and, in a bounded table, evictions: after every step the
  table holds exactly the keys the model says, a key not admitted reads as zeros or its initial
  row and takes no update.
- The decisions do not depend on order or batching; a refused key stays refused; p = 1 admits all.
- The policy is saved with the table file and comes back; bad values are refused naming them.
- Through the torch module and the accelerator rows (CNCORE_CNCARD=cpu) the same keys get rows.
"""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from reference import EDGE_KEYS, _mix64

import cncore
from cncore.tablefile import load_store, save_table

M64 = (1 << 64) - 1


def admitted(seed: int, key: int, p: float) -> bool:
    """The rule, literally (cn_admit.h, cn_admit_draw)."""
    draw = _mix64(((key & M64) ^ _mix64((seed ^ 0xD1B54A32D192ED03) & M64)) & M64) >> 11
    return draw < math.ceil(p * 2**53)


keys_st = st.lists(st.one_of(st.sampled_from(EDGE_KEYS), st.integers(-(2**63), 2**63 - 1), st.integers(0, 40)),
                   min_size=1, max_size=24)


class ProbabilityMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.seed, self.p = 11, 0.4
        self.store = cncore.EmbeddingStore(dim=2, seed=self.seed, admission=cncore.Probability(self.p),
                                           initializer=cncore.Constant(1.0), optimizer=cncore.SGD(lr=0.5))
        self.model = {}  # key -> row (the model's rows)

    @rule(keys=keys_st)
    def train(self, keys):
        keys = np.array(keys, dtype=np.int64)
        out, ctx = self.store.pooled_lookup(keys, lengths=np.ones(len(keys), np.int64))
        for i, k in enumerate(keys.tolist()):
            if k not in self.model and admitted(self.seed, k, self.p):
                self.model[k] = np.ones(2, np.float32)
            expected = self.model.get(k, np.zeros(2, np.float32))
            np.testing.assert_array_equal(out[i], expected)
        self.store.apply_gradients(ctx, np.ones((len(keys), 2), np.float32))
        for k in set(keys.tolist()):
            if k in self.model:
                self.model[k] = self.model[k] - 0.5 * keys.tolist().count(k)

    @rule(keys=keys_st)
    def evaluate(self, keys):
        keys = np.array(keys, dtype=np.int64)
        out, _ = self.store.pooled_lookup(keys, lengths=np.ones(len(keys), np.int64), insert_missing=False)
        for i, k in enumerate(keys.tolist()):
            np.testing.assert_array_equal(out[i], self.model.get(k, np.zeros(2, np.float32)))

    @rule(keys=keys_st)
    def write(self, keys):  # explicit writes are not gated
        keys = np.array(sorted(set(keys)), dtype=np.int64)
        rows = np.full((len(keys), 2), 3.0, np.float32)
        self.store.insert_or_assign(keys, rows)
        for k in keys.tolist():
            self.model[k] = np.full(2, 3.0, np.float32)

    @invariant()
    def same_keys_and_rows(self):
        batch = self.store.export()
        assert sorted(batch.keys.tolist()) == sorted(self.model)
        for k, row in zip(batch.keys.tolist(), batch.rows):
            np.testing.assert_array_equal(row, self.model[k])


TestProbabilityMachine = ProbabilityMachine.TestCase
TestProbabilityMachine.settings = settings(max_examples=40, stateful_step_count=12, deadline=None)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=1, max_size=200, unique=True),
       st.sampled_from([0.05, 0.5, 0.9, 1.0]), st.integers(0, 2**64 - 1), st.integers(1, 7))
def test_decisions_depend_on_seed_and_key_only(keys, p, seed, batches):
    make = lambda: cncore.EmbeddingStore(dim=1, seed=seed, admission=cncore.Probability(p))  # noqa: E731
    whole, parts = make(), make()
    whole.pooled_lookup(np.array(keys), lengths=np.ones(len(keys), np.int64))
    shuffled = np.random.default_rng(seed % 2**32).permutation(np.array(keys, dtype=np.int64))
    for chunk in np.array_split(shuffled, batches):
        if len(chunk):
            parts.pooled_lookup(chunk, lengths=np.ones(len(chunk), np.int64))
            parts.pooled_lookup(chunk, lengths=np.ones(len(chunk), np.int64))  # a refused key stays refused
    expected = sorted(k for k in keys if admitted(seed, k, p))
    assert sorted(whole.export().keys.tolist()) == sorted(parts.export().keys.tolist()) == expected
    if p == 1.0:
        assert expected == sorted(keys)


def test_about_p_of_the_keys_get_a_row_and_unadmitted_initial_reads_the_initial_row():
    store = cncore.EmbeddingStore(dim=2, seed=3, admission=cncore.Probability(0.25, unadmitted="initial"),
                                  initializer=cncore.Constant(0.5), optimizer=cncore.SGD(lr=1.0))
    keys = np.arange(20_000, dtype=np.int64)
    out, ctx = store.pooled_lookup(keys, lengths=np.ones(len(keys), np.int64))
    assert abs(len(store) / len(keys) - 0.25) < 0.02
    np.testing.assert_array_equal(out, np.full((len(keys), 2), 0.5, np.float32))  # admitted or not: initial
    store.apply_gradients(ctx, np.ones((len(keys), 2), np.float32))
    after, _ = store.pooled_lookup(keys, lengths=np.ones(len(keys), np.int64), insert_missing=False)
    has_row = np.isin(keys, store.export().keys)
    np.testing.assert_array_equal(after[has_row], np.full((int(has_row.sum()), 2), -0.5, np.float32))
    np.testing.assert_array_equal(after[~has_row], np.full((int((~has_row).sum()), 2), 0.5, np.float32))


def test_an_evicted_key_is_admitted_again_with_a_fresh_row():
    store = cncore.EmbeddingStore(dim=1, seed=9, admission=cncore.Probability(1.0), max_rows=2,
                                  eviction=cncore.LRU(), headroom=0, initializer=cncore.Constant(0.0),
                                  optimizer=cncore.SGD(lr=1.0))
    sink = []
    store.on_evict(lambda batch: sink.extend(batch.keys.tolist()))
    for keys in ([5], [6], [7], [5]):
        out, ctx = store.pooled_lookup(np.array(keys), lengths=np.array([1]))
        store.apply_gradients(ctx, np.ones((1, 1), np.float32))
    assert sink == [5, 6] and sorted(store.export().keys.tolist()) == [5, 7]
    assert store.lookup(np.array([5])).tolist() == [[-1.0]]  # a fresh row, trained once


def test_the_policy_round_trips_through_a_table_file(tmp_path):
    config = cncore.StoreConfig(dim=2, seed=4, admission=cncore.Probability(0.5, unadmitted="initial"))
    store = cncore.EmbeddingStore(config)
    store.pooled_lookup(np.arange(100), lengths=np.ones(100, np.int64))
    save_table(store, str(tmp_path / "t"))
    again = load_store(str(tmp_path / "t"))
    assert again.config.admission == cncore.Probability(0.5, unadmitted="initial")
    assert sorted(again.export().keys.tolist()) == sorted(store.export().keys.tolist())
    again.pooled_lookup(np.arange(100, 200), lengths=np.ones(100, np.int64))
    assert sorted(again.export().keys.tolist()) == sorted(k for k in range(200) if admitted(4, k, 0.5))


@pytest.mark.parametrize("bad", [0, 0.0, -0.1, 1.5, True, "0.5", float("nan")])
def test_bad_probabilities_are_refused_naming_the_field(bad):
    with pytest.raises(ValueError, match="Probability.p"):
        cncore.Probability(bad)
    with pytest.raises(ValueError, match="Probability.unadmitted"):
        cncore.Probability(0.5, unadmitted="ones")
    store = cncore.EmbeddingStore(dim=1, admission=cncore.Probability(0.5))
    with pytest.raises(TypeError, match="only MinCount"):
        store.decay_admission()


@pytest.mark.parametrize("device", ["cpu", "cncard"])
def test_the_torch_module_admits_the_same_keys(monkeypatch, device):
    monkeypatch.setenv("CNCORE_CNCARD", "cpu")
    from cncore_torch import CNEmbeddingBag
    bag = CNEmbeddingBag(100, 2, mode="sum", seed=7, optimizer=cncore.SGD(lr=0.1), device=device,
                         admission=cncore.Probability(0.5))
    keys = torch.arange(-300, 300)
    bag(keys.reshape(-1, 1)).sum().backward()
    seed = bag.config.seed
    assert sorted(bag.keys().tolist()) == [k for k in range(-300, 300) if admitted(seed, k, 0.5)]


def test_the_ssd_tier_admits_the_same_keys_as_memory(tmp_path):
    config = cncore.StoreConfig(dim=4, seed=2, admission=cncore.Probability(0.5), optimizer=cncore.SGD(lr=0.1))
    memory = cncore.EmbeddingStore(config)
    tier = cncore.make_store(cncore.StoreConfig(dim=4, seed=2, admission=cncore.Probability(0.5),
                                                optimizer=cncore.SGD(lr=0.1),
                                                storage=cncore.Tiered(str(tmp_path / "t"), cache_bytes=1 << 14)))
    rng = np.random.default_rng(0)
    seen = set()
    for _ in range(6):  # more keys than the cache holds: rows go to disk and back
        keys = rng.integers(0, 3000, 256)
        seen |= set(keys.tolist())
        outs = []
        for store in (memory, tier):
            out, ctx = store.pooled_lookup(keys, lengths=np.full(32, 8))
            store.apply_gradients(ctx, np.ones((32, 4), np.float32))
            outs.append(out)
        np.testing.assert_array_equal(outs[0], outs[1])
    assert sorted(tier.export().keys.tolist()) == sorted(memory.export().keys.tolist())
    assert sorted(memory.export().keys.tolist()) == sorted(k for k in seen if admitted(2, k, 0.5))

"""Fallback rows (``StoreConfig(fallback_rows=N)``, cn_table_core.h "Fallback Rows"): random
sequences of inserts, training steps, erases, evictions, clears and evaluation lookups against
the literal model of test_bounded_eviction.py extended to them: a key without a row of its own
reads and trains the shared row mix64(key) % N with its optimizer state; a key that gets a row
starts from its fallback row's values (fallback_copy) or its initial row; fallback row j starts
as key j's initial row; len, read and export see keyed rows only; clear resets the fallback rows.
In residual mode (fallback_mode="residual") every key of a pooled lookup reads its own row (zeros
if none) plus its fallback row, both train with their own optimizer state, and a new row starts
at zero."""
import copy

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule
from reference import DictStore, _mix64, pooled_reference, uniform_row
from test_bounded_eviction import DIM, EPS, HIGH, LOW, LR, SEED, BoundedMachine, BoundedModel, keys_small

import cncore


class FallbackModel(BoundedModel):
    """BoundedModel plus N fallback rows (values and row-wise Adagrad state) as the docs state them."""

    def __init__(self, policy, max_rows, headroom, ttl, min_count, halve_every, n_fallback, copy_rows,
                 residual=False):
        super().__init__(policy, max_rows, headroom, ttl, min_count, 16, 2, False, halve_every)
        self.n_fallback, self.copy_rows, self.residual = n_fallback, copy_rows, residual
        self.reset_fallback()

    def reset_fallback(self):
        self.fb_rows = [uniform_row(SEED, j, DIM, LOW, HIGH) for j in range(self.n_fallback)]
        self.fb_state = [np.full(1, 0.25, np.float32) for _ in range(self.n_fallback)]

    def fallback_of(self, k):
        return _mix64(k % 2**64) % self.n_fallback

    def initial(self, key):  # a new keyed row's start (DictStore.find_or_insert draws it here)
        if self.residual:
            return np.zeros(DIM, np.float32)
        if self.copy_rows:
            return self.fb_rows[self.fallback_of(key)].copy()
        return super().initial(key)

    def overflow(self, keys):
        """With fallback rows, a training lookup that must evict takes one round of eviction, as
        a batch past the budget does, whatever the number of its new keys."""
        new = list(dict.fromkeys(k for k in keys if k not in self.rows))
        if len(self.rows) + len(new) <= self.max_rows:
            return keys
        used = {k for k in keys if k in self.rows}
        n = max(len(self.rows) - self.low_water, len(self.rows) + 1 - self.max_rows)
        self.evict_lowest(max(0, min(n, len(self.rows) - len(used))), exclude=used)
        over = set(new[self.max_rows - len(self.rows):])
        return [k for k in keys if k not in over]

    def read(self, keys):
        if self.residual:
            return np.array([self.rows.get(k, np.zeros(DIM, np.float32)) + self.fb_rows[self.fallback_of(k)]
                             for k in keys], dtype=np.float32).reshape(len(keys), DIM)
        return np.array([self.rows[k] if k in self.rows else self.fb_rows[self.fallback_of(k)] for k in keys],
                        dtype=np.float32).reshape(len(keys), DIM)

    def fallback_grads(self, grads):
        """The keys whose gradient reaches their fallback row: all of them in residual mode, else
        those without a row of their own."""
        return grads if self.residual else {k: g for k, g in grads.items() if k not in self.rows}

    def train_fallback(self, grads):
        """Row-wise Adagrad on each fallback row, with the gradient summed over the keys it serves."""
        summed = {}
        for k, g in grads.items():
            j = self.fallback_of(k)
            summed[j] = summed.get(j, np.zeros(DIM)) + g
        for j, g in summed.items():
            self.fb_state[j] = (self.fb_state[j] + np.mean(g * g)).astype(np.float32)
            self.fb_rows[j] = (self.fb_rows[j] - LR / (np.sqrt(self.fb_state[j][0]) + EPS) * g).astype(np.float32)


class FallbackMachine(BoundedMachine):
    @initialize(policy=st.sampled_from(["lru", "lfu", "ttl"]), max_rows=st.integers(3, 10),
                headroom=st.integers(0, 2), ttl=st.integers(0, 3), min_count=st.sampled_from([0, 2]),
                initial=st.just(False), halve_every=st.sampled_from([None, 2]), n_fallback=st.integers(1, 4),
                copy_rows=st.booleans(), mode=st.sampled_from(["miss", "residual"]))
    def setup(self, policy, max_rows, headroom, ttl, min_count, initial, halve_every, n_fallback, copy_rows, mode):
        copy_rows = copy_rows or mode == "residual"  # (residual mode refuses fallback_copy=False)
        eviction = {"lru": cncore.LRU(), "lfu": cncore.LFU(halve_every), "ttl": cncore.TTL(ttl)}[policy]
        opt = cncore.RowWiseAdagrad(lr=LR, eps=EPS, initial_accumulator_value=0.25)
        admission = cncore.MinCount(min_count, width=16, depth=2) if min_count else None
        headroom = min(headroom, max_rows - 1)
        self.store = cncore.EmbeddingStore(dim=DIM, seed=SEED, initializer=cncore.Uniform(LOW, HIGH), optimizer=opt,
                                           max_rows=max_rows, eviction=eviction, headroom=headroom,
                                           admission=admission, fallback_rows=n_fallback, fallback_copy=copy_rows,
                                           fallback_mode=mode)
        self.ref = FallbackModel(policy, max_rows, headroom, ttl, min_count, halve_every, n_fallback, copy_rows,
                                 mode == "residual")
        self.sink = []
        self.store.on_evict(self.sink.append)
        self.unordered = set()

    @rule(bags=st.lists(keys_small, min_size=1, max_size=3), seed=st.integers(0, 100), weighted=st.booleans())
    def train_step(self, bags, seed, weighted):
        keys = [k for b in bags for k in b]
        offsets = np.concatenate([[0], np.cumsum([len(b) for b in bags])]).astype(np.int64)
        rng = np.random.default_rng(seed)
        weights = rng.choice([0.0, 0.5, 3.0], len(keys)).astype(np.float32) if weighted else None
        self.ref.insert(self.ref.overflow(self.ref.admit(keys)))
        lookup_step = self.store.step
        out, ctx = self.store.pooled_lookup(np.array(keys, dtype=np.int64), offsets, per_sample_weights=weights)
        # float32 sums of up to 30 trained rows against float64 ones: the error scales with the
        # terms' magnitudes, not with the sum's (a bag of hot keys can cancel to near zero)
        rows = self.ref.read(keys)
        magnitude = pooled_reference(np.abs(rows), offsets, "sum", None if weights is None else np.abs(weights))
        np.testing.assert_array_less(np.abs(out - pooled_reference(rows, offsets, "sum", weights)),
                                     1e-5 * magnitude + 1e-6)
        grad = rng.standard_normal(out.shape).astype(np.float32)
        grads, occurrences = self.ref.backward(keys, offsets, grad, weights)
        self.store.apply_gradients(ctx, grad)
        self.ref.train_fallback(self.ref.fallback_grads(grads))
        self.ref.rowwise_adagrad({k: g for k, g in grads.items() if k in self.ref.rows}, LR, EPS)
        self.ref.record_access({k: n for k, n in occurrences.items() if k in self.ref.rows}, lookup_step)

    @rule(data=st.data())
    def clear(self, data):
        """Rarely: clear forgets every keyed row and resets the fallback rows."""
        if data.draw(st.integers(0, 9)) == 0:
            self.store.clear()
            self.ref.erased += len(self.ref.rows)
            DictStore.clear(self.ref)
            self.ref.reset_fallback()

    @rule(keys=keys_small)
    def evaluation_lookup(self, keys):
        """Unseen keys read their fallback row; nothing changes."""
        before = self.store.export_fallback()
        out, _ = self.store.pooled_lookup(np.array(keys, dtype=np.int64), lengths=np.array([len(keys)]),
                                          insert_missing=False)
        np.testing.assert_allclose(out, pooled_reference(self.ref.read(keys), np.array([0, len(keys)]), "sum"),
                                   rtol=1e-5, atol=1e-6)
        after = self.store.export_fallback()
        np.testing.assert_array_equal(before[0], after[0])

    @invariant()
    def fallback_rows_match(self):
        rows, state = self.store.export_fallback()
        np.testing.assert_allclose(rows, np.array(self.ref.fb_rows), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(state, np.array(self.ref.fb_state), rtol=1e-5)


FallbackMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestFallbackMachine = pytest.mark.slow(FallbackMachine.TestCase)


def sgd_store(**kw):
    return cncore.EmbeddingStore(dim=2, seed=3, optimizer=cncore.SGD(lr=1.0), initializer=cncore.Uniform(-1, 1), **kw)


def fallback_of(key, n):
    return _mix64(key % 2**64) % n


def test_a_key_without_a_row_trains_its_fallback_row_like_a_table_hashed_into_n_rows():
    """MinCount(9) keeps every key out: they read and train the shared rows exactly as a dense
    (N, dim) array indexed by mix64(key) % N with SGD does (NumPy's add.at as the backward)."""
    n = 3
    s = sgd_store(fallback_rows=n, admission=cncore.MinCount(9))
    keys = np.array([5, 6, 7, 5, 8], np.int64)
    offsets = np.array([0, 2, 5])
    weight = s.export_fallback()[0].astype(np.float64)
    idx = np.array([fallback_of(int(k), n) for k in keys])
    bag_of = np.repeat(np.arange(2), np.diff(offsets))
    for _ in range(2):
        out, ctx = s.pooled_lookup(keys, offsets)
        want = np.zeros((2, 2))
        np.add.at(want, bag_of, weight[idx])
        np.testing.assert_allclose(out, want, rtol=1e-6)
        grad = np.arange(4, dtype=np.float32).reshape(2, 2)
        s.apply_gradients(ctx, grad)
        np.add.at(weight, idx, -grad[bag_of])
    assert len(s) == 0
    np.testing.assert_allclose(s.export_fallback()[0], weight, rtol=1e-6)


@pytest.mark.parametrize("copy_rows", [True, False])
def test_an_admitted_key_starts_from_its_fallback_row_or_from_the_initializer(copy_rows):
    s = sgd_store(fallback_rows=2, admission=cncore.MinCount(2), fallback_copy=copy_rows)
    _, ctx = s.pooled_lookup(np.array([11]), lengths=np.array([1]))
    s.apply_gradients(ctx, np.ones((1, 2), np.float32))  # trains fallback row mix64(11) % 2
    trained = s.export_fallback()[0][fallback_of(11, 2)]
    s.pooled_lookup(np.array([11]), lengths=np.array([1]))  # second sighting: admitted
    assert len(s) == 1
    want = trained if copy_rows else cncore.initial_rows(s.config, np.array([11]))[0]
    np.testing.assert_array_equal(s.lookup(np.array([11]))[0], want)


def test_an_evicted_key_that_comes_back_starts_from_the_fallback_row_it_read_meanwhile():
    s = sgd_store(fallback_rows=1, max_rows=1, headroom=0, eviction=cncore.LRU())
    s.pooled_lookup(np.array([1]), lengths=np.array([1]))
    _, ctx = s.pooled_lookup(np.array([2, 1]), lengths=np.array([1, 1]))  # 2 evicts nothing: 1 is in use
    assert s.export().keys.tolist() == [1]
    s.apply_gradients(ctx, np.ones((2, 2), np.float32))  # 2 overflowed: it trained the fallback row
    fb = s.export_fallback()[0][0]
    s.pooled_lookup(np.array([3]), lengths=np.array([1]))  # 1 is evicted, 3 starts from the fallback row
    assert s.export().keys.tolist() == [3]
    np.testing.assert_array_equal(s.lookup(np.array([3]))[0], fb)


def test_sizes_count_keyed_rows_memory_counts_fallback_rows_and_copies_keep_them():
    plain, with_fb = sgd_store(capacity=0), sgd_store(capacity=0, fallback_rows=1000)
    assert len(with_fb) == 0 and with_fb.nbytes >= plain.nbytes + 1000 * 2 * 4
    _, ctx = with_fb.pooled_lookup(np.array([4, 5]), lengths=np.array([2]))
    with_fb.apply_gradients(ctx, np.ones((1, 2), np.float32))
    clone = copy.deepcopy(with_fb)
    for a, b in zip(clone.export_fallback(), with_fb.export_fallback()):
        np.testing.assert_array_equal(a, b)
    assert clone.export().keys.tolist() == with_fb.export().keys.tolist()


def test_without_fallback_rows_keys_without_a_row_still_read_zeros():
    s = sgd_store(admission=cncore.MinCount(5))
    out, _ = s.pooled_lookup(np.array([1, 2]), lengths=np.array([2]))
    assert out.tolist() == [[0.0, 0.0]] and s.fallback_rows == 0
    assert s.export_fallback()[0].shape == (0, 2)


def test_bad_fallback_options_are_refused_by_name():
    with pytest.raises(ValueError, match=r"fallback_rows must be an int in \[0, 2\*\*56\], got -1"):
        cncore.StoreConfig(dim=2, fallback_rows=-1)
    with pytest.raises(TypeError, match="fallback_copy must be a bool"):
        cncore.StoreConfig(dim=2, fallback_rows=2, fallback_copy="yes")
    with pytest.raises(ValueError, match="fallback_rows=2: a tiered table"):
        cncore.StoreConfig(dim=2, fallback_rows=2, storage=cncore.Tiered("/nonexistent", 1 << 20))
    with pytest.raises(ValueError, match="keys not admitted read their fallback row"):
        cncore.StoreConfig(dim=2, fallback_rows=2, admission=cncore.MinCount(2, unadmitted="initial"))
    s = sgd_store(fallback_rows=2)
    with pytest.raises(ValueError, match=r"rows: expected shape \(2, 2\)"):
        s.load_fallback(np.zeros((3, 2), np.float32))


def trained_store(**kw):
    s = cncore.EmbeddingStore(dim=3, max_rows=2, fallback_rows=4, optimizer=cncore.Adagrad(lr=0.1), **kw)
    _, ctx = s.pooled_lookup(np.array([1, 2, 3, 4, 5]), lengths=np.array([5]))
    s.apply_gradients(ctx, np.ones((1, 3), np.float32))
    return s


def assert_same_fallback(a, b):
    for x, y in zip(a.export_fallback(), b.export_fallback()):
        np.testing.assert_array_equal(x, y)


def test_a_table_file_full_delta_and_compacted_carries_the_fallback_rows(tmp_path):
    from cncore.tablefile import compact_table, load_store, save_table
    s = trained_store()
    path = str(tmp_path / "t.cnt")
    base = save_table(s, path)
    assert_same_fallback(load_store(path), s)
    _, ctx = s.pooled_lookup(np.array([6, 7, 8]), lengths=np.array([3]))  # trains keyed and fallback rows
    s.apply_gradients(ctx, np.ones((1, 3), np.float32))
    assert save_table(s, path, since=base).delta
    back = load_store(path)
    assert_same_fallback(back, s)
    assert back.config == s.config and sorted(back.export().keys.tolist()) == sorted(s.export().keys.tolist())
    compact_table(path)
    assert_same_fallback(load_store(path), s)


def test_a_table_file_without_its_fallback_rows_is_refused_by_name(tmp_path):
    import json
    import os

    from cncore.fileio import TableFormatError
    from cncore.tablefile import TableWriter, load_store, save_table
    s = trained_store()
    with pytest.raises(ValueError, match=r"fallback_rows=4: the table's fallback rows were not written"):
        with TableWriter(str(tmp_path / "w.cnt"), s.config, 0) as _:
            pass
    assert not os.path.exists(tmp_path / "w.cnt")
    path = str(tmp_path / "t.cnt")
    save_table(s, path)
    version = open(os.path.join(path, "CURRENT")).read().strip()
    manifest = os.path.join(path, version, "manifest.json")
    m = json.load(open(manifest))
    del m["fallback"]
    with open(manifest, "w") as fh:
        json.dump(m, fh)
    os.remove(os.path.join(path, version, "manifest.sha256"))
    with pytest.raises(TableFormatError, match=r"fallback: missing \(config.fallback_rows=4\)"):
        load_store(path)


def test_a_table_file_of_a_table_without_fallback_rows_holds_no_fallback_fields():
    from cncore.fileio import config_to_dict
    d = config_to_dict(cncore.StoreConfig(dim=2))
    assert "fallback_rows" not in d and "fallback_copy" not in d
    assert config_to_dict(cncore.StoreConfig(dim=2, fallback_rows=3))["fallback_rows"] == 3


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_sixteen_bit_fallback_rows_start_round_and_are_copied_bit_for_bit(dtype):
    s = cncore.EmbeddingStore(dim=3, dtype=dtype, fallback_rows=2, admission=cncore.MinCount(2),
                              optimizer=cncore.SGD(lr=0.3))
    values = s.export_fallback()[0]
    keyed = cncore.EmbeddingStore(dim=3, dtype=dtype, optimizer=cncore.SGD(lr=0.3))  # keys 0, 1 stored as rows
    keyed.find_or_insert(np.arange(2))
    np.testing.assert_array_equal(values, keyed.lookup(np.arange(2)))
    assert not np.array_equal(values, cncore.initial_rows(s.config, np.arange(2)))  # the float32 draw, rounded
    _, ctx = s.pooled_lookup(np.array([11]), lengths=np.array([1]))
    s.apply_gradients(ctx, np.ones((1, 3), np.float32))
    s.pooled_lookup(np.array([11]), lengths=np.array([1]))  # admitted: a copy of its fallback row
    np.testing.assert_array_equal(s.lookup(np.array([11]))[0], s.export_fallback()[0][fallback_of(11, 2)])
    back = copy.deepcopy(s)
    assert_same_fallback(back, s)

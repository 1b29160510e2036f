"""``StoreConfig(fallback_rows="auto")`` (cncore/store_split.py): the table starts as max_rows
keyed rows and, at the first training lookup that finds it full, chooses its split once from
its churn and repeat; a split evicts by the table's policy down to the keyed rows (the victims
to the sink), starts each fallback row as the mean of its victims (the initializer's row where
none), and from then on behaves as a table built with that split. Checked against the literal
models of test_bounded_eviction.py and test_bounded_fallback.py, extended to the decision."""
import copy

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule
from reference import DictStore, _mix64, pooled_reference, uniform_row
from test_bounded_eviction import DIM, EPS, HIGH, LOW, LR, SEED, BoundedModel
from test_bounded_fallback import FallbackMachine, FallbackModel

import cncore
from cncore import store_split
from cncore.tablefile import load_store, save_table


class AutoSplitModel(FallbackModel):
    """FallbackModel with no fallback rows until the decision, which it takes as the docs state it."""

    def __init__(self, policy, max_rows, ttl, halve_every):
        headroom = min(max(1, max_rows // 32), max_rows - 1)
        super().__init__(policy, max_rows, headroom, ttl, 0, halve_every, 0, True)
        self.pending = True
        self.measures = None

    def decide(self, keys):
        """Before a training lookup: the split, once, when the call's new keys do not fit."""
        if not self.pending:
            return
        new = set(keys) - set(self.rows)
        if len(self.rows) + len(new) <= self.max_rows:
            return
        churn = (len(self.rows) + self.evicted + len(new)) / (self.step + 1) / self.max_rows
        repeat = (sum(self.counts.values()) + len(keys)) / (len(self.rows) + len(new))
        n = 0
        if churn >= store_split.AUTO_CHURN and repeat <= store_split.AUTO_REPEAT and self.max_rows >= 2:
            n = min(self.max_rows - 1, max(1, round(self.max_rows * store_split.AUTO_SHARE)))
        elif churn >= store_split.OVERFLOW_CHURN and self.max_rows >= max(2, store_split.OVERFLOW_MIN_ROWS):
            n = min(self.max_rows - 1, max(1, round(self.max_rows * store_split.OVERFLOW_SHARE)))
        self.pending, self.measures = False, (churn, repeat, n)
        keyed = self.max_rows - n
        self.max_rows, self.low_water = keyed, keyed - min(max(1, keyed // 32), keyed - 1)
        if not n:
            return
        sinks = len(self.sink)
        self.evict_lowest(max(0, len(self.rows) - keyed))
        victims = self.sink[-1] if len(self.sink) > sinks else []
        self.n_fallback = n
        self.reset_fallback()
        for j in range(n):
            mine = [row for k, row, *_ in victims if self.fallback_of(k) == j]
            if mine:
                self.fb_rows[j] = np.mean(np.array(mine, np.float64), axis=0).astype(np.float32)

    def initial(self, key):
        return super().initial(key) if self.n_fallback else BoundedModel.initial(self, key)

    def overflow(self, keys):
        return super().overflow(keys) if self.n_fallback else BoundedModel.overflow(self, keys)

    def read(self, keys):
        return super().read(keys) if self.n_fallback else BoundedModel.read(self, keys)

    def train_fallback(self, grads):
        if self.n_fallback:
            super().train_fallback(grads)


def auto_store(max_rows, policy=None, **kw):
    opt = cncore.RowWiseAdagrad(lr=LR, eps=EPS, initial_accumulator_value=0.25)
    return cncore.EmbeddingStore(dim=DIM, seed=SEED, initializer=cncore.Uniform(LOW, HIGH), optimizer=opt,
                                 max_rows=max_rows, eviction=policy or cncore.LFU(), fallback_rows="auto", **kw)


class AutoSplitMachine(FallbackMachine):
    """Training lookups and backwards (and the bounded machine's other verbs) of an auto table
    against AutoSplitModel: the same decision at the same call, then FallbackMachine's checks."""

    @initialize(policy=st.sampled_from(["lru", "lfu", "ttl"]), max_rows=st.integers(3, 12), ttl=st.integers(0, 3),
                halve_every=st.sampled_from([None, 2]))
    def setup_auto(self, policy, max_rows, ttl, halve_every):
        eviction = {"lru": cncore.LRU(), "lfu": cncore.LFU(halve_every), "ttl": cncore.TTL(ttl)}[policy]
        self.store = auto_store(max_rows, eviction)
        self.ref = AutoSplitModel(policy, max_rows, ttl, halve_every)
        self.sink = []
        self.store.on_evict(self.sink.append)
        self.unordered = set()

    def setup(self, *a, **kw):  # (not a rule: FallbackMachine's initializer is replaced by setup_auto)
        raise AssertionError("not used")

    @rule(bags=st.lists(st.lists(st.integers(-12, 12), max_size=10), min_size=1, max_size=3),
          seed=st.integers(0, 100), weighted=st.booleans())
    def train_step(self, bags, seed, weighted):
        self.ref.decide([k for b in bags for k in b])
        super().train_step(bags, seed, weighted)
        measures = self.store.split_measures
        assert (None if measures is None else (measures.churn, measures.repeat, measures.fallback_rows)) \
            == self.ref.measures
        assert self.store.config.max_rows == self.ref.max_rows
        assert self.store.fallback_rows == self.ref.n_fallback
        assert self.store.config.fallback_rows == ("auto" if self.ref.pending else self.ref.n_fallback)

    @rule(bags=st.lists(st.lists(st.sampled_from([1, 2]), min_size=10, max_size=30), min_size=1, max_size=3),
          seed=st.integers(0, 100))
    def train_hot_keys(self, bags, seed):
        """Keys looked up many times a call: their repeat keeps the table's keyed rows."""
        self.train_step(bags, seed, False)

    @invariant()
    def fallback_rows_match(self):
        rows, state = self.store.export_fallback()
        np.testing.assert_allclose(rows, np.array(self.ref.fb_rows, np.float32).reshape(-1, DIM), rtol=1e-5,
                                   atol=1e-6)
        np.testing.assert_allclose(state, np.array(self.ref.fb_state, np.float32).reshape(-1, 1), rtol=1e-5)


AutoSplitMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=30, deadline=None)
TestAutoSplitMachine = AutoSplitMachine.TestCase  # (about 2 s)


def sgd_auto(max_rows, **kw):
    return cncore.EmbeddingStore(dim=2, seed=3, optimizer=cncore.SGD(lr=1.0), initializer=cncore.Uniform(-1, 1),
                                 max_rows=max_rows, fallback_rows="auto", **kw)


def train(store, keys, grad=1.0):
    out, ctx = store.pooled_lookup(np.array(keys, dtype=np.int64), lengths=[len(keys)])
    store.apply_gradients(ctx, np.full(out.shape, grad, np.float32))
    return out


def test_a_churning_table_splits_evicting_by_lfu_into_the_sink_and_its_fallback_rows_start_as_their_victims_mean():
    store = sgd_auto(10)
    sink = []
    store.on_evict(sink.append)
    train(store, [0, 1, 2, 3, 4, 5, 6, 7, 7, 7])    # key 7: count 3, the others 1
    before = store.read(np.arange(8))
    train(store, [5, 6])                           # step 2: keys 5 and 6 at count 2, last step 1
    before = store.read(np.arange(8))
    assert store.split_measures is None and store.config.fallback_rows == "auto" and store.fallback_rows == 0
    _, ctx = store.pooled_lookup(np.arange(8, 16), lengths=[8])  # 8 held + 8 new > 10: the decision
    # churn (8 + 0 + 8) / (2 + 1) / 10 = 0.53, repeat (12 + 8) / 16 = 1.25: 9 fallback rows, 1 keyed
    assert store.split_measures == store_split.SplitMeasures(16 / 3 / 10, 20 / 16, 9)
    assert store.config.max_rows == 1 and store.config.fallback_rows == 9 and store.config.headroom == 0
    # LFU: (count, last step, key) ascending; key 7 (count 3) stays.
    victims = [0, 1, 2, 3, 4, 5, 6]
    assert sink[0].keys.tolist() == victims
    np.testing.assert_array_equal(sink[0].rows, before.rows[victims])
    fallback = store.export_fallback()[0]
    for j in range(9):
        mine = [k for k in victims if _mix64(k) % 9 == j]
        want = (before.rows[mine].astype(np.float64).mean(axis=0) if mine
                else uniform_row(3, j, 2, -1.0, 1.0))  # fallback row j's initial row: key j's
        np.testing.assert_allclose(fallback[j], want, rtol=1e-6)
    # The kept key kept its row until the lookup's own round of eviction took it (the one keyed
    # row, unused by the lookup), and the lookup's first new key took the row.
    assert sink[1].keys.tolist() == [7]
    np.testing.assert_array_equal(sink[1].rows, before.rows[[7]])
    assert store.export().keys.tolist() == [8] and store.evicted_count == 8
    # After it: an evicted key reads its fallback row; the new key started from its own.
    out, _ = store.pooled_lookup(np.array([3]), lengths=[1], insert_missing=False)
    np.testing.assert_array_equal(out[0], fallback[_mix64(3) % 9])
    np.testing.assert_array_equal(store.lookup(np.array([8]))[0], fallback[_mix64(8) % 9])
    store.apply_gradients(ctx, np.ones((1, 2), np.float32))


def test_a_table_of_repeated_keys_or_slow_churn_keeps_its_keyed_rows():
    repeated = sgd_auto(4)
    train(repeated, [1, 1, 1, 1, 2, 2, 2, 2])
    train(repeated, [3, 3, 3, 4, 4, 5, 5, 5])         # repeat (8 + 8) / 5 = 3.2 > 3
    assert repeated.split_measures.fallback_rows == 0
    assert repeated.config.fallback_rows == 0 and repeated.config.max_rows == 4 and repeated.fallback_rows == 0
    slow = sgd_auto(8)
    for k in range(8):
        train(slow, [k])
    train(slow, [8])                                   # churn 9 / 9 / 8 = 0.125 < 0.25
    assert slow.split_measures == store_split.SplitMeasures(9 / 9 / 8, 9 / 9, 0)
    assert slow.config.max_rows == 8 and len(slow) == 8 - slow.config.headroom  # (a round of eviction)


def test_a_small_table_one_call_overflows_shares_half_its_rows_whatever_its_repeat():
    """churn >= OVERFLOW_CHURN (the call's new keys alone exceed the budget) splits
    OVERFLOW_SHARE of the rows even where repeat > AUTO_REPEAT keeps a table; not under
    OVERFLOW_MIN_ROWS rows, nor below that churn."""
    call = [k for k in range(6) for _ in range(4)]     # 6 keys, 4 lookups each: repeat 24 / 6 = 4 > 3
    small = sgd_auto(4)
    sink = []
    small.on_evict(sink.append)
    train(small, call)                                 # churn 6 / 1 / 4 = 1.5 >= 1
    assert small.split_measures == store_split.SplitMeasures(1.5, 4.0, 2)
    assert small.config.max_rows == 2 and small.config.fallback_rows == 2 and small.fallback_rows == 2
    assert len(small) <= 2 and sum(len(b.keys) for b in sink) == small.evicted_count
    tiny = sgd_auto(2)
    train(tiny, call)                                  # churn 3, but 2 rows < OVERFLOW_MIN_ROWS
    assert tiny.split_measures == store_split.SplitMeasures(3.0, 4.0, 0) and tiny.fallback_rows == 0
    slower = sgd_auto(8)
    train(slower, [k for k in range(5) for _ in range(4)])
    train(slower, [k for k in range(5, 9) for _ in range(4)])  # churn 9 / 2 / 8 = 0.56 < 1, repeat 36 / 9 = 4
    assert slower.split_measures == store_split.SplitMeasures(9 / 2 / 8, 4.0, 0) and slower.fallback_rows == 0


def test_a_split_only_comes_from_a_training_lookup():
    store = sgd_auto(4)
    store.find_or_insert(np.arange(4))
    store.pooled_lookup(np.arange(4, 12), lengths=[8], insert_missing=False)
    assert store.config.fallback_rows == "auto" and len(store) == 4


def test_a_lookup_made_before_the_split_is_refused_by_its_backward():
    store = sgd_auto(10)
    train(store, list(range(8)))
    _, old = store.pooled_lookup(np.arange(8), lengths=[8])
    _, new = store.pooled_lookup(np.arange(8, 16), lengths=[8])
    assert store.fallback_rows == 9
    before = store.export_fallback()[0]
    with pytest.raises(RuntimeError, match="erased"):
        store.apply_gradients(old, np.ones((1, 2), np.float32))
    np.testing.assert_array_equal(store.export_fallback()[0], before)
    store.apply_gradients(new, np.ones((1, 2), np.float32))


def test_the_grouped_lookup_decides_with_the_keys_of_every_feature_of_a_table():
    store = sgd_auto(10)
    train(store, list(range(6)))
    other = cncore.EmbeddingStore(dim=2)
    # 6 held + 3 new from each feature = 12 > 10; one feature's alone would fit.
    cncore.grouped_pooled_lookup([store, other, store], [np.array([10, 11, 12]), np.array([1]),
                                                          np.array([13, 14, 15])], lengths=[[3], [1], [3]])
    assert store.split_measures is not None and store.split_measures.churn == 12 / 2 / 10


def test_a_callback_that_raises_still_sees_the_split_finished():
    store = sgd_auto(10)
    store.on_evict(lambda batch: (_ for _ in ()).throw(KeyError("sink")))
    train(store, list(range(8)))
    with pytest.raises(KeyError, match="sink"):
        store.pooled_lookup(np.arange(8, 16), lengths=[8])
    assert store.config.max_rows == 1 and store.fallback_rows == 9 and store.evicted_count == 7


def test_threads_filling_one_auto_table_split_it_once():
    import threading
    store = sgd_auto(64)
    sink, refused, errors = [], [], []
    store.on_evict(sink.append)

    def worker(offset):
        try:
            for i in range(20):
                keys = np.arange(8) + offset + 1000 * i
                out, ctx = store.pooled_lookup(keys, lengths=[8])
                try:
                    store.apply_gradients(ctx, np.ones(out.shape, np.float32))
                except RuntimeError as e:  # a lookup in flight on the table the split replaced
                    refused.append(e)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(100 * t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert all("erased" in str(e) for e in refused)
    assert store.split_measures is not None and store.config.fallback_rows == store.split_measures.fallback_rows
    assert store.evicted_count == sum(len(b.keys) for b in sink) and len(store) <= store.config.max_rows


def test_set_optimizer_keeps_the_fallback_rows_values():
    store = cncore.EmbeddingStore(dim=1, max_rows=4, fallback_rows="auto")
    store.choose_split(2)
    store.load_fallback(np.array([[1.0], [2.0]], np.float32))
    store.set_optimizer(cncore.Adagrad(lr=0.1, initial_accumulator_value=0.5))
    rows, state = store.export_fallback()
    assert rows.tolist() == [[1.0], [2.0]] and state.tolist() == [[0.5], [0.5]]
    assert store.config.fallback_rows == 2 and store.config.optimizer is not None


def run_twice():
    store = auto_store(6)
    rng = np.random.default_rng(0)
    for _ in range(6):
        keys = rng.integers(-20, 20, 12)
        out, ctx = store.pooled_lookup(keys, lengths=[6, 6])
        store.apply_gradients(ctx, rng.standard_normal(out.shape).astype(np.float32))
    batch = store.export()
    order = np.argsort(batch.keys)
    return store.config, batch.keys[order], batch.rows[order], store.export_fallback()


def test_two_runs_give_the_same_split_and_the_same_bits():
    a, b = run_twice(), run_twice()
    assert a[0] == b[0] and a[0].fallback_rows != "auto"
    for x, y in zip(a[1:3] + a[3], b[1:3] + b[3]):
        assert x.tobytes() == y.tobytes()


def same_store(a, b):
    assert a.config == b.config and a.step == b.step and a.evicted_count == b.evicted_count
    ea, eb = a.export(), b.export()
    oa, ob = np.argsort(ea.keys), np.argsort(eb.keys)
    assert ea.keys[oa].tolist() == eb.keys[ob].tolist()
    np.testing.assert_array_equal(ea.rows[oa], eb.rows[ob])
    np.testing.assert_array_equal(ea.counts[oa], eb.counts[ob])
    for x, y in zip(a.export_fallback(), b.export_fallback()):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("decided", [False, True])
def test_table_files_and_copies_keep_an_undecided_table_undecided_and_a_decided_one_split(tmp_path, decided):
    store = sgd_auto(10)
    train(store, list(range(8)))
    if decided:
        train(store, list(range(8, 16)))
        assert store.fallback_rows == 9
    save_table(store, str(tmp_path / "t.cnt"))
    for back in (load_store(str(tmp_path / "t.cnt")), copy.deepcopy(store)):
        same_store(store, back)
        assert back.config.fallback_rows == (9 if decided else "auto")
        # The same next call decides the same way (its measures come from the rows and the step).
        twin = copy.deepcopy(store)
        np.testing.assert_array_equal(train(twin, list(range(16, 24))), train(back, list(range(16, 24))))
        same_store(twin, back)


def test_a_collections_state_dict_carries_the_split_or_its_absence():
    torch = pytest.importorskip("torch")
    from torchrec import EmbeddingBagConfig
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from cncore_torch.collection import CNEmbeddingBagCollection

    def collection():
        return CNEmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name="t", embedding_dim=2, num_embeddings=10, feature_names=["f"])],
            optimizer=cncore.SGD(lr=0.5), max_rows=10, fallback_rows="auto")

    def step(ebc, ids):
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f"], values=torch.tensor(ids),
                                                  lengths=torch.tensor([len(ids)]))
        ebc(kjt).values().sum().backward()

    ebc = collection()
    step(ebc, list(range(8)))
    undecided = ebc.state_dict()
    assert "tables.t.fallback_rows" not in undecided
    step(ebc, list(range(8, 16)))
    decided = ebc.state_dict()
    assert ebc.stores["t"].fallback_rows == 9 and len(decided["tables.t.fallback_rows"]) == 9
    fresh = collection()
    fresh.load_state_dict(decided)
    assert fresh.stores["t"].config == ebc.stores["t"].config
    same_store(fresh.stores["t"], ebc.stores["t"])
    back = collection()
    back.load_state_dict(undecided)
    assert back.stores["t"].config.fallback_rows == "auto" and len(back.stores["t"]) == 8


def test_a_delta_saved_across_the_split_loads_as_the_split_table(tmp_path):
    store = sgd_auto(10)
    train(store, list(range(8)))
    path = str(tmp_path / "t.cnt")
    base = save_table(store, path)
    train(store, list(range(8, 16)))
    save_table(store, path, since=base)
    same_store(store, load_store(path))


def test_a_delta_saved_across_a_decision_to_keep_the_keyed_rows_is_a_full_save_and_loads(tmp_path):
    store = sgd_auto(4)
    train(store, [1, 1, 1, 1, 2, 2, 2, 2])
    path = str(tmp_path / "t.cnt")
    base = save_table(store, path)
    train(store, [3, 3, 3, 4, 4, 5, 5, 5])  # repeat 3.2 > 3: keeps its keyed rows (fallback_rows 0)
    assert store.config.fallback_rows == 0
    assert not save_table(store, path, since=base).delta  # the config changed since base
    same_store(store, load_store(path))


@pytest.mark.parametrize("decided", [False, True])
def test_dcp_loads_the_split_or_its_absence_into_a_fresh_auto_collection(tmp_path, decided):
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp
    from torchrec import EmbeddingBagConfig
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from cncore_torch.collection import CNEmbeddingBagCollection
    from cncore_torch.dcp import CNLoadPlanner

    def collection():
        return CNEmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name="t", embedding_dim=2, num_embeddings=10, feature_names=["f"])],
            optimizer=cncore.SGD(lr=0.5), max_rows=10, fallback_rows="auto")

    ebc = collection()
    for ids in ([list(range(8)), list(range(8, 16))] if decided else [list(range(8))]):
        kjt = KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor(ids), torch.tensor([len(ids)]))
        ebc(kjt).values().sum().backward()
    dcp.save({"model": ebc.state_dict()}, checkpoint_id=str(tmp_path), no_dist=True)
    fresh = collection()
    state = {"model": fresh.state_dict()}
    dcp.load(state, checkpoint_id=str(tmp_path), planner=CNLoadPlanner(), no_dist=True)
    fresh.load_state_dict(state["model"])
    assert fresh.stores["t"].config.fallback_rows == (9 if decided else "auto")
    same_store(fresh.stores["t"], ebc.stores["t"])


def test_what_auto_cannot_do_is_refused_by_name(tmp_path):
    refusals = [
        (dict(), "set max_rows too"),
        (dict(max_rows=8, storage=cncore.Tiered(str(tmp_path / "t"), cache_bytes=1 << 20)), "tiered table"),
        (dict(max_rows=8, fallback_mode="residual"), "fallback_mode='residual'"),
        (dict(max_rows=8, admission=cncore.MinCount(2)), "admission=MinCount"),
        (dict(max_rows=8, admission=cncore.Probability(0.5)), "admission=Probability"),
    ]
    for fields, message in refusals:
        with pytest.raises(ValueError, match=r"fallback_rows='auto': .*" + message.replace("(", r"\(")):
            cncore.StoreConfig(dim=2, fallback_rows="auto", **fields)
    with pytest.raises(ValueError, match="fallback_rows must be an int in .* or 'auto', got 'yes'"):
        cncore.StoreConfig(dim=2, max_rows=8, fallback_rows="yes")
    store = sgd_auto(4)
    for bad in (4, -1, 1.5, True):
        with pytest.raises(ValueError, match=r"fallback_rows must be an int in \[0, 3\]"):
            store.choose_split(bad)
    assert store.config.fallback_rows == "auto"
    store.choose_split(2)
    with pytest.raises(ValueError, match="its split is fixed"):
        store.choose_split(1)


def test_device_tables_refuse_auto_by_name_and_an_undecided_shard_saves_no_fallback_rows():
    pytest.importorskip("torch")
    from cncore_torch.state import save_store
    entries = {}  # a shard (test_distributed_fallback.py): its entries, 0 fallback rows while undecided
    save_store(sgd_auto(4), entries, "t.", shard=(0, 2, 0), fallback_entries=True)
    assert tuple(entries["t.fallback_rows"].shape) == (0, 2) and int(entries["t.fallback_count"]) == 0
    import torch

    from cncore_torch.device_rows import DeviceRows
    config = cncore.StoreConfig(dim=2, max_rows=4, fallback_rows="auto")
    for key_index in ("host", "device"):
        with pytest.raises(ValueError, match="fallback_rows=auto: (rows on an accelerator|the device index) keep"):
            DeviceRows(config, torch.device("cpu"), key_index)


def test_the_model_and_the_store_agree_on_a_decision_a_lookup_at_a_time():
    """A short fixed run of the state machine's steps (the hypothesis machine is marked slow)."""
    store, ref = auto_store(5), AutoSplitModel("lfu", 5, 0, None)
    rng = np.random.default_rng(3)
    for _ in range(8):
        keys = [int(k) for k in rng.integers(-12, 12, 6)]
        ref.decide(keys)
        ref.insert(ref.overflow(keys))
        step = store.step
        out, ctx = store.pooled_lookup(np.array(keys, dtype=np.int64), lengths=[6])
        np.testing.assert_allclose(out, pooled_reference(ref.read(keys), np.array([0, 6]), "sum"), rtol=1e-5,
                                   atol=1e-6)
        grad = rng.standard_normal(out.shape).astype(np.float32)
        grads, occurrences = ref.backward(keys, np.array([0, 6]), grad, None)
        store.apply_gradients(ctx, grad)
        ref.train_fallback(ref.fallback_grads(grads))
        ref.rowwise_adagrad({k: g for k, g in grads.items() if k in ref.rows}, LR, EPS)
        ref.record_access({k: n for k, n in occurrences.items() if k in ref.rows}, step)
    assert not ref.pending and store.config.max_rows == ref.max_rows
    np.testing.assert_allclose(store.export_fallback()[0], np.array(ref.fb_rows, np.float32).reshape(-1, DIM),
                               rtol=1e-5, atol=1e-6)
    assert sorted(store.export().keys.tolist()) == sorted(ref.rows)
    assert DictStore.lookup(ref, list(ref.rows)).shape == (len(ref.rows), DIM)


@pytest.mark.parametrize("grouped", [True, False])
def test_a_training_lookup_the_core_refuses_splits_nothing(grouped):
    # The split comes before the core's lookup; at the step limit the core refuses the call,
    # and a refused call changes no table: the table that would have split stays undecided.
    def make():
        s = cncore.EmbeddingStore(dim=1, max_rows=10, fallback_rows="auto", optimizer=cncore.SGD(lr=1.0))
        _, ctx = s.pooled_lookup(np.arange(8), lengths=[8])
        s.apply_gradients(ctx, np.ones((1, 1), np.float32))
        return s
    auto, reference_store = make(), make()
    at_limit = cncore.EmbeddingStore(dim=1, optimizer=cncore.SGD(lr=1.0))
    at_limit.step = 2**32 - 1
    if not grouped:
        auto.step = 2**32 - 1
    before = auto.export()
    with pytest.raises(ValueError, match="2\\*\\*32 - 1"):
        if grouped:
            cncore.grouped_pooled_lookup([auto, at_limit], [np.arange(8, 16), np.array([1])], lengths=[[8], [1]])
        else:
            auto.pooled_lookup(np.arange(8, 16), lengths=[8])
    after = auto.export()
    assert auto.config.fallback_rows == "auto" and auto.fallback_rows == 0 and auto.split_measures is None
    assert np.array_equal(before.keys, after.keys) and np.array_equal(before.rows, after.rows)
    assert auto.evicted_count == 0
    # the same call on a table that is not at the limit splits, as the module doc's example says
    reference_store.pooled_lookup(np.arange(8, 16), lengths=[8])
    assert reference_store.fallback_rows == 9

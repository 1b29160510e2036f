"""The device key index (cncore_torch.device_index) against the core's index and a literal model.

Runs on the CPU device; with CNCORE_TEST_ACCELERATOR=1 on the accelerator (CUDA or MLU), where
the same checks compare the device's results (brought back with .cpu()) with the core's.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from reference import EDGE_KEYS, M64, _mix64, uniform_row

import cncore
from cncore_torch.device_index import WAYS, DeviceKeyIndex, initial_rows, mix64


def _device() -> torch.device:
    if os.environ.get("CNCORE_TEST_ACCELERATOR") == "1":
        from cncore_torch.devices import resolve_device
        return resolve_device("cncard").device
    return torch.device("cpu")


DEVICE = _device()
POOL = EDGE_KEYS + list(range(-20, 21))


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


# --- the hashes and the initialiser, bit for bit ---------------------------------------------------

def test_mix64_equals_the_specification_on_edge_keys():
    keys = EDGE_KEYS + [123456789, -987654321]
    got = _np(mix64(torch.tensor(keys, device=DEVICE))).astype(np.uint64).tolist()
    assert got == [_mix64(k & M64) for k in keys]


@pytest.mark.parametrize("init", [cncore.Uniform(-0.3, 0.7), cncore.Uniform(), cncore.Constant(0.25),
                                  cncore.Normal(0.5, 2.0), cncore.TruncatedNormal(0.0, 1.0, -0.5, 0.5)])
def test_initial_rows_equal_the_cores_bit_for_bit(init):
    keys = np.array(EDGE_KEYS + list(np.random.default_rng(0).integers(-2**63, 2**63 - 1, 500)), dtype=np.int64)
    cfg = cncore.StoreConfig(dim=13, seed=11, initializer=init)
    got = _np(initial_rows(cfg, torch.from_numpy(keys).to(DEVICE)))
    assert got.dtype == np.float32
    assert np.array_equal(got.view(np.uint32), cncore.initial_rows(cfg, keys).view(np.uint32))


def test_uniform_rows_equal_the_specification_bit_for_bit():
    """The spec's low + span * u in float32, rounded twice (the product, then the sum): the core
    compiles its initialiser without fused multiply-adds (cn_init.h), and the device rounds the same."""
    cfg = cncore.StoreConfig(dim=5, seed=3, initializer=cncore.Uniform(-1.0, 2.0))
    got = _np(initial_rows(cfg, torch.tensor(EDGE_KEYS, device=DEVICE)))
    want = np.stack([uniform_row(3, k, 5, -1.0, 2.0) for k in EDGE_KEYS])
    np.testing.assert_array_equal(got, want)


# --- a literal model of the core's index (cn_table.h, cn_arena.h, cn_evict.h as they state it) ---

class LiteralIndex:
    """A dict key -> slot; slots from a free stack, else the next new one; eviction by sorting
    (score, key) over the live rows; every rule as the core's comments state it."""

    def __init__(self, cfg: cncore.StoreConfig):
        self.cfg, self.slot, self.meta = cfg, {}, {}
        self.free: list[int] = []
        self.high, self.step, self.evicted = 0, 0, []
        self.max_rows = cfg.max_rows or 0
        self.low_water = self.max_rows - (cfg.headroom or 0)

    def score(self, key):
        count, last = self.meta[key]
        ev = self.cfg.eviction
        if isinstance(ev, cncore.LFU):
            if ev.halve_every is not None:
                idle = self.step - last
                period = ev.halve_every if ev.halve_every != "auto" else 2 ** cncore.policies.auto_halve_shift(
                    self.step, self.max_rows, len(self.slot), len(self.evicted))  # at the eviction, as cn_evict.h
                halvings = idle // period if idle > 0 else 0
                count = 0 if halvings >= 32 else count >> halvings
            return (count, last, key)
        return (last, key)

    def evict_lowest(self, k, pinned=()):
        order = sorted((key for key in self.slot if key not in pinned), key=self.score)[:k]
        for key in order:
            self.free.append(self.slot.pop(key))
            del self.meta[key]
        self.evicted.extend(order)
        return len(order)

    def find_or_insert(self, keys, overflow=False):
        found = [k in self.slot for k in keys]
        new = list(dict.fromkeys(k for k in keys if k not in self.slot))
        if self.max_rows and len(self.slot) + len(new) > self.max_rows:
            pinned = {k for k in keys if k in self.slot}
            if overflow and len(pinned) + len(new) > self.max_rows:
                # a training lookup: one round of eviction (at least one row, never the call's
                # own), then the first new keys that fit get rows
                size = len(self.slot)
                k = max(0, min(max(size - self.low_water, size + 1 - self.max_rows), size - len(pinned)))
                self.evict_lowest(k, pinned)
                new = new[: max(0, self.max_rows - len(self.slot))]
            elif len(pinned) + len(new) > self.max_rows:
                raise ValueError("max_rows")
            else:
                self.evict_lowest(min(len(self.slot) + len(new) - self.low_water, len(self.slot) - len(pinned)),
                                  pinned)
        for k in new:
            if self.free:
                self.slot[k] = self.free.pop()
            else:
                self.slot[k] = self.high
                self.high += 1
            self.meta[k] = (0, 0)
        return [self.slot.get(k, -1) for k in keys], found

    def erase(self, keys):
        out = []
        for k in keys:
            out.append(k in self.slot)
            if k in self.slot:
                self.free.append(self.slot.pop(k))
                del self.meta[k]
        return out

    def train(self, keys):
        self.find_or_insert(keys, overflow=True)
        kept = [k for k in keys if k in self.slot]
        for k, c in zip(*np.unique(np.array(kept, dtype=np.int64), return_counts=True)):
            count, _ = self.meta[int(k)]
            self.meta[int(k)] = (min(count + int(c), 2**32 - 1), self.step)
        self.step += 1


CONFIGS = {
    "unbounded": {},
    "lru": {"max_rows": 12, "eviction": cncore.LRU(), "headroom": 3},
    "lfu": {"max_rows": 12, "eviction": cncore.LFU()},
    "lfu-aging": {"max_rows": 10, "eviction": cncore.LFU(halve_every=2), "headroom": 2},
    "lfu-auto": {"max_rows": 6, "eviction": cncore.LFU(halve_every="auto"), "headroom": 1},
    "ttl": {"max_rows": 14, "eviction": cncore.TTL(3), "headroom": 1},
    "mincount": {"max_rows": 12, "eviction": cncore.LRU(), "admission": cncore.MinCount(2, width=16, depth=2)},
    "probability": {"admission": cncore.Probability(0.5)},
}
keys_st = st.lists(st.sampled_from(POOL), min_size=0, max_size=24)


class IndexMachine(RuleBasedStateMachine):
    """Every call on the device index, the core store and (without admission) the literal model;
    after each, the same keys in the same slots with the same metadata and evicted keys."""

    @initialize(name=st.sampled_from(sorted(CONFIGS)))
    def build(self, name):
        self.cfg = cncore.StoreConfig(dim=3, capacity=16, seed=5, optimizer=cncore.SGD(lr=0.0),  # a row per key,
                                      initializer=cncore.Uniform(-1.0, 1.0), fallback_rows=0,  # as the device index
                                      **CONFIGS[name])
        self.core = cncore.EmbeddingStore(self.cfg)
        self.core_evicted: list[int] = []
        self.dev_evicted: list[int] = []
        self.idx = DeviceKeyIndex(self.cfg, DEVICE)
        if self.cfg.eviction is not None:  # a sink makes the core hand victims over in eviction order
            self.core.on_evict(lambda b: self.core_evicted.extend(b.keys.tolist()))
            self.idx.on_evict(lambda b: self.dev_evicted.extend(_np(b.keys).tolist()))
        self.model = LiteralIndex(self.cfg) if self.cfg.admission is None else None

    def _both(self, core_call, dev_call):
        try:
            want = core_call()
        except ValueError as exc:
            with pytest.raises(ValueError, match="exceed the table's max_rows"):
                dev_call()
            return exc
        return want, dev_call()

    @rule(keys=keys_st)
    def find_or_insert(self, keys):
        arr = np.array(keys, dtype=np.int64)
        out = self._both(lambda: self.core.find_or_insert(arr), lambda: self.idx.find_or_insert(torch.from_numpy(arr)))
        if isinstance(out, ValueError):
            if self.model is not None:
                with pytest.raises(ValueError):
                    self.model.find_or_insert(keys)
            return
        (slots, found), r = out
        assert _np(r.slots).tolist() == slots.tolist()
        assert _np(r.found).tolist() == found.tolist()
        new = _np(r.new_keys)
        assert new.tolist() == list(dict.fromkeys(arr[~found].tolist()))
        assert np.array_equal(_np(initial_rows(self.cfg, r.new_keys)), self.core.read(new).rows)
        if self.model is not None:
            assert self.model.find_or_insert(keys) == (slots.tolist(), found.tolist())

    @rule(keys=keys_st)
    def train(self, keys):
        """A training lookup (admission decides) and its backward (accesses recorded)."""
        arr = np.array(keys, dtype=np.int64)

        def core_call():
            out, ctx = self.core.pooled_lookup(arr, lengths=np.array([len(arr)]))
            self.core.apply_gradients(ctx, np.zeros_like(out))
            return self.core.find(arr)

        def dev_call():
            r = self.idx.find_or_insert(torch.from_numpy(arr).to(DEVICE), admit=True)
            used = r.slots[r.slots >= 0]
            uniq, occ = torch.unique(used, return_counts=True)
            self.idx.record_access(uniq, occ)
            self.idx.step += 1
            return r

        out = self._both(core_call, dev_call)
        if isinstance(out, ValueError):
            return
        (slots, _), r = out
        assert _np(r.slots).tolist() == slots.tolist()
        if self.model is not None:
            self.model.train(keys)

    @rule(keys=keys_st)
    def erase(self, keys):
        arr = np.array(keys, dtype=np.int64)
        erased = self.core.erase(arr)
        assert _np(self.idx.erase(torch.from_numpy(arr))).tolist() == erased.tolist()
        if self.model is not None:
            assert self.model.erase(keys) == erased.tolist()

    @rule(n=st.integers(0, 6))
    def evict(self, n):
        if self.cfg.eviction is None:
            with pytest.raises(TypeError, match="no eviction policy"):
                self.idx.evict(n)
            return
        k = self.core.evict(n)
        assert self.idx.evict(n) == k
        if self.model is not None:
            assert self.model.evict_lowest(min(n, len(self.model.slot))) == k

    @rule()
    def evict_expired(self):
        if not isinstance(self.cfg.eviction, cncore.TTL):
            return
        k = self.core.evict_expired()
        assert self.idx.evict_expired() == k
        if self.model is not None:
            expired = [key for key, (_, last) in self.model.meta.items() if self.model.step - last > 3]
            assert self.model.evict_lowest(len(expired)) == k

    @invariant()
    def same_table(self):
        if not hasattr(self, "core"):
            return
        exp = self.core.export()
        keys, slots = self.idx.export_slots()
        got = dict(zip(_np(keys).tolist(), _np(slots).tolist()))
        core_slots, _ = self.core.find(exp.keys)
        assert got == dict(zip(exp.keys.tolist(), core_slots.tolist()))
        assert len(self.idx) == len(self.core) == len(got)
        order = np.argsort(exp.keys)
        at = torch.from_numpy(core_slots[order]).to(DEVICE)
        assert _np(self.idx.counts[at]).tolist() == exp.counts[order].tolist()
        assert _np(self.idx.last_steps[at]).tolist() == exp.last_steps[order].tolist()
        assert self.idx.evicted_count == self.core.evicted_count
        assert self.dev_evicted == self.core_evicted
        if self.model is not None:
            assert self.model.slot == got
            assert self.model.evicted == self.core_evicted


IndexMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)
test_index_against_core_and_literal_model = pytest.mark.slow(IndexMachine.TestCase)


# --- batches ----------------------------------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(keys=st.lists(st.sampled_from([0, -1, 2**63 - 1, -(2**63), 7]), min_size=1, max_size=200))
def test_duplicate_heavy_batch_gives_one_slot_per_key_in_first_occurrence_order(keys):
    idx = DeviceKeyIndex(cncore.StoreConfig(dim=1), DEVICE)
    r = idx.find_or_insert(torch.tensor(keys, device=DEVICE))
    first = list(dict.fromkeys(keys))
    assert _np(r.new_keys).tolist() == first
    assert _np(r.slots).tolist() == [first.index(k) for k in keys]
    assert len(idx) == len(first)


def _colliding_keys(n_buckets: int, n: int) -> list[int]:
    """n keys whose home bucket is the same in an index of n_buckets buckets."""
    cand = torch.arange(200_000)
    b = mix64(cand) & (n_buckets - 1)
    return cand[b == b[0]][:n].tolist()


def test_a_full_bucket_doubles_the_buckets_and_keeps_every_key():
    idx = DeviceKeyIndex(cncore.StoreConfig(dim=1, capacity=16), DEVICE)
    nb = idx.n_buckets
    keys = _colliding_keys(nb, 3 * WAYS)
    r = idx.find_or_insert(torch.tensor(keys, device=DEVICE))
    assert idx.n_buckets > nb
    assert _np(r.slots).tolist() == list(range(len(keys)))
    slots, found = idx.find(torch.tensor(keys, device=DEVICE))
    assert bool(found.all()) and _np(slots).tolist() == list(range(len(keys)))


def test_growth_by_load_keeps_slots_and_load_under_the_limit():
    core = cncore.EmbeddingStore(dim=1, capacity=16)
    idx = DeviceKeyIndex(cncore.StoreConfig(dim=1, capacity=16), DEVICE)
    rng = np.random.default_rng(1)
    for _ in range(20):
        keys = rng.integers(-2**63, 2**63 - 1, 300, dtype=np.int64)
        keys[::7] = keys[0]
        assert _np(idx.find_or_insert(torch.from_numpy(keys)).slots).tolist() == core.find_or_insert(keys)[0].tolist()
    assert len(idx) == len(core) and idx.load_factor <= 0.5 and idx.high_water == len(core)


# --- refusals ---------------------------------------------------------------------------------------

def test_bad_keys_are_refused_naming_the_argument():
    idx = DeviceKeyIndex(cncore.StoreConfig(dim=1), DEVICE)
    with pytest.raises(TypeError, match=r"keys: expected an integer tensor of keys, got dtype torch\.float32"):
        idx.find_or_insert(torch.tensor([1.0]))
    with pytest.raises(ValueError, match=r"keys: expected a 1-D tensor of keys, got shape \(1, 2\)"):
        idx.find(torch.tensor([[1, 2]]))
    with pytest.raises(TypeError, match=r"config must be a cncore\.StoreConfig, got dict"):
        DeviceKeyIndex({"dim": 1})  # type: ignore[arg-type]


def test_an_explicit_insert_past_the_budget_is_refused_and_changes_nothing():
    idx = DeviceKeyIndex(cncore.StoreConfig(dim=1, max_rows=4, eviction=cncore.LRU()), DEVICE)
    idx.find_or_insert(torch.tensor([1, 2], device=DEVICE))
    with pytest.raises(ValueError, match=r"the call's distinct keys exceed the table's max_rows \(4\)"):
        idx.find_or_insert(torch.tensor([1, 2, 3, 4, 5], device=DEVICE))
    assert _np(idx.export_slots()[0]).tolist() == [1, 2] and idx.evicted_count == 0


def test_a_training_lookup_past_the_budget_gives_rows_to_the_first_new_keys_as_the_core():
    cfg = cncore.StoreConfig(dim=1, max_rows=4, eviction=cncore.LRU(), admission=cncore.MinCount(1, width=16))
    core, idx = cncore.EmbeddingStore(cfg), DeviceKeyIndex(cfg, DEVICE)
    keys = np.array([9, 1, 9, 2, 3, 4, 5, 1], dtype=np.int64)
    core.find_or_insert(np.array([1, 7]))
    idx.find_or_insert(torch.tensor([1, 7], device=DEVICE))
    core.pooled_lookup(keys, lengths=np.array([len(keys)]))
    r = idx.find_or_insert(torch.from_numpy(keys).to(DEVICE), admit=True)
    # 2 rows of 4, low water 3: no row needs to go, so the first two new keys take the free rows
    assert _np(r.slots).tolist() == core.find(keys)[0].tolist() == [2, 0, 2, 3, -1, -1, -1, 0]
    assert _np(r.new_keys).tolist() == [9, 2] and idx.evicted_count == core.evicted_count == 0
    r = idx.find_or_insert(torch.tensor([8, 6, 5, 4, 3], device=DEVICE), admit=True)  # one round evicts 1
    core.pooled_lookup(np.array([8, 6, 5, 4, 3]), lengths=np.array([5]))
    assert _np(r.slots).tolist() == core.find(np.array([8, 6, 5, 4, 3]))[0].tolist()
    assert idx.evicted_count == core.evicted_count == 1
    assert torch.equal(idx._sketch.cpu(), torch.from_numpy(core._table.admission_counters.astype(np.int64)))


# --- the device index behind CNEmbeddingBag(device="cncard") ----------------------------------------

@pytest.fixture
def device_index(cncard, monkeypatch):
    """Accelerator tables built with their key index on the device."""
    monkeypatch.setenv("CNCORE_DEVICE_INDEX", "device")


def _sorted_export(module):
    e = module.export()
    order = torch.argsort(e["keys"].cpu())
    return {k: v.cpu()[order] for k, v in e.items()}


@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("optimizer", [cncore.SGD(lr=0.1), cncore.RowWiseAdagrad(lr=0.1), cncore.Adam(lr=0.01)],
                         ids=["sgd", "rowwise", "adam"])
def test_a_bounded_bag_with_the_device_index_trains_like_the_core(device_index, mode, optimizer):
    from cncore_torch import CNEmbeddingBag
    from cncore_torch.device_rows import DeviceIndexedRows
    kw = {"mode": mode, "optimizer": optimizer, "max_rows": 24, "eviction": cncore.LFU(), "headroom": 3, "seed": 4,
              "admission": cncore.MinCount(2, width=64), "initializer": cncore.Uniform(-0.5, 0.5)}
    core, card = CNEmbeddingBag(1000, 4, **kw), CNEmbeddingBag(1000, 4, device="cncard", **kw)
    assert isinstance(card.device_rows, DeviceIndexedRows)
    sunk = {"core": [], "card": []}
    core.store.on_evict(lambda b: sunk["core"].append((b.keys.tolist(), b.rows.copy())))
    card.device_rows.on_evict(lambda b: sunk["card"].append((b.keys.tolist(), b.rows.copy())))
    rng = np.random.default_rng(2)
    for _ in range(12):
        ids = torch.from_numpy(rng.integers(-15, 30, (8, 3)))
        ids[0, 0] = -(2**63)
        w = torch.rand(8, 3)
        g = torch.randn(8, 4)
        a, b = core(ids, per_sample_weights=w), card(ids, per_sample_weights=w)
        torch.testing.assert_close(b.cpu(), a)
        a.backward(g)
        b.backward(g.to(b.device))
    ea, eb = _sorted_export(core), _sorted_export(card)
    assert eb["keys"].tolist() == ea["keys"].tolist()
    for name in ea:
        torch.testing.assert_close(eb[name], ea[name], rtol=1e-5, atol=1e-6)
    assert [k for k, _ in sunk["card"]] == [k for k, _ in sunk["core"]] and sunk["core"]
    for (_, rc), (_, rd) in zip(sunk["core"], sunk["card"]):
        np.testing.assert_allclose(rd, rc, rtol=1e-5, atol=1e-6)
    assert card.device_rows.evicted_count == core.store.evicted_count


def test_state_dict_moves_between_the_device_index_and_the_core(device_index):
    from cncore_torch import CNEmbeddingBag
    kw = {"mode": "sum", "optimizer": cncore.Adagrad(lr=0.1), "max_rows": 10, "eviction": cncore.LRU()}
    card = CNEmbeddingBag(100, 3, device="cncard", **kw)
    for ids in ([[1, 2, 3]], [[4, -(2**63), 2**63 - 1]], [[7, 8, 9, 10, 11]]):
        card(torch.tensor(ids)).sum().backward()
    core = CNEmbeddingBag(100, 3, **kw)
    core.load_state_dict(card.state_dict())
    back = CNEmbeddingBag(100, 3, device="cncard", **kw)
    back.load_state_dict(core.state_dict())
    ea, eb, ec = _sorted_export(card), _sorted_export(core), _sorted_export(back)
    for name in ea:
        assert torch.equal(eb[name], ea[name]) and torch.equal(ec[name], ea[name])
    assert core.store.evicted_count == card.device_rows.evicted_count == back.device_rows.evicted_count


def test_a_deep_copy_keeps_the_device_index_and_every_row(device_index):
    import copy

    from cncore_torch import CNEmbeddingBag
    from cncore_torch.device_rows import DeviceIndexedRows
    bag = CNEmbeddingBag(100, 3, mode="sum", optimizer=cncore.SGD(lr=0.1), device="cncard")
    bag(torch.tensor([[1, -(2**63), 5]])).sum().backward()
    twin = copy.deepcopy(bag)
    assert isinstance(twin.device_rows, DeviceIndexedRows)
    ea, eb = _sorted_export(bag), _sorted_export(twin)
    for name in ea:
        assert torch.equal(ea[name], eb[name])
    twin(torch.tensor([[7]])).sum().backward()
    assert len(twin.device_rows) == 4 and len(bag.device_rows) == 3


def test_a_bad_key_index_choice_is_refused_naming_it(cncard, monkeypatch):
    from cncore_torch import CNEmbeddingBag
    from cncore_torch.device_rows import DeviceRows
    monkeypatch.setenv("CNCORE_DEVICE_INDEX", "gpu")
    with pytest.raises(ValueError, match=r"CNCORE_DEVICE_INDEX='gpu': expected 'host' .* or 'device'"):
        CNEmbeddingBag(10, 2, device="cncard")
    with pytest.raises(ValueError, match=r"key_index='hbm': expected 'host'"):
        DeviceRows(cncore.StoreConfig(dim=2), torch.device("cpu"), key_index="hbm")


def test_both_collections_with_the_device_index_train_like_the_core(device_index):
    from torchrec import EmbeddingBagConfig, EmbeddingConfig, KeyedJaggedTensor

    from cncore_torch import CNEmbeddingBagCollection, CNEmbeddingCollection
    from cncore_torch.device_rows import DeviceIndexedRows
    bags = [EmbeddingBagConfig(name="t_user", embedding_dim=4, num_embeddings=50, feature_names=["user", "friend"]),
            EmbeddingBagConfig(name="t_item", embedding_dim=8, num_embeddings=50, feature_names=["item"])]
    seqs = [EmbeddingConfig(name="t_user", embedding_dim=4, num_embeddings=50, feature_names=["user", "friend"])]
    kw = {"optimizer": cncore.RowWiseAdagrad(lr=0.1), "seed": 3}
    for cls, configs in ((CNEmbeddingBagCollection, bags), (CNEmbeddingCollection, seqs)):
        core, card = cls(configs, **kw), cls(configs, device="cncard", **kw)
        assert all(isinstance(s, DeviceIndexedRows) for s in card.stores.values())
        rng = np.random.default_rng(4)
        features = [f for c in configs for f in c.feature_names]
        for _ in range(5):
            lengths = torch.from_numpy(rng.integers(0, 4, len(features) * 5))
            values = torch.from_numpy(rng.integers(-20, 20, int(lengths.sum())))
            kjt = KeyedJaggedTensor.from_lengths_sync(features, values, lengths)
            a, b = core(kjt), card(kjt)
            if cls is CNEmbeddingBagCollection:
                torch.testing.assert_close(b.values().cpu(), a.values())
                a.values().sum().backward()
                b.values().sum().backward()
            else:
                for f in features:
                    torch.testing.assert_close(b[f].values().cpu(), a[f].values())
                sum(a[f].values().sum() for f in features).backward()
                sum(b[f].values().sum() for f in features).backward()
        for name in core.stores:
            ea, eb = core.stores[name].export(), card.stores[name].export()
            oa, ob = np.argsort(ea.keys), np.argsort(eb.keys)
            assert eb.keys[ob].tolist() == ea.keys[oa].tolist()
            np.testing.assert_allclose(eb.rows[ob], ea.rows[oa], rtol=1e-5, atol=1e-6)
            assert eb.counts[ob].tolist() == ea.counts[oa].tolist()
            assert card.stores[name].evicted_count == core.stores[name].evicted_count

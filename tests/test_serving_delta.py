"""cncore_torch.serving.apply_delta: a frozen model follows training's incremental saves in
place (changed rows, new IDs, removed IDs), equal afterwards to the live model bit for bit;
a request served on another thread sees the old or the new version, whole, never a mix;
a state machine against a dict of rows for any sequence of deltas."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor, PoolingType

import cncore
from cncore.tablefile import save_table
from cncore_torch import CNEmbeddingBagCollection
from cncore_torch.serving import (
    FrozenEmbedding,
    FrozenEmbeddingBagCollection,
    TableDelta,
    apply_delta,
    freeze,
    frozen_tables,
)
from cncore_torch.serving.freeze import serving_lock

FEATURES = ["f", "g"]
CONFIGS = [EmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=10, feature_names=["f"],
                              pooling=PoolingType.MEAN),
           EmbeddingBagConfig(name="b", embedding_dim=3, num_embeddings=10, feature_names=["g"])]


def kjt(ids_f, ids_g, bags=1):
    return KeyedJaggedTensor.from_lengths_sync(
        FEATURES, torch.tensor(list(ids_f) + list(ids_g), dtype=torch.int64),
        torch.tensor([len(ids_f) // bags] * bags + [len(ids_g) // bags] * bags))


def train(ebc, ids):
    ebc.train()
    ebc(kjt(ids, ids)).values().sum().backward()
    ebc.eval()


def test_chain_deltas_bring_the_frozen_model_to_the_live_one(tmp_path):
    ebc = CNEmbeddingBagCollection(CONFIGS, optimizer=cncore.SGD(lr=0.1))
    train(ebc, range(40))
    saves = {n: save_table(s, tmp_path / n) for n, s in ebc.stores.items()}
    frozen = freeze(torch.nn.Sequential(ebc))
    probe = kjt(list(range(-5, 120)), list(range(-5, 120)))
    for step, ids in enumerate(([3, 5, 50, 51], list(range(60, 110)), [5, 7])):
        train(ebc, ids)                                          # changed rows and new IDs
        ebc.stores["a"].erase(np.array([0, 1, 2, 60 + step]))    # and removed ones
        deltas = {}
        for name, store in ebc.stores.items():
            since, saves[name] = saves[name], save_table(store, tmp_path / name, since=saves[name])
            assert saves[name].delta
            deltas[name] = TableDelta.from_chain(tmp_path / name, since.version)
        report = apply_delta(frozen, deltas)
        with torch.no_grad():
            assert torch.equal(frozen(probe).values(), ebc(probe).values())
        for name, table in frozen_tables(frozen).items():
            live = np.sort(ebc.stores[name.split(".")[-1]].export().keys)
            assert np.array_equal(table.slots.ids.numpy(), live)
        # 0, 1, 2 at the first delta; 61 is trained and erased within the second (never served); 62
        assert report.ids_removed == [3, 0, 1][step] and report.rows_written == sum(
            len(d.keys) for d in deltas.values())
    assert report.locked_seconds < 1.0


def test_a_whole_chain_at_once_nets_its_versions(tmp_path):
    ebc = CNEmbeddingBagCollection(CONFIGS, optimizer=cncore.SGD(lr=0.1))
    train(ebc, range(10))
    base = save_table(ebc.stores["a"], tmp_path / "a")
    frozen = freeze(ebc)
    last = base
    for ids, gone in (([1, 20], [2]), ([2, 21], [20])):  # 2 removed then back; 20 added then removed
        train(ebc, ids)
        ebc.stores["a"].erase(np.array(gone))
        last = save_table(ebc.stores["a"], tmp_path / "a", since=last)
    delta = TableDelta.from_chain(tmp_path / "a", base.version)
    assert 2 in delta.keys and 20 in delta.removed and 20 not in delta.keys and 2 not in delta.removed
    apply_delta(frozen, {"a": delta})
    probe = kjt(range(-2, 25), [])
    with torch.no_grad():
        assert torch.equal(frozen(probe).values()[:, :4], ebc(probe).values()[:, :4])


def reference_model(rows: dict[str, dict[int, np.ndarray]]) -> FrozenEmbeddingBagCollection:
    """A frozen collection built from scratch out of the rows of one version."""
    keys = {n: np.array(sorted(r), np.int64) for n, r in rows.items()}
    dims = {c.name: c.embedding_dim for c in CONFIGS}
    values = {n: np.array([rows[n][k] for k in keys[n]], np.float32).reshape(-1, dims[n]) for n in rows}
    return FrozenEmbeddingBagCollection(CONFIGS, False, keys, values)


def test_every_request_sees_one_version_while_deltas_land():
    """A serving thread answers the same batch (both tables) over and over while four deltas
    land, each changing every row of both tables (and adding and removing IDs, growing the
    tables): every answer equals one version's exact output, and versions never go back."""
    rng = np.random.default_rng(0)
    rows = {c.name: {k: rng.standard_normal(c.embedding_dim).astype(np.float32) for k in range(2000)}
            for c in CONFIGS}
    frozen = freeze(reference_model(rows))
    request = kjt(rng.integers(0, 2600, 512 * 8).tolist(), rng.integers(0, 2600, 512 * 8).tolist(), bags=512)
    expected, deltas = [reference_model(rows)(request).values()], []
    for v in range(4):
        delta = {}
        for c in CONFIGS:
            keys = np.array([k for k in rows[c.name] if k % 7 != v] + list(range(2000 + 150 * v, 2150 + 150 * v)))
            removed = np.array([k for k in rows[c.name] if k % 7 == v])
            new = rng.standard_normal((len(keys), c.embedding_dim)).astype(np.float32)
            delta[c.name] = TableDelta(keys, new, removed)
            rows[c.name] = dict(zip(keys.tolist(), new))
        deltas.append(delta)
        expected.append(reference_model(rows)(request).values())
    seen, stop, errors = [], threading.Event(), []

    def serve():
        try:
            while not stop.is_set():
                out = frozen(request).values()
                match = [v for v, e in enumerate(expected) if torch.equal(out, e)]
                seen.append(match[0] if match else -1)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    thread = threading.Thread(target=serve)
    thread.start()
    def wait_for_version(v):
        """Until a request has answered with version v: each version is served before the next
        lands, however the two threads are scheduled."""
        deadline = time.monotonic() + 60
        while not (seen and seen[-1] == v) and not errors and -1 not in seen:
            assert time.monotonic() < deadline, f"no request answered with version {v} in 60 s: {seen[-20:]}"
            threading.Event().wait(0.001)

    try:
        for v, delta in enumerate(deltas):
            wait_for_version(v)
            apply_delta(frozen, delta)
        wait_for_version(len(deltas))
    finally:
        stop.set()
        thread.join(timeout=60)
    assert not errors and -1 not in seen
    assert seen == sorted(seen) and seen[0] == 0 and seen[-1] == 4 and set(seen) == {0, 1, 2, 3, 4}


def test_apply_delta_refusals():
    frozen = freeze(reference_model({"a": {1: np.ones(4, np.float32)}, "b": {}}))
    delta = TableDelta(np.array([1]), np.ones((1, 4), np.float32), np.array([], np.int64))
    with pytest.raises(KeyError, match="'c': no such table"):
        apply_delta(frozen, {"c": delta})
    with pytest.raises(ValueError, match=r"deltas\['b'\]: rows of dim 4, but the table's dim is 3"):
        apply_delta(frozen, {"b": delta})
    with pytest.raises(TypeError, match="that freeze did not make"):
        apply_delta(torch.nn.Linear(2, 2), {"a": delta})
    before = {k: v.clone() for k, v in frozen.state_dict().items()}
    with pytest.raises(TypeError, match="rebuild must be a bool, got 'yes'"):
        apply_delta(frozen, {"a": delta}, rebuild="yes")
    after = frozen.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    with pytest.raises(ValueError, match="an ID appears twice"):
        TableDelta(np.array([1, 1]), np.ones((2, 4)), np.array([]))
    from torchrec.inference.modules import quantize_embeddings
    quantized = quantize_embeddings(frozen, dtype=torch.float16, inplace=False)
    with pytest.raises(TypeError, match=r"are quantized .*apply the delta to the float frozen model, then quantize"):
        apply_delta(quantized, {"a": delta})
    frozen.register_forward_pre_hook(lambda m, a: apply_delta(frozen, {"a": delta}))  # runs inside the read
    with pytest.raises(RuntimeError, match="called from inside the frozen model's forward"):
        frozen(kjt([1], [1]))
    assert serving_lock(frozen).readers == 0   # the refused request let go of its read


class DeltaMachine(RuleBasedStateMachine):
    """Any sequence of deltas on a frozen CNEmbedding-style table against a dict of rows."""

    def __init__(self):
        super().__init__()
        self.rows = {k: np.full(2, float(k), np.float32) for k in range(5)}
        self.model = freeze(torch.nn.Sequential(FrozenEmbedding(np.arange(5), np.stack(list(self.rows.values())))))

    @rule(write=st.sets(st.integers(-20, 40), max_size=12), remove=st.sets(st.integers(-20, 40), max_size=12),
          value=st.floats(-4, 4, width=32))
    def delta(self, write, remove, value):
        remove = remove - write
        keys = np.array(sorted(write), np.int64)
        rows = (np.arange(len(keys), dtype=np.float32)[:, None] + np.float32(value)) * np.ones(2, np.float32)
        apply_delta(self.model, {"0": TableDelta(keys, rows, np.array(sorted(remove), np.int64))})
        for k in remove:
            self.rows.pop(k, None)
        self.rows.update(zip(keys.tolist(), rows))

    @invariant()
    def answers_match_the_dict(self):
        probe = torch.arange(-21, 42)
        expected = np.stack([self.rows.get(int(k), np.zeros(2, np.float32)) for k in probe])
        assert np.array_equal(self.model(probe).numpy(), expected)
        table = frozen_tables(self.model)["0"].slots
        assert table.ids.tolist() == sorted(self.rows)
        used = table.slots.tolist() + table.free.tolist()
        assert len(set(used)) == len(used) and min(used, default=2) >= 2   # no row shared, reserved rows kept


TestDeltaMachine = DeltaMachine.TestCase
TestDeltaMachine.settings = settings(max_examples=25, stateful_step_count=12, deadline=None)


def test_an_unpooled_collection_and_a_module_follow_deltas_too(tmp_path):
    """CNEmbeddingCollection and CNEmbedding, each growing past its rows: equal to the live ones
    after the delta their own saves give."""
    from torchrec import EmbeddingConfig

    from cncore_torch import CNEmbedding, CNEmbeddingCollection

    ec = CNEmbeddingCollection([EmbeddingConfig(name="u", embedding_dim=4, num_embeddings=10, feature_names=["f"])],
                               optimizer=cncore.SGD(lr=0.1))
    emb = CNEmbedding(10, 4, optimizer=cncore.SGD(lr=0.1))
    features = KeyedJaggedTensor.from_lengths_sync(["f"], torch.arange(5), torch.tensor([5]))
    ec(features)["f"].values().sum().backward()
    emb(torch.arange(5)).sum().backward()
    model = torch.nn.ModuleDict({"ec": ec.eval(), "emb": emb.eval()})
    bases = {"u": save_table(ec.stores["u"], tmp_path / "u"), "emb": save_table(emb.store, tmp_path / "emb")}
    frozen = freeze(model)
    ec.train(), emb.train()
    more = KeyedJaggedTensor.from_lengths_sync(["f"], torch.arange(3, 40), torch.tensor([37]))
    ec(more)["f"].values().sum().backward()
    emb(torch.arange(3, 40)).sum().backward()
    ec.stores["u"].erase(np.array([0])), emb.store.erase(np.array([1]))
    ec.eval(), emb.eval()
    deltas = {"u": TableDelta.from_chain(tmp_path / "u", bases["u"].version,
                                         save_table(ec.stores["u"], tmp_path / "u", since=bases["u"]).version),
              "emb": TableDelta.from_chain(tmp_path / "emb", bases["emb"].version,
                                           save_table(emb.store, tmp_path / "emb", since=bases["emb"]).version)}
    report = apply_delta(frozen, deltas)
    assert report.tables_grown == 2
    probe = KeyedJaggedTensor.from_lengths_sync(["f"], torch.arange(-1, 45), torch.tensor([46]))
    with torch.no_grad():
        assert torch.equal(frozen["ec"](probe)["f"].values(), ec(probe)["f"].values())
        assert torch.equal(frozen["emb"](torch.arange(-1, 45)), emb(torch.arange(-1, 45)))


def test_table_delta_and_export_refuse_bad_input():
    with pytest.raises(TypeError, match=r"keys: expected 1-D int64 IDs, got float64 of shape \(2,\)"):
        TableDelta(np.array([1.0, 2.0]), np.ones((2, 4)), np.array([], np.int64))
    with pytest.raises(ValueError, match=r"rows: expected \(2, dim\) rows for 2 keys, got shape \(3, 4\)"):
        TableDelta(np.array([1, 2]), np.ones((3, 4)), np.array([], np.int64))
    with pytest.raises(TypeError, match="deltas must be a mapping"):
        apply_delta(freeze(torch.nn.Sequential(FrozenEmbedding(np.arange(2), np.ones((2, 2))))), [])
    from cncore_torch.serving import export_program
    with pytest.raises(TypeError, match="args must be a tuple of the model's positional inputs, got Tensor"):
        export_program(torch.nn.Identity(), torch.ones(2))

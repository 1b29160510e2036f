"""Checkpoints of accelerator tables with the key index on the device: `torch.distributed.checkpoint`
save / load in one process, and state_dicts moving between the three homes of a table's index
(the device index, the core's index beside device rows, the core itself), both ways.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import cncore

FIELDS = ("keys", "rows", "optimizer_state", "counts", "last_steps")
HOMES = {"device": ("cncard", "device"), "host": ("cncard", "host"), "core": ("cpu", "host")}


@pytest.fixture
def make(cncard, monkeypatch):
    """make(home): the model with its tables in `home` ("device": rows and index on the
    accelerator; "host": rows there, the core's index; "core": both in the core)."""
    from torchrec import EmbeddingBagConfig, EmbeddingConfig

    from cncore_torch import CNEmbedding, CNEmbeddingBag, CNEmbeddingBagCollection, CNEmbeddingCollection
    from cncore_torch.devices import resolve_device

    def build(home: str) -> torch.nn.ModuleDict:
        device, index = HOMES[home]
        monkeypatch.setenv("CNCORE_DEVICE_INDEX", index)
        torch.manual_seed(1)
        bounded = {"max_rows": 14, "eviction": cncore.LFU(), "headroom": 2, "fallback_rows": 0}  # as on the device
        return torch.nn.ModuleDict({
            "bag": CNEmbeddingBag(99, 4, mode="mean", optimizer=cncore.Adam(lr=0.01), seed=2, device=device,
                                  initializer=cncore.Uniform(), **bounded),
            "emb": CNEmbedding(99, 3, optimizer=cncore.RowWiseAdagrad(lr=0.1), max_rows=12, eviction=cncore.LRU(),
                               seed=3, device=device, fallback_rows=0),
            "ebc": CNEmbeddingBagCollection(
                [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=50, feature_names=["b"])],
                optimizer=cncore.Adagrad(lr=0.1), seed=4, device=device, **bounded),
            "ec": CNEmbeddingCollection(
                [EmbeddingConfig(name="u", embedding_dim=2, num_embeddings=50, feature_names=["a"])],
                optimizer=cncore.SGD(lr=0.1), seed=5, device=device),
            "dense": torch.nn.Linear(4, 1, device=resolve_device(device).device)})
    return build


def _kjt(step: int):
    from torchrec import KeyedJaggedTensor
    rng = np.random.default_rng(step)
    lengths = torch.from_numpy(rng.integers(0, 4, 8))
    return KeyedJaggedTensor.from_lengths_sync(["a", "b"], torch.from_numpy(rng.integers(-20, 20, int(lengths.sum()))),
                                               lengths)


def _train(model, steps):
    for step in steps:
        ids = torch.from_numpy(np.random.default_rng(100 + step).integers(-25, 25, (6, 3)))
        kjt = _kjt(step)
        loss = (model["dense"](model["bag"](ids)).sum() + model["emb"](ids[:2]).pow(2).sum()
                + model["ebc"](kjt).values().pow(2).sum() + model["ec"](kjt)["a"].values().sum())
        loss.backward()


def _tables(model):
    return {"bag": model["bag"].storage, "emb": model["emb"].storage, "ebc.t": model["ebc"].stores["t"],
            "ec.u": model["ec"].stores["u"]}


def _assert_same_tables(a_model, b_model):
    for name, a in _tables(a_model).items():
        b = _tables(b_model)[name]
        ea, eb = a.export(), b.export()
        oa, ob = np.argsort(ea.keys), np.argsort(eb.keys)  # (the slot order may differ)
        for f in FIELDS:
            np.testing.assert_array_equal(getattr(eb, f)[ob], getattr(ea, f)[oa], err_msg=f"{name}.{f}")
        assert len(a) > 0 and b.step == a.step and b.evicted_count == a.evicted_count, name


def test_dcp_round_trips_device_indexed_tables_and_training_goes_on_as_before(make, tmp_path):
    """Every row, optimizer state, count, last step, step and evicted count back exactly; two
    more steps (new keys, evictions by the restored counts and steps) give the same tables."""
    import torch.distributed.checkpoint as dcp

    from cncore_torch.dcp import CNLoadPlanner
    from cncore_torch.device_rows import DeviceIndexedRows
    model = make("device")
    assert all(isinstance(t, DeviceIndexedRows) for t in _tables(model).values())
    _train(model, range(4))
    assert model["bag"].storage.evicted_count > 0 and model["ebc"].stores["t"].evicted_count > 0
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path), no_dist=True)
    fresh = make("device")
    state = {"model": fresh.state_dict()}
    dcp.load(state, checkpoint_id=str(tmp_path), planner=CNLoadPlanner(), no_dist=True)
    fresh.load_state_dict(state["model"])
    _assert_same_tables(model, fresh)
    torch.testing.assert_close(fresh["dense"].weight, model["dense"].weight, rtol=0, atol=0)
    evicted = model["bag"].storage.evicted_count
    _train(model, range(4, 6))
    _train(fresh, range(4, 6))
    assert model["bag"].storage.evicted_count > evicted
    _assert_same_tables(model, fresh)


@pytest.mark.parametrize(("source", "target"), [("device", "host"), ("host", "device"), ("device", "core"),
                                                ("core", "device")])
def test_a_state_dict_moves_between_the_device_index_and_the_others_both_ways(make, source, target, tmp_path):
    """Plain state_dict / load_state_dict, and the same through DCP: the tables arrive whole, and
    the next training steps give both the same keys and evictions (rows within float rounding:
    the core sums and updates with its own kernels)."""
    import torch.distributed.checkpoint as dcp

    from cncore_torch.dcp import CNLoadPlanner
    model = make(source)
    _train(model, range(4))
    plain = make(target)
    plain.load_state_dict(model.state_dict())
    _assert_same_tables(model, plain)
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path), no_dist=True)
    through_dcp = make(target)
    state = {"model": through_dcp.state_dict()}
    dcp.load(state, checkpoint_id=str(tmp_path), planner=CNLoadPlanner(), no_dist=True)
    through_dcp.load_state_dict(state["model"])
    _assert_same_tables(model, through_dcp)
    _train(model, range(4, 6))
    _train(plain, range(4, 6))
    for name, a in _tables(model).items():
        ea, eb = a.export(), _tables(plain)[name].export()
        oa, ob = np.argsort(ea.keys), np.argsort(eb.keys)
        assert eb.keys[ob].tolist() == ea.keys[oa].tolist() and a.evicted_count == _tables(plain)[name].evicted_count
        np.testing.assert_array_equal(eb.counts[ob], ea.counts[oa])
        np.testing.assert_array_equal(eb.last_steps[ob], ea.last_steps[oa])
        np.testing.assert_allclose(eb.rows[ob], ea.rows[oa], rtol=1e-5, atol=1e-6)

"""The row-storage interface (cncore.storage.RowStorage): the core store, the SSD tier and the
accelerator rows (DeviceRows, with CNCORE_CNCARD=cpu's CPU device) all offer it, and the same
sequence of verbs leaves them with the same rows, optimizer state, metadata and counters, so a
front end needs one path for all three."""
import numpy as np
import pytest
import torch

import cncore
from cncore.storage import RowStorage
from cncore_torch.device_rows import DeviceRows


def _config(**kw):
    return cncore.StoreConfig(dim=3, optimizer=cncore.Adagrad(lr=0.1), initializer=cncore.Constant(0.5), seed=1,
                              **kw)


def _storages(tmp_path, **kw):
    """The three storages of one config; a row budget (max_rows) has no tier (its memory is
    bounded by its cache, every row stays on disk)."""
    storages = {"core": cncore.EmbeddingStore(_config(**kw)), "device": DeviceRows(_config(**kw), torch.device("cpu"))}
    if "max_rows" not in kw:
        storages["tier"] = cncore.make_store(_config(storage=cncore.Tiered(str(tmp_path / "tier"),
                                                                           cache_bytes=1 << 16), **kw))
    return storages


def _snapshot(storage):
    e = storage.export()
    order = np.argsort(e.keys)
    return (e.keys[order].tolist(), e.rows[order].tolist(), e.optimizer_state[order].tolist(),
            np.asarray(e.counts)[order].tolist(), np.asarray(e.last_steps)[order].tolist(), len(storage),
            storage.step, storage.evicted_count)


def test_every_storage_offers_the_interface(tmp_path):
    for name, storage in _storages(tmp_path).items():
        assert isinstance(storage, RowStorage), name
        assert storage.dim == 3 and storage.capacity >= 0 and storage.nbytes > 0


@pytest.mark.parametrize("bounded", [False, True])
def test_the_same_verbs_leave_every_storage_the_same(tmp_path, bounded):
    kw = dict(max_rows=6, eviction=cncore.LRU(), headroom=0) if bounded else {}
    storages = _storages(tmp_path, **kw)
    sinks = {name: [] for name in storages}
    if bounded:
        for name, storage in storages.items():
            storage.on_evict(lambda batch, name=name: sinks[name].extend(batch.keys.tolist()))
    rng = np.random.default_rng(0)
    for step in range(6):
        keys = rng.choice(20, 4, replace=False).astype(np.int64)
        rows = rng.standard_normal((4, 3)).astype(np.float32)
        results = {name: np.asarray(s.insert_or_assign(keys, rows)).tolist() for name, s in storages.items()}
        assert len({str(r) for r in results.values()}) == 1, results
        results = {name: np.asarray(s.assign(keys[:2] + 100 * (step % 2), rows[:2])).tolist()
                   for name, s in storages.items()}
        assert len({str(r) for r in results.values()}) == 1, results
        snapshots = {name: _snapshot(s) for name, s in storages.items()}
        assert all(v == snapshots["core"] for v in snapshots.values()), step
    if bounded:
        assert sinks["core"] == sinks["device"] and sinks["core"]
        for s in storages.values():
            assert s.evict(2) == 2
    keys = np.array([7, 8], np.int64)
    for s in storages.values():
        s.clear()
        s.reserve(10)
        s.load(keys, np.ones((2, 3), np.float32), np.full((2, 3), 2.0, np.float32), np.array([3, 4]),
               np.array([1, 2]))
        s.step = 5
    snapshots = {name: _snapshot(s) for name, s in storages.items()}
    assert all(v == snapshots["core"] for v in snapshots.values())


def test_a_bad_write_is_refused_alike_and_changes_nothing(tmp_path):
    for name, storage in _storages(tmp_path).items():
        storage.insert_or_assign(np.array([1], np.int64), np.ones((1, 3), np.float32))
        before = _snapshot(storage)
        with pytest.raises((TypeError, ValueError)):
            storage.insert_or_assign(np.array([2, 3], np.int64), np.ones((2, 4), np.float32))
        with pytest.raises((TypeError, ValueError)):
            storage.insert_or_assign(np.array([2], np.int64), np.ones((1, 3), np.float64))
        assert _snapshot(storage) == before, name

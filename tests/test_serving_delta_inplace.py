"""apply_delta writes a delta's new and evicted IDs into the live FBGEMM hash in place (evicted
ones as tombstones): against a dict of rows over a sequence of deltas that evict IDs, add them
back, and add -1 and the int64 extremes, with and without fallback rows; the same answers as the
hash rebuilt whole and as a model frozen afresh from the dict; a table read by two features is
written in both its regions; a region past its fill limit is rebuilt whole, tombstones dropped."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

from cncore_torch.serving import FrozenEmbeddingBag, FrozenEmbeddingBagCollection, TableDelta, apply_delta, freeze
from cncore_torch.serving.hashmap import TOMBSTONE, region_capacity
from cncore_torch.serving.table import TableSlots

LO, HI = np.iinfo(np.int64).min, np.iinfo(np.int64).max
EDGES = np.array([-1, LO, HI, 0, -2, LO + 1, HI - 1], np.int64)
DIM = 3


def row_of(key: int, version: int) -> np.ndarray:
    return np.array([key % 997, version, key % 13], np.float32)


def single_row_outputs(model, probe: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(probe).view(-1, 1)).numpy()


@pytest.mark.parametrize("fallback", [None, np.arange(4 * DIM, dtype=np.float32).reshape(4, DIM) + 100])
def test_in_place_deltas_follow_a_dict_and_equal_a_rebuild_and_a_fresh_freeze(fallback):
    rng = np.random.default_rng(7)
    start = rng.choice(10**6, 300, replace=False).astype(np.int64) - 500_000
    ref = {int(k): row_of(int(k), 0) for k in start}
    inplace = freeze(torch.nn.Sequential(FrozenEmbeddingBag(start, np.stack(list(ref.values())), mode="sum",
                                                            fallback=fallback)))
    rebuilt = freeze(torch.nn.Sequential(FrozenEmbeddingBag(start, np.stack(list(ref.values())), mode="sum",
                                                            fallback=fallback)))
    evicted: list[int] = []
    in_place = 0
    for version in range(1, 9):
        held = np.array(sorted(ref), np.int64)
        gone = rng.choice(held, 12, replace=False)
        changed = rng.choice(np.setdiff1d(held, gone), 10, replace=False)
        back = np.array(evicted[:5], np.int64)              # evicted before, now added again
        evicted = evicted[5:] + gone.tolist()
        new = rng.integers(-10**9, 10**9, 6).astype(np.int64)
        edges = EDGES[[version % len(EDGES), (version + 3) % len(EDGES)]]  # -1 and the extremes come and go
        write = np.unique(np.concatenate([changed, back, new, edges]))
        removed = np.concatenate([gone, EDGES[[(version + 5) % len(EDGES)]]])
        removed = np.setdiff1d(removed, write) if version % 2 else removed   # odd versions: evict and re-add too
        delta = TableDelta(write, np.stack([row_of(int(k), version) for k in write]), removed)
        mask = inplace[0].remap.key_mask
        a = apply_delta(inplace, {"0": delta})
        b = apply_delta(rebuilt, {"0": delta}, rebuild=True)
        # in place, unless an added ID is the one the key mask makes FBGEMM's empty key (-1 under mask 0)
        assert (a.hashes_rebuilt, b.hashes_rebuilt) == (int(~mask in write), 1)
        in_place += not a.hashes_rebuilt
        assert (a.ids_added, a.ids_removed, a.rows_written) == (b.ids_added, b.ids_removed, b.rows_written)
        for k in removed:
            ref.pop(int(k), None)
        ref.update({int(k): row_of(int(k), version) for k in write})

        probe = np.unique(np.concatenate([np.array(sorted(ref), np.int64), removed, gone, EDGES,
                                          rng.integers(-10**9, 10**9, 20)]))
        got = single_row_outputs(inplace, probe)
        np.testing.assert_array_equal(got, single_row_outputs(rebuilt, probe))
        keys = np.array(sorted(ref), np.int64)
        fresh = FrozenEmbeddingBag(keys, np.stack([ref[int(k)] for k in keys]), mode="sum", fallback=fallback)
        np.testing.assert_array_equal(got, single_row_outputs(fresh, probe))
        for k, out in zip(probe.tolist(), got):
            if k in ref:
                np.testing.assert_array_equal(out, ref[k])
            elif fallback is None:
                np.testing.assert_array_equal(out, np.zeros(DIM, np.float32))
    assert in_place >= 6
    # the evicted IDs' entries stay as tombstones in the in-place hash, the rebuilt one has none
    remap = inplace[0].remap
    assert int((remap.hash_table[:, 1] == TOMBSTONE).sum()) > 0
    assert int((rebuilt[0].remap.hash_table[:, 1] == TOMBSTONE).sum()) == 0


def test_a_table_read_by_two_features_is_written_in_both_regions():
    configs = [EmbeddingBagConfig(name="t", embedding_dim=2, num_embeddings=10, feature_names=["f", "g"])]
    frozen = freeze(FrozenEmbeddingBagCollection(configs, False, {"t": np.array([3, 4])},
                                                 {"t": np.array([[1, 1], [2, 2]], np.float32)}))
    report = apply_delta(frozen, {"t": TableDelta(np.array([HI, 5]), np.array([[7, 7], [9, 9]], np.float32),
                                                  np.array([3]))})
    assert report.hashes_rebuilt == 0
    request = KeyedJaggedTensor.from_lengths_sync(["f", "g"], torch.tensor([3, 4, HI, 5, 3, 4, HI, 5]),
                                                  torch.tensor([1, 3, 1, 3]))
    with torch.no_grad():
        got = frozen(request).values().numpy()
    np.testing.assert_array_equal(got, [[0, 0, 0, 0], [18, 18, 18, 18]])   # (sample, f and g)


def test_a_delta_past_the_fill_limit_rebuilds_the_hash_and_drops_the_tombstones():
    keys = np.arange(100, dtype=np.int64)
    model = freeze(torch.nn.Sequential(FrozenEmbeddingBag(keys, np.ones((100, DIM), np.float32), mode="sum")))
    remap = model[0].remap
    assert remap.hash_used == [100] and remap.hash_table.shape[0] == region_capacity(100) == 224
    remap.hash_used = None    # as a file pickled before the count was kept: the delta counts the entries
    # 224 * 0.6 = 134 entries in use at most: 30 new IDs fit in place, then 10 more do not
    small = apply_delta(model, {"0": TableDelta(np.arange(100, 130), np.full((30, DIM), 2, np.float32),
                                                np.arange(0, 30))})
    assert small.hashes_rebuilt == 0 and remap.hash_used == [130]
    assert small.bytes_written == 30 * DIM * 4 + 60 * 16   # rows, 60 hash entries (the ID arrays wait)
    big = apply_delta(model, {"0": TableDelta(np.arange(130, 140), np.full((10, DIM), 3, np.float32),
                                              np.arange(30, 40))})
    assert big.hashes_rebuilt == 1 and remap.hash_used == [100]
    assert int((remap.hash_table[:, 1] == TOMBSTONE).sum()) == 0
    probe = np.arange(-1, 141, dtype=np.int64)
    expected = np.where(((probe >= 40) & (probe < 100))[:, None], 1.0,
                        np.where(((probe >= 100) & (probe < 130))[:, None], 2.0,
                                 np.where(((probe >= 130) & (probe < 140))[:, None], 3.0, 0.0)))
    np.testing.assert_array_equal(single_row_outputs(model, probe), np.broadcast_to(expected, (len(probe), DIM)))


def test_pending_ids_merge_when_read_saved_or_copied(tmp_path):
    keys = np.arange(10, dtype=np.int64)
    model = freeze(torch.nn.Sequential(FrozenEmbeddingBag(keys, np.ones((10, DIM), np.float32), mode="sum")))
    table = model[0].table
    apply_delta(model, {"0": TableDelta(np.array([LO, 20]), np.full((2, DIM), 2, np.float32), np.array([3, 4, 99]))})
    apply_delta(model, {"0": TableDelta(np.array([3]), np.full((1, DIM), 3, np.float32), np.array([20, 5]))})
    expected = [LO, 0, 1, 2, 3, 6, 7, 8, 9]
    assert table.__dict__["_pending"] is not None               # noted, not merged
    state = model.state_dict()                                   # a state_dict merges
    assert state["0.remap.tables.table.ids"].tolist() == expected and table.__dict__["_pending"] is None
    apply_delta(model, {"0": TableDelta(np.array([4]), np.full((1, DIM), 4, np.float32), np.array([LO]))})
    torch.save(model, tmp_path / "m.pt")                         # so does a pickle
    loaded = torch.load(tmp_path / "m.pt", weights_only=False)
    assert loaded[0].table.ids.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9]
    probe = np.array([LO, 3, 4, 5, 20, 9])
    np.testing.assert_array_equal(single_row_outputs(loaded, probe), single_row_outputs(model, probe))
    np.testing.assert_array_equal(single_row_outputs(model, probe)[:, 0], [0, 3, 4, 0, 0, 1])
    apply_delta(model, {"0": TableDelta(np.array([LO]), np.full((1, DIM), 5, np.float32), np.array([], np.int64))})
    from cncore_torch.serving.export import export_program
    program = export_program(model, (torch.tensor([[1, 2], [3, 4]]),))     # so does an export
    assert table.__dict__["_pending"] is None
    assert program.state_dict["0.remap.tables.table.ids"].tolist()[0] == LO
    # the slots read back through the arrays are the hash's
    assert table.slots.tolist() == model[0].remap.rows(table.ids, torch.tensor([0, table.ids.numel()])).tolist()


def test_changed_rows_alone_write_no_hash_entry_and_leave_the_id_arrays():
    model = freeze(torch.nn.Sequential(FrozenEmbeddingBag(np.array([5, 6]), np.ones((2, DIM), np.float32),
                                                          mode="sum")))
    table, before = model[0].table, model[0].remap.hash_table.clone()
    ids = table.ids
    report = apply_delta(model, {"0": TableDelta(np.array([6]), np.full((1, DIM), 4, np.float32), np.array([9]))})
    assert report.bytes_written == DIM * 4 and (report.ids_added, report.ids_removed) == (0, 0)
    assert torch.equal(model[0].remap.hash_table, before) and table.ids.data_ptr() == ids.data_ptr()
    np.testing.assert_array_equal(single_row_outputs(model, np.array([5, 6, 9])),
                                  [[1] * DIM, [4] * DIM, [0] * DIM])


def test_pending_ids_follow_a_dict_and_merge_past_a_quarter_of_the_table():
    """TableSlots.record against a dict over deltas that evict, add, and add back the same IDs;
    reading the arrays merges; 4096 + N / 4 IDs pending merge by themselves."""
    rng = np.random.default_rng(3)
    table = TableSlots(np.arange(50, dtype=np.int64) * 3, first_slot=5)
    ref = {int(k): int(s) for k, s in zip(table.ids.tolist(), table.slots.tolist())}
    for step in range(40):
        held = np.array(sorted(ref), np.int64)
        removed = rng.choice(held, min(4, len(held)), replace=False)
        pool = np.setdiff1d(np.arange(-20, 200, dtype=np.int64), np.setdiff1d(held, removed))
        added = rng.choice(pool, 5, replace=False)
        slots = rng.integers(0, 10**6, 5)
        table.record(removed, added, slots)
        for k in removed.tolist():
            del ref[k]
        ref.update(zip(added.tolist(), slots.tolist()))
        if step % 7 == 0:
            assert table.ids.tolist() == sorted(ref) and table.slots.tolist() == [ref[k] for k in sorted(ref)]
            assert table.__dict__["_pending"] is None
    assert table.__dict__["_pending"] is not None
    assert [a.tolist() for a in table.merged(np.empty(0, np.int64), np.empty(0, np.int64),
                                             np.empty(0, np.int64))] == [sorted(ref), [ref[k] for k in sorted(ref)]]
    big = TableSlots(np.arange(10), first_slot=1)
    big.record(np.arange(5), np.arange(100, 4200), np.arange(4100))
    assert big.__dict__["_pending"] is None and big._buffers["ids"].numel() == 4105

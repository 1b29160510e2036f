"""A training step of accelerator tables with the key index on the device: the host syncs it
makes (counted with `device_syncs.HostSyncs` on the CPU device), and the static-shape row
gradients of its backward against `nn.EmbeddingBag`'s.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from device_syncs import HostSyncs

import cncore
from cncore_torch.device_index import DeviceKeyIndex
from cncore_torch.device_index.segments import distinct_rows, join_row_gradients, pooled_row_gradients


@pytest.fixture
def device_index(cncard, monkeypatch):
    monkeypatch.setenv("CNCORE_DEVICE_INDEX", "device")


# --- the counter itself ------------------------------------------------------------------------------

def test_the_counter_records_each_kind_of_host_sync_the_library_makes():
    idx = DeviceKeyIndex(cncore.StoreConfig(dim=2), "cpu")
    with HostSyncs() as syncs:
        idx.find_or_insert(torch.tensor([3, 4, 3]))
        idx.find(torch.tensor([3, 9]))  # no sync
        idx.export_slots()  # nonzero
        idx.erase(torch.tensor([4]))  # nonzero
        n = int(torch.tensor([1, 2]).sum())  # the test's own read: not the library's
    assert n == 3
    assert syncs.records == ["_local_scalar_dense in find_or_insert", "tolist in find_or_insert",
                             "nonzero in export_slots", "nonzero in erase"]


def test_the_counter_records_python_reads_data_dependent_sizes_and_device_copies(device_index):
    from cncore_torch import CNEmbeddingBag
    bag = CNEmbeddingBag(10, 2, mode="sum", optimizer=cncore.SGD(lr=0.1), device="cncard")
    bag(torch.tensor([[1, 2]])).sum().backward()
    rows = bag.device_rows
    with HostSyncs() as syncs:
        rows.export()  # .cpu() and .numpy() of every column
        torch.unique(torch.tensor([1, 1]))  # outside the library
    assert syncs.records[:3] == ["nonzero in export_slots", "cpu in export", "numpy in export"]
    assert set(syncs.records) == {"nonzero in export_slots", "cpu in export", "numpy in export"}
    with HostSyncs() as syncs:
        rows.gradient_keys(torch.tensor([0, 2, 0], device=rows.device), torch.zeros(3, 2, device=rows.device))
    assert syncs.records == ["nonzero in gradient_keys"]
    with HostSyncs() as syncs:
        rows._weighted_mean_as_sum(torch.tensor([0, 2]), torch.ones(2), 1)  # repeat_interleave with its size
    assert syncs.records == []


# --- the counts of a training step -------------------------------------------------------------------

_ONE_READ = ["_local_scalar_dense in find_or_insert"]  # the count of absent keys
_NEW_KEYS = _ONE_READ + ["tolist in find_or_insert"]  # the count of new keys and whether they all found a way


_MODES_WEIGHTED = [("sum", False), ("mean", False), ("max", False), ("sum", True), ("mean", True)]


@pytest.mark.parametrize(("mode", "weighted"), _MODES_WEIGHTED)
def test_a_training_step_syncs_once_on_known_keys_twice_on_new_ones_and_never_in_backward(
        device_index, mode, weighted):
    from cncore_torch import CNEmbeddingBag
    bag = CNEmbeddingBag(100, 8, mode=mode, optimizer=cncore.Adam(lr=0.01), device="cncard",
                         initializer=cncore.Uniform())
    device = bag.device_rows.device  # (the IDs where the rows are: a copy there is a sync of its own)
    ids = torch.tensor([[1, 2, 3], [3, 4, -(2**63)]], device=device)
    w = torch.rand(2, 3, device=device, requires_grad=True) if weighted else None
    bag(ids, per_sample_weights=w).sum().backward()
    for step_ids, forward_reads in ((ids, _ONE_READ), (ids + 10, _NEW_KEYS)):
        with HostSyncs() as forward:
            out = bag(step_ids, per_sample_weights=w)
        with HostSyncs() as backward:
            out.sum().backward()
        assert forward.records == forward_reads
        assert backward.records == []
    with HostSyncs() as syncs:  # 1-D IDs with the caller's offsets: one more read, their check
        bag(ids.reshape(-1), torch.tensor([0, 2, 6], device=device)).sum().backward()
    assert syncs.records == ["_local_scalar_dense in _check_offsets"] + _ONE_READ


def test_an_evicting_step_reads_the_device_twice_more_and_its_backward_never(device_index):
    """A step whose new keys pass max_rows: the two reads of new keys, then the count of rows
    the call pins (`_make_room`) and of the eviction candidates (`eviction_order`)."""
    from cncore_torch import CNEmbeddingBag
    bag = CNEmbeddingBag(100, 4, mode="sum", optimizer=cncore.SGD(lr=0.1), device="cncard",
                         initializer=cncore.Uniform(), max_rows=8, eviction=cncore.LRU(), headroom=2)
    device = bag.device_rows.device
    bag(torch.arange(8, device=device).reshape(2, 4)).sum().backward()
    with HostSyncs() as forward:
        out = bag(torch.tensor([[1, 2, 20, 21]], device=device))
    with HostSyncs() as backward:
        out.sum().backward()
    assert forward.records == _NEW_KEYS + ["_local_scalar_dense in _make_room", "_local_scalar_dense in eviction_order"]
    assert backward.records == []
    assert bag.device_rows.evicted_count == 4 and len(bag.device_rows) == 6  # down to max_rows - headroom


def test_a_collection_step_joins_a_shared_tables_features_with_no_sync(device_index):
    from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

    from cncore_torch import CNEmbeddingBagCollection
    configs = [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=50, feature_names=["a", "b"])]
    ebc = CNEmbeddingBagCollection(configs, optimizer=cncore.SGD(lr=0.1), device="cncard")
    device = ebc.stores["t"].device
    kjt = KeyedJaggedTensor.from_lengths_sync(["a", "b"], torch.tensor([1, 2, 2, 5, 1], device=device),
                                              torch.tensor([2, 1, 1, 1], device=device))
    ebc(kjt).values().sum().backward()
    with HostSyncs() as forward:
        out = ebc(kjt).values()
    with HostSyncs() as backward:
        out.sum().backward()
    # the KJT's split per feature reads each feature's length (as TorchRec's KJT does), then one
    # find_or_insert for both features of the table; the backward joins their rows with none
    assert forward.records == ["_local_scalar_dense in features_by_key"] * 2 + _ONE_READ
    assert backward.records == []


@pytest.mark.parametrize("key_index", ["device", "host"])
def test_a_bounded_table_under_two_features_evicts_and_trains_as_the_cores(cncard, monkeypatch, key_index):
    """Both features' keys are resolved in one call, in feature order, as the core's grouped
    lookup does: a feature's new keys never evict a row the other feature of the step read."""
    from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

    from cncore_torch import CNEmbeddingBagCollection
    monkeypatch.setenv("CNCORE_DEVICE_INDEX", key_index)
    configs = [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=50, feature_names=["a", "b"])]
    kw = {"optimizer": cncore.Adagrad(lr=0.1), "max_rows": 9, "eviction": cncore.LRU(), "headroom": 1, "seed": 2,
          "fallback_rows": 0}  # a row per key in both homes (the core's default would split)
    core, card = CNEmbeddingBagCollection(configs, **kw), CNEmbeddingBagCollection(configs, device="cncard", **kw)
    evicted: dict[str, list] = {"core": [], "card": []}
    core.stores["t"].on_evict(lambda b: evicted["core"].extend(b.keys.tolist()))
    card.stores["t"].on_evict(lambda b: evicted["card"].extend(b.keys.tolist()))
    rng = np.random.default_rng(5)
    for _ in range(8):
        lengths = torch.from_numpy(rng.integers(0, 3, 6))
        kjt = KeyedJaggedTensor.from_lengths_sync(["a", "b"], torch.from_numpy(
            rng.integers(-12, 12, int(lengths.sum()))), lengths)
        a, b = core(kjt).values(), card(kjt).values()
        torch.testing.assert_close(b.cpu(), a)
        a.pow(2).sum().backward()
        b.pow(2).sum().backward()
    assert evicted["card"] == evicted["core"] and len(evicted["core"]) > 0
    ea, eb = core.stores["t"].export(), card.stores["t"].export()
    oa, ob = np.argsort(ea.keys), np.argsort(eb.keys)
    assert eb.keys[ob].tolist() == ea.keys[oa].tolist()
    np.testing.assert_array_equal(eb.counts[ob], ea.counts[oa])
    np.testing.assert_array_equal(eb.last_steps[ob], ea.last_steps[oa])
    np.testing.assert_allclose(eb.rows[ob], ea.rows[oa], rtol=1e-5, atol=1e-6)


# --- the static-shape gradients against nn.EmbeddingBag ----------------------------------------------

@pytest.mark.parametrize(("mode", "weighted"), [(["sum", "mean", "max"].index(m), w) for m, w in _MODES_WEIGHTED])
def test_static_row_gradients_equal_embedding_bags_weight_gradient(mode, weighted):
    rng = np.random.default_rng(mode + 3 * weighted)
    for _ in range(20):
        n, n_bags, dim, n_rows = int(rng.integers(0, 30)), int(rng.integers(1, 7)), 3, 12
        rows_idx = torch.from_numpy(rng.integers(0, n_rows, n))
        offsets = torch.from_numpy(np.concatenate([[0], np.sort(rng.integers(0, n + 1, n_bags - 1)), [n]]))
        weights = torch.from_numpy(rng.random(n).astype(np.float32)) if weighted else None
        table = torch.from_numpy(rng.standard_normal((n_rows, dim)).astype(np.float32))
        grad_out = torch.from_numpy(rng.standard_normal((n_bags, dim)).astype(np.float32))
        ref = torch.nn.EmbeddingBag(n_rows, dim, mode=("sum", "mean", "max")[mode], include_last_offset=True)
        ref.weight.data.copy_(table)
        pw = None if weights is None else weights.clone().requires_grad_()
        if weighted and mode == 1:  # the core's weighted mean: sum(w x) / len (embedding_bag has no such mode)
            lengths = (offsets[1:] - offsets[:-1]).clamp(min=1).repeat_interleave(offsets[1:] - offsets[:-1])
            ref.mode = "sum"
            ref(rows_idx, offsets, per_sample_weights=pw / lengths).backward(grad_out)
        else:
            ref(rows_idx, offsets, per_sample_weights=pw).backward(grad_out)
        rows, grads, occurrences, grad_weights = pooled_row_gradients(table, rows_idx, offsets, weights, mode, grad_out)
        assert rows.shape == (n,) and grads.shape == (n, dim) and occurrences.shape == (n,)
        real = occurrences > 0
        expected_rows = sorted(set(rows_idx.tolist()) - {0})
        assert rows[real].tolist() == expected_rows
        assert occurrences[real].tolist() == [rows_idx.tolist().count(r) for r in expected_rows]
        assert bool((rows[~real] == 0).all()) and bool((grads[~real] == 0).all())
        torch.testing.assert_close(grads[real], ref.weight.grad[rows[real]], rtol=1e-6, atol=1e-6)
        if weighted:
            torch.testing.assert_close(grad_weights, pw.grad, rtol=1e-5, atol=1e-6)


def test_distinct_rows_and_their_join_equal_torch_unique():
    rng = np.random.default_rng(7)
    for _ in range(30):
        a, b = (torch.from_numpy(rng.integers(0, 9, int(rng.integers(0, 12)))) for _ in range(2))
        for rows_idx in (a, b):
            rows, position, occurrences = distinct_rows(rows_idx)
            u, inverse, counts = torch.unique(rows_idx, return_inverse=True, return_counts=True)
            assert rows[: len(u)].tolist() == u.tolist() and bool((rows[len(u):] == 0).all())
            assert position.tolist() == inverse.tolist()
            assert occurrences[: len(u)].tolist() == counts.tolist() and bool((occurrences[len(u):] == 0).all())
        parts = [pooled_row_gradients(torch.ones(9, 2), r, torch.tensor([0, len(r)]), None, 0, torch.ones(1, 2))[:3]
                 for r in (a, b)]
        rows, grads, occurrences = join_row_gradients(parts)
        both = torch.cat([a, b])
        for r in range(1, 9):
            at = (rows == r).nonzero().flatten()
            n = int((both == r).sum())
            assert len(at) == (1 if n else 0)
            if n:
                assert int(occurrences[at]) == n and grads[at].tolist() == [[float(n), float(n)]]
        assert float(grads[rows == 0].abs().sum()) == 0.0 and int(occurrences[rows == 0].sum()) == 0


def test_the_hooks_of_a_device_indexed_bag_get_each_read_key_once(device_index):
    from cncore_torch import CNEmbeddingBag
    bag = CNEmbeddingBag(10, 2, mode="sum", device="cncard", initializer=cncore.Constant(1.0))
    bag.train()
    bag(torch.tensor([[5, -3, 5]])).backward(torch.ones(1, 2, device=bag.device_rows.device))
    keys, grads = bag.last_gradients
    assert keys.tolist() == [5, -3] and grads.tolist() == [[2.0, 2.0], [1.0, 1.0]]


def test_a_non_finite_gradient_of_an_id_without_a_row_leaves_every_entry_but_its_rows_finite():
    table = torch.ones(4, 2)
    grad_out = torch.tensor([[float("inf"), 1.0], [2.0, 3.0]])
    for mode in (0, 1, 2):
        rows, grads, occurrences, _ = pooled_row_gradients(table, torch.tensor([0, 0, 2]), torch.tensor([0, 2, 3]),
                                                           None, mode, grad_out)
        assert rows.tolist() == [0, 2, 0] and occurrences.tolist() == [0, 1, 0]
        assert grads.tolist() == [[0.0, 0.0], [2.0, 3.0], [0.0, 0.0]]

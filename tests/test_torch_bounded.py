"""Bounded tables and row dtypes through the torch front end: CNEmbeddingBag / CNEmbedding and the
TorchRec collections take max_rows / eviction / admission / headroom / row_dtype, train exactly as
the core store with the same StoreConfig does, keep evicted counts in state_dict, and refuse bad
options (naming them) and checkpoints larger than their budget (changing nothing)."""
import numpy as np
import pytest
import torch
from reference import assert_unchanged, snapshot

import cncore
from cncore_torch import CNEmbedding, CNEmbeddingBag

torchrec = pytest.importorskip("torchrec")
from torchrec import EmbeddingBagConfig, EmbeddingConfig, KeyedJaggedTensor  # noqa: E402

from cncore_torch import CNEmbeddingBagCollection, CNEmbeddingCollection  # noqa: E402


def _batches(seed, n_steps=12, n_bags=16, pooling=2, id_space=120):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, id_space, (n_bags, pooling)) for _ in range(n_steps)]


def _train_beside(bag, ref, exact: bool):
    """Train `bag` and the core store `ref` on the same batches and gradients, checking the
    outputs each step (exactly, or to float32 reassociation); yields after each step."""
    for ids in _batches(0):
        out = bag(torch.from_numpy(ids))
        grad = torch.cos(out.detach()) + 0.5
        out.backward(grad)
        ref_out, ctx = ref.pooled_lookup(ids.reshape(-1), lengths=np.full(len(ids), ids.shape[1]), mode="sum")
        ref.apply_gradients(ctx, grad.cpu().numpy())
        np.testing.assert_allclose(out.detach().cpu().numpy(), ref_out,
                                   rtol=0 if exact else 1e-6, atol=0 if exact else 1e-7)
        yield


@pytest.mark.parametrize("eviction", [cncore.LRU(), cncore.LFU(), cncore.TTL(3)], ids=["lru", "lfu", "ttl"])
@pytest.mark.parametrize("admission", [None, cncore.MinCount(2)], ids=["all", "mincount2"])
def test_module_trains_exactly_as_the_core_store_with_the_same_config(eviction, admission):
    """Same outputs every step, and in the end the same keys, rows, optimizer state, counts,
    last steps and evictions, as a cncore store driven directly with the same gradients."""
    opt = cncore.RowWiseAdagrad(lr=0.1)
    bag = CNEmbeddingBag(1000, 4, mode="sum", optimizer=opt, max_rows=40, eviction=eviction, admission=admission,
                         headroom=2)
    ref = cncore.EmbeddingStore(bag.store.config)
    sink, ref_sink = [], []
    bag.store.on_evict(sink.append)
    ref.on_evict(ref_sink.append)
    for _ in _train_beside(bag, ref, exact=True):
        assert len(bag.store) <= 40
    got, want = bag.store.export(), ref.export()
    for name in ("keys", "rows", "optimizer_state", "counts", "last_steps"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    assert bag.store.evicted_count == ref.evicted_count > 0
    assert [b.keys.tolist() for b in sink] == [b.keys.tolist() for b in ref_sink]
    assert sum(len(b.keys) for b in sink) == bag.store.evicted_count


def test_cnembedding_takes_the_options_and_trains_a_lookup_past_its_budget():
    emb = CNEmbedding(10, 3, optimizer=cncore.SGD(lr=0.1), max_rows=4, eviction=cncore.LRU(), headroom=0,
                      fallback_rows=0)
    emb(torch.tensor([1, 2, 3, 4])).sum().backward()
    emb(torch.tensor([5])).sum().backward()
    assert sorted(emb.keys().tolist()) == [2, 3, 4, 5] and emb.store.evicted_count == 1
    # Five new IDs, four rows, headroom 0: one round of eviction frees one row (2, the oldest),
    # 10 (first seen) takes it, 11..14 overflow (read zeros, take no update).
    out = emb(torch.tensor([10, 11, 12, 13, 14]))
    assert sorted(emb.keys().tolist()) == [3, 4, 5, 10] and emb.store.evicted_count == 2
    assert out[1:].tolist() == [[0.0] * 3] * 4 and bool((out[0] != 0).any())
    out.sum().backward()
    assert sorted(emb.keys().tolist()) == [3, 4, 5, 10]


def test_state_dict_keeps_the_evicted_count_and_a_larger_checkpoint_is_refused():
    bag = CNEmbeddingBag(10, 2, mode="sum", optimizer=cncore.SGD(lr=0.1), max_rows=3, eviction=cncore.LFU(),
                         headroom=0, fallback_rows=0)
    for ids in ([[1, 2, 3]], [[4, 5]], [[6]]):
        bag(torch.tensor(ids)).sum().backward()
    state = bag.state_dict()
    assert int(state["evicted_count"]) == bag.store.evicted_count == 3
    again = CNEmbeddingBag(10, 2, mode="sum", optimizer=cncore.SGD(lr=0.1), max_rows=3, eviction=cncore.LFU(),
                           fallback_rows=0)
    again.load_state_dict(state)
    assert again.store.evicted_count == 3
    np.testing.assert_array_equal(again.store.export().rows, bag.store.export().rows)
    tight = CNEmbeddingBag(10, 2, mode="sum", optimizer=cncore.SGD(lr=0.1), max_rows=2, eviction=cncore.LFU(),
                           fallback_rows=0)
    tight(torch.tensor([[7]]))
    before = snapshot(tight.store)
    with pytest.raises(RuntimeError, match=r"holds 3 rows for this table, more than its max_rows \(2\)"):
        tight.load_state_dict(state)
    assert_unchanged(tight.store, before)
    unbounded = CNEmbeddingBag(10, 2, mode="sum", optimizer=cncore.SGD(lr=0.1))
    unbounded.load_state_dict(state)  # the count comes along; the table has no budget
    assert unbounded.store.evicted_count == 3 and len(unbounded.store) == 3


@pytest.mark.parametrize("kwargs, error, match", [
    ({"max_rows": "lots"}, ValueError, "max_rows must be"),
    ({"max_rows": 0, "eviction": cncore.LRU()}, ValueError, "max_rows"),
    ({"eviction": "lru"}, TypeError, "eviction must be"),
    ({"admission": 2}, TypeError, "admission"),
    ({"row_dtype": torch.int8}, ValueError, "row_dtype must be torch.float32"),
    ({"row_dtype": 16}, TypeError, "row_dtype must be a string"),
    ({"row_dtype": "float64"}, ValueError, "dtype must be one of"),
])
def test_bad_options_are_refused_naming_them(kwargs, error, match):
    with pytest.raises(error, match=match):
        CNEmbeddingBag(10, 2, **kwargs)


@pytest.mark.parametrize("eviction", [cncore.LRU(), cncore.LFU(), cncore.TTL(3)], ids=["lru", "lfu", "ttl"])
@pytest.mark.parametrize("admission", [None, cncore.MinCount(2)], ids=["all", "mincount2"])
def test_device_rows_train_as_the_core_store_with_the_same_policy(cncard, eviction, admission):
    """Rows on the accelerator (the `cncard` fixture: on the CPU unless asked): the same keys
    evicted in the same order and handed over with their rows, state and metadata, the same
    admissions, and rows equal to the core store's up to float32 reassociation (the device
    path computes with PyTorch ops: rows within 1e-6 relative)."""
    opt = cncore.RowWiseAdagrad(lr=0.1)
    bag = CNEmbeddingBag(1000, 4, mode="sum", optimizer=opt, max_rows=40, eviction=eviction, admission=admission,
                         headroom=2, device="cncard", fallback_rows=0)
    assert bag.store is None and bag.device_rows is not None
    ref = cncore.EmbeddingStore(bag.config)
    sink, ref_sink = [], []
    bag.device_rows.on_evict(sink.append)
    ref.on_evict(ref_sink.append)
    for _ in _train_beside(bag, ref, exact=False):
        assert bag.num_rows <= 40
    got, want = {k: v.cpu() for k, v in bag.export().items()}, ref.export()
    order, ref_order = np.argsort(got["keys"].numpy()), np.argsort(want.keys)
    np.testing.assert_array_equal(got["keys"].numpy()[order], want.keys[ref_order])
    for name in ("counts", "last_steps"):
        np.testing.assert_array_equal(got[name].numpy()[order], getattr(want, name)[ref_order], err_msg=name)
    for name in ("rows", "optimizer_state"):
        np.testing.assert_allclose(got[name].numpy()[order], getattr(want, name)[ref_order], rtol=1e-6, atol=1e-7,
                                   err_msg=name)
    assert bag.device_rows.evicted_count == ref.evicted_count > 0
    assert [b.keys.tolist() for b in sink] == [b.keys.tolist() for b in ref_sink]
    for b, r in zip(sink, ref_sink):
        np.testing.assert_array_equal(b.counts, r.counts)
        np.testing.assert_array_equal(b.last_steps, r.last_steps)
        np.testing.assert_allclose(b.rows, r.rows, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(b.optimizer_state, r.optimizer_state, rtol=1e-6, atol=1e-7)
    assert int(bag.state_dict()["evicted_count"]) == ref.evicted_count


def test_device_rows_refuse_a_backward_after_an_eviction_and_keep_the_budget_across_moves(cncard):
    bag = CNEmbeddingBag(10, 2, mode="sum", optimizer=cncore.SGD(lr=0.1), max_rows=3, eviction=cncore.LRU(),
                         headroom=0, device="cncard", fallback_rows=0)
    bag(torch.tensor([[1, 2, 3]])).sum().backward()  # step 0
    bag(torch.tensor([[1]])).sum().backward()  # 1 is now the one used last (step 1)
    first = bag(torch.tensor([[2]]))  # a forward only: no access recorded
    bag(torch.tensor([[4, 5]]))  # evicts 2 and 3 (step 0), keeps 1
    rows_before = bag.export()
    with pytest.raises(RuntimeError, match="rows were evicted from this table since this lookup's forward"):
        first.sum().backward()
    after = bag.export()
    for name, value in rows_before.items():
        torch.testing.assert_close(after[name], value, rtol=0, atol=0)
    assert sorted(bag.keys().tolist()) == [1, 4, 5] and bag.device_rows.evicted_count == 2
    bag.move_to("cpu")  # the core store takes the rows, metadata and count
    assert bag.store.evicted_count == 2 and sorted(bag.keys().tolist()) == [1, 4, 5]
    bag.move_to("cncard")
    bag(torch.tensor([[6]])).sum().backward()  # by the metadata carried back: 4 (never trained, lowest key)
    assert sorted(bag.keys().tolist()) == [1, 5, 6] and bag.device_rows.evicted_count == 3


def test_device_rows_refuse_what_they_cannot_do_naming_it(cncard):
    with pytest.raises(ValueError, match="unadmitted='zeros'"):
        CNEmbeddingBag(10, 2, device="cncard", admission=cncore.MinCount(2, unadmitted="initial"))
    with pytest.raises(ValueError, match="rows on an accelerator are float32"):
        CNEmbeddingBag(10, 2, device="cncard", row_dtype="bfloat16")
    with pytest.raises(TypeError, match="no eviction policy"):
        CNEmbeddingBag(10, 2, device="cncard").device_rows.on_evict(print)


def _tables():
    return [EmbeddingBagConfig(name="t_user", embedding_dim=4, num_embeddings=20, feature_names=["user"]),
            EmbeddingBagConfig(name="t_item", embedding_dim=2, num_embeddings=8, feature_names=["item"])]


def test_collection_options_once_per_table_and_from_the_configs():
    ebc = CNEmbeddingBagCollection(_tables(), optimizer=cncore.SGD(lr=0.1), max_rows="num_embeddings",
                                   eviction={"t_user": cncore.LFU(), "t_item": cncore.LRU()},
                                   admission={"t_user": cncore.MinCount(2)}, headroom=1)
    user, item = ebc.stores["t_user"].config, ebc.stores["t_item"].config
    assert (user.max_rows, type(user.eviction), user.admission, user.headroom) == (20, cncore.LFU,
                                                                                   cncore.MinCount(2), 1)
    assert (item.max_rows, type(item.eviction), item.admission, item.headroom) == (8, cncore.LRU, None, 1)
    ec = CNEmbeddingCollection([EmbeddingConfig(name="t", embedding_dim=2, num_embeddings=5, feature_names=["f"])],
                               max_rows=3, eviction=cncore.TTL(4))
    assert ec.stores["t"].config.max_rows == 3 and ec.stores["t"].config.eviction == cncore.TTL(4)
    with pytest.raises(ValueError, match=r"max_rows: no table named \['t_other'\]"):
        CNEmbeddingBagCollection(_tables(), max_rows={"t_other": 3}, eviction=cncore.LRU())


def test_collection_training_stays_within_every_budget_and_hands_over_every_evicted_row():
    ebc = CNEmbeddingBagCollection(_tables(), optimizer=cncore.Adagrad(lr=0.1), max_rows={"t_user": 12, "t_item": 5},
                                   eviction=cncore.LRU(), headroom=1, fallback_rows=0)
    sinks = {name: [] for name in ebc.stores}
    for name, store in ebc.stores.items():
        store.on_evict(sinks[name].append)
    rng = np.random.default_rng(3)
    seen = {name: set() for name in ebc.stores}
    for _ in range(15):
        users, items = rng.integers(0, 40, 8), rng.integers(0, 9, 4)
        seen["t_user"].update(users.tolist())
        seen["t_item"].update(items.tolist())
        kjt = KeyedJaggedTensor.from_lengths_sync(["user", "item"], torch.from_numpy(np.concatenate([users, items])),
                                                  torch.tensor([2, 2, 2, 2, 1, 1, 1, 1]))
        ebc(kjt).values().sum().backward()
        assert ebc.table_rows()["t_user"] <= 12 and ebc.table_rows()["t_item"] <= 5
    for name, store in ebc.stores.items():
        handed = [k for b in sinks[name] for k in b.keys.tolist()]
        assert len(handed) == store.evicted_count
        # every row ever inserted is in the table or was handed over (a key may come back)
        assert seen[name] <= set(handed) | set(store.export().keys.tolist())
    state = ebc.state_dict()
    assert int(state["tables.t_user.evicted_count"]) == ebc.stores["t_user"].evicted_count > 0

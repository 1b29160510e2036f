"""Pooled lookup against a plain reference and torch.nn.functional.embedding_bag."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import EDGE_KEYS, pooled_reference

import cncore


def make_store(dim, keys, rng, **kw):
    store = cncore.EmbeddingStore(dim=dim, seed=5, **kw)
    uniq = np.unique(keys)
    store.insert_or_assign(uniq, rng.standard_normal((len(uniq), dim)).astype(np.float32))
    return store


def as_dense(store, keys):
    """The store's rows as an index remap + dense matrix, for torch's embedding_bag."""
    uniq, inverse = np.unique(keys, return_inverse=True)
    return store.lookup(uniq), inverse.astype(np.int64)


bags = st.lists(st.lists(st.sampled_from(EDGE_KEYS + list(range(20))), max_size=6), min_size=1, max_size=12)


@settings(max_examples=80)
@given(bags=bags, mode=st.sampled_from(["sum", "mean", "max"]), weighted=st.booleans(),
       dim=st.sampled_from([1, 3, 8, 33]))
def test_matches_torch_embedding_bag(bags, mode, weighted, dim):
    rng = np.random.default_rng(len(bags) * 31 + dim)
    keys = np.array([k for b in bags for k in b], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum([len(b) for b in bags])]).astype(np.int64)
    weighted = weighted and mode != "max"
    weights = rng.standard_normal(len(keys)).astype(np.float32) if weighted else None
    store = make_store(dim, keys, rng)
    out, ctx = store.pooled_lookup(keys, offsets, mode=mode, per_sample_weights=weights)
    dense, idx = as_dense(store, keys)
    np.testing.assert_allclose(out, pooled_reference(dense[idx], offsets, mode, weights), rtol=1e-5, atol=1e-5)
    if mode == "mean" and weighted:
        return  # torch refuses weights with mean; the plain reference above covers it
    expected = torch.nn.functional.embedding_bag(
        torch.from_numpy(idx), torch.from_numpy(dense), torch.from_numpy(offsets), mode=mode,
        per_sample_weights=None if weights is None else torch.from_numpy(weights), include_last_offset=True)
    np.testing.assert_allclose(out, expected.numpy(), rtol=1e-5, atol=1e-5)


def test_lengths_and_offsets_agree(rng):
    keys = rng.integers(-100, 100, 50)
    lengths = np.array([0, 5, 0, 20, 25, 0])
    store = make_store(4, keys, rng)
    a, _ = store.pooled_lookup(keys, np.concatenate([[0], np.cumsum(lengths)]))
    b, _ = store.pooled_lookup(keys, lengths=lengths)
    np.testing.assert_array_equal(a, b)
    assert not a[[0, 2, 5]].any()


def test_evaluation_reads_unseen_as_zero_and_inserts_nothing(rng):
    store = make_store(4, np.array([1, 2]), rng)
    before = store.export()
    keys = np.array([1, 99, 2, 77])
    for mode in ("sum", "mean", "max"):
        out, _ = store.pooled_lookup(keys, lengths=np.array([2, 2]), mode=mode, insert_missing=False)
        rows = store.lookup(keys)  # zeros for 99 and 77
        np.testing.assert_allclose(out, pooled_reference(rows, np.array([0, 2, 4]), mode), rtol=1e-6)
    after = store.export()
    assert len(store) == 2
    np.testing.assert_array_equal(after.counts, before.counts)


@pytest.mark.parametrize("backward", ["fused", "accumulate"])
def test_training_inserts_and_its_backward_counts_accesses(backward):
    store = cncore.EmbeddingStore(dim=2, seed=1, optimizer=cncore.SGD())
    store.step = 41
    keys = np.array([5, 5, 6, 5])
    out, ctx = store.pooled_lookup(keys, lengths=np.array([3, 1]))
    assert ctx.n_new == 2 and len(store) == 2
    fresh = cncore.EmbeddingStore(dim=2, seed=1).lookup(np.array([5, 6]), insert_missing=True)
    np.testing.assert_allclose(out[0], 2 * fresh[0] + fresh[1], rtol=1e-6)
    assert store.read(np.array([5, 6])).counts.tolist() == [0, 0]  # recorded by the backward
    grad = np.zeros((2, 2), np.float32)
    if backward == "fused":
        store.apply_gradients(ctx, grad)
    else:
        store.accumulate_gradients(ctx, grad)
    r = store.read(np.array([5, 6]))
    assert r.counts.tolist() == [3, 1]
    assert r.last_steps.tolist() == [41, 41]
    _, ctx = store.pooled_lookup(np.array([6]), lengths=np.array([1]))
    store.apply_gradients(ctx, np.zeros((1, 2), np.float32))
    r = store.read(np.array([5, 6]))
    assert r.counts.tolist() == [3, 2]
    assert r.last_steps.tolist() == [41, 42 if backward == "fused" else 41]


def test_evaluation_backward_records_no_access():
    store = cncore.EmbeddingStore(dim=2)
    store.find_or_insert(np.array([1]))
    _, ctx = store.pooled_lookup(np.array([1, 1]), lengths=np.array([2]), insert_missing=False)
    store.accumulate_gradients(ctx, np.ones((1, 2), np.float32))
    assert store.read(np.array([1])).counts.tolist() == [0]


def test_max_argmax_ties_go_to_first_key():
    store = cncore.EmbeddingStore(dim=2, initializer=cncore.Constant(1.0), optimizer=cncore.SGD(lr=1.0))
    keys = np.array([3, 4])
    out, ctx = store.pooled_lookup(keys, lengths=np.array([2]), mode="max")
    assert ctx.argmax.tolist() == [[0, 0]]
    store.apply_gradients(ctx, np.ones((1, 2), dtype=np.float32))
    np.testing.assert_array_equal(store.lookup(keys), [[0.0, 0.0], [1.0, 1.0]])


def test_output_written_into_a_column_block_of_a_caller_buffer(rng):
    store = make_store(3, np.arange(10), rng)
    buf = np.full((4, 7), 9.0, dtype=np.float32)
    out, _ = store.pooled_lookup(np.arange(8), lengths=np.full(4, 2), out=buf[:, 2:5])
    assert np.shares_memory(out, buf)
    assert (buf[:, :2] == 9).all() and (buf[:, 5:] == 9).all()
    np.testing.assert_allclose(buf[:, 2:5], pooled_reference(store.lookup(np.arange(8)), np.arange(0, 9, 2), "sum"),
                               rtol=1e-6)


def test_grouped_lookup_equals_per_store_lookups(rng):
    stores = [make_store(d, np.arange(30), rng) for d in (2, 5, 3)]
    keys = [rng.integers(0, 40, 12) for _ in stores]
    lengths = [np.array([3, 0, 4, 5]), np.array([12, 0, 0, 0]), np.array([1, 1, 1, 9])]
    modes = ["sum", "mean", "max"]
    out, ctxs = cncore.grouped_pooled_lookup(stores, keys, lengths=lengths, modes=modes, insert_missing=False)
    col = 0
    for s, k, ln, m, ctx in zip(stores, keys, lengths, modes, ctxs):
        single, _ = s.pooled_lookup(k, lengths=ln, mode=m, insert_missing=False)
        np.testing.assert_array_equal(out[:, col:col + s.dim], single)
        assert ctx.columns == slice(col, col + s.dim)
        col += s.dim


def test_shared_store_in_one_group(rng):
    store = make_store(4, np.arange(10), rng)
    out, _ = cncore.grouped_pooled_lookup([store, store], [np.array([1, 2]), np.array([2, 3])],
                                          lengths=[np.array([2]), np.array([2])], insert_missing=False)
    rows = store.lookup(np.array([1, 2, 3]))
    np.testing.assert_allclose(out, [np.concatenate([rows[0] + rows[1], rows[1] + rows[2]])], rtol=1e-6)


def test_empty_batch():
    store = cncore.EmbeddingStore(dim=3)
    out, ctx = store.pooled_lookup(np.zeros(0, np.int64), np.zeros(1, np.int64))
    assert out.shape == (0, 3)
    out, ctx = store.pooled_lookup(np.zeros(0, np.int64), lengths=np.zeros(3, np.int64), mode="max")
    assert out.shape == (3, 3) and not out.any()


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_a_record_carries_what_a_context_does_and_its_backward_applies_the_same_update(mode):
    """grouped.forward_one's record (what the torch modules' autograd node keeps) makes the
    LookupContext pooled_lookup makes (context_of), and backward_one with it updates the rows
    exactly as apply_gradients with the context; a record from before an erase is refused
    with the rows unchanged, as a context is."""
    from dataclasses import fields

    from cncore.grouped import RECORD_FIELDS, LookupContext, _optim_tuple, backward_one, context_of, forward_one
    rng = np.random.default_rng(3)
    keys = rng.integers(0, 50, 40)
    offsets = np.array([0, 10, 10, 25, 40])
    grad = rng.standard_normal((4, 6)).astype(np.float32)
    stores = [cncore.EmbeddingStore(dim=6, seed=9, optimizer=cncore.Adagrad(lr=0.3)) for _ in range(2)]
    out_ref, ctx = stores[0].pooled_lookup(keys, offsets, mode=mode)
    out = np.empty((4, 6), np.float32)
    record = forward_one(stores[1], keys, offsets, None, cncore.grouped.MODES[mode], out, True)
    assert len(record) == len(RECORD_FIELDS) and set(RECORD_FIELDS) <= {f.name for f in fields(LookupContext)}
    np.testing.assert_array_equal(out, out_ref)
    made = context_of(stores[1], record)
    for name in RECORD_FIELDS:  # (the erase epoch is each store's own: compared with its own lookup's)
        a = getattr(made, name)
        b = (stores[1].pooled_lookup(keys[:1], np.array([0, 1]), insert_missing=False)[1] if name == "erase_epoch"
             else ctx).__getattribute__(name)
        assert (np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b), name
    stores[0].apply_gradients(ctx, grad)
    backward_one(stores[1], record, grad, _optim_tuple(stores[1], None))
    a, b = stores[0].export(), stores[1].export()
    np.testing.assert_array_equal(a.keys, b.keys)
    np.testing.assert_array_equal(a.rows, b.rows)
    np.testing.assert_array_equal(a.optimizer_state, b.optimizer_state)
    assert stores[0].step == stores[1].step == 1
    record = forward_one(stores[1], keys, offsets, None, cncore.grouped.MODES[mode], out, True)
    stores[1].erase(keys[:1])
    before = stores[1].export()
    with pytest.raises(RuntimeError, match="erased"):
        backward_one(stores[1], record, grad, _optim_tuple(stores[1], None))
    np.testing.assert_array_equal(stores[1].export().rows, before.rows)

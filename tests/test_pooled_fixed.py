"""The pooled forward's register path (sum and mean over dims that are a multiple of 16, up to
128; cn_pool.h's cn_pool_bag_fixed) gives the bits of the general path (cn_pool_bag), which a
table with absent keys read as initial rows (MinCount(..., unadmitted="initial")) always takes.
Also: unweighted sums equal a float32 sum in key order, and the bag shapes at the edges of the
row prefetch (bags shorter than the prefetch distance, empty bags, one ID in all, the thread
count) change nothing."""
import numpy as np
import pytest

import cncore

DTYPES = ["float32", "float16", "bfloat16"]


def stores(dim, dtype, keys, rows):
    """The same rows in a table that takes the register path and in one that takes the general path."""
    fast = cncore.EmbeddingStore(cncore.StoreConfig(dim=dim, dtype=dtype))
    general = cncore.EmbeddingStore(cncore.StoreConfig(dim=dim, dtype=dtype,
                                                       admission=cncore.MinCount(1, unadmitted="initial")))
    for s in (fast, general):
        s.insert_or_assign(keys, rows)
    absent = np.setdiff1d(np.array([1, 2, 3]), keys)[:1]  # the general path's mark: an absent key reads nonzero
    assert general.pooled_lookup(absent, lengths=[1], insert_missing=False)[0].any()
    return fast, general


def ordered_sum(rows, offsets):
    """Each bag's rows added in float32, one at a time, in key order (empty bags: zeros)."""
    out = np.zeros((len(offsets) - 1, rows.shape[1]), np.float32)
    for b in range(len(offsets) - 1):
        for i in range(offsets[b], offsets[b + 1]):
            out[b] = out[b] + rows[i]
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [16, 32, 48, 64, 80, 96, 112, 128, 8, 144])  # 8, 144: general path in both
@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
def test_register_path_gives_the_general_paths_bits(dtype, dim, mode, weighted):
    rng = np.random.default_rng(dim * 7 + len(dtype))
    table_keys = rng.integers(-2**62, 2**62, 3000)
    rows = rng.standard_normal((len(table_keys), dim)).astype(np.float32)
    fast, general = stores(dim, dtype, table_keys, rows)
    lengths = rng.choice([0, 1, 2, 3, 7, 20, 45], size=400)  # around every prefetch distance (4..32 keys)
    keys = rng.choice(table_keys, int(lengths.sum()))
    weights = rng.standard_normal(len(keys)).astype(np.float32) if weighted else None
    got, _ = fast.pooled_lookup(keys, lengths=lengths, mode=mode, per_sample_weights=weights, insert_missing=False)
    want, _ = general.pooled_lookup(keys, lengths=lengths, mode=mode, per_sample_weights=weights,
                                    insert_missing=False)
    np.testing.assert_array_equal(got, want)
    if not weighted and mode == "sum":
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        np.testing.assert_array_equal(got, ordered_sum(fast.lookup(keys), offsets))


@pytest.mark.parametrize("dtype", DTYPES)
def test_absent_keys_read_as_zeros_in_the_register_path(dtype):
    rng = np.random.default_rng(3)
    present = np.arange(100, 200, dtype=np.int64)
    fast, _ = stores(64, dtype, present, rng.standard_normal((100, 64)).astype(np.float32))
    keys = np.array([5, 150, 6, 151, 7, 152, 8, 9], dtype=np.int64)  # absent ones first, last and between
    lengths = np.array([1, 2, 0, 3, 2])
    out, ctx = fast.pooled_lookup(keys, lengths=lengths, insert_missing=False)
    rows = fast.lookup(keys)
    assert (rows[[0, 2, 4, 6, 7]] == 0).all()
    np.testing.assert_array_equal(out, ordered_sum(rows, np.concatenate([[0], np.cumsum(lengths)])))
    np.testing.assert_array_equal(ctx.slots[[0, 2, 4, 6, 7]], -1)
    assert len(fast) == 100  # an evaluation lookup inserts nothing


@pytest.mark.parametrize("dim", [16, 64, 128])
def test_one_id_and_only_empty_bags(dim):
    store = cncore.EmbeddingStore(cncore.StoreConfig(dim=dim, initializer=cncore.Constant(0.5)))
    store.insert_or_assign(np.array([42]), np.full((1, dim), 1.5, np.float32))
    out, _ = store.pooled_lookup(np.array([42]), lengths=np.array([1]), insert_missing=False)
    np.testing.assert_array_equal(out, np.full((1, dim), 1.5, np.float32))
    out, _ = store.pooled_lookup(np.array([42]), lengths=np.array([0, 0, 1, 0]), mode="mean", insert_missing=False)
    np.testing.assert_array_equal(out, np.stack([np.zeros(dim), np.zeros(dim), np.full(dim, 1.5), np.zeros(dim)]))
    out, _ = store.pooled_lookup(np.array([], np.int64), lengths=np.zeros(5, np.int64), insert_missing=False)
    np.testing.assert_array_equal(out, np.zeros((5, dim), np.float32))


@pytest.mark.parametrize("dtype", DTYPES)
def test_results_do_not_depend_on_the_thread_count(dtype):
    rng = np.random.default_rng(11)
    table_keys = np.arange(50_000, dtype=np.int64) * 7919
    fast, _ = stores(64, dtype, table_keys, rng.standard_normal((len(table_keys), 64)).astype(np.float32))
    lengths = rng.integers(0, 40, 4096)  # past the 2048 IDs that bring in the workers
    keys = rng.choice(table_keys, int(lengths.sum()))
    weights = rng.standard_normal(len(keys)).astype(np.float32)
    outs = []
    try:
        for n in (1, 2, 3):
            cncore.set_num_threads(n)
            outs.append(fast.pooled_lookup(keys, lengths=lengths, per_sample_weights=weights, insert_missing=False)[0])
    finally:
        cncore.set_num_threads(None)
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(outs[0], outs[2])


@pytest.mark.parametrize("n", [1, 2, 127, 128, 129, 300, 5000])  # around the find's prefetch distance (128)
def test_find_around_the_prefetch_distance(n):
    """The batch find hashes each key once, parking its bucket position in slots[] until its
    probe: batches shorter than, equal to and past the distance, and split between threads."""
    rng = np.random.default_rng(n)
    store = cncore.EmbeddingStore(dim=4)
    present = rng.integers(-2**63, 2**63 - 1, 2000, dtype=np.int64)
    slots_in, _ = store.find_or_insert(present)
    where = dict(zip(present.tolist(), slots_in.tolist()))
    keys = np.where(rng.random(n) < 0.7, rng.choice(present, n), rng.integers(-2**63, 2**63 - 1, n, dtype=np.int64))
    slots, found = store.find(keys)
    np.testing.assert_array_equal(slots, [where.get(k, -1) for k in keys.tolist()])
    np.testing.assert_array_equal(found, slots >= 0)


def test_find_refuses_slots_that_overlap_the_keys():
    store = cncore.EmbeddingStore(dim=4)
    store.find_or_insert(np.arange(10))
    keys = np.arange(300, dtype=np.int64)
    with pytest.raises(ValueError, match="must not overlap keys"):
        store._table.find(keys, keys)
    with pytest.raises(ValueError, match="must not overlap keys"):
        store._table.find(keys[:200], keys[100:])

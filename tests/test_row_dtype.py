"""float16 and bfloat16 rows (cn_dtype.h): every value is the float32 value rounded to nearest
even, once per write. Checked exactly against a float32 store whose rows are re-rounded after
each write (the same float32 arithmetic in the same order, one rounding), and against the
stated bounds; saturation, files (full saves and delta chains), eviction sinks, the torch
module, and bad dtypes."""
import numpy as np
import pytest

import cncore
from cncore.tablefile import TableWriter, load_store, open_table, save_table

DTYPES = ["float16", "bfloat16"]
OPTIMIZERS = [cncore.SGD(lr=0.5), cncore.Adagrad(lr=0.3), cncore.RowWiseAdagrad(lr=0.3), cncore.Adam(lr=0.05)]


def bf16_round(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 -> bfloat16, widened back (finite inputs), saturating."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint32)
    r = np.where((r & 0x7FFF) == 0x7F80, (r & 0x8000) | 0x7F7F, r)
    return (r << 16).astype(np.uint32).view(np.float32)


def f16_round(x: np.ndarray) -> np.ndarray:
    return np.clip(np.asarray(x, np.float32), -65504, 65504).astype(np.float16).astype(np.float32)


ROUND = {"float16": f16_round, "bfloat16": bf16_round}
REL = {"float16": 2.0**-11, "bfloat16": 2.0**-8}  # half a unit in the last place, relative


def _rerounded(ref: cncore.EmbeddingStore, dtype: str) -> None:
    """Make the float32 reference hold what the low-precision table holds."""
    batch = ref.export()
    if len(batch.keys):
        ref.insert_or_assign(batch.keys, ROUND[dtype](batch.rows), batch.optimizer_state)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: type(o).__name__)
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_training_equals_float32_rounded_once_per_write(dtype, optimizer, mode):
    low = cncore.EmbeddingStore(cncore.StoreConfig(dim=12, dtype=dtype, optimizer=optimizer, seed=4,
                                                   initializer=cncore.Normal(0.0, 0.5)))
    ref = cncore.EmbeddingStore(cncore.StoreConfig(dim=12, optimizer=optimizer, seed=4,
                                                   initializer=cncore.Normal(0.0, 0.5)))
    rng = np.random.default_rng(7)
    for _step in range(6):
        keys = rng.integers(0, 40, 60)
        lengths = rng.multinomial(60, np.ones(12) / 12)
        weights = rng.uniform(0.5, 2.0, 60).astype(np.float32) if mode != "max" else None
        out, ctx = low.pooled_lookup(keys, lengths=lengths, mode=mode, per_sample_weights=weights)
        ref.find_or_insert(keys)
        _rerounded(ref, dtype)  # new keys' initial rows, rounded
        ref_out, ref_ctx = ref.pooled_lookup(keys, lengths=lengths, mode=mode, per_sample_weights=weights)
        np.testing.assert_array_equal(out, ref_out)
        grad = rng.standard_normal(out.shape).astype(np.float32)
        low.apply_gradients(ctx, grad)
        ref.apply_gradients(ref_ctx, grad)
        _rerounded(ref, dtype)
    got, want = low.export(), ref.export()
    order, ref_order = np.argsort(got.keys), np.argsort(want.keys)
    np.testing.assert_array_equal(got.keys[order], want.keys[ref_order])
    np.testing.assert_array_equal(got.rows[order], want.rows[ref_order])
    np.testing.assert_array_equal(got.optimizer_state[order], want.optimizer_state[ref_order])
    np.testing.assert_array_equal(got.counts[order], want.counts[ref_order])


@pytest.mark.parametrize("dtype", DTYPES)
def test_initial_rows_are_the_float32_rows_rounded_within_half_an_ulp(dtype):
    keys = np.arange(-500, 500, dtype=np.int64) * 7919
    low = cncore.EmbeddingStore(cncore.StoreConfig(dim=16, dtype=dtype, initializer=cncore.Uniform(-3, 3)))
    ref = cncore.EmbeddingStore(cncore.StoreConfig(dim=16, initializer=cncore.Uniform(-3, 3)))
    rows, exact = low.lookup(keys, insert_missing=True), ref.lookup(keys, insert_missing=True)
    np.testing.assert_array_equal(rows, ROUND[dtype](exact))
    normal = np.abs(exact) >= 2.0**-14
    assert (np.abs(rows - exact)[normal] <= REL[dtype] * np.abs(exact)[normal]).all()
    assert np.abs(rows - exact).max() > 0  # the values really are rounded


def test_values_past_float16_saturate_and_bfloat16_keeps_the_float32_range():
    big = np.array([[1e6, -1e6, 65504.0, 70000.0]], np.float32)
    f16 = cncore.EmbeddingStore(cncore.StoreConfig(dim=4, dtype="float16"))
    f16.insert_or_assign(np.array([1]), big)
    np.testing.assert_array_equal(f16.lookup(np.array([1])), [[65504, -65504, 65504, 65504]])
    bf16 = cncore.EmbeddingStore(cncore.StoreConfig(dim=4, dtype="bfloat16"))
    bf16.insert_or_assign(np.array([1]), np.array([[3.4e38, -1e30, 1e-30, 0.0]], np.float32))
    got = bf16.lookup(np.array([1]))
    assert np.isfinite(got).all() and got[0, 0] > 3.3e38
    np.testing.assert_array_equal(got, bf16_round(np.array([[3.4e38, -1e30, 1e-30, 0.0]], np.float32)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_half_the_row_bytes(dtype):
    """Memory: dim 64 with row-wise Adagrad (its state in the metadata) is 256 bytes of row in
    float32 and 128 at 16 bits."""
    f32 = cncore.EmbeddingStore(cncore.StoreConfig(dim=64, capacity=1 << 16, optimizer=cncore.RowWiseAdagrad()))
    low = cncore.EmbeddingStore(cncore.StoreConfig(dim=64, capacity=1 << 16, dtype=dtype,
                                                   optimizer=cncore.RowWiseAdagrad()))
    index = f32.nbytes - (1 << 16) * (256 + 16)
    assert low.nbytes - index == (1 << 16) * (128 + 16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_files_round_trip_the_dtype_and_the_values_exactly(dtype, tmp_path):
    store = cncore.EmbeddingStore(cncore.StoreConfig(dim=6, dtype=dtype, optimizer=cncore.Adam(lr=0.1)))
    rng = np.random.default_rng(1)
    out, ctx = store.pooled_lookup(rng.integers(0, 100, 50), lengths=np.full(10, 5))
    store.apply_gradients(ctx, rng.standard_normal(out.shape).astype(np.float32))
    base = save_table(store, str(tmp_path / "t"))
    out, ctx = store.pooled_lookup(rng.integers(50, 150, 50), lengths=np.full(10, 5))
    store.apply_gradients(ctx, rng.standard_normal(out.shape).astype(np.float32))
    save_table(store, str(tmp_path / "t"), since=base)  # a delta
    back = load_store(str(tmp_path / "t"))
    assert back.config.dtype == dtype and back.config == store.config
    a, b = store.export(), back.export()
    order, back_order = np.argsort(a.keys), np.argsort(b.keys)
    for name in ("keys", "rows", "optimizer_state", "counts", "last_steps"):
        np.testing.assert_array_equal(getattr(a, name)[order], getattr(b, name)[back_order], err_msg=name)


@pytest.mark.parametrize("dtype", DTYPES)
def test_files_hold_16_bit_rows_at_half_the_size(dtype, tmp_path):
    """Format version 3: rows.npy of a 16-bit table holds 2 bytes a value (float16, or bfloat16
    bit patterns as uint16); reads widen them to the exact float32 values of the store."""
    import json
    store = cncore.EmbeddingStore(cncore.StoreConfig(dim=8, dtype=dtype))
    store.find_or_insert(np.arange(1000))
    save_table(store, str(tmp_path / "t"))
    table = open_table(str(tmp_path / "t"))
    assert table.rows.dtype == {"float16": np.float16, "bfloat16": np.uint16}[dtype]
    manifest = json.load(open(tmp_path / "t" / table.version / "manifest.json"))
    header = manifest["arrays"]["rows"]["bytes"] - 1000 * 8 * 2
    assert 0 < header <= 128  # the .npy header, then exactly 2 bytes per value
    exported = store.read(table.read("keys", 0, len(table)))
    np.testing.assert_array_equal(table.read("rows", 0, len(table)), exported.rows)
    picks = np.array([999, 0, 5, 5])
    np.testing.assert_array_equal(table.take("rows", picks), exported.rows[picks])
    assert table.take("rows", picks).dtype == np.float32


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_writer_fed_float32_rows_rounds_them_as_the_core_does(dtype, tmp_path):
    """TableWriter given arbitrary float32 rows for a 16-bit table stores what a store of that
    dtype would hold for them: the core's rounding (nearest, ties to even, saturating)."""
    rng = np.random.default_rng(3)
    rows = (rng.standard_normal((64, 4)) * np.float32(10.0) ** rng.integers(-6, 7, (64, 1))).astype(np.float32)
    rows[0] = [1e6, -1e6, np.float32(1 + 2**-8), np.float32(1 + 3 * 2**-9)]  # saturation, ties
    config = cncore.StoreConfig(dim=4, dtype=dtype)
    with TableWriter(str(tmp_path / "t"), config, n_rows=64) as writer:
        writer.write(np.arange(64), rows)
    store = cncore.EmbeddingStore(config)
    store.load(np.arange(64), rows)
    np.testing.assert_array_equal(open_table(str(tmp_path / "t")).read("rows", 0, 64), store.read(np.arange(64)).rows)
    np.testing.assert_array_equal(store.read(np.arange(64)).rows, ROUND[dtype](rows))


def test_version_2_files_of_16_bit_tables_with_float32_rows_still_open(tmp_path):
    """Before format version 3 a 16-bit table's rows.npy held float32: such a file still opens."""
    import hashlib
    import json
    import os
    store = cncore.EmbeddingStore(cncore.StoreConfig(dim=3, dtype="bfloat16", optimizer=cncore.SGD()))
    store.find_or_insert(np.arange(10))
    float32_twin = cncore.EmbeddingStore(cncore.StoreConfig(dim=3, optimizer=cncore.SGD()))
    b = store.export()
    float32_twin.load(b.keys, b.rows)
    path = str(tmp_path / "t")
    save_table(float32_twin, path)
    version = os.path.join(path, open(os.path.join(path, "CURRENT")).read().strip())
    manifest = json.load(open(os.path.join(version, "manifest.json")))
    manifest["version"], manifest["config"]["dtype"] = 2, "bfloat16"
    del manifest["evicted"]
    text = json.dumps(manifest).encode()
    open(os.path.join(version, "manifest.json"), "wb").write(text)
    open(os.path.join(version, "manifest.sha256"), "w").write(f"{hashlib.sha256(text).hexdigest()}  manifest.json\n")
    back = load_store(path)
    assert back.config.dtype == "bfloat16"
    np.testing.assert_array_equal(back.read(b.keys).rows, b.rows)


def test_evicted_rows_reach_the_sink_as_float32_values_of_the_table():
    store = cncore.EmbeddingStore(cncore.StoreConfig(dim=3, dtype="bfloat16", max_rows=4, eviction=cncore.LRU(),
                                                     headroom=0))
    sink = []
    store.on_evict(sink.append)
    store.find_or_insert(np.array([1, 2, 3, 4]))
    before = store.lookup(np.array([1]))
    store.find_or_insert(np.array([9]))
    assert sink[0].keys.tolist() == [1] and sink[0].rows.dtype == np.float32
    np.testing.assert_array_equal(sink[0].rows, before)


@pytest.mark.parametrize("dtype", ["float64", "half", "int8", 16, None])
def test_other_dtypes_are_refused_naming_dtype(dtype):
    with pytest.raises(ValueError, match="dtype must be one of"):
        cncore.StoreConfig(dim=4, dtype=dtype)


def test_torch_module_rows_in_bfloat16():
    torch = pytest.importorskip("torch")
    from cncore_torch import CNEmbeddingBag
    bag = CNEmbeddingBag(10, 4, mode="sum", row_dtype=torch.bfloat16, optimizer=cncore.SGD(lr=0.1))
    out = bag(torch.tensor([[1, 2], [2, 3]]))
    assert out.dtype == torch.float32 and bag.store.config.dtype == "bfloat16"
    rows = bag.store.lookup(np.array([1, 2, 3]))
    np.testing.assert_array_equal(rows, bf16_round(rows))  # the stored values are bfloat16 values
    np.testing.assert_array_equal(out.detach().numpy(), np.stack([rows[0] + rows[1], rows[1] + rows[2]]))
    state = bag.state_dict()
    again = CNEmbeddingBag(10, 4, mode="sum", row_dtype="bfloat16", optimizer=cncore.SGD(lr=0.1))
    again.load_state_dict(state)
    np.testing.assert_array_equal(again.store.lookup(np.array([1, 2, 3])), rows)

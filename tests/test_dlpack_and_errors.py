"""The DLPack boundary, and bad input: a clear error naming the argument, the store unchanged."""
import subprocess
import sys

import numpy as np
import pytest
import torch
from reference import assert_unchanged, snapshot

import cncore


@pytest.fixture
def store():
    s = cncore.EmbeddingStore(dim=4, seed=1, optimizer=cncore.Adagrad())
    s.find_or_insert(np.array([1, 2, 3]))
    return s


def test_import_cncore_loads_no_deep_learning_framework():
    code = ("import sys, numpy as np, cncore\n"
            "s = cncore.EmbeddingStore(dim=2); s.pooled_lookup(np.arange(4), lengths=np.array([2, 2]))\n"
            "bad = [m for m in ('torch', 'jax', 'tensorflow', 'paddle', 'oneflow') if m in sys.modules]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_torch_tensors_in_and_zero_copy_out(store):
    keys = torch.tensor([1, 2, 3, 4])
    offsets = torch.tensor([0, 2, 4])
    weights = torch.ones(4)
    out_t = torch.zeros(2, 4)
    out, ctx = store.pooled_lookup(keys, offsets, per_sample_weights=weights, out=out_t)
    assert out.ctypes.data == out_t.data_ptr()  # written in place into the torch tensor
    rows = store.lookup(keys.numpy())
    np.testing.assert_allclose(out_t.numpy(), [rows[0] + rows[1], rows[2] + rows[3]], rtol=1e-6)
    back = torch.from_dlpack(out)
    assert back.data_ptr() == out.ctypes.data
    looked = store.lookup(keys)
    assert torch.from_dlpack(looked).data_ptr() == looked.ctypes.data
    assert np.from_dlpack(looked).ctypes.data == looked.ctypes.data
    store.apply_gradients(ctx, torch.ones(2, 4))


def test_jax_arrays_in_and_out(store):
    jax = pytest.importorskip("jax")  # the test extras install it; CI has it
    import jax.numpy as jnp
    keys = jnp.array([1, 2, 3, 9])  # int32 under JAX's default config: widened
    out, _ = store.pooled_lookup(keys, lengths=jnp.array([2, 2]), insert_missing=False)
    got = jax.dlpack.from_dlpack(out)
    np.testing.assert_array_equal(np.asarray(got), out)
    with pytest.raises(BufferError, match="out: is read-only"):
        store.pooled_lookup(keys, lengths=jnp.array([2, 2]), out=jnp.zeros((2, 4), jnp.float32))


def test_buffer_protocol_and_lists(store):
    slots, found = store.find(memoryview(np.array([1, 5], dtype=np.int64)))
    assert found.tolist() == [True, False]
    assert store.contains([3, 4]).tolist() == [True, False]


class FakeDeviceArray:
    def __dlpack_device__(self):
        return (2, 0)  # kDLCUDA

    def __dlpack__(self, **kw):
        raise AssertionError("must not be consumed")


BAD_CALLS = [
    ("keys", TypeError, "expected int64", lambda s: s.find_or_insert(np.array([1.0, 2.0]))),
    ("keys", TypeError, "expected int64", lambda s: s.find_or_insert(np.array([1, 2], dtype=np.uint64))),
    ("keys", ValueError, "1-D", lambda s: s.find_or_insert(np.ones((2, 2), np.int64))),
    ("keys", ValueError, "CPU array", lambda s: s.find_or_insert(FakeDeviceArray())),
    ("keys", TypeError, "expected an array", lambda s: s.find_or_insert("1,2")),
    ("rows", ValueError, "shape", lambda s: s.insert_or_assign(np.array([7]), np.ones((1, 3), np.float32))),
    ("rows", TypeError, "float32", lambda s: s.insert_or_assign(np.array([7]), np.ones((1, 4)))),
    ("optimizer_state", ValueError, "shape",
     lambda s: s.insert_or_assign(np.array([7]), np.ones((1, 4), np.float32), np.ones((1, 1), np.float32))),
    ("offsets", ValueError, "position 2",
     lambda s: s.pooled_lookup(np.array([7, 8, 9]), np.array([0, 2, 1, 3]))),
    ("offsets", ValueError, "end at the number of keys",
     lambda s: s.pooled_lookup(np.array([7, 8, 9]), np.array([0, 1, 2]))),
    ("offsets", ValueError, "must start at 0", lambda s: s.pooled_lookup(np.array([7]), np.array([1, 1]))),
    ("offsets", TypeError, "int64 or int32", lambda s: s.pooled_lookup(np.array([7]), np.array([0.0, 1.0]))),
    ("lengths", ValueError, "exactly one", lambda s: s.pooled_lookup(np.array([7]))),
    ("lengths", ValueError, r"must be in \[0, len\(keys\[0\]\)\]",
     lambda s: s.pooled_lookup(np.array([7, 8]), lengths=np.array([3, -1]))),
    ("per_sample_weights", ValueError, "shape",
     lambda s: s.pooled_lookup(np.array([7, 8]), lengths=np.array([2]), per_sample_weights=np.ones(3, np.float32))),
    ("per_sample_weights", ValueError, "not 'max'",
     lambda s: s.pooled_lookup(np.array([7]), lengths=np.array([1]), mode="max",
                               per_sample_weights=np.ones(1, np.float32))),
    ("modes", ValueError, "'sum', 'mean' or 'max'", lambda s: s.pooled_lookup(np.array([7]), lengths=[1], mode="avg")),
    ("out", BufferError, "read-only",
     lambda s: s.pooled_lookup(np.array([7]), lengths=[1], out=_readonly((1, 4)))),
    ("out", ValueError, "shape",
     lambda s: s.pooled_lookup(np.array([7]), lengths=[1], out=np.zeros((2, 4), np.float32))),
    ("out", BufferError, "contiguous",
     lambda s: s.pooled_lookup(np.array([7]), lengths=[1, 0], out=np.zeros((4, 2), np.float32).T)),
    ("rows", TypeError, "float32", lambda s: s.load(np.array([9]), np.ones((1, 4), np.float16))),
    ("counts", ValueError, r"\[0, 2\*\*32 - 1\]",
     lambda s: s.load(np.array([9]), np.ones((1, 4), np.float32), counts=np.array([-1]))),
    ("n_rows", ValueError, "n_rows", lambda s: s.reserve(-1)),
    ("max_rows", ValueError, "max_rows", lambda s: s.export(max_rows=0)),
]


def _readonly(shape):
    a = np.zeros(shape, np.float32)
    a.flags.writeable = False
    return a


@pytest.mark.parametrize("arg,exc,message,call", BAD_CALLS, ids=[f"{a}-{i}" for i, (a, *_) in enumerate(BAD_CALLS)])
def test_bad_input_names_the_argument_and_leaves_the_store_unchanged(store, arg, exc, message, call):
    before = snapshot(store)
    with pytest.raises(exc, match=message) as info:
        call(store)
    assert arg in str(info.value)
    assert_unchanged(store, before)


def test_bad_gradient_input_leaves_rows_unchanged(store):
    _, ctx = store.pooled_lookup(np.array([1, 2]), lengths=[2])
    before = snapshot(store)
    with pytest.raises(ValueError, match="grad_output"):
        store.apply_gradients(ctx, np.ones((2, 4), np.float32))
    with pytest.raises(TypeError, match="grad_output"):
        store.apply_gradients(ctx, np.ones((1, 4)))
    with pytest.raises(ValueError, match="lr"):
        store.apply_gradients(ctx, np.ones((1, 4), np.float32), lr=float("nan"))
    with pytest.raises(TypeError, match="ctx"):
        store.apply_gradients(object(), np.ones((1, 4), np.float32))
    with pytest.raises(ValueError, match="another store"):
        cncore.EmbeddingStore(dim=4, optimizer=cncore.SGD()).apply_gradients(ctx, np.ones((1, 4), np.float32))
    assert_unchanged(store, before)


def test_a_bad_feature_in_a_group_changes_no_store(store):
    other = cncore.EmbeddingStore(dim=2)
    before = snapshot(store)
    with pytest.raises(ValueError, match=r"offsets\[1\]"):
        cncore.grouped_pooled_lookup([store, other], [np.array([50, 51]), np.array([60])],
                                     [np.array([0, 2]), np.array([0, 2])])
    assert_unchanged(store, before)
    assert len(other) == 0


def test_torch_tensor_requiring_grad_is_refused_clearly(store):
    with pytest.raises(TypeError, match="per_sample_weights"):
        store.pooled_lookup(np.array([1]), lengths=[1], per_sample_weights=torch.ones(1, requires_grad=True))


@pytest.mark.parametrize("bad", [
    dict(dim=0), dict(dim=4, dtype="float64"), dict(dim=4, dtype="half"), dict(dim=4, seed=-1),
    dict(dim=4, capacity=-5), dict(dim=4, max_load_factor=0.99), dict(dim=4, optimizer="sgd"),
    dict(dim=4, initializer=cncore.Uniform),
])
def test_bad_config_is_refused(bad):
    with pytest.raises((TypeError, ValueError)):
        cncore.StoreConfig(**bad)


def test_bad_initializer_and_optimizer_arguments():
    with pytest.raises(ValueError, match="low < high"):
        cncore.Uniform(1.0, 0.0)
    with pytest.raises(ValueError, match="std"):
        cncore.Normal(0.0, 0.0)
    with pytest.raises(ValueError, match="no probability mass"):
        cncore.TruncatedNormal(mean=0.0, std=1.0, low=40.0, high=41.0)
    with pytest.raises(ValueError, match="betas"):
        cncore.Adam(betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="lr"):
        cncore.SGD(lr=-1.0)


def test_store_fed_by_a_torchrec_keyed_jagged_tensor_and_torch_autograd():
    """A store used directly from PyTorch: KJT values/lengths in, output written into a tensor,
    its gradient applied by the store."""
    kjt_module = pytest.importorskip("torchrec.sparse.jagged_tensor")
    kjt = kjt_module.KeyedJaggedTensor.from_lengths_sync(
        keys=["item"], values=torch.tensor([2**40, 7, 7, -5]), lengths=torch.tensor([3, 0, 1]))
    store = cncore.EmbeddingStore(dim=4, optimizer=cncore.SGD(lr=0.5), initializer=cncore.Constant(1.0))
    values, lengths = kjt.values(), kjt.lengths()
    pooled = torch.empty(len(lengths), 4)
    _, ctx = store.pooled_lookup(values, lengths=lengths, out=pooled)
    assert pooled.tolist() == [[3.0] * 4, [0.0] * 4, [1.0] * 4]
    pooled.requires_grad_()
    loss = pooled.sum()
    loss.backward()
    store.apply_gradients(ctx, pooled.grad)
    # key 7 appears twice in bag 0: one update with the summed gradient 2 -> 1 - 0.5 * 2 = 0
    np.testing.assert_array_equal(store.lookup(np.array([2**40, 7, -5])), [[0.5] * 4, [0.0] * 4, [0.5] * 4])

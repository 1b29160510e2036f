"""Serving: `cncore_jax.frozen.freeze(model)` turns the tables into arrays with an in-graph
lookup (`jnp.searchsorted`), equal to the evaluation lookup in every pooling mode (reference: a
dict of the table's rows pooled in NumPy); the original keeps training apart; `jax.export` of
an inference function serializes, and the artifact runs in a process where importing cncore
fails."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

jax = pytest.importorskip("jax")
nnx = pytest.importorskip("flax.nnx")
import jax.numpy as jnp  # noqa: E402
from reference import pooled_reference  # noqa: E402

import cncore  # noqa: E402
import cncore_jax as cj  # noqa: E402
from cncore_jax.frozen import FrozenEmbeddingBag, FrozenRows, freeze  # noqa: E402
from cncore_jax.modules import EmbeddingBag, EmbeddingBagCollection  # noqa: E402

jax.config.update("jax_enable_x64", True)

KNOWN = np.array([-(2**63), -3, 0, 17, 2**40, 2**63 - 1])
IDS = np.array([17, 17, 5, 2**63 - 1, -(2**63), 2**40, 0, -3, 999, 0, 0])  # 5 and 999 absent; last 2 padding
LENGTHS = np.array([3, 0, 4, 2])


def filled_bag(mode):
    bag = EmbeddingBag(dim=3, mode=mode, initializer=cncore.Uniform(-1, 1), seed=2)
    bag.table.store.find_or_insert(KNOWN)
    return bag


def reference(store, ids, lengths, mode, weights=None):
    """The rows as a dict (absent keys: zeros), pooled in NumPy."""
    batch = store.export()
    rows = dict(zip(batch.keys.tolist(), batch.rows))
    used = int(lengths.sum())
    picked = np.array([rows.get(int(k), np.zeros(store.dim, np.float32)) for k in ids[:used]])
    return pooled_reference(picked, np.r_[0, np.cumsum(lengths)], mode, None if weights is None else weights[:used])


@pytest.mark.parametrize("mode,weighted", [("sum", False), ("mean", False), ("max", False), ("sum", True),
                                           ("mean", True)])
def test_a_frozen_bag_pools_as_the_evaluation_lookup(mode, weighted):
    bag = filled_bag(mode)
    weights = np.linspace(0.5, 2.0, len(IDS)).astype(np.float32) if weighted else None
    frozen = freeze(bag)
    assert isinstance(frozen, FrozenEmbeddingBag) and isinstance(frozen.rows, FrozenRows)
    got = nnx.jit(lambda m, i, n, w: m(i, n, weights=w))(frozen, jnp.asarray(IDS), jnp.asarray(LENGTHS),
                                                         None if weights is None else jnp.asarray(weights))
    np.testing.assert_allclose(got, reference(bag.table.store, IDS, LENGTHS, mode, weights), rtol=1e-6, atol=1e-7)
    bag.eval()  # the live evaluation lookup agrees, and inserts nothing
    live = bag(jnp.asarray(IDS), jnp.asarray(LENGTHS), weights=None if weights is None else jnp.asarray(weights))
    np.testing.assert_allclose(got, live, rtol=1e-6, atol=1e-7)
    assert len(bag.table) == len(KNOWN)


class Model(nnx.Module):
    def __init__(self):
        self.ebc = EmbeddingBagCollection({"a": cj.Table(dim=2, optimizer=cncore.SGD(lr=0.5), seed=1),
                                           "b": cj.Table(dim=3, optimizer=cncore.SGD(lr=0.5), seed=2)},
                                          modes=["sum", "mean"])
        self.head = nnx.Linear(5, 1, rngs=nnx.Rngs(0))

    def __call__(self, ids, lengths):
        return self.head(self.ebc(ids, lengths))[:, 0]


def train(model, steps=2):
    @nnx.jit
    def step(model, ids, lengths):
        nnx.value_and_grad(lambda m: m(ids, lengths).sum())(model)

    for _ in range(steps):
        step(model, {"a": jnp.asarray(IDS), "b": jnp.asarray(IDS[::-1].copy())},
             {"a": jnp.asarray(LENGTHS), "b": jnp.asarray(LENGTHS)})


@pytest.mark.slow
def test_freeze_copies_the_rows_as_they_are_and_the_model_trains_on():
    model = Model()
    train(model)
    frozen = freeze(model)
    assert frozen is not model and frozen.head.kernel is model.head.kernel  # dense variables shared
    ids = {"a": jnp.asarray(IDS), "b": jnp.asarray(IDS)}
    lengths = {"a": jnp.asarray(LENGTHS), "b": jnp.asarray(LENGTHS)}
    forward = nnx.jit(lambda m, i, n: m(i, n))
    before = np.asarray(forward(frozen, ids, lengths))
    model.eval()
    np.testing.assert_allclose(before, forward(model, ids, lengths), rtol=1e-6)  # as the live model evaluates
    model.train()
    train(model)  # the original keeps training; the frozen copy does not move
    np.testing.assert_allclose(forward(frozen, ids, lengths), before, rtol=0)
    assert isinstance(model.ebc, EmbeddingBagCollection)


BLOCK_CNCORE = """
import importlib.abc, sys
class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("cncore", "cncore_jax", "cncore_torch", "cncore_numpy"):
            raise ImportError(f"{name} is blocked: the artifact must run without cncore")
sys.meta_path.insert(0, Blocked())
"""


@pytest.mark.slow
def test_the_exported_inference_function_runs_without_cncore(tmp_path):
    pytest.importorskip("flatbuffers")  # JAX's serializer for jax.export
    model = Model()
    train(model)
    frozen = freeze(model)

    def serve(ids_a, ids_b, lengths):
        return jax.nn.sigmoid(frozen({"a": ids_a, "b": ids_b}, {"a": lengths, "b": lengths}))

    spec = jax.ShapeDtypeStruct((len(IDS),), jnp.int64)
    exported = jax.export.export(jax.jit(serve))(spec, spec, jax.ShapeDtypeStruct((len(LENGTHS),), jnp.int64))
    (tmp_path / "model.jaxexport").write_bytes(exported.serialize())
    model.eval()
    expected = jax.nn.sigmoid(model({"a": jnp.asarray(IDS), "b": jnp.asarray(IDS[::-1].copy())},
                                    {"a": jnp.asarray(LENGTHS), "b": jnp.asarray(LENGTHS)}))
    code = BLOCK_CNCORE + f"""
import json
import jax, jax.numpy as jnp, numpy as np
jax.config.update("jax_enable_x64", True)
try:
    import cncore
    raise SystemExit("cncore imported")
except ImportError:
    pass
served = jax.export.deserialize(open({str(tmp_path / "model.jaxexport")!r}, "rb").read())
ids = np.array({IDS.tolist()!r})
out = served.call(jnp.asarray(ids), jnp.asarray(ids[::-1].copy()), jnp.asarray(np.array({LENGTHS.tolist()!r})))
print(json.dumps({{"out": np.asarray(out).tolist(), "cncore": any(m.startswith("cncore") for m in sys.modules)}}))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ), cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["cncore"] is False
    np.testing.assert_allclose(result["out"], expected, rtol=1e-6)

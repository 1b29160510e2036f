"""Data parallel on two host devices (a child process with
XLA_FLAGS=--xla_force_host_platform_device_count=2): under `shard_map`, `pmap` (with the
module's `axis_name`, or `cj.lookup(..., axis_name=)` with `cj.apply_gradients`) and a `jit`
over a mesh (batch sharded, no axis name), each step is one
lookup of every device's bags and one update with the sum of the devices' gradients: the
tables and dense parameters equal one device trained on the concatenated batch."""
import json

import numpy as np
import pytest

pytest.importorskip("flax.nnx")
from reference import run_isolated

CHILD = """
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import json
import jax, jax.numpy as jnp, numpy as np, optax, cncore
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P
from cncore_jax.modules import EmbeddingBag
jax.config.update("jax_enable_x64", True)
assert len(jax.devices()) == 2
N_DEV, B, PER = 2, 3, 4   # devices, bags per device, padded ids per bag... per device: B * PER ids
STEPS = 3

class Model(nnx.Module):
    def __init__(self, axis_name=None):
        self.emb = EmbeddingBag(dim=2, optimizer=cncore.Adagrad(lr=0.3), initializer=cncore.Uniform(-1, 1),
                                seed=4, axis_name=axis_name)
        self.head = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    def __call__(self, ids, lengths):
        return self.head(self.emb(ids, lengths))[:, 0]

rng = np.random.default_rng(0)
data = []
for _ in range(STEPS):   # per device: its ids (with padding at the end), lengths, labels
    lengths = rng.integers(0, PER + 1, (N_DEV, B))
    ids = rng.integers(-5, 6, (N_DEV, B * PER)) * 1000003
    data.append((ids, lengths, rng.normal(size=(N_DEV, B)).astype(np.float32)))

def concatenated(ids, lengths):
    # one device on the whole batch: each device's ids without its padding, then padding
    keep = [ids[d, :lengths[d].sum()] for d in range(N_DEV)]
    flat = np.concatenate(keep + [np.zeros(N_DEV * B * PER - sum(map(len, keep)), np.int64)])
    return flat, lengths.reshape(-1)

def share(model, ids, lengths, y):   # this device's share of the global mean loss
    return jnp.sum((model(ids, lengths) - y) ** 2) / (N_DEV * B)

def result(model):
    b = model.emb.table.store.export()
    o = np.argsort(b.keys)
    return {"keys": b.keys[o].tolist(), "rows": b.rows[o].tolist(), "state": b.optimizer_state[o].tolist(),
            "step": model.emb.table.store.step, "kernel": np.asarray(model.head.kernel[...]).tolist()}

out = {}
# one device, the concatenated batch
model = Model()
opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
@nnx.jit
def step(model, opt, ids, lengths, y):
    loss, grads = nnx.value_and_grad(share)(model, ids, lengths, y)
    opt.update(model, grads)
for ids, lengths, y in data:
    f, l = concatenated(ids, lengths)
    step(model, opt, jnp.asarray(f), jnp.asarray(l), jnp.asarray(y.reshape(-1)))
out["one device"] = result(model)

# jit over a mesh: the batch sharded over two devices, the usual step unchanged
mesh = jax.make_mesh((N_DEV,), ("b",))
model = Model()
opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
sharded = NamedSharding(mesh, P("b"))
for ids, lengths, y in data:
    f, l = concatenated(ids, lengths)
    step(model, opt, *(jax.device_put(jnp.asarray(a), sharded) for a in (f, l, y.reshape(-1))))
out["jit over a mesh"] = result(model)

def functional(model, wrap, sum_dense):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = optax.sgd(0.1)
    def local(params, opt_state, ids, lengths, y):
        loss, grads = jax.value_and_grad(lambda p: share(nnx.merge(graphdef, p, rest), ids, lengths, y))(params)
        if sum_dense:  # pmap: the dense gradient is the sum of the shares (shard_map sums a replicated input's)
            grads = jax.lax.psum(grads, "b")
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state
    run = wrap(local)
    opt_state = tx.init(params)
    for ids, lengths, y in data:
        params, opt_state = run(params, opt_state, jnp.asarray(ids), jnp.asarray(lengths), jnp.asarray(y))
    nnx.update(model, params)
    return result(model)

def mapped(local):
    f = jax.shard_map(lambda p, s, i, l, y: local(p, s, i[0], l[0], y[0]), mesh=mesh,
                      in_specs=(P(), P(), P("b"), P("b"), P("b")), out_specs=(P(), P()))
    return jax.jit(lambda p, s, i, l, y: f(p, s, *(jax.device_put(a, sharded) for a in (i, l, y))))

def pmapped(local):
    run = jax.pmap(local, axis_name="b", in_axes=(None, None, 0, 0, 0))   # parameters replicated
    return lambda p, s, i, l, y: jax.tree.map(lambda a: a[0], run(p, s, i, l, y))

out["shard_map"] = functional(Model(axis_name="b"), mapped, sum_dense=False)
out["pmap"] = functional(Model(axis_name="b"), pmapped, sum_dense=True)
# the functional API: cj.lookup(..., axis_name) and cj.apply_gradients under shard_map
import cncore_jax as cj
def explicit(ids, lengths, axis_name=None):
    out, ctx = cj.lookup(table, ids, lengths, axis_name=axis_name)
    cj.apply_gradients(ctx, out * 0.5 + 1.0)
    return out
pooled = {}
for name in ("one device", "explicit shard_map"):
    table = cj.Table(dim=2, optimizer=cncore.Adagrad(lr=0.3), initializer=cncore.Uniform(-1, 1), seed=4)
    for ids, lengths, y in data:
        if name == "one device":
            f, l = concatenated(ids, lengths)
            got = jax.jit(explicit)(jnp.asarray(f), jnp.asarray(l))
        else:
            got = jax.jit(jax.shard_map(lambda i, l: explicit(i[0], l[0], "b"), mesh=mesh, in_specs=(P("b"), P("b")),
                                        out_specs=P("b")))(*(jax.device_put(jnp.asarray(a), sharded)
                                                             for a in (ids, lengths)))
    pooled[name] = np.asarray(got).tolist()
    b = table.store.export()
    o = np.argsort(b.keys)
    out["explicit " + name] = {"keys": b.keys[o].tolist(), "rows": b.rows[o].tolist(), "step": table.store.step,
                               "pooled": pooled[name]}
print(json.dumps(out))
"""


@pytest.mark.slow
def test_each_step_applies_the_sum_of_the_devices_gradients_once():
    got = run_isolated(CHILD, timeout=240)
    explicit, explicit_ref = got.pop("explicit explicit shard_map"), got.pop("explicit one device")
    assert explicit["keys"] == explicit_ref["keys"] and explicit["step"] == explicit_ref["step"] == 3
    np.testing.assert_allclose(explicit["rows"], explicit_ref["rows"], rtol=1e-6)
    np.testing.assert_allclose(explicit["pooled"], explicit_ref["pooled"], rtol=1e-6)  # each device got its bags
    ref = got.pop("one device")
    assert ref["step"] == 3 and len(ref["keys"]) > 3
    assert sorted(got) == ["jit over a mesh", "pmap", "shard_map"]
    for how, res in got.items():
        assert res["keys"] == ref["keys"], how
        assert res["step"] == ref["step"], how  # one update per step, not one per device
        np.testing.assert_allclose(res["rows"], ref["rows"], rtol=1e-5, atol=1e-6, err_msg=how)
        np.testing.assert_allclose(res["state"], ref["state"], rtol=1e-5, atol=1e-6, err_msg=how)
        np.testing.assert_allclose(res["kernel"], ref["kernel"], rtol=1e-5, atol=1e-6, err_msg=how)
    assert json.dumps(ref)  # plain data crossed the process boundary

"""cncore_jax's Flax NNX modules (train/eval) and checkpoints through the shared table file
format: a table saved from JAX opens in PyTorch (cncore_torch) and cn-table, and back."""
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

jax = pytest.importorskip("jax")
nnx = pytest.importorskip("flax.nnx")
import jax.numpy as jnp  # noqa: E402
from jax_routes import no_context_left_waiting  # noqa: E402,F401  (autouse: no context left waiting)

import cncore  # noqa: E402
import cncore_jax as cj  # noqa: E402
from cncore_jax.modules import EmbeddingBag, EmbeddingBagCollection  # noqa: E402

jax.config.update("jax_enable_x64", True)


needs_tablefile = pytest.mark.skipif(not importlib.util.find_spec("cncore.tablefile"),
                                     reason="cncore.tablefile (the shared table format) is not in the core yet")


def zero_loss(module, *inputs):
    """A loss whose gradient is 0: the step inserts and updates (rows unchanged); and the output."""
    out = module(*inputs)
    return (out * 0.0).sum(), out


@nnx.jit
def train_forward(module, *inputs):
    (_, out), _ = nnx.value_and_grad(zero_loss, has_aux=True)(module, *inputs)
    return out


def test_eval_mode_inserts_nothing_under_nnx_jit():
    bag = EmbeddingBag(dim=3, mode="mean", optimizer=cncore.SGD(lr=0.1), initializer=cncore.Constant(1.0))

    @nnx.jit
    def forward(bag, ids, lengths):
        return bag(ids, lengths)

    out = train_forward(bag, jnp.array([1, 2, 2]), jnp.array([1, 2]))
    np.testing.assert_allclose(out, np.ones((2, 3)))
    assert len(bag.table) == 2
    bag.eval()
    assert bag.deterministic
    out = forward(bag, jnp.array([1, 9, 10]), jnp.array([1, 2]))
    np.testing.assert_allclose(out, [[1, 1, 1], [0, 0, 0]])  # unseen IDs read as zero rows
    assert len(bag.table) == 2
    view = nnx.view(bag, deterministic=False)
    train_forward(view, jnp.array([9]), jnp.array([1]))
    assert len(bag.table) == 3


def test_collection_is_one_grouped_lookup_and_one_update():
    tables = {"users": cj.Table(dim=2, optimizer=cncore.SGD(lr=1.0), initializer=cncore.Constant(1.0)),
              "items": cj.Table(dim=3, optimizer=cncore.SGD(lr=1.0), initializer=cncore.Constant(2.0))}
    ebc = EmbeddingBagCollection(tables)

    @nnx.jit
    def step(ebc, ids, lengths):
        def loss_fn(ebc):
            out = ebc(ids, lengths)
            return out.sum(), out
        (_, out), _ = nnx.value_and_grad(loss_fn, has_aux=True)(ebc)
        return out

    out = step(ebc, {"users": jnp.array([5]), "items": jnp.array([7, 7])},
               {"users": jnp.array([1, 0]), "items": jnp.array([1, 1])})
    parts = ebc.split(out)
    np.testing.assert_allclose(parts["users"], [[1, 1], [0, 0]])
    np.testing.assert_allclose(parts["items"], [[2, 2, 2], [2, 2, 2]])
    np.testing.assert_allclose(tables["items"].store.lookup(np.array([7])), [[0, 0, 0]])  # 2 - 1 * 2 bags
    with pytest.raises(ValueError, match=r"lengths: expected a dict with one entry per table \['users', 'items'\]"):
        ebc({"users": jnp.array([5]), "items": jnp.array([7])}, {"users": jnp.array([1])})


def test_weights_from_the_model_get_their_gradient_and_rows_their_update():
    """Weights computed by the model, lookup inside the loss: jax.grad reaches the model's
    parameters through the weights, and the sink's cotangent is what the rows' update needs."""
    table = cj.Table(dim=2, optimizer=cncore.SGD(lr=1.0), initializer=cncore.Constant(1.0))
    ids, lengths = jnp.array([1, 2, 3]), jnp.array([3])

    def loss(scale, sink):
        out, ctx = cj.lookup(table, ids, lengths, weights=scale * jnp.array([1.0, 2.0, 3.0]), sink=sink)
        return out.sum(), ctx

    (value, ctx), (g_scale, g_rows) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
        jnp.float32(2.0), jnp.zeros((1, 2)))
    assert float(value) == 2.0 * 6 * 2   # weights 2, 4, 6 on rows of ones, two columns
    assert float(g_scale) == 6 * 2       # d/dscale of scale * (1 + 2 + 3) * 2 columns
    cj.apply_gradients(ctx, g_rows)
    np.testing.assert_allclose(table.store.lookup(np.array([1, 2, 3])), [[-1, -1], [-3, -3], [-5, -5]])


def snapshot(store):
    b = store.export()
    order = np.argsort(b.keys)
    return [b.keys[order], b.rows[order], b.optimizer_state[order], b.counts[order], b.last_steps[order], store.step]


def trained_table():
    table = cj.Table(dim=4, optimizer=cncore.Adam(lr=0.1), seed=5)
    for k in range(3):
        out, ctx = cj.lookup(table, jnp.array([k, 2**62 + k, -1]), jnp.array([2, 1]))
        cj.apply_gradients(ctx, jnp.ones_like(out))
    return table


@needs_tablefile
def test_a_table_saved_from_jax_opens_in_torch_and_cn_table_and_back(tmp_path):
    torch = pytest.importorskip("torch")
    from cncore_torch import CNEmbeddingBag
    from cncore_torch.checkpoint import checkpoint_to_tables, table_configs, tables_to_checkpoint

    table = trained_table()
    table.save(str(tmp_path / "jax" / "@root"))
    expected = snapshot(table.store)

    # PyTorch: the module loads the entries read from the table directory
    bag = CNEmbeddingBag(10, 4, optimizer=cncore.Adam(lr=0.1), seed=5)
    bag.load_state_dict(tables_to_checkpoint(str(tmp_path / "jax")), strict=False)
    got = snapshot(bag.store)
    for a, b in zip(expected, got):
        np.testing.assert_array_equal(a, b)

    # cn-table reads it
    done = subprocess.run([sys.executable, "-m", "cncore_numpy.cli", "inspect", str(tmp_path / "jax" / "@root"),
                           "--json"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["rows"] == len(table)

    # back: torch trains a step, writes its table, JAX loads it
    out = bag(torch.tensor([0, 7]), torch.tensor([0, 1]))
    out.sum().backward()
    bag.fused_optimizer.step()
    checkpoint_to_tables(bag.state_dict(), str(tmp_path / "torch"), table_configs(bag))
    back = cj.Table.load(str(tmp_path / "torch" / "@root"))
    for a, b in zip(snapshot(bag.store), snapshot(back.store)):
        np.testing.assert_array_equal(a, b)
    assert back.config.optimizer == cncore.Adam(lr=0.1)


@needs_tablefile
def test_save_and_load_keep_every_row_and_the_step(tmp_path):
    table = trained_table()
    path = str(tmp_path / "t")
    table.save(path)
    back = cj.Table.load(path)
    for a, b in zip(snapshot(table.store), snapshot(back.store)):
        np.testing.assert_array_equal(a, b)
    assert back.config == table.config
    assert "CURRENT" in os.listdir(path)  # the shared format's layout

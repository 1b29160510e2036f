"""Tables as NNX state: each table is a `TableState` variable in `nnx.state(model)` and its
filters; `nnx.clone` copies the rows (the clone trains apart); orbax saves and restores the
model with its tables (`cncore_jax.checkpoint`), exactly: rows, optimizer state, counts, last
steps and step, and a step after the restore equals a step of the original."""
import numpy as np
import pytest

jax = pytest.importorskip("jax")
nnx = pytest.importorskip("flax.nnx")
optax = pytest.importorskip("optax")
ocp = pytest.importorskip("orbax.checkpoint")
import jax.numpy as jnp  # noqa: E402
from reference import assert_unchanged, snapshot  # noqa: E402

import cncore  # noqa: E402
import cncore_jax as cj  # noqa: E402
from cncore_jax.checkpoint import load_pure_dict, to_pure_dict  # noqa: E402
from cncore_jax.modules import EmbeddingBag, TableState  # noqa: E402

jax.config.update("jax_enable_x64", True)

IDS = jnp.array([2**63 - 1, -(2**63), 5, 5, -1, 0])  # the extremes: stored as uint32 pairs
LENGTHS = jnp.array([3, 2])


@pytest.fixture(autouse=True)
def _no_context_left_waiting():
    yield
    cj.discard_pending()


class Model(nnx.Module):
    def __init__(self, seed):
        self.users = EmbeddingBag(dim=3, optimizer=cncore.Adam(lr=0.1), seed=seed)
        self.items = EmbeddingBag(dim=2, optimizer=cncore.SGD(lr=0.5), seed=seed + 1, mode="mean")
        self.head = nnx.Linear(5, 1, rngs=nnx.Rngs(seed))

    def __call__(self, ids, lengths):
        return self.head(jnp.concatenate([self.users(ids, lengths), self.items(ids, lengths)], axis=1))[:, 0]


@nnx.jit
def train_step(model, optimizer, ids, lengths):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(ids, lengths) - 1.0) ** 2))(model)
    optimizer.update(model, grads)
    return loss


def trained(seed=0, steps=3):
    model = Model(seed)
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    for _ in range(steps):
        train_step(model, optimizer, IDS, LENGTHS)
    return model, optimizer


def test_tables_are_table_state_variables_in_nnx_state_and_its_filters():
    model, _ = trained(steps=1)
    tables = nnx.state(model, TableState)
    assert sorted(path for path, _ in nnx.to_flat_state(tables)) == [("items", "embedding"), ("users", "embedding")]
    assert all(isinstance(v, TableState) and isinstance(v, nnx.Param) for _, v in nnx.to_flat_state(tables))
    assert tables["users"]["embedding"].table is model.users.table
    dense = nnx.state(model, nnx.Not(TableState))
    assert sorted(path for path, _ in nnx.to_flat_state(dense)) == [("head", "bias"), ("head", "kernel")]
    assert ("users", "embedding") in dict(nnx.to_flat_state(nnx.state(model)))


def test_nnx_clone_copies_the_rows_and_the_clone_trains_apart():
    model, _ = trained()
    before = [snapshot(model.users.table.store), snapshot(model.items.table.store)]
    clone = nnx.clone(model)
    assert clone.users.table is not model.users.table
    assert clone.users.table.store is not model.users.table.store
    for table, snap in zip((clone.users.table, clone.items.table), before):
        assert_unchanged(table.store, snap)  # the same rows, state, counts, steps
    clone_opt = nnx.Optimizer(clone, optax.sgd(0.1), wrt=nnx.Param)
    train_step(clone, clone_opt, IDS, LENGTHS)
    assert clone.users.table.store.step == before[0][6] + 1
    assert_unchanged(model.users.table.store, before[0])  # the original did not move
    assert_unchanged(model.items.table.store, before[1])


def test_orbax_round_trip_restores_the_tables_and_the_model_exactly(tmp_path):
    model, optimizer = trained()
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path / "ckpt", to_pure_dict(model))
    restored = Model(seed=0)  # built as the saved one was: empty tables, the initial dense parameters
    assert len(restored.users.table) == 0
    with ocp.StandardCheckpointer() as ckptr:
        load_pure_dict(restored, ckptr.restore(tmp_path / "ckpt"))
    for name in ("users", "items"):
        assert_unchanged(getattr(restored, name).table.store, snapshot(getattr(model, name).table.store))
    np.testing.assert_array_equal(restored.head.kernel[...], model.head.kernel[...])
    np.testing.assert_array_equal(restored.head.bias[...], model.head.bias[...])
    # one more step on each from the same state (a new key too): the same tables (Adam's moments, step)
    restored_opt = nnx.Optimizer(restored, optax.sgd(0.1), wrt=nnx.Param)
    more = jnp.array([5, 11, -1, 0, 0, 0])
    train_step(model, optimizer, more, LENGTHS)
    train_step(restored, restored_opt, more, LENGTHS)
    for name in ("users", "items"):
        assert_unchanged(getattr(restored, name).table.store, snapshot(getattr(model, name).table.store))


def test_loading_a_dict_without_a_table_or_with_another_width_changes_nothing():
    model, _ = trained(steps=1)
    pure = to_pure_dict(model)
    target, _ = trained(seed=3, steps=1)
    snaps = [snapshot(target.users.table.store), snapshot(target.items.table.store)]
    kernel = np.asarray(target.head.kernel[...])
    missing = {k: v for k, v in pure.items() if k != "items"}
    with pytest.raises(ValueError, match=r"pure: no entry for the table at items/embedding; was it saved with "
                                         r"cncore_jax.checkpoint.to_pure_dict\(model\)\?"):
        load_pure_dict(target, missing)
    wrong = dict(pure, items=pure["users"])
    with pytest.raises(ValueError, match=r"pure: the table at items/embedding has rows of shape \(\d+, 3\); this "
                                         r"model's table has dim 2"):
        load_pure_dict(target, wrong)
    assert_unchanged(target.users.table.store, snaps[0])
    assert_unchanged(target.items.table.store, snaps[1])
    np.testing.assert_array_equal(target.head.kernel[...], kernel)

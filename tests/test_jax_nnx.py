"""The usual Flax NNX train step trains the tables: lookup inside `model.__call__`, one
`nnx.value_and_grad(loss_fn)(model)`, `nnx.Optimizer` for the dense parameters, under
`nnx.jit` or `jax.jit` with `nnx.split` / `nnx.merge`. Reference: the same model with a dense
jnp table (rows re-derived from the initialiser's specification) trained by optax's optimizer
of the same kind on the same IDs: rows, dense parameters and losses equal."""
import numpy as np
import pytest

jax = pytest.importorskip("jax")
nnx = pytest.importorskip("flax.nnx")
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402
from jax_routes import no_context_left_waiting, route  # noqa: E402,F401  (the fixtures)
from reference import uniform_row  # noqa: E402

import cncore  # noqa: E402
import cncore_jax as cj  # noqa: E402
from cncore_jax import _host  # noqa: E402
from cncore_jax.modules import EmbeddingBag, EmbeddingBagCollection, TableState  # noqa: E402

jax.config.update("jax_enable_x64", True)


DIM, SEED = 3, 11
KEYS = np.array([2**62 + 5, -7, 0, 13, 99, 2**40])  # the vocabulary the batches draw from
OPTIMIZERS = {  # ours, and optax's of the same kind on the dense table
    "sgd": (cncore.SGD(lr=0.3), optax.sgd(0.3)),
    "adagrad": (cncore.Adagrad(lr=0.2), optax.adagrad(0.2, initial_accumulator_value=0.0, eps=1e-10)),
}


def batches(n_steps, batch=4, per_bag=3, seed=0):
    """Bags of IDs with repeats (a key twice in one bag, in two bags), padding at the end."""
    rng = np.random.default_rng(seed)
    for _ in range(n_steps):
        lengths = rng.integers(0, per_bag + 1, batch)
        idx = rng.integers(0, len(KEYS), per_bag * batch)
        y = rng.normal(size=batch).astype(np.float32)
        yield idx, lengths, y


class Model(nnx.Module):
    def __init__(self, optimizer, rngs):
        self.emb = EmbeddingBag(dim=DIM, optimizer=optimizer, initializer=cncore.Uniform(-0.5, 0.5), seed=SEED)
        self.head = nnx.Linear(DIM, 1, rngs=rngs)

    def __call__(self, ids, lengths):
        return self.head(self.emb(ids, lengths))[:, 0]


class DenseModel(nnx.Module):
    """The reference: a dense (V, dim) table, rows as the initialiser's specification gives."""

    def __init__(self, rngs):
        self.table = nnx.Param(jnp.asarray(np.stack([uniform_row(SEED, int(k), DIM, -0.5, 0.5) for k in KEYS])))
        self.head = nnx.Linear(DIM, 1, rngs=rngs)

    def __call__(self, idx, lengths):
        bag = jnp.repeat(jnp.arange(len(lengths)), lengths, total_repeat_length=idx.shape[0])
        valid = jnp.arange(idx.shape[0]) < lengths.sum()
        pooled = jax.ops.segment_sum(jnp.where(valid[:, None], self.table[...][idx], 0.0), bag,
                                     num_segments=len(lengths))
        return self.head(pooled)[:, 0]


def loss_of(model, ids, lengths, y):
    return jnp.mean((model(ids, lengths) - y) ** 2)


def rows_of(table):
    return table.store.lookup(KEYS)


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_the_usual_nnx_step_trains_the_tables_as_a_dense_table(kind):
    ours_opt, dense_opt = OPTIMIZERS[kind]
    model, dense = Model(ours_opt, nnx.Rngs(0)), DenseModel(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    # the dense reference: its table with optax's optimizer, its head with the same sgd
    dense_optimizer = nnx.Optimizer(dense, optax.multi_transform({"table": dense_opt, "head": optax.sgd(0.1)},
                                                                 nnx.State({"table": "table",
                                                                            "head": {"bias": "head",
                                                                                     "kernel": "head"}})),
                                    wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, ids, lengths, y):
        loss, grads = nnx.value_and_grad(loss_of)(model, ids, lengths, y)
        optimizer.update(model, grads)
        return loss

    for idx, lengths, y in batches(12):
        loss = train_step(model, optimizer, jnp.asarray(KEYS[idx]), jnp.asarray(lengths), jnp.asarray(y))
        ref = train_step(dense, dense_optimizer, jnp.asarray(idx), jnp.asarray(lengths), jnp.asarray(y))
        np.testing.assert_allclose(float(loss), float(ref), rtol=1e-5)
    np.testing.assert_allclose(rows_of(model.emb.table), dense.table[...], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(model.head.kernel[...], dense.head.kernel[...], rtol=1e-5, atol=1e-6)
    assert model.emb.table.store.step == 12  # the fused update ran exactly once per step
    assert float(model.emb.embedding[...]) == 0.0  # the tap: gradient 0, so optax leaves it at 0
    assert len(_host.REGISTRY) == 0  # no context left waiting


@pytest.mark.usefixtures("route")
def test_plain_jax_jit_with_split_and_merge_trains_the_tables():
    """Through both boundaries: the ordered io_callback and the FFI call (ordered by data)."""
    model, dense = Model(cncore.SGD(lr=0.3), nnx.Rngs(1)), DenseModel(nnx.Rngs(1))
    tx = optax.sgd(0.3)

    def make_step(graphdef):
        @jax.jit
        def step(params, rest, opt_state, ids, lengths, y):
            def loss_fn(params):
                return loss_of(nnx.merge(graphdef, params, rest), ids, lengths, y)
            loss, grads = jax.value_and_grad(loss_fn)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss
        return step

    states = []
    for m in (model, dense):
        graphdef, params, rest = nnx.split(m, nnx.Param, ...)
        states.append([make_step(graphdef), params, rest, tx.init(params), graphdef])
    for idx, lengths, y in batches(6, seed=3):
        for s, ids in zip(states, (KEYS[idx], idx)):
            s[1], s[3], _ = s[0](s[1], s[2], s[3], jnp.asarray(ids), jnp.asarray(lengths), jnp.asarray(y))
    dense_params = states[1][1]
    np.testing.assert_allclose(rows_of(model.emb.table), dense_params["table"][...], rtol=1e-5, atol=1e-6)
    assert model.emb.table.store.step == 6


def test_a_collection_is_trained_by_the_usual_step_with_one_update_per_table():
    tables = {"users": cj.Table(dim=2, optimizer=cncore.SGD(lr=1.0), initializer=cncore.Constant(1.0)),
              "items": cj.Table(dim=3, optimizer=cncore.SGD(lr=1.0), initializer=cncore.Constant(2.0))}
    ebc = EmbeddingBagCollection(tables)

    @nnx.jit
    def step(ebc, ids, lengths):
        loss, _ = nnx.value_and_grad(lambda m: m(ids, lengths).sum())(ebc)
        return loss

    step(ebc, {"users": jnp.array([5]), "items": jnp.array([7, 7])},
         {"users": jnp.array([1, 0]), "items": jnp.array([1, 1])})
    np.testing.assert_allclose(tables["users"].store.lookup(np.array([5])), [[0, 0]])  # 1 - 1 * 1 bag
    np.testing.assert_allclose(tables["items"].store.lookup(np.array([7])), [[0, 0, 0]])  # 2 - 1 * 2 bags
    assert [t.store.step for t in tables.values()] == [1, 1]
    assert set(nnx.state(ebc, TableState)["embeddings"]) == {"users", "items"}


REFUSED = r"a module's training lookup ran outside differentiation.*nnx.value_and_grad\(loss_fn\)\(model\)"


def test_a_training_lookup_outside_differentiation_is_refused_before_inserting():
    model = Model(cncore.SGD(lr=0.1), nnx.Rngs(0))
    with pytest.raises(Exception, match=REFUSED):
        nnx.jit(lambda m: m(jnp.array([1, 2]), jnp.array([2])))(model)
        jax.effects_barrier()
    with pytest.raises(Exception, match=REFUSED):
        model(jnp.array([1, 2]), jnp.array([2]))  # eager
        jax.effects_barrier()
    assert len(model.emb.table) == 0
    model.eval()  # what the message offers for a forward pass that reads
    np.testing.assert_allclose(nnx.jit(lambda m: m(jnp.array([1]), jnp.array([1])))(model), model.head.bias[...])
    assert len(model.emb.table) == 0


def test_a_wrt_filter_without_the_tables_is_refused():
    model = Model(cncore.SGD(lr=0.1), nnx.Rngs(0))
    only_dense = nnx.DiffState(0, nnx.All(nnx.Param, nnx.Not(TableState)))

    @nnx.jit
    def step(model):
        return nnx.grad(lambda m: m(jnp.array([1, 2]), jnp.array([2])).sum(), argnums=only_dense)(model)

    with pytest.raises(Exception, match=REFUSED):
        step(model)
        jax.effects_barrier()
    assert len(model.emb.table) == 0


def test_differentiating_one_forward_twice_is_refused_by_the_second_update():
    table = cj.Table(dim=1, optimizer=cncore.SGD(lr=1.0), initializer=cncore.Constant(1.0))
    bag = EmbeddingBag(table)

    def f(tap):
        out, _ = cj._traced.pooled_lookup([table], [jnp.array([4])], [jnp.array([1])], tap=tap)
        return out.sum()

    _, vjp = jax.vjp(f, bag.embedding[...])
    vjp(jnp.float32(1.0))
    with pytest.raises(Exception, match="already used: its gradient was applied"):
        vjp(jnp.float32(1.0))
        jax.effects_barrier()
    np.testing.assert_allclose(table.store.lookup(np.array([4])), [[0.0]])  # one update: 1 - 1
    assert table.store.step == 1


@pytest.mark.slow
def test_pending_lookups_past_the_bound_are_refused_and_none_is_dropped():
    table = cj.Table(dim=2, optimizer=cncore.SGD(lr=1.0), initializer=cncore.Constant(1.0))
    _, first = cj.lookup(table, jnp.array([1]), jnp.array([1]))
    for k in range(_host.MAX_PENDING - 1):
        cj.lookup(table, jnp.array([100 + k]), jnp.array([1]))
    rows = len(table)
    with pytest.raises(Exception, match=r"64 training lookups are waiting for their gradients .* refused and the "
                                        r"tables are unchanged.*cncore_jax.discard_pending\(\)"):
        cj.lookup(table, jnp.array([7]), jnp.array([1]))
        jax.effects_barrier()
    assert len(table) == rows and not table.store.contains(np.array([7]))[0]
    cj.apply_gradients(first, jnp.ones((1, 2)))  # the oldest is still there: nothing was dropped
    np.testing.assert_allclose(table.store.lookup(np.array([1])), [[0, 0]])
    assert cj.discard_pending() == _host.MAX_PENDING - 1
    _, ctx = cj.lookup(table, jnp.array([7]), jnp.array([1]))  # room again
    cj.apply_gradients(ctx, jnp.ones((1, 2)))
    assert len(_host.REGISTRY) == 0


def test_a_module_whose_output_never_reaches_the_loss_is_refused_past_the_bound():
    """Its backward never runs (JAX drops a zero cotangent's work), so its contexts wait: past
    MAX_PENDING the next step is refused, naming why, instead of inserting untrained rows forever."""
    bag = EmbeddingBag(dim=2, optimizer=cncore.SGD(lr=0.1))

    class Unused(nnx.Module):
        def __init__(self):
            self.bag, self.w = bag, nnx.Param(jnp.ones(()))

        def __call__(self, ids, lengths):
            self.bag(ids, lengths)  # looked up, never used
            return self.w[...] * 2.0

    model = Unused()
    step = nnx.jit(lambda m, i: nnx.value_and_grad(lambda m: m(i, jnp.array([1])))(m)[0])
    for k in range(_host.MAX_PENDING):
        step(model, jnp.array([k]))
    jax.effects_barrier()
    with pytest.raises(Exception, match="a module whose output does not reach the loss never gets its backward"):
        step(model, jnp.array([999]))
        jax.effects_barrier()
    assert len(bag.table) == _host.MAX_PENDING and bag.table.store.step == 0


def test_per_sample_weights_from_the_model_train_with_the_rows():
    """Weights computed from a model parameter: one usual step updates the rows (SGD, in the
    lookup's backward) and the parameter (optax), as jax.grad of the dense reference gives."""
    keys, base = np.array([4, 9, 4]), jnp.array([1.0, 2.0, 3.0])
    lengths = jnp.array([2, 1])

    class Weighted(nnx.Module):
        def __init__(self):
            self.bag = EmbeddingBag(dim=DIM, mode="mean", optimizer=cncore.SGD(lr=0.5),
                                    initializer=cncore.Uniform(-0.5, 0.5), seed=SEED)
            self.scale = nnx.Param(jnp.float32(1.5))

        def __call__(self, ids):
            return (self.bag(ids, lengths, weights=self.scale[...] * base) ** 2).sum()

    model = Weighted()
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, ids):
        loss, grads = nnx.value_and_grad(lambda m: m(ids))(model)
        optimizer.update(model, grads)
        return loss

    step(model, optimizer, jnp.asarray(keys))
    rows = jnp.asarray(np.stack([uniform_row(SEED, k, DIM, -0.5, 0.5) for k in (4, 9)]))
    idx = jnp.array([0, 1, 0])

    def dense_loss(rows, scale):
        w = (scale * base)[:, None] * rows[idx]
        return (jnp.stack([(w[0] + w[1]) / 2, w[2]]) ** 2).sum()

    g_rows, g_scale = jax.grad(dense_loss, argnums=(0, 1))(rows, jnp.float32(1.5))
    np.testing.assert_allclose(model.bag.table.store.lookup(np.array([4, 9])), rows - 0.5 * g_rows, rtol=1e-5)
    np.testing.assert_allclose(float(model.scale[...]), 1.5 - 0.1 * float(g_scale), rtol=1e-5)


"""cncore_jax's effects under jit: each lookup and update runs exactly once per step, in program
order (with and without donated buffers); contexts are used once and never pile up; bad input
is refused naming the argument, with the table unchanged; vmap is refused."""
import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import cncore  # noqa: E402
import cncore_jax as cj  # noqa: E402
from cncore_jax import _host  # noqa: E402

jax.config.update("jax_enable_x64", True)


from jax_routes import no_context_left_waiting, route  # noqa: E402,F401  (the fixtures)


@pytest.fixture
def events(monkeypatch):
    """Every host call, in the order it ran: ("lookup", token) and ("apply", token)."""
    log = []
    forward, apply = _host.forward, _host.apply

    def logged_forward(*args, **kwargs):
        out, token = forward(*args, **kwargs)
        log.append(("lookup", int(token)))
        return out, token

    def logged_apply(tables, token, grad, lr):
        apply(tables, token, grad, lr)
        log.append(("apply", int(token)))

    monkeypatch.setattr(_host, "forward", logged_forward)
    monkeypatch.setattr(_host, "apply", logged_apply)
    return log


def snapshot(table):
    b = table.store.export()
    order = np.argsort(b.keys)
    return b.keys[order], b.rows[order], b.optimizer_state[order], b.counts[order], table.store.step


@pytest.mark.parametrize("donate", [False, True])
def test_once_per_step_in_program_order(route, events, donate):
    table = cj.Table(dim=3, optimizer=cncore.Adagrad(lr=0.1))

    def step(w, ids, lengths):
        pooled, ctx = cj.lookup(table, ids, lengths)

        def loss(w, pooled):
            return jnp.sum((pooled @ w) ** 2)

        value, (gw, gp) = jax.value_and_grad(loss, argnums=(0, 1))(w, pooled)
        cj.apply_gradients(ctx, gp)
        return w - 0.1 * gw, value

    step = jax.jit(step, donate_argnums=(0,) if donate else ())
    rng = np.random.default_rng(0)
    w = jnp.ones((3, 2))
    occurrences = {}
    for _k in range(6):
        ids = rng.integers(0, 20, 8)
        for i in ids[:6]:
            occurrences[int(i)] = occurrences.get(int(i), 0) + 1
        w, _ = step(w, jnp.asarray(ids), jnp.array([3, 3]))  # the last two ids are padding
    tokens = [t for _, t in events[::2]]
    assert [e for e, _ in events] == ["lookup", "apply"] * 6
    assert [t for _, t in events[1::2]] == tokens and len(set(tokens)) == 6
    keys, _, _, counts, step_count = snapshot(table)
    assert step_count == 6
    assert dict(zip(keys.tolist(), counts.tolist())) == occurrences  # each lookup applied exactly once
    assert not set(tokens) & set(_host.REGISTRY._pending)  # every context was taken out by its update


def test_an_unused_lookup_still_runs_once(route, events):
    table = cj.Table(dim=2)

    @jax.jit
    def f(ids):
        cj.lookup(table, ids, jnp.array([2]), training=False)
        cj.lookup(table, ids, jnp.array([2]))
        return ids.sum()

    f(jnp.array([1, 2]))
    f(jnp.array([3, 4]))
    assert [e for e, _ in events] == ["lookup"] * 4
    assert sorted(table.store.export().keys.tolist()) == [1, 2, 3, 4]


def test_a_context_is_applied_once(route):
    table = cj.Table(dim=2, optimizer=cncore.SGD(lr=1.0))
    _, ctx = cj.lookup(table, jnp.array([1]), jnp.array([1]))
    cj.apply_gradients(ctx, jnp.ones((1, 2)))
    before = snapshot(table)
    with pytest.raises(Exception, match="already used: its gradient was applied"):
        cj.apply_gradients(ctx, jnp.ones((1, 2)))
        jax.effects_barrier()
    after = snapshot(table)
    assert all(np.array_equal(a, b) for a, b in zip(before, after))


def test_a_discarded_context_is_refused_with_a_clear_error():
    """(Past MAX_PENDING waiting contexts a lookup is refused, none dropped:
    test_jax_nnx.py::test_pending_lookups_past_the_bound_are_refused_and_none_is_dropped.)"""
    table = cj.Table(dim=2, optimizer=cncore.SGD(lr=1.0))
    _, ctx = cj.lookup(table, jnp.array([1]), jnp.array([1]))
    cj.discard(ctx)
    with pytest.raises(Exception, match="is discarded"):
        cj.apply_gradients(ctx, jnp.ones((1, 2)))
        jax.effects_barrier()


def test_an_eval_lookup_has_nothing_to_apply():
    table = cj.Table(dim=2, optimizer=cncore.SGD(lr=1.0))
    _, ctx = cj.lookup(table, jnp.array([1]), jnp.array([1]), training=False)
    with pytest.raises(Exception, match="made with training=False"):
        cj.apply_gradients(ctx, jnp.ones((1, 2)))
        jax.effects_barrier()


def test_vmap_is_refused(route):
    table = cj.Table(dim=2)
    with pytest.raises(TypeError, match="cannot run under jax.vmap"):
        jax.vmap(lambda ids: cj.lookup(table, ids, jnp.array([2]))[0])(jnp.ones((3, 2), jnp.int64))
    assert len(table) == 0


def test_remat_around_a_lookup_is_refused_by_jax(route):
    table = cj.Table(dim=2, optimizer=cncore.SGD(lr=1.0))

    def loss(w):
        out, _ = cj.lookup(table, jnp.array([1, 2]), jnp.array([2]), weights=w)
        return out.sum()

    with pytest.raises(NotImplementedError, match="Effects not supported in partial-eval of `checkpoint`/`remat`"):
        jax.grad(jax.checkpoint(loss))(jnp.ones(2))


BAD = [
    (dict(ids=jnp.array([1.0, 2.0])), TypeError, r"ids\[0\]: expected int32 or int64 ids, got float"),
    (dict(ids=np.array([1, 2], np.uint64)), TypeError, r"ids\[0\]: expected int32 or int64 ids, got uint64"),
    (dict(ids=jnp.ones((2, 1), jnp.int64)), ValueError, r"ids\[0\]: expected a 1-D array"),
    (dict(lengths=jnp.ones((1, 2), jnp.int64)), ValueError, r"lengths\[0\]: expected a 1-D array"),
    (dict(lengths=jnp.array([1.0])), TypeError, r"lengths\[0\]: expected int32 or int64 bag lengths"),
    (dict(mode="median"), ValueError, r"mode: expected 'sum', 'mean' or 'max', got 'median'"),
    (dict(mode="max", weights=jnp.ones(2)), ValueError, r"weights: per-sample weights apply to 'sum' and 'mean'"),
    (dict(weights=jnp.ones(3)), ValueError, r"weights: expected shape \(2,\)"),
    (dict(weights=jnp.ones(2, jnp.int32)), TypeError, r"weights: expected a floating-point array"),
    (dict(training="yes"), TypeError, r"training must be True or False"),
    (dict(sink=jnp.zeros((2, 2))), ValueError, r"sink: expected shape \(1, 2\)"),
]


@pytest.mark.parametrize("change,error,message", BAD, ids=[m.split(":")[0] for _, _, m in BAD])
def test_bad_input_names_the_argument_and_changes_nothing(change, error, message):
    table = cj.Table(dim=2, optimizer=cncore.SGD(lr=1.0))
    cj.lookup(table, jnp.array([5]), jnp.array([1]))
    before = snapshot(table)
    args = dict(ids=jnp.array([1, 2]), lengths=jnp.array([2]))
    args.update(change)
    ids, lengths = args.pop("ids"), args.pop("lengths")
    with pytest.raises(error, match=message):
        cj.lookup(table, ids, lengths, **args)
    assert all(np.array_equal(a, b) for a, b in zip(before, snapshot(table)))


@pytest.mark.parametrize("lengths,message", [(jnp.array([3]), r"lengths\[0\]: add up to 3, but only 2 ids"),
                                             (jnp.array([3, -1]), r"lengths\[0\]: must be >= 0")])
def test_bad_lengths_found_on_the_host_change_nothing(route, lengths, message):
    table = cj.Table(dim=2)
    with pytest.raises(Exception, match=message):
        jax.jit(lambda ids, n: cj.lookup(table, ids, n)[0])(jnp.array([1, 2]), lengths).block_until_ready()
    assert len(table) == 0


def test_bad_gradients_are_refused():
    table = cj.Table(dim=2, optimizer=cncore.SGD(lr=1.0))
    _, ctx = cj.lookup(table, jnp.array([1]), jnp.array([1]))
    with pytest.raises(ValueError, match=r"grad: expected shape \(1, 2\)"):
        cj.apply_gradients(ctx, jnp.ones((2, 2)))
    with pytest.raises(TypeError, match="ctx: expected the LookupRef"):
        cj.apply_gradients("ctx", jnp.ones((1, 2)))
    with pytest.raises(ValueError, match="ctx: it belongs to a lookup of other tables"):
        cj.Table(dim=2).apply_gradients(ctx, jnp.ones((1, 2)))
    cj.apply_gradients(ctx, jnp.ones((1, 2)))  # still pending after the refusals


def test_int64_ids_need_x64():
    table = cj.Table(dim=2)
    with jax.enable_x64(False):
        with pytest.raises(TypeError, match=r"ids\[0\]: int64 ids need jax.config.update\('jax_enable_x64'"):
            cj.lookup(table, np.array([2**40]), np.array([1], np.int32))
        out, _ = cj.lookup(table, np.array([7], np.int32), np.array([1], np.int32))
    assert table.store.contains(np.array([7])).tolist() == [True]

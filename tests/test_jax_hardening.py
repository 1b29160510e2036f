"""A cncore_jax table read from Python right after a jitted step sees that step, on both
boundaries: `len`, reads through `table.store`, `save` (and what `Table.load` reads back) equal an
in-memory replay of the same steps on a plain cncore store, however soon after the step they
come. A save from another thread while steps run writes each lookup and update wholly or not at
all. The README's quick start saves the trained table every time.

JAX may return from a jitted call before its host work has run (the FFI route does here; the
ordered callback route mostly runs its host work before returning, which JAX does not promise).
The steps here put dense work between the lookup and the update, which the update's gradient
depends on, so the update's host work starts well after the call returned."""
import os
import re
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from jax_routes import no_context_left_waiting, route  # noqa: E402,F401  (the fixtures)
from reference import run_isolated, snapshot  # noqa: E402

import cncore  # noqa: E402
import cncore_jax as cj  # noqa: E402
from cncore_jax import _ffi  # noqa: E402

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = Path(TESTS).parent
N_IDS, N_BAGS, DIM = 6, 2, 3   # a step's padded ids, its bags, the table's width
DELAY = 256                    # side of the matrices multiplied between lookup and update
ROUTE_NAMES = ["callback", pytest.param("ffi", marks=pytest.mark.skipif(
    not _ffi.available(), reason="no C++ compiler for the FFI route"))]



def new_table() -> cj.Table:
    return cj.Table(dim=DIM, optimizer=cncore.Adagrad(lr=0.1), initializer=cncore.Uniform(-1.0, 1.0), seed=5)


def make_step(table):
    """A jitted train step whose update waits for dense work: grad_rows * 1.0, where the 1.0 is
    known only once the matrix products are done."""
    @jax.jit
    def step(m, ids, lengths, grad_rows):
        pooled, ctx = cj.lookup(table, ids, lengths)
        x = m
        for _ in range(6):
            x = jnp.tanh(x @ m)
        one = jnp.where(x[0, 0] > -2.0, 1.0, 0.0).astype(jnp.float32)
        cj.apply_gradients(ctx, grad_rows * one)
        return pooled

    @jax.jit
    def evaluate(ids, lengths):
        return cj.lookup(table, ids, lengths, training=False)[0]

    return step, evaluate


def padded(keys):
    ids = np.zeros(N_IDS, np.int32)
    ids[:len(keys)] = keys
    return ids


def bags(keys, split):
    first = min(split, len(keys))
    return np.array([first, len(keys) - first], np.int32)


def same(a, b) -> bool:
    return a[0] == b[0] and a[6] == b[6] and all(np.array_equal(x, y) for x, y in zip(a[1:6], b[1:6]))


# A generated sequence is rounds of up to three steps followed by one to three reads. A step
# trains on `keys` (at most N_IDS, split into two bags) with gradient rows drawn from `seed`;
# each read comes right after whatever came last.
keys_st = st.lists(st.integers(-3, 30), max_size=N_IDS)
STEP = st.tuples(st.just("step"), keys_st, st.integers(0, N_IDS), st.integers(0, 2**16))
READ = st.one_of(
    st.tuples(st.just("eval"), keys_st, st.integers(0, N_IDS)),
    st.tuples(st.just("len")),
    st.tuples(st.just("read"), st.lists(st.integers(-3, 30), min_size=1, max_size=8)),
    st.tuples(st.just("export")),
    st.tuples(st.just("save_load")),
    st.tuples(st.just("reload")),
)
ROUNDS = st.lists(st.tuples(st.lists(STEP, max_size=3), st.lists(READ, min_size=1, max_size=3)),
                  min_size=1, max_size=5).map(lambda rounds: [op for steps, reads in rounds for op in steps + reads])


class Race:
    """A table driven by jitted steps, beside its replay: a plain cncore store given the same
    lookups and updates in Python, each finished before the next begins."""

    def __init__(self, folder):
        self.folder, self.saves = folder, 0
        self.m = jnp.eye(DELAY, dtype=jnp.float32) * 0.5
        self.use(new_table())
        self.replay = cncore.EmbeddingStore(self.table.config)

    def use(self, table):
        self.table = table
        self.step, self.evaluate = make_step(table)

    def save(self) -> str:
        self.saves += 1
        path = os.path.join(self.folder, f"t{self.saves}.cnt")
        self.table.save(path)
        return path

    def run(self, op) -> list:
        """Apply `op` to both; the list of what differed (empty when the read equals the replay's)."""
        kind = op[0]
        if kind == "step":
            _, keys, split, seed = op
            lengths = bags(keys, split)
            grad = np.random.default_rng(seed).uniform(-1, 1, (N_BAGS, DIM)).astype(np.float32)
            self.step(self.m, padded(keys), lengths, grad)   # not waited for: the next read is at once
            _, ctx = self.replay.pooled_lookup(np.array(keys, np.int64), lengths=lengths)
            self.replay.apply_gradients(ctx, grad)
            return []
        if kind == "eval":
            _, keys, split = op
            lengths = bags(keys, split)
            got = np.asarray(self.evaluate(padded(keys), lengths))
            want = self.replay.pooled_lookup(np.array(keys, np.int64), lengths=lengths, insert_missing=False)[0]
            return [] if np.array_equal(got, want) else [f"eval {keys}: {got.tolist()} != {want.tolist()}"]
        if kind == "len":
            got, want = len(self.table), len(self.replay)
            return [] if got == want else [f"len {got} != {want}"]
        if kind == "read":
            keys = np.array(op[1], np.int64)
            got, want = self.table.store.read(keys), self.replay.read(keys)
            ok = np.array_equal(got.rows, want.rows) and np.array_equal(got.optimizer_state, want.optimizer_state)
            return [] if ok else [f"read {op[1]} differs"]
        if kind == "export":
            got, want = snapshot(self.table.store), snapshot(self.replay)
            return [] if same(got, want) else [f"export: {got[0]} rows at step {got[6]}, replay {want[0]} at {want[6]}"]
        loaded = cj.Table.load(self.save())
        got, want = snapshot(loaded.store), snapshot(self.replay)
        if kind == "reload":  # train on from the file, as a resumed job does
            self.use(loaded)
        return [] if same(got, want) else [f"{kind}: {got[0]} rows at step {got[6]}, replay {want[0]} at {want[6]}"]


def race_harness(route_name: str, examples: int, folder: str) -> dict:
    """Generated sequences of steps and immediate reads on one boundary, each read compared with
    the replay's; what went wrong is counted rather than raised, so every case runs. The cases
    go on with one table and its replay (a case starts while the last one's steps may still be
    running, and the steps compile once); after a difference or a raise, a fresh pair."""
    cj.set_boundary(route_name)
    counts = {"cases": 0, "ops": 0, "crashes": 0, "silent_changes": 0, "examples": []}
    state = {"race": Race(folder)}

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(ROUNDS)
    def case(ops):
        counts["cases"] += 1
        race = state["race"]
        for op in ops:
            counts["ops"] += 1
            try:
                wrong = race.run(op)
            except Exception as e:  # counted: any raise is a crash of the sequence
                counts["crashes"] += 1
                counts["examples"].append(f"{ops}: {type(e).__name__}: {e}"[:400])
                state["race"] = Race(folder)
                return
            if wrong:
                counts["silent_changes"] += 1
                counts["examples"].append(f"{ops}: {wrong[0]}"[:400])
                state["race"] = Race(folder)
                return

    case()
    counts["examples"] = counts["examples"][:5]
    return counts


@pytest.mark.parametrize("route_name", ROUTE_NAMES)
def test_reads_racing_steps_equal_the_replay(route_name, tmp_path):
    """Generated sequences of jitted steps, each followed at once by `len`, reads, exports,
    evaluation lookups, save + load or a reload that trains on from the file: every read equals
    the replay's. Run in a child process (a wait that never ends would otherwise hang the run)."""
    code = f"""
        import json, sys
        sys.path.insert(0, {TESTS!r})
        import test_jax_hardening as h
        print(json.dumps(h.race_harness({route_name!r}, 40, {str(tmp_path)!r})))
    """
    counts = run_isolated(code, timeout=240)
    assert (counts["crashes"], counts["silent_changes"]) == (0, 0), counts["examples"]
    assert counts["cases"] == 40 and counts["ops"] >= 200


def test_len_reads_and_save_right_after_a_step_see_it(route, tmp_path):
    """Each read comes right after a step returns, before its update has run on its own: the
    step count, `len`, the rows and the saved file are those after the step."""
    table = new_table()
    step, _ = make_step(table)
    m = jnp.eye(DELAY, dtype=jnp.float32) * 0.5
    grad = np.full((N_BAGS, DIM), 0.5, np.float32)
    replay = cncore.EmbeddingStore(table.config)
    for k in range(1, 5):
        keys = [10 * k, 10 * k + 1, 10 * k + 1, 7]
        step(m, padded(keys), bags(keys, 2), grad)
        _, ctx = replay.pooled_lookup(np.array(keys, np.int64), lengths=bags(keys, 2))
        replay.apply_gradients(ctx, grad)
        if k == 1:
            assert (len(table), table.store.step) == (3, 1)
        elif k == 2:
            np.testing.assert_array_equal(table.store.read(np.array([20, 21, 7])).rows,
                                          replay.read(np.array([20, 21, 7])).rows)
        elif k == 3:
            assert same(snapshot(table.store), snapshot(replay))
        else:
            table.save(str(tmp_path / "t.cnt"))
            saved = snapshot(cj.Table.load(str(tmp_path / "t.cnt")).store)
            assert saved[6] == 4 and same(saved, snapshot(replay))
    jax.effects_barrier()
    assert same(snapshot(table.store), snapshot(replay))


def test_an_nnx_collections_tables_right_after_a_step_see_it(route, tmp_path):
    """The same through Flax NNX: an `EmbeddingBagCollection` trained by an `nnx.jit` step; its
    tables' `len`, rows and saved files right after the step are those after the step."""
    nnx = pytest.importorskip("flax.nnx")
    from cncore_jax.modules import EmbeddingBagCollection
    tables = {"users": new_table(), "items": new_table()}
    ebc = EmbeddingBagCollection(tables)
    m = jnp.eye(DELAY, dtype=jnp.float32) * 0.5

    @nnx.jit
    def step(ebc, m, ids, lengths):
        def loss_fn(ebc):  # the usual step: the update runs in the lookup's backward
            out = ebc(ids, lengths)
            x = m
            for _ in range(6):
                x = jnp.tanh(x @ m)
            return (out * (0.25 * jnp.where(x[0, 0] > -2.0, 1.0, 0.0))).sum()
        return nnx.value_and_grad(loss_fn)(ebc)[0]

    replay = {name: cncore.EmbeddingStore(t.config) for name, t in tables.items()}
    for k in range(1, 4):
        keys = {"users": [k, k + 100], "items": [5, 5 * k, 7]}
        step(ebc, m, {n: padded(v) for n, v in keys.items()}, {n: bags(v, 1) for n, v in keys.items()})
        for name, store in replay.items():
            _, ctx = store.pooled_lookup(np.array(keys[name], np.int64), lengths=bags(keys[name], 1))
            store.apply_gradients(ctx, np.full((N_BAGS, DIM), 0.25, np.float32))
        assert [len(t) for t in ebc.tables] == [len(replay["users"]), len(replay["items"])]
        ebc.tables[1].save(str(tmp_path / f"items{k}.cnt"))
        assert same(snapshot(cj.Table.load(str(tmp_path / f"items{k}.cnt")).store), snapshot(replay["items"]))
        assert same(snapshot(ebc.tables[0].store), snapshot(replay["users"]))


@pytest.mark.parametrize("route_name", ROUTE_NAMES)
def test_a_save_from_another_thread_holds_whole_lookups_and_updates(route_name, tmp_path):
    """One thread dispatches steps (each inserting 64 new rows) without waiting; the main thread
    saves again and again meanwhile. Every save succeeds and loads as one of the states the
    replay passes through (after a lookup, or after its update), in order: never a torn row,
    never "the store changed". Run in a child process (a lock taken in the wrong order would
    hang)."""
    code = f"""
        import json, os, sys, threading
        sys.path.insert(0, {TESTS!r})
        import numpy as np, jax, jax.numpy as jnp, cncore, cncore_jax as cj
        import test_jax_hardening as h
        from reference import snapshot
        cj.set_boundary({route_name!r})
        table = cj.Table(dim=8, optimizer=cncore.Adagrad(lr=0.1), seed=5)

        def step(m, ids, grad):
            pooled, ctx = cj.lookup(table, ids, jnp.full((64,), 2, jnp.int32))
            x = m
            for _ in range(3):
                x = jnp.tanh(x @ m)
            cj.apply_gradients(ctx, grad * jnp.where(x[0, 0] > -2.0, 1.0, 0.0).astype(jnp.float32))
            return pooled

        K = 40
        rng = np.random.default_rng(0)
        batches = [np.concatenate([np.arange(64 * k, 64 * k + 64), rng.integers(0, 64 * k + 64, 64)])
                   .astype(np.int32) for k in range(K)]
        grads = [rng.uniform(-1, 1, (64, 8)).astype(np.float32) for _ in range(K)]
        m = jnp.eye(h.DELAY, dtype=jnp.float32) * 0.5
        compiled = jax.jit(step).lower(m, batches[0], grads[0]).compile()  # compiled; nothing ran
        replay = cncore.EmbeddingStore(table.config)
        states = [snapshot(replay)]
        for ids, g in zip(batches, grads):
            _, ctx = replay.pooled_lookup(ids.astype(np.int64), lengths=np.full(64, 2))
            states.append(snapshot(replay))
            replay.apply_gradients(ctx, g)
            states.append(snapshot(replay))

        done = threading.Event()
        def train():
            for ids, g in zip(batches, grads):
                compiled(m, ids, g)
            jax.effects_barrier()  # this thread's steps: JAX keeps the tokens per thread
            done.set()

        trainer = threading.Thread(target=train)
        trainer.start()
        path = os.path.join({str(tmp_path)!r}, "t.cnt")
        seen, errors = [], []
        while not done.is_set() or len(seen) + len(errors) < 3:
            try:
                table.save(path)
                got = snapshot(cj.Table.load(path).store)
                seen.append(next((i for i, s in enumerate(states) if h.same(s, got)), -1))
            except Exception as e:
                errors.append(f"{{type(e).__name__}}: {{e}}")
        trainer.join()
        final = next((i for i, s in enumerate(states) if h.same(s, snapshot(table.store))), -1)
        print(json.dumps({{"seen": seen, "errors": errors[:3], "n_errors": len(errors), "final": final,
                          "n_states": len(states)}}))
    """
    out = run_isolated(code, timeout=240)
    assert out["n_errors"] == 0, out["errors"]
    assert out["final"] == out["n_states"] - 1
    assert -1 not in out["seen"], out["seen"]       # each save is a state the replay passed through
    assert out["seen"] == sorted(out["seen"])        # and the saves go forward, never back


def readme_jax_block() -> str:
    readme = (ROOT / "README.md").read_text()
    blocks = [m.group(1) for m in re.finditer(r"^```python\n(.*?)^```", readme, re.M | re.S)]
    (block,) = [b for b in blocks if "cncore_jax" in b and "table.save(" in b]
    return block


@pytest.mark.slow
@pytest.mark.parametrize("route_name", ROUTE_NAMES)
def test_the_readme_quick_start_saves_the_trained_table_every_time(route_name, tmp_path, monkeypatch):
    """The README's JAX quick start, 10 times in one process (each run traces its model anew): the
    table it saves right after its step is the table after the step, every time."""
    pytest.importorskip("optax")
    block = readme_jax_block()
    monkeypatch.chdir(tmp_path)
    previous = cj.set_boundary(route_name)
    try:
        for run in range(10):
            ns = {"__name__": "readme"}
            exec(compile(block, "README.md (JAX quick start)", "exec"), ns)
            saved = snapshot(cj.Table.load("users.cnt").store)
            jax.effects_barrier()
            live = snapshot(ns["model"].users.table.store)
            assert (saved[0], saved[6]) == (3, 1), run
            assert same(saved, live), run
    finally:
        cj.set_boundary(previous)

"""The hot kernels' instruction-set levels (cython_src/include/cn_isa.h): every level this CPU runs
gives the pooled forward of nn.EmbeddingBag, the fused steps of torch.optim (row-wise Adagrad:
FBGEMM's formula in NumPy), the per-row gradients of a float64 sum and the initial rows of
NumPy's re-derivation, and the levels agree with each other; CNCORE_ISA picks a level and a
name this CPU cannot run is refused.

Each level runs in a subprocess with CNCORE_ISA set (an illegal instruction kills that process,
and fails its test, not the run), on small tables, and hands its results back in an .npz.

The bound: the levels differ only in rounding (v3 and v4 fuse a multiply and an add into one
multiply-add, which rounds once), so every float32 result is within FLOAT_BOUND of the
reference: |ours - ref| <= 1e-5 * (|ref| + scale) + 1e-7, `scale` the bag's sum of magnitudes
(forward) or the row's update magnitude (steps), about 100 float32 roundings of the terms
summed; 16-bit rows updated in float32 and rounded once more may differ by one unit in the
last place of their dtype. Max pooling and initial rows do no arithmetic that depends on the
level: those are the same bits on every level.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from reference import uniform_row

import cncore
from cncore import _core

LEVELS = list(cncore.runnable_isas())
DIMS = [16, 64, 13]
DTYPES = ["float32", "float16", "bfloat16"]
# (mode, weighted): EmbeddingBag takes per-sample weights in sum mode only
POOLINGS = [("sum", False), ("mean", False), ("max", False), ("sum", True)]
OPTIMIZERS = ["sgd", "adagrad", "rowwise-adagrad", "adam"]
LR, EPS = 0.05, 1e-8
N_ROWS, N_BAGS, STEPS = 300, 48, 2

# One level's results: runs under CNCORE_ISA=<level>, writes every array into the .npz named by argv[1].
WORKER = textwrap.dedent(r"""
    import json, sys
    import numpy as np
    import cncore

    spec = json.loads(sys.argv[2])
    out = {"isa": np.array(cncore.kernel_isa())}
    rng = np.random.default_rng(7)
    keys_all = rng.integers(-2**62, 2**62, spec["n_rows"])
    lengths = rng.integers(0, 21, spec["n_bags"])
    batch = rng.choice(keys_all, int(lengths.sum()))
    weights = rng.standard_normal(len(batch)).astype(np.float32)
    for dim in spec["dims"]:
        rows = rng.standard_normal((spec["n_rows"], dim)).astype(np.float32)
        grad = rng.standard_normal((spec["n_bags"], dim)).astype(np.float32)
        out[f"grad_{dim}"] = grad
        out[f"rows_{dim}"] = rows
        # values at the edges of the 16-bit dtypes: ties, subnormals, saturation, and a NaN (which
        # a diverged row holds: it must read back NaN, not a clamped 65504)
        edges = np.array([1 + 2**-11, 1 + 3 * 2**-11, 1 + 2**-8, 1 + 3 * 2**-9, 6e-8, -3e-8, 1e-40, 65504, 65519,
                          70000, -1e6, 3.3e38, -0.0, 2**-24, np.nan, -7.7], np.float32)
        out[f"edges_{dim}"] = edges_rows = np.resize(edges, (len(keys_all), dim))
        for dtype in spec["dtypes"]:
            store = cncore.EmbeddingStore(cncore.StoreConfig(dim=dim, dtype=dtype))
            store.insert_or_assign(keys_all, edges_rows)
            out[f"edges_{dim}_{dtype}"] = store.lookup(keys_all)
        for dtype in spec["dtypes"]:
            store = cncore.EmbeddingStore(cncore.StoreConfig(dim=dim, dtype=dtype))
            store.insert_or_assign(keys_all, rows)
            out[f"table_{dim}_{dtype}"] = store.lookup(keys_all)  # as stored, widened
            for mode, weighted in spec["poolings"]:
                pooled, _ = store.pooled_lookup(batch, lengths=lengths, mode=mode, insert_missing=False,
                                                per_sample_weights=weights if weighted else None)
                out[f"fwd_{dim}_{dtype}_{mode}_{int(weighted)}"] = pooled
        optimizers = {"sgd": cncore.SGD(lr=spec["lr"]), "adagrad": cncore.Adagrad(lr=spec["lr"], eps=spec["eps"]),
                      "rowwise-adagrad": cncore.RowWiseAdagrad(lr=spec["lr"], eps=spec["eps"]),
                      "adam": cncore.Adam(lr=spec["lr"], eps=spec["eps"])}
        for name, opt in optimizers.items():
            for dtype in ("float32", "bfloat16") if name == "rowwise-adagrad" else ("float32",):
                for mode, weighted in (("sum", True), ("mean", False)):
                    store = cncore.EmbeddingStore(cncore.StoreConfig(dim=dim, dtype=dtype, optimizer=opt))
                    store.insert_or_assign(keys_all, rows)
                    for _ in range(spec["steps"]):
                        _, ctx = store.pooled_lookup(batch, lengths=lengths, mode=mode,
                                                     per_sample_weights=weights if weighted else None)
                        store.apply_gradients(ctx, grad)
                    out[f"step_{dim}_{name}_{dtype}_{mode}"] = store.lookup(keys_all)
        store = cncore.EmbeddingStore(cncore.StoreConfig(dim=dim))
        store.insert_or_assign(keys_all, rows)
        _, ctx = store.pooled_lookup(batch, lengths=lengths, per_sample_weights=weights)
        out[f"unique_keys_{dim}"], out[f"unique_{dim}"] = store.accumulate_gradients(ctx, grad)
        for init in (cncore.Uniform(-0.3, 0.7), cncore.Normal(0.1, 2.0), cncore.TruncatedNormal(0.0, 1.0, -0.5, 0.5)):
            cfg = cncore.StoreConfig(dim=dim, initializer=init, seed=11)
            out[f"init_{dim}_{type(init).__name__}"] = cncore.initial_rows(cfg, keys_all)
            out[f"inserted_{dim}_{type(init).__name__}"] = cncore.EmbeddingStore(cfg).lookup(
                keys_all, insert_missing=True)
    np.savez(sys.argv[1], batch=batch, lengths=lengths, weights=weights, keys_all=keys_all, **out)
""")


def run_level(level: str | None, path: str, code: str = WORKER) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != _core.ISA_VARIABLE}
    if level is not None:
        env[_core.ISA_VARIABLE] = level
    spec = {"dims": DIMS, "dtypes": DTYPES, "poolings": POOLINGS, "lr": LR, "eps": EPS, "n_rows": N_ROWS,
            "n_bags": N_BAGS, "steps": STEPS}
    return subprocess.run([sys.executable, "-c", code, path, json.dumps(spec)], env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every runnable level's results, by level name."""
    found = {}
    for level in LEVELS:
        path = str(tmp_path_factory.mktemp(level) / "out.npz")
        proc = run_level(level, path)
        assert proc.returncode == 0, f"CNCORE_ISA={level}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
        with np.load(path) as data:
            found[level] = dict(data)
        assert str(found[level]["isa"]) == level
    return found


def assert_within_bound(got, want, scale, what):
    bound = 1e-5 * (np.abs(want) + scale) + 1e-7
    err = np.abs(got.astype(np.float64) - want)
    assert (err <= bound).all(), f"{what}: max error {err.max():.3g}, worst error/bound {(err / bound).max():.3g}"


def embedding_bag(rows, batch_rows_idx, offsets, mode, weights):
    eb = torch.nn.EmbeddingBag.from_pretrained(torch.from_numpy(rows.astype(np.float64)), mode=mode,
                                               include_last_offset=True)
    return eb(torch.from_numpy(batch_rows_idx), torch.from_numpy(offsets),
              per_sample_weights=None if weights is None else torch.from_numpy(weights.astype(np.float64))).numpy()


def batch_as_rows(r, table):
    """The table's rows (float32, keys_all's order), the batch as positions into them, its offsets."""
    where = {int(k): i for i, k in enumerate(r["keys_all"])}
    idx = np.array([where[int(k)] for k in r["batch"]], dtype=np.int64)
    return table, idx, np.concatenate([[0], np.cumsum(r["lengths"])]).astype(np.int64)


@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode,weighted", POOLINGS)
def test_forward_of_every_level_is_embedding_bags(results, dim, dtype, mode, weighted):
    name = f"fwd_{dim}_{dtype}_{mode}_{int(weighted)}"
    for level, r in results.items():
        rows, idx, offsets = batch_as_rows(r, r[f"table_{dim}_{dtype}"])  # 16-bit rows pooled as stored
        weights = r["weights"] if weighted else None
        want = embedding_bag(rows, idx, offsets, mode, weights)
        got = r[name]
        if mode == "max":  # no arithmetic: the maxima themselves, empty bags zeros
            np.testing.assert_array_equal(got, want.astype(np.float32), err_msg=f"{level} {name}")
            continue
        scale = embedding_bag(np.abs(rows), idx, offsets, mode, None if weights is None else np.abs(weights))
        assert_within_bound(got, want, scale, f"{level} {name}")
    base = results[LEVELS[0]][name].astype(np.float64)
    for level, r in results.items():  # the levels against each other, within twice the bound
        if mode == "max":
            np.testing.assert_array_equal(r[name], base, err_msg=f"{level} against base, {name}")
        else:
            assert_within_bound(r[name], base, 2 * (np.abs(base) + scale), f"{level} against base, {name}")


def torch_step(rows, r, mode, weighted, grad, name, dtype):
    """STEPS steps of torch.optim on an EmbeddingBag's weight (dense: rows without a gradient do not
    move under SGD, Adagrad or Adam while every step touches the same rows). Row-wise Adagrad:
    FBGEMM's EXACT_ROWWISE_ADAGRAD in float64 NumPy. Returns the rows of the batch's keys' table
    (float64), keyed by the table's row order, rounded to `dtype` after every step as the store
    keeps them, and how far each value moved."""
    keys_all, batch = r["keys_all"], r["batch"]
    where = {int(k): i for i, k in enumerate(keys_all)}
    idx = torch.tensor([where[int(k)] for k in batch], dtype=torch.int64)
    offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(r["lengths"])]).astype(np.int64))
    w = torch.nn.Parameter(torch.from_numpy(rows.astype(np.float64)))
    psw = torch.from_numpy(r["weights"].astype(np.float64)) if weighted else None
    state = np.zeros(len(rows))
    opt = {"sgd": lambda: torch.optim.SGD([w], lr=LR), "adagrad": lambda: torch.optim.Adagrad([w], lr=LR, eps=EPS),
           "adam": lambda: torch.optim.Adam([w], lr=LR, eps=EPS), "rowwise-adagrad": lambda: None}[name]()
    for _ in range(STEPS):
        w.grad = None
        out = torch.nn.functional.embedding_bag(idx, w, offsets, mode=mode, per_sample_weights=psw,
                                                include_last_offset=True)
        out.backward(torch.from_numpy(grad.astype(np.float64)))
        if opt is not None:
            opt.step()
        else:
            g = w.grad.numpy()
            touched = np.abs(g).sum(axis=1) > 0
            state[touched] += (g[touched] ** 2).mean(axis=1)
            with torch.no_grad():
                w[touched] -= torch.from_numpy(LR / (np.sqrt(state[touched]) + EPS))[:, None] * w.grad[touched]
        if dtype != "float32":
            with torch.no_grad():
                w.copy_(w.to(getattr(torch, dtype)).to(torch.float64))
    return w.detach().numpy(), np.abs(rows.astype(np.float64) - w.detach().numpy())


@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_fused_step_of_every_level_is_torch_optims(results, dim, name):
    r0 = results[LEVELS[0]]
    grad = r0[f"grad_{dim}"]
    for dtype in ("float32", "bfloat16") if name == "rowwise-adagrad" else ("float32",):
        for mode, weighted in (("sum", True), ("mean", False)):
            key = f"step_{dim}_{name}_{dtype}_{mode}"
            want, moved = torch_step(r0[f"table_{dim}_{dtype}"], r0, mode, weighted, grad, name, dtype)
            for level, r in results.items():
                got = r[key]
                if dtype == "float32":
                    assert_within_bound(got, want, moved, f"{level} {key}")
                else:  # updated in float32 (the reference in float64), both rounded to bfloat16 a step
                    assert_within_bfloat16_units(got, want, f"{level} {key}")
            for level, r in results.items():
                if dtype == "float32":
                    assert_within_bound(r[key], r0[key].astype(np.float64), 2 * (np.abs(r0[key]) + moved),
                                        f"{level} against base, {key}")
                else:
                    assert_within_bfloat16_units(r[key], r0[key], f"{level} against base, {key}")


def assert_within_bfloat16_units(got, want, what):
    """Within two units in the last place of bfloat16 (8 significant bits) of `want`."""
    ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(want.astype(np.float64)), 1e-30))) - 7)
    err = np.abs(got.astype(np.float64) - want)
    assert (err <= 2 * ulp + 1e-7).all(), f"{what}: worst error/ulp {(err / ulp).max():.3g}"


def rounded_as_stored(x, dtype):
    """float32 values as a table of `dtype` holds them, widened back: nearest, ties to even; past
    float16's largest finite value, saturated to it (torch's casts, which are IEEE's)."""
    if dtype == "float16":
        return np.clip(x, -65504, 65504).astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        return torch.from_numpy(x).to(torch.bfloat16).to(torch.float32).numpy()
    return x


@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_written_and_read_are_rounded_alike_on_every_level(results, dim, dtype):
    """insert_or_assign rounds float32 rows to the table's dtype and lookup widens them back in
    the code outside the kernels, which calls the active level's conversions (cn_dtype.h): every
    level gives the same bits, those of torch's casts, for normal values and at the edges."""
    for name in ("rows", "edges"):
        for level, r in results.items():
            want = rounded_as_stored(r[f"{name}_{dim}"], dtype)
            got = r[f"table_{dim}_{dtype}" if name == "rows" else f"edges_{dim}_{dtype}"]
            # a NaN's payload is not a value (torch's bfloat16 cast gives 0xffff, the table 0x7fc0):
            # NaN where NaN is wanted, every other value to the bit
            got, want = (np.where(np.isnan(a), np.float32(np.nan), a) for a in (got, want))
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32),
                                          err_msg=f"{level} {name} {dtype} dim {dim}")


@pytest.mark.parametrize("dim", DIMS)
def test_unique_gradients_of_every_level_are_float64_sums(results, dim):
    for level, r in results.items():
        keys, g = r[f"unique_keys_{dim}"], r[f"unique_{dim}"]
        batch, lengths, weights = r["batch"], r["lengths"], r["weights"]
        grad = r[f"grad_{dim}"]
        bag_of = np.repeat(np.arange(N_BAGS), lengths)
        want, scale = {}, {}
        for i, k in enumerate(batch):
            contrib = float(weights[i]) * grad[bag_of[i]].astype(np.float64)
            want[int(k)] = want.get(int(k), 0) + contrib
            scale[int(k)] = scale.get(int(k), 0) + np.abs(contrib)
        assert list(keys) == list(dict.fromkeys(int(k) for k in batch))  # first-occurrence order
        assert_within_bound(g, np.array([want[int(k)] for k in keys]), np.array([scale[int(k)] for k in keys]),
                            f"{level} unique gradients, dim {dim}")


@pytest.mark.parametrize("dim", DIMS)
def test_initial_rows_are_the_same_bits_on_every_level_and_in_the_insert(results, dim):
    r0 = results[LEVELS[0]]
    for init in ("Uniform", "Normal", "TruncatedNormal"):
        key = f"init_{dim}_{init}"
        for level, r in results.items():
            np.testing.assert_array_equal(r[key], r0[key], err_msg=f"{level} {key}")
            np.testing.assert_array_equal(r[f"inserted_{dim}_{init}"], r[key], err_msg=f"{level} inserted {key}")
    # uncontracted, the uniform rows are NumPy's float32 re-derivation bit for bit
    want = np.stack([uniform_row(11, int(k), dim, -0.3, 0.7) for k in r0["keys_all"]])
    np.testing.assert_array_equal(r0[f"init_{dim}_Uniform"], want)


def test_unset_or_empty_variable_runs_the_best_level_this_cpu_has(tmp_path):
    code = "import cncore; print(cncore.kernel_isa(), ','.join(cncore.runnable_isas()))"
    for level in (None, ""):
        proc = run_level(level, str(tmp_path / "unused"), code)
        assert proc.returncode == 0, proc.stderr
        chosen, runnable = proc.stdout.split()
        assert chosen == runnable.split(",")[-1] == LEVELS[-1]


def test_every_level_this_cpu_has_is_chosen_when_named(results):
    assert LEVELS[0] == "base" and LEVELS == list(_core.ISA_LEVELS[:len(LEVELS)])
    assert sorted(results) == sorted(LEVELS)


@pytest.mark.parametrize("value", ["v5", "V4", "avx512", "native", " v3"])
def test_an_unknown_level_is_refused_at_import_naming_the_variable(tmp_path, value):
    proc = run_level(value, str(tmp_path / "unused"), "import cncore")
    assert proc.returncode != 0
    assert f"CNCORE_ISA={value!r} is not a level of the kernels" in proc.stderr
    assert "use one of base, v3, v4" in proc.stderr and f"this CPU runs {', '.join(LEVELS)}" in proc.stderr


def test_a_level_this_cpu_lacks_is_refused_naming_what_it_runs():
    """The refusal's logic on a CPU that runs base and v3 only (this one may run them all)."""
    message = _core.isa_refusal("v4", ("base", "v3"))
    assert message == ("CNCORE_ISA='v4': this CPU (or this build of cncore) cannot run the v4 kernels; it runs "
                       "base, v3. Set CNCORE_ISA to one of those, or unset it to choose the best")
    assert _core.isa_refusal("v3", ("base", "v3")) is None and _core.isa_refusal(None, ("base",)) is None
    assert "is not a level" in _core.isa_refusal("v9", ("base",))


def test_the_levels_run_code_of_their_own(results):
    """A weighted sum rounds differently with fused multiply-adds (v3, v4) than without (base), so
    equal results everywhere would mean that a level did not run its own kernels."""
    if "v3" not in results:
        pytest.skip("this CPU runs the base level only: nothing to tell apart")
    name = "fwd_64_float32_sum_1"
    assert (results["base"][name] != results["v3"][name]).any()


def test_setup_refuses_native_and_portable_together_naming_both():
    """The build is portable unless CNCORE_NATIVE=1 (setup.py); asking for both is an error
    before anything is compiled."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "CNCORE_NATIVE": "1", "CNCORE_PORTABLE": "1"}
    proc = subprocess.run([sys.executable, os.path.join(root, "setup.py"), "--version"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "CNCORE_NATIVE=1 and CNCORE_PORTABLE=1 ask for different builds" in proc.stderr

"""Bad input to every public entry point of `cncore`: a clear error naming the argument, and
the stores byte-identical afterwards (issue 9, "The harness that keeps it so").

Layer 1, the catalogue (`tests/bad_inputs_catalogue.py`): wrong dtypes, shapes, values,
configs, contexts and cursors, each case played in a child process (chunks of cases per
process; a chunk that dies is replayed one case per process), so that a segfault or a hang is
one failed case. Each case asserts the exception type (TypeError / ValueError / BufferError;
MemoryError only for absurd sizes; RuntimeError only for stale contexts and export cursors),
that the message names the argument, and that every store of the case's world is unchanged
(export sorted by key, len, step, capacity).

Layer 2, hypothesis: random dtypes, shapes and values for keys, offsets, lengths, weights and
gradients, checked against a model of what is valid (valid input gives the reference result,
invalid input is refused naming an invalid argument and changes nothing). It runs in-process,
so it runs only when no catalogue case crashed the core.

    python -c "import tests.test_core_bad_inputs as t; print(t.N_CASES)"
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import bad_inputs_catalogue as catalogue  # noqa: E402

import cncore  # noqa: E402

CASES = catalogue.build()
CASE_IDS = list(CASES)
N_CASES = len(CASES)
# The catalogue as built for issue 9; raise it when cases are added, never lower it.
MIN_CASES = 1285

CHUNK = 80
CHUNK_TIMEOUT_S = 60
SINGLE_TIMEOUT_S = 15


def _play(ids, timeout, env=None):
    """Run cases in one child process: ({id: record}, how the process ended or None)."""
    try:
        proc = subprocess.run([sys.executable, os.path.join(HERE, "bad_inputs_catalogue.py")],
                              input=json.dumps(ids), capture_output=True, text=True, timeout=timeout,
                              cwd=os.path.dirname(HERE), env=env)
        out, err, rc = proc.stdout, proc.stderr, proc.returncode
        death = None if rc == 0 else (f"killed by signal {-rc}" if rc < 0 else f"exited with status {rc}")
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        death = f"hung (no result within {timeout} s)"
    records = {}
    for line in out.splitlines():
        if line.startswith("CASE "):
            rec = json.loads(line[5:])
            records[rec["id"]] = rec
    if death is not None:
        death += "; stderr tail: " + err[-1500:].strip()
    return records, death


def _play_chunk(ids, chunk_timeout=CHUNK_TIMEOUT_S, single_timeout=SINGLE_TIMEOUT_S, env=None):
    records, death = _play(ids, chunk_timeout, env)
    if death is None and len(records) == len(ids):
        return records
    if not records and death.startswith("exited"):  # the child could not even start (an import error)
        return {cid: {"id": cid, "died": f"the case runner could not start: {death}"} for cid in ids}
    # The chunk died (maybe only at exit, in a destructor): replay its cases one per process
    # to find the crasher.
    running = next((cid for cid in ids if cid not in records), ids[-1])
    any_died = False
    for cid in ids:
        one, one_death = _play([cid], single_timeout, env)
        if cid in one and one_death is None:
            records[cid] = one[cid]
        else:
            records[cid] = {"id": cid, "died": one_death or "the process ended without a result"}
            any_died = True
    if not any_died:  # alone every case survives: an earlier case corrupted what this one touched
        records[running] = {"id": running, "died": f"{death or 'no result'} (in its chunk of {len(ids)} cases; "
                                                   "alone it passes: an earlier case of the chunk broke the process)"}
    return records


@pytest.fixture(scope="session")
def results():
    chunks = [CASE_IDS[i:i + CHUNK] for i in range(0, len(CASE_IDS), CHUNK)]
    merged = {}
    with ThreadPoolExecutor(max_workers=2) as pool:
        for recs in pool.map(_play_chunk, chunks):
            merged.update(recs)
    return merged


def test_the_catalogue_does_not_shrink():
    assert N_CASES >= MIN_CASES
    kinds = {case.kind for case in CASES.values()}
    assert kinds == {"refuse", "accept", "either"}
    # every public entry point has cases
    prefixes = {cid.split("/")[0] for cid in CASE_IDS}
    for name in ("find", "contains", "find_or_insert", "insert_or_assign", "assign", "load", "erase", "reserve",
                 "lookup", "read", "export", "iter_export", "pooled_lookup", "apply_gradients",
                 "accumulate_gradients", "grouped_pooled_lookup", "grouped_apply_gradients", "set_num_threads",
                 "initial_rows", "step", "StoreConfig", "EmbeddingStore", "Uniform", "Normal", "TruncatedNormal",
                 "Constant", "SGD", "Adagrad", "RowWiseAdagrad", "Adam", "stale-ctx", "stale-cursor",
                 "mutated-after-lookup"):
        assert name in prefixes, name


def test_the_runner_reports_a_crash_and_a_hang_as_failed_cases_and_plays_the_rest():
    ids = ["selftest/refused-1", "selftest/segfault", "selftest/refused-2", "selftest/hang", "selftest/refused-3",
           "selftest/erases-then-raises"]
    recs = _play_chunk(ids, chunk_timeout=6, single_timeout=2, env={**os.environ, "CN_BAD_INPUTS_SELFTEST": "1"})
    assert sorted(recs) == sorted(ids)
    assert recs["selftest/segfault"]["died"].startswith("killed by signal 11")
    assert "Segmentation fault" in recs["selftest/segfault"]["died"]  # faulthandler's report in the tail
    assert recs["selftest/hang"]["died"].startswith("hung (no result within 2 s)")
    for cid in ("selftest/refused-1", "selftest/refused-2", "selftest/refused-3"):
        assert recs[cid]["exc"] == "TypeError" and recs[cid]["unchanged"] is True, recs[cid]
        assert recs[cid]["msg"].startswith("keys:"), recs[cid]
    erased = recs["selftest/erases-then-raises"]
    assert erased["exc"] == "TypeError" and erased["unchanged"] is False
    assert erased["detail"] == "changed: s (keys, rows, optimizer_state, counts, last_steps, len)"


def _check(case, rec):
    assert "died" not in rec, f"{case.id}: the core crashed or hung: {rec.get('died')}"
    if rec["exc"] == "WorldError":
        pytest.fail(f"{case.id}: the test world could not be built: {rec['msg']}")
    if rec["exc"] == "CaseFailed":
        pytest.fail(f"{case.id}: accepted, but {rec['msg']}")
    if case.kind == "accept" or (case.kind == "either" and rec["exc"] is None):
        assert rec["exc"] is None, f"{case.id}: must be accepted, raised {rec['exc']}: {rec['msg']}"
        return
    assert rec["exc"] is not None, f"{case.id}: accepted; must raise {'/'.join(case.types)} naming {case.match!r}"
    assert set(rec["mro"]) & set(case.types), \
        f"{case.id}: raised {rec['exc']} ({rec['msg']}); must be one of {'/'.join(case.types)}"
    assert rec["in_cncore"], f"{case.id}: {rec['exc']} ({rec['msg']}) came from the case's own code, not from cncore"
    assert re.search(case.match, rec["msg"]), \
        f"{case.id}: the message does not name the argument ({case.match!r}): {rec['exc']}: {rec['msg']}"
    assert rec["unchanged"], f"{case.id}: refused ({rec['exc']}: {rec['msg']}) but {rec['detail']}"


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_bad_input(case_id, results):
    _check(CASES[case_id], results[case_id])


# --- layer 2: hypothesis, in-process ------------------------------------------------------------

@pytest.fixture(scope="module")
def core_survives(results):
    dead = sorted(cid for cid, rec in results.items() if "died" in rec)
    if dead:
        pytest.fail("the property tests run in-process and need a core that survives the catalogue; "
                    f"{len(dead)} case(s) crash or hang it: {', '.join(dead[:10])}")


F32 = np.float32
DIM = 3
KEY_DTYPES = [np.int64, np.int32, np.int16, np.uint64, np.float64, np.float32, np.bool_]


def _snap(store):
    return catalogue.snapshot(store)


def _fresh_store(optimizer=None):
    store = cncore.EmbeddingStore(dim=DIM, seed=11, initializer=cncore.Constant(0.5),
                                  optimizer=optimizer or cncore.SGD(lr=0.25))
    store.find_or_insert(np.arange(5))
    store.step = 2
    return store


@st.composite
def lookup_inputs(draw):
    """keys / offsets / lengths / weights / mode, each valid most of the time."""
    n = draw(st.integers(0, 8))
    kdtype = draw(st.sampled_from(KEY_DTYPES)) if draw(st.booleans()) else np.int64
    kshape = (n,) if draw(st.integers(0, 5)) else (n, 1)
    keys = np.array(draw(st.lists(st.integers(0, 9), min_size=n, max_size=n)), dtype=np.int64)
    keys = keys.astype(kdtype).reshape(kshape)
    n_bags = draw(st.integers(0, 4))
    cuts = sorted(draw(st.lists(st.integers(0, n), min_size=max(n_bags - 1, 0), max_size=max(n_bags - 1, 0))))
    offsets = np.array([0] + cuts + [n] if n_bags else [0], dtype=np.int64)
    if n_bags == 0 and n:
        offsets = np.array([0, n])  # B = 1
    if draw(st.integers(0, 4)) == 0:  # spoil one offset
        i = draw(st.integers(0, len(offsets) - 1))
        offsets[i] += draw(st.sampled_from([-3, -1, 1, 2, 2**40]))
    odtype = draw(st.sampled_from([np.int64, np.int32, np.float64, np.int64, np.int64]))
    offsets = offsets.astype(odtype)
    use_lengths = draw(st.booleans())
    lengths = np.diff(offsets.astype(np.int64)) if len(offsets) else np.array([], dtype=np.int64)
    mode = draw(st.sampled_from(["sum", "mean", "max", "sum", "bogus"]))
    weights = None
    if draw(st.booleans()):
        wlen = n + draw(st.sampled_from([0, 0, 0, -1, 1])) if n else draw(st.sampled_from([0, 1]))
        wdtype = draw(st.sampled_from([F32, F32, F32, np.float64]))
        weights = np.array(draw(st.lists(st.floats(-2, 2, width=32), min_size=max(wlen, 0), max_size=max(wlen, 0))),
                           dtype=wdtype)
    return keys, (None, lengths) if use_lengths else (offsets, None), weights, mode


def _invalid_arguments(keys, offsets, lengths, weights, mode):
    """Which arguments the model says are wrong (empty: the lookup must succeed)."""
    bad = set()
    if keys.dtype not in (np.int64, np.int32) or keys.ndim != 1:
        bad.add("keys")
    n = keys.shape[0]
    if offsets is not None:
        o = offsets
        if o.dtype not in (np.int64, np.int32) or len(o) == 0 or o[0] != 0 or (np.diff(o) < 0).any() or o[-1] != n:
            bad.add("offsets")
    else:
        if lengths.dtype not in (np.int64, np.int32) or (lengths < 0).any() or lengths.sum() != n:
            bad.add("lengths")
    if mode not in ("sum", "mean", "max"):
        bad.add("mode")
    if weights is not None and (mode == "max" or weights.dtype != F32 or weights.shape != (n,)):
        bad.add("per_sample_weights")
    return bad


def _reference_pool(store, keys, offsets, weights, mode):
    keys = keys.astype(np.int64)
    rows = store.lookup(keys).astype(np.float64)
    out = np.zeros((len(offsets) - 1, store.dim))
    w = np.ones(len(keys)) if weights is None else weights.astype(np.float64)
    for b in range(len(offsets) - 1):
        lo, hi = int(offsets[b]), int(offsets[b + 1])
        if hi == lo:
            continue
        if mode == "max":
            out[b] = rows[lo:hi].max(axis=0)
        else:
            out[b] = (rows[lo:hi] * w[lo:hi, None]).sum(axis=0)
            if mode == "mean":
                out[b] /= hi - lo
    return out


@settings(max_examples=150)
@given(lookup_inputs())
def test_random_lookup_inputs_are_pooled_or_refused_cleanly(core_survives, inputs):
    keys, (offsets, lengths), weights, mode = inputs
    store = _fresh_store()
    before = _snap(store)
    bad = _invalid_arguments(keys, offsets, lengths, weights, mode)
    if bad:
        with pytest.raises((TypeError, ValueError, BufferError)) as info:
            store.pooled_lookup(keys, offsets, lengths=lengths, per_sample_weights=weights, mode=mode)
        assert any(re.search(rf"\b{name}", str(info.value)) for name in bad), (bad, str(info.value))
        assert _snap(store) == before
        return
    out, ctx = store.pooled_lookup(keys, offsets, lengths=lengths, per_sample_weights=weights, mode=mode)
    bag_offsets = offsets if offsets is not None else np.concatenate([[0], np.cumsum(lengths)])
    np.testing.assert_allclose(out, _reference_pool(store, keys, bag_offsets, weights, mode), rtol=1e-5, atol=1e-6)
    assert store.contains(keys.astype(np.int64)).all()


@st.composite
def gradient_inputs(draw):
    n_bags = draw(st.integers(1, 4))
    lens = draw(st.lists(st.integers(0, 3), min_size=n_bags, max_size=n_bags))
    keys = np.array(draw(st.lists(st.integers(0, 7), min_size=sum(lens), max_size=sum(lens))), dtype=np.int64)
    weights = None
    if draw(st.booleans()):
        weights = np.array(draw(st.lists(st.floats(-2, 2, width=32), min_size=len(keys), max_size=len(keys))),
                           dtype=F32)
    shape = (n_bags + draw(st.sampled_from([0, 0, 0, 0, -1, 1])), DIM + draw(st.sampled_from([0, 0, 0, 0, -1, 1])))
    if draw(st.integers(0, 9)) == 0:
        shape = shape[:1]
    gdtype = draw(st.sampled_from([F32, F32, F32, F32, np.float64, np.float16, np.int32]))
    values = draw(st.lists(st.floats(-4, 4, width=32), min_size=int(np.prod(shape)), max_size=int(np.prod(shape))))
    grad = np.array(values, dtype=np.float64).reshape(shape).astype(gdtype)
    if grad.size and gdtype in (F32, np.float64) and draw(st.integers(0, 7)) == 0:
        grad.flat[draw(st.integers(0, grad.size - 1))] = np.nan
    lr = draw(st.sampled_from([None, 0.5, 0.0, np.float32(0.125), -0.5, float("nan"), True, 1e39]))
    return keys, np.array(lens), weights, grad, lr


def _lr_ok(lr):
    if lr is None:
        return True
    if isinstance(lr, (bool, np.bool_)) or not isinstance(lr, (int, float, np.integer, np.floating)):
        return False
    return bool(np.isfinite(lr)) and lr >= 0 and abs(float(lr)) <= float(np.finfo(F32).max)


@settings(max_examples=150)
@given(gradient_inputs())
def test_random_gradients_update_like_sgd_or_are_refused_cleanly(core_survives, inputs):
    keys, lens, weights, grad, lr = inputs
    store = _fresh_store()
    out, ctx = store.pooled_lookup(keys, lengths=lens, per_sample_weights=weights)
    before = _snap(store)
    grad_ok = grad.dtype == F32 and grad.shape == (len(lens), DIM) and np.isfinite(grad).all()
    if not (grad_ok and _lr_ok(lr)):
        with pytest.raises((TypeError, ValueError)) as info:
            store.apply_gradients(ctx, grad, lr=lr)
        names = ([] if grad_ok else ["grad_output"]) + ([] if _lr_ok(lr) else ["lr"])
        assert any(re.search(rf"\b{n}\b", str(info.value)) for n in names), (names, str(info.value))
        assert _snap(store) == before
        return
    rate = 0.25 if lr is None else float(lr)
    want = {int(k): store.lookup(np.array([k]))[0].astype(np.float64) for k in np.unique(keys)}
    offsets = np.concatenate([[0], np.cumsum(lens)])
    step = np.zeros((len(keys), DIM))
    for b in range(len(lens)):
        for i in range(offsets[b], offsets[b + 1]):
            step[i] = grad[b] * (1.0 if weights is None else float(weights[i]))
    total = {k: np.zeros(DIM) for k in want}
    for i, k in enumerate(keys):
        total[int(k)] += step[i]
    store.apply_gradients(ctx, grad, lr=lr)
    for k, row in want.items():
        np.testing.assert_allclose(store.lookup(np.array([k]))[0], row - np.float32(rate) * total[k],
                                   rtol=1e-5, atol=1e-5)
    assert store.step == 3


@settings(max_examples=100)
@given(n_first=st.integers(1, 4), n_second=st.integers(1, 4), width_delta=st.sampled_from([0, 0, 0, -1, 1]),
       grad_bags=st.integers(1, 4), same_lookup=st.booleans())
def test_random_grouped_contexts_are_checked_against_every_context(core_survives, n_first, n_second, width_delta,
                                                                   grad_bags, same_lookup):
    a = _fresh_store()
    b = cncore.EmbeddingStore(dim=2, initializer=cncore.Constant(1.0), optimizer=cncore.SGD(lr=0.5))
    if same_lookup:
        n_second = n_first
        _, ctxs = cncore.grouped_pooled_lookup([a, b], [np.arange(n_first), np.arange(n_first)],
                                               lengths=[np.ones(n_first, np.int64), np.ones(n_first, np.int64)])
    else:
        _, (ca,) = cncore.grouped_pooled_lookup([a], [np.arange(n_first)], lengths=[np.ones(n_first, np.int64)])
        _, (cb,) = cncore.grouped_pooled_lookup([b], [np.arange(n_second)], lengths=[np.ones(n_second, np.int64)])
        ctxs = [ca, cb]
    grad = np.ones((grad_bags, DIM + 2 + width_delta), F32)
    before = (_snap(a), _snap(b))
    valid = same_lookup and grad_bags == n_first and width_delta == 0
    if not valid:
        with pytest.raises((TypeError, ValueError)) as info:
            cncore.grouped_apply_gradients(ctxs, grad)
        assert re.search(r"grad_output|\bctxs?\b|context", str(info.value)), str(info.value)
        assert (_snap(a), _snap(b)) == before
        return
    cncore.grouped_apply_gradients(ctxs, grad)
    np.testing.assert_array_equal(b.lookup(np.arange(n_first)), np.full((n_first, 2), 0.5, F32))
    np.testing.assert_array_equal(a.lookup(np.arange(n_first)), np.full((n_first, DIM), 0.25, F32))


@st.composite
def grouped_inputs(draw):
    """F features sharing B bags; at most one thing spoiled, in one feature (known exactly)."""
    n_features = draw(st.integers(1, 3))
    n_bags = draw(st.integers(1, 3))
    feats = []
    for _ in range(n_features):
        lens = np.array(draw(st.lists(st.integers(0, 3), min_size=n_bags, max_size=n_bags)), dtype=np.int64)
        keys = np.array(draw(st.lists(st.integers(0, 9), min_size=int(lens.sum()), max_size=int(lens.sum()))),
                        dtype=draw(st.sampled_from([np.int64, np.int32])))
        mode = draw(st.sampled_from(["sum", "mean", "max"]))
        weights = None
        if mode != "max" and draw(st.booleans()):
            weights = np.array(draw(st.lists(st.floats(-2, 2, width=32), min_size=len(keys), max_size=len(keys))),
                               dtype=F32)
        by_offsets = draw(st.booleans())
        feats.append({"keys": keys, "offsets": np.concatenate([[0], np.cumsum(lens)]) if by_offsets else None,
                      "lengths": None if by_offsets else lens, "per_sample_weights": weights, "modes": mode})
    spoil = draw(st.sampled_from([None, None, "keys", "offsets", "lengths", "per_sample_weights", "modes", "bags"]))
    f = draw(st.integers(0, n_features - 1))
    feat = feats[f]
    if spoil == "keys":
        feat["keys"] = draw(st.sampled_from([feat["keys"].astype(np.float64), feat["keys"].reshape(1, -1),
                                             feat["keys"].astype(np.uint64)]))
    elif spoil in ("offsets", "lengths"):
        lens = np.diff(feat["offsets"]) if feat["offsets"] is not None else feat["lengths"]
        if spoil == "offsets":
            bad = np.concatenate([[0], np.cumsum(lens)])
            bad[draw(st.integers(0, len(bad) - 1))] += draw(st.sampled_from([-2, 1, 2**40]))
            feat.update(offsets=bad, lengths=None)
            if bad[0] == 0 and bad[-1] == len(feat["keys"]) and (np.diff(bad) >= 0).all():
                spoil = None  # moving an inner offset by 1 can leave valid offsets ([0, 0, 1, 1] -> [0, 1, 1, 1])
        else:
            bad = lens.copy()
            bad[draw(st.integers(0, len(bad) - 1))] += draw(st.sampled_from([-5, -1, 1]))
            feat.update(offsets=None, lengths=bad)
    elif spoil == "per_sample_weights":
        feat["per_sample_weights"] = draw(st.sampled_from([np.ones(len(feat["keys"]) + 1, F32),
                                                           np.ones(len(feat["keys"]))]))
        if draw(st.booleans()):
            feat["modes"] = "max"
    elif spoil == "modes":
        feat["modes"] = draw(st.sampled_from(["median", "", None, 2]))
    elif spoil == "bags":
        if n_features == 1:
            spoil = None
        else:
            feat.update(keys=np.array([1], dtype=np.int64), offsets=None, lengths=np.array([1] + [0] * n_bags),
                        per_sample_weights=None)
    return feats, spoil, f


@settings(max_examples=120)
@given(grouped_inputs(), st.sampled_from(["distinct", "shared"]))
def test_random_grouped_lookups_name_the_bad_feature_or_pool_every_feature(core_survives, inputs, sharing):
    feats, spoil, bad_feature = inputs
    a = _fresh_store()
    b = cncore.EmbeddingStore(dim=2, seed=4, initializer=cncore.Constant(-1.0))
    b.find_or_insert(np.arange(3))
    stores = [a if (f % 2 == 0 or sharing == "shared") else b for f in range(len(feats))]
    call = {name: [feat[name] for feat in feats] for name in ("offsets", "lengths", "per_sample_weights", "modes")}
    keys = [feat["keys"] for feat in feats]
    before = (_snap(a), _snap(b))
    if spoil is not None:
        with pytest.raises((TypeError, ValueError, BufferError)) as info:
            cncore.grouped_pooled_lookup(stores, keys, **call)
        want = rf"feature {bad_feature}\b|bags" if spoil == "bags" else rf"\b{spoil}\[{bad_feature}\]"
        assert re.search(want, str(info.value)), (want, str(info.value))
        assert (_snap(a), _snap(b)) == before
        return
    out, ctxs = cncore.grouped_pooled_lookup(stores, keys, **call)
    assert out.shape == (len(feats[0]["lengths"]) if feats[0]["lengths"] is not None
                         else len(feats[0]["offsets"]) - 1, sum(st_.dim for st_ in stores))
    for f, (feat, ctx) in enumerate(zip(feats, ctxs)):
        o = feat["offsets"] if feat["offsets"] is not None else np.concatenate([[0], np.cumsum(feat["lengths"])])
        want = _reference_pool(stores[f], feat["keys"], o, feat["per_sample_weights"], feat["modes"])
        np.testing.assert_allclose(out[:, ctx.columns], want, rtol=1e-5, atol=1e-6)

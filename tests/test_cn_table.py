"""cn-table's tools, each checked against a NumPy (or Python dict) computation on the same arrays."""
import json
import os
import re
import sys

import numpy as np
import pytest
from reference import EDGE_KEYS, tree

import cncore
from cncore.tablefile import config_to_dict
from cncore_numpy import TableWriter, load_table, open_table, save_table
from cncore_numpy.cli import main
from cncore_numpy.exchange import export_table, import_table
from cncore_numpy.tools import diff, inspect, merge, prune_mask

OPTIMIZERS = [None, cncore.SGD(lr=0.1), cncore.Adagrad(lr=0.1), cncore.RowWiseAdagrad(lr=0.1),
              cncore.Adam(lr=0.01, betas=(0.8, 0.9))]


def trained(optimizer=cncore.RowWiseAdagrad(), dim=5, n=3000, steps=6, seed=3, key_pool=None):
    rng = np.random.default_rng(seed)
    store = cncore.EmbeddingStore(dim=dim, optimizer=optimizer, initializer=cncore.Normal(0, 1), seed=seed)
    keys = rng.integers(-(2**63), 2**63 - 1, n) if key_pool is None else key_pool
    keys = np.concatenate([np.array(EDGE_KEYS), keys])
    for _ in range(steps):
        batch = keys[rng.zipf(1.3, 4000) % len(keys)]
        _, ctx = store.pooled_lookup(batch, lengths=np.ones(len(batch), dtype=np.int64))
        if optimizer is None:
            store.accumulate_gradients(ctx, rng.standard_normal((len(batch), dim)).astype(np.float32))
            store.step = store.step + 1
        else:
            store.apply_gradients(ctx, rng.standard_normal((len(batch), dim)).astype(np.float32))
    return store


def as_dict(table):
    """{key: (row, state, count, last step)} of a TableFile: the reference the tools are checked on."""
    return {int(k): (np.asarray(table.rows[i]), np.asarray(table.optimizer_state[i]), int(table.counts[i]),
                     int(table.last_steps[i])) for i, k in enumerate(np.asarray(table.keys))}


def assert_tables_equal(a, b):
    assert a.config == b.config and a.step == b.step and len(a) == len(b)
    da, db = as_dict(a), as_dict(b)
    assert da.keys() == db.keys()
    for k, (row, state, count, last) in da.items():
        np.testing.assert_array_equal(db[k][0], row)
        np.testing.assert_array_equal(db[k][1], state)
        assert db[k][2:] == (count, last)


@pytest.fixture
def table_path(tmp_path):
    path = str(tmp_path / "t")
    save_table(trained(), path)
    return path


def test_inspect_matches_numpy(table_path, capsys):
    t = open_table(table_path)
    s = inspect(t)
    assert s["rows"] == len(t) and s["dim"] == 5 and s["step"] == 6 and s["optimizer"] == "RowWiseAdagrad"
    assert s["key_min"] == -(2**63) and s["key_max"] == 2**63 - 1
    norms = np.linalg.norm(np.asarray(t.rows, dtype=np.float64), axis=1)
    assert s["row_norm"]["counts"] == np.histogram(norms.astype(np.float32), bins=10)[0].tolist()
    assert s["access_count"]["counts"] == np.histogram(np.asarray(t.counts), s["access_count"]["edges"])[0].tolist()
    ages = t.step - np.asarray(t.last_steps, dtype=np.int64)
    assert s["age"]["counts"] == np.histogram(ages, s["age"]["edges"])[0].tolist()
    assert s["bytes"] == sum(os.path.getsize(getattr(t, n).filename)
                             for n in ("keys", "rows", "optimizer_state", "counts", "last_steps"))
    assert main(["inspect", table_path, "--json", "--quiet"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == len(t)
    assert main(["inspect", table_path, "--quiet"]) == 0
    assert "rows of dim 5" in capsys.readouterr().out


def test_inspect_of_an_empty_table(tmp_path):
    with TableWriter(str(tmp_path / "e"), cncore.StoreConfig(dim=3), 0):
        pass
    s = inspect(open_table(str(tmp_path / "e")))
    assert s["rows"] == 0 and s["key_min"] is None and sum(s["access_count"]["counts"]) == 0


@pytest.mark.parametrize("criteria", [dict(min_count=3), dict(min_step=5), dict(min_norm=2.0), dict(top_k=100),
                                      dict(min_count=2, top_k=50), dict(min_count=10**9)])
def test_prune_keeps_exactly_what_numpy_says(table_path, tmp_path, criteria, capsys):
    t = open_table(table_path)
    keys, counts = np.asarray(t.keys), np.asarray(t.counts)
    expected = np.ones(len(t), dtype=bool)
    if "min_count" in criteria:
        expected &= counts >= criteria["min_count"]
    if "min_step" in criteria:
        expected &= np.asarray(t.last_steps) >= criteria["min_step"]
    if "min_norm" in criteria:
        expected &= np.linalg.norm(np.asarray(t.rows, dtype=np.float64), axis=1) >= criteria["min_norm"]
    if "top_k" in criteria and expected.sum() > criteria["top_k"]:
        idx = np.flatnonzero(expected)
        ranked = sorted(idx, key=lambda i: (-int(counts[i]), int(keys[i])))[: criteria["top_k"]]
        expected[:] = False
        expected[ranked] = True
    keep, failing = prune_mask(t, **criteria)
    np.testing.assert_array_equal(keep, expected)
    out = str(tmp_path / "pruned")
    options = [arg for k, v in criteria.items() for arg in (f"--{k.replace('_', '-')}", str(v))]
    args = ["prune", table_path, out, "--quiet", *options]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert f"removed {int((~expected).sum()):,} of {len(t):,} rows" in printed
    if "min_count" in criteria:
        assert f"count < {criteria['min_count']}: {int((counts < criteria['min_count']).sum()):,}" in printed
    pruned = open_table(out)
    assert pruned.config == t.config and pruned.step == t.step
    whole = as_dict(t)
    kept = as_dict(pruned)
    assert sorted(kept) == sorted(keys[expected].tolist())
    for k, (row, state, count, last) in kept.items():
        np.testing.assert_array_equal(row, whole[k][0])
        np.testing.assert_array_equal(state, whole[k][1])
        assert (count, last) == whole[k][2:]


def test_prune_needs_a_criterion(table_path, tmp_path):
    with pytest.raises(SystemExit):
        main(["prune", table_path, str(tmp_path / "x")])


@pytest.mark.parametrize("fmt", [".npz", ".npy", ".parquet"])
@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=str)
def test_export_import_round_trip_is_exact(tmp_path, fmt, optimizer):
    if fmt == ".parquet":
        pytest.importorskip("pyarrow")
    src = str(tmp_path / "t")
    save_table(trained(optimizer, dim=4, n=700), src)
    exported = str(tmp_path / f"t{fmt}")
    assert main(["export", src, exported, "--quiet"]) == 0
    back = str(tmp_path / "back")
    extra = ["--config-from", src] if fmt == ".npy" else []
    assert main(["import", exported, back, "--quiet", "--step", "6"] + extra) == 0
    assert_tables_equal(open_table(src), open_table(back))


def test_exports_are_plain_columns(table_path, tmp_path):
    t = open_table(table_path)
    export_table(t, str(tmp_path / "t.npz"))
    export_table(t, str(tmp_path / "t.npy"))
    npz = np.load(str(tmp_path / "t.npz"))
    np.testing.assert_array_equal(npz["keys"], t.keys)
    np.testing.assert_array_equal(npz["rows"], t.rows)
    np.testing.assert_array_equal(npz["last_steps"], t.last_steps)
    assert int(npz["step"]) == t.step and json.loads(str(npz["config"]))["dim"] == 5
    rec = np.load(str(tmp_path / "t.npy"))
    np.testing.assert_array_equal(rec["key"], t.keys)
    np.testing.assert_array_equal(rec["row"], t.rows)
    np.testing.assert_array_equal(rec["optimizer_state"], t.optimizer_state)
    np.testing.assert_array_equal(rec["count"], t.counts)


def test_parquet_columns(table_path, tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    t = open_table(table_path)
    export_table(t, str(tmp_path / "t.parquet"), batch_rows=1000)
    pt = pq.read_table(str(tmp_path / "t.parquet"))
    assert pt.num_rows == len(t) and pt.schema.names == ["key", "row", "optimizer_state", "count", "last_step"]
    np.testing.assert_array_equal(pt.column("key").to_numpy(), t.keys)
    np.testing.assert_array_equal(np.stack(pt.column("row").to_numpy(zero_copy_only=False)), t.rows)


def test_npy_import_infers_the_config_from_the_fields(tmp_path):
    src = str(tmp_path / "t")
    save_table(trained(cncore.Adam(), dim=3, n=50), src)
    export_table(open_table(src), str(tmp_path / "t.npy"))
    import_table(str(tmp_path / "t.npy"), str(tmp_path / "back"))
    back = open_table(str(tmp_path / "back"))
    assert back.config.optimizer == cncore.Adam() and back.step == 0
    np.testing.assert_array_equal(back.optimizer_state, open_table(src).optimizer_state)


def test_import_refuses_duplicate_keys_and_unknown_formats(tmp_path, capsys):
    np.savez(str(tmp_path / "dup.npz"), keys=np.array([1, 2, 1]), rows=np.zeros((3, 2), np.float32))
    assert main(["import", str(tmp_path / "dup.npz"), str(tmp_path / "x"), "--quiet"]) == 2
    assert "not unique" in capsys.readouterr().err
    assert not (tmp_path / "x" / "CURRENT").exists()
    assert main(["export", str(tmp_path / "nothing"), str(tmp_path / "t.csv")]) == 2
    assert "not a table" in capsys.readouterr().err
    save_table(trained(n=10), str(tmp_path / "t"))
    assert main(["export", str(tmp_path / "t"), str(tmp_path / "t.csv")]) == 2
    assert "unknown format" in capsys.readouterr().err


def test_import_of_plain_numpy_arrays_fills_defaults(tmp_path):
    """An .npz of just keys and rows (made by any NumPy user) becomes a table."""
    keys = np.array(EDGE_KEYS, dtype=np.int64)
    rows = np.arange(len(keys) * 2, dtype=np.float32).reshape(-1, 2)
    np.savez(str(tmp_path / "plain.npz"), keys=keys, rows=rows)
    import_table(str(tmp_path / "plain.npz"), str(tmp_path / "t"))
    t = open_table(str(tmp_path / "t"))
    np.testing.assert_array_equal(t.lookup(keys), rows)
    assert t.config.optimizer is None and not np.asarray(t.counts).any()


@pytest.mark.parametrize("policy", ["left", "right", "newer", "average"])
def test_merge_against_a_dict(tmp_path, policy, capsys):
    rng = np.random.default_rng(1)
    pool = rng.integers(-(2**63), 2**63 - 1, 2000)
    left, right = str(tmp_path / "l"), str(tmp_path / "r")
    save_table(trained(n=0, key_pool=pool[:1200], seed=1, steps=4), left)
    save_table(trained(n=0, key_pool=pool[800:], seed=2, steps=7), right)
    out = str(tmp_path / "m")
    assert main(["merge", left, right, out, "--policy", policy, "--quiet"]) == 0
    assert "in both" in capsys.readouterr().out
    L, R = as_dict(open_table(left)), as_dict(open_table(right))
    expected = {**R, **L}  # left wins unless the policy says otherwise
    for k in L.keys() & R.keys():
        lv, rv = L[k], R[k]
        if policy == "right" or (policy == "newer" and rv[3] > lv[3]):
            expected[k] = rv
        elif policy == "average":
            expected[k] = ((lv[0] + rv[0]) * np.float32(0.5), (lv[1] + rv[1]) * np.float32(0.5),
                           min(lv[2] + rv[2], 2**32 - 1), max(lv[3], rv[3]))
    merged = open_table(out)
    assert merged.step == 7 and merged.config == open_table(left).config
    got = as_dict(merged)
    assert got.keys() == expected.keys()
    for k, (row, state, count, last) in expected.items():
        np.testing.assert_array_equal(got[k][0], row)
        np.testing.assert_array_equal(got[k][1], state)
        assert got[k][2:] == (count, last)
    if policy == "newer":
        both = L.keys() & R.keys()
        assert any(R[k][3] > L[k][3] for k in both) and any(R[k][3] <= L[k][3] for k in both)


def test_merge_refuses_mismatched_tables(tmp_path, capsys):
    save_table(trained(dim=5, n=10), str(tmp_path / "a"))
    save_table(trained(dim=4, n=10), str(tmp_path / "b"))
    save_table(trained(cncore.Adagrad(), dim=5, n=10), str(tmp_path / "c"))
    assert main(["merge", str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "m"), "--policy", "left"]) == 2
    assert "dim 4 differs" in capsys.readouterr().err
    with pytest.raises(ValueError, match="optimizer Adagrad differs"):
        merge(open_table(str(tmp_path / "a")), open_table(str(tmp_path / "c")), str(tmp_path / "m"), "left")
    with pytest.raises(ValueError, match="policy"):
        merge(open_table(str(tmp_path / "a")), open_table(str(tmp_path / "a")), str(tmp_path / "m"), "oldest")
    assert not (tmp_path / "m").exists() or not (tmp_path / "m" / "CURRENT").exists()


def test_diff_against_numpy(tmp_path, capsys):
    store = trained(n=500)
    old = str(tmp_path / "old")
    save_table(store, old)
    keys = store.export().keys
    rng = np.random.default_rng(5)
    removed = keys[:40]
    moved = keys[100:160]
    store.erase(removed)
    delta = rng.standard_normal((len(moved), 5)).astype(np.float32)
    delta[:10] = 1e-7  # below the tolerance used below
    store.assign(moved, store.lookup(moved) + delta)
    added = np.array([11, 12, 13]) * 7919
    store.find_or_insert(added)
    new = str(tmp_path / "new")
    save_table(store, new)
    d = diff(open_table(old), open_table(new), tolerance=1e-5)
    np.testing.assert_array_equal(d["added"], np.sort(added))
    np.testing.assert_array_equal(d["removed"], np.sort(removed))
    before = {int(k): r for k, r in zip(keys, open_table(old).lookup(keys))}
    real = moved[10:]
    order = np.argsort(real)
    np.testing.assert_array_equal(d["changed"], real[order])
    change = store.lookup(real[order]).astype(np.float64) - np.stack([before[int(k)] for k in real[order]])
    np.testing.assert_allclose(d["change_l2"], np.linalg.norm(change, axis=1), rtol=1e-12)
    np.testing.assert_allclose(d["change_max_abs"], np.abs(change).max(axis=1), rtol=1e-12)
    assert main(["diff", old, new, "--json", "--quiet", "--out", str(tmp_path / "d.npz")]) == 0
    assert json.loads(capsys.readouterr().out)["changed"] == len(moved)  # tolerance 0: all 60
    np.testing.assert_array_equal(np.load(str(tmp_path / "d.npz"))["removed"], np.sort(removed))


def test_to_fixed_serves_the_same_rows(table_path, tmp_path):
    out = str(tmp_path / "f.npz")
    assert main(["to-fixed", table_path, out, "--quiet"]) == 0
    fixed = np.load(out)
    t = open_table(table_path)
    ids, weight = fixed["ids"], fixed["weight"]
    np.testing.assert_array_equal(ids, np.sort(np.asarray(t.keys)))
    assert weight.shape == (len(t) + 1, 5) and not weight[-1].any()
    queries = np.concatenate([np.asarray(t.keys)[::7], [12345, -2]])
    pos = np.searchsorted(ids, queries)
    pos = np.where((pos < len(ids)) & (ids[np.minimum(pos, len(ids) - 1)] == queries), pos, len(ids))
    np.testing.assert_array_equal(weight[pos], load_table(table_path).lookup(queries))


def test_tools_refuse_a_damaged_table(table_path, tmp_path, capsys):
    t = open_table(table_path)
    with open(t.rows.filename, "r+b") as fh:
        fh.seek(200)
        byte = fh.read(1)
        fh.seek(200)
        fh.write(bytes([byte[0] ^ 0xFF]))
    assert main(["inspect", table_path]) == 2
    assert "SHA-256" in capsys.readouterr().err


@pytest.mark.parametrize("fmt", [".npz", ".npy", ".parquet"])
def test_import_refuses_a_truncated_export(table_path, tmp_path, fmt, capsys):
    if fmt == ".parquet":
        pytest.importorskip("pyarrow")
    exported = str(tmp_path / f"t{fmt}")
    export_table(open_table(table_path), exported)
    size = os.path.getsize(exported)
    with open(exported, "r+b") as fh:
        fh.truncate(size - 100)
    assert main(["import", exported, str(tmp_path / "back"), "--quiet", "--config-from", table_path]) == 2
    assert capsys.readouterr().err.startswith("cn-table import: error:")
    assert not (tmp_path / "back" / "CURRENT").exists()


def test_tools_may_write_over_their_input(table_path, capsys):
    """The old version stays until the new one commits, so `prune T T` is safe."""
    t = open_table(table_path)
    expected = sorted(np.asarray(t.keys)[prune_mask(t, min_count=3)[0]].tolist())
    assert main(["prune", table_path, table_path, "--min-count", "3", "--quiet"]) == 0
    assert sorted(open_table(table_path).keys.tolist()) == expected
    assert main(["merge", table_path, table_path, table_path, "--policy", "average", "--quiet"]) == 0
    assert sorted(open_table(table_path).keys.tolist()) == expected
    assert sorted(os.listdir(table_path)) == ["CURRENT", "v000003"]


def refused(argv, capsys, message) -> str:
    """cn-table refuses `argv`: exit 2, one line `cn-table CMD: error: ...` matching `message`."""
    assert main(argv + ["--quiet"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"cn-table {argv[0]}: error: "), captured.err
    assert re.search(message, lines[0]), lines[0]
    return lines[0]


def plain_npz(path, **arrays):
    arrays.setdefault("keys", np.array([1, 2]))
    arrays.setdefault("rows", np.zeros((len(arrays["keys"]), 2), np.float32))
    np.savez(path, **arrays)


@pytest.mark.parametrize("arrays,message", [
    (dict(keys=np.array([1.2, 1.7])), "keys: expected integers, got float64"),
    (dict(keys=np.array([1, 2**63], np.uint64)), "keys: values must fit int64"),
    (dict(keys=np.array([True, False])), "keys: expected integers, got bool"),
    (dict(counts=np.array([-1, 3])), r"counts: values must be in \[0, 2\*\*32 - 1\], got -1"),
    (dict(last_steps=np.array([2**40, 0])),
     r"last_steps: values must be in \[0, 2\*\*32 - 1\], got 0 \.\. 1099511627776"),
    (dict(rows=np.array([1.0, 2.0])), r"rows has shape \(2,\); expected 2-D"),
    (dict(keys=np.array([[1, 2]])), r"keys has shape \(1, 2\); expected 1-D"),
    (dict(counts=np.array([1, 2, 3])), r"counts has shape \(3,\)"),
    (dict(rows=np.array([["a", "b"], ["c", "d"]])), "rows: expected real numbers"),
    (dict(config=np.array("{ not json")), "config is not JSON"),
    (dict(config=np.array(json.dumps({"dim": 2, "initializer": {"type": "set_num_threads", "n": 100000}}))),
     "config must have the fields"),
    (dict(step=np.array(1.5)), "step must be one integer"),
])
def test_import_refuses_what_a_cast_would_change_and_writes_nothing(tmp_path, capsys, arrays, message):
    """Float keys 1.2, 1.7 used to become 1, 1; counts -1 4294967295; last steps 2**40 0; 1-D
    rows an IndexError with a traceback."""
    src = str(tmp_path / "src.npz")
    plain_npz(src, **arrays)
    before = tree(tmp_path)
    line = refused(["import", src, str(tmp_path / "t")], capsys, message)
    assert src in line
    assert tree(tmp_path) == before


def test_import_refuses_a_config_type_outside_the_whitelist(tmp_path, capsys, monkeypatch):
    """A config's `type` named any callable of cncore, which import called."""
    calls = []
    monkeypatch.setattr(cncore, "set_num_threads", lambda *a, **k: calls.append((a, k)))
    config = json.loads(json.dumps(config_to_dict(cncore.StoreConfig(dim=2))))
    config["initializer"] = {"type": "set_num_threads", "n": 100000}
    plain_npz(str(tmp_path / "src.npz"), config=np.array(json.dumps(config)))
    refused(["import", str(tmp_path / "src.npz"), str(tmp_path / "t")], capsys,
            r"config\.initializer\.type must be one of \['Constant', 'Normal', 'TruncatedNormal', 'Uniform'\]")
    assert calls == [] and not (tmp_path / "t").exists()


def test_import_into_an_existing_table_refused_mid_write_leaves_it_whole(table_path, tmp_path, capsys):
    before = tree(table_path)
    plain_npz(str(tmp_path / "src.npz"), keys=np.arange(5), rows=np.zeros((5, 5), np.float32),
              counts=np.array([1, 2, 3, 4, -5]))
    refused(["import", str(tmp_path / "src.npz"), table_path], capsys, "counts: values must be")
    assert tree(table_path) == before


def parquet_with(tmp_path, column, values):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    cols = {"key": pa.array([1, 2], pa.int64()),
            "row": pa.FixedSizeListArray.from_arrays(pa.array([0.0, 1.0, 2.0, 3.0], pa.float32()), 2),
            "count": pa.array([0, 0], pa.int64()), "last_step": pa.array([0, 0], pa.int64())}
    cols[column] = values
    path = str(tmp_path / "src.parquet")
    pq.write_table(pa.table(cols), path)
    return path


@pytest.mark.parametrize("column,values,message", [
    ("key", [1, None], r"column 'key' holds 1 nulls"),
    ("key", [1.2, 1.7], "keys: expected integers, got float64"),
    ("count", [-1, 0], r"counts: values must be in \[0, 2\*\*32 - 1\]"),
    ("last_step", [2**40, 0], r"last_steps: values must be in \[0, 2\*\*32 - 1\]"),
    ("count", [None, 0], r"column 'count' holds 1 nulls"),
    ("row", "list-with-null", r"column 'row' holds 1 nulls"),
    ("row", "variable-list", r"column 'row' must be a fixed-size list"),
])
def test_import_of_parquet_refuses_nulls_and_lossy_casts(tmp_path, capsys, column, values, message):
    """A null Parquet key used to become INT64_MIN, exit 0."""
    pa = pytest.importorskip("pyarrow")
    if values == "list-with-null":
        values = pa.FixedSizeListArray.from_arrays(pa.array([0.0, None, 2.0, 3.0], pa.float32()), 2)
    elif values == "variable-list":
        values = pa.array([[0.0, 1.0], [2.0, 3.0]], pa.list_(pa.float32()))
    else:
        values = pa.array(values)
    src = parquet_with(tmp_path, column, values)
    before = tree(tmp_path)
    refused(["import", src, str(tmp_path / "t")], capsys, message)
    assert tree(tmp_path) == before


def test_parquet_hint_names_the_distribution(table_path, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow now raises ImportError
    refused(["export", table_path, str(tmp_path / "t.parquet")], capsys,
            re.escape("Parquet needs pyarrow: pip install 'cn-embedding[parquet]'"))


@pytest.mark.parametrize("command", ["import", "prune", "merge", "to-fixed", "export", "diff"])
def test_no_output_replaces_or_empties_a_directory_holding_other_files(table_path, tmp_path, capsys, command):
    """Saving into "project" used to delete everything in it but CURRENT and the version."""
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "notes.txt").write_text("mine")
    (tmp_path / "dir.npz").mkdir()  # a directory named as an export file
    export_table(open_table(table_path), str(tmp_path / "t.npz"))
    out = str(project)
    argv = {"import": ["import", str(tmp_path / "t.npz"), out], "prune": ["prune", table_path, out, "--min-count", "2"],
            "merge": ["merge", table_path, table_path, out, "--policy", "left"],
            "to-fixed": ["to-fixed", table_path, out],
            "export": ["export", table_path, str(tmp_path / "dir.npz")],
            "diff": ["diff", table_path, table_path, "--out", out]}
    before = tree(tmp_path)
    refused(argv[command], capsys, "not a table directory|is a directory")
    assert tree(tmp_path) == before


def test_nan_rows_are_data(tmp_path, capsys):
    """inspect failed on any NaN row; diff did not report a row that became NaN."""
    t = cncore.EmbeddingStore(dim=2, initializer=cncore.Constant(1.0))
    t.find_or_insert(np.arange(6))
    nan = np.float32("nan")
    t.assign([1, 2, 3], np.array([[nan, 0], [nan, nan], [np.inf, 0]], np.float32))
    old = str(tmp_path / "old")
    save_table(t, old)
    s = inspect(open_table(old))
    assert (s["nan_rows"], s["inf_rows"], sum(s["row_norm"]["counts"])) == (2, 1, 3)
    assert main(["inspect", old, "--quiet"]) == 0
    assert "rows holding NaN: 2, holding an infinity: 1" in capsys.readouterr().out
    # 0 becomes NaN, 1 stops being NaN, 2 stays NaN, 3 stays inf, 4 moves, 5 stays
    t.assign([0, 1, 4], np.array([[nan, 1], [0, 0], [2, 1]], np.float32))
    new = str(tmp_path / "new")
    save_table(t, new)
    d = diff(open_table(old), open_table(new))
    assert d["changed"].tolist() == [0, 1, 4]
    assert np.isnan(d["change_l2"][:2]).all() and d["change_l2"][2] == 1.0
    assert main(["diff", old, new, "--json", "--quiet"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["changed"], summary["changed_to_or_from_nan"], summary["change_l2_max"]) == (3, 2, 1.0)


def test_to_fixed_of_an_empty_table(tmp_path, capsys):
    with TableWriter(str(tmp_path / "e"), cncore.StoreConfig(dim=3), 0):
        pass
    assert main(["to-fixed", str(tmp_path / "e"), str(tmp_path / "f.npz"), "--quiet"]) == 0
    fixed = np.load(str(tmp_path / "f.npz"))
    assert fixed["ids"].shape == (0,) and fixed["weight"].tolist() == [[0.0, 0.0, 0.0]]

"""cn-table inspect and prune, checked against NumPy computations on the same arrays."""
import json

import numpy as np
import pytest

import cncore
from cncore_numpy import load_table, open_table, save_table
from cncore_numpy.cli import inspect, main, prune_mask


@pytest.fixture
def table_path(tmp_path):
    rng = np.random.default_rng(3)
    store = cncore.EmbeddingStore(dim=5, optimizer=cncore.RowWiseAdagrad(), initializer=cncore.Normal(0, 1))
    keys = rng.integers(-(2**63), 2**63 - 1, 3000)
    for step in range(6):
        batch = keys[rng.zipf(1.3, 4000) % len(keys)]
        _, ctx = store.pooled_lookup(batch, lengths=np.ones(len(batch), dtype=np.int64))
        store.apply_gradients(ctx, np.zeros((len(batch), 5), np.float32))
    path = str(tmp_path / "t")
    save_table(store, path)
    return path


def test_inspect_matches_numpy(table_path, capsys):
    t = open_table(table_path)
    s = inspect(t, quiet=True)
    assert s["rows"] == len(t) and s["dim"] == 5 and s["step"] == 6
    assert s["key_min"] == int(np.min(t.keys)) and s["key_max"] == int(np.max(t.keys))
    norms = np.linalg.norm(np.asarray(t.rows, dtype=np.float64), axis=1)
    assert s["row_norm"]["counts"] == np.histogram(norms, bins=10)[0].tolist()
    assert sum(s["access_count"]["counts"]) == len(t)
    assert s["access_count"]["counts"][0] == int((np.asarray(t.counts) == 0).sum())
    assert main(["inspect", table_path, "--json", "--quiet"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == len(t)


@pytest.mark.parametrize("criteria", [dict(min_count=3), dict(min_step=5), dict(min_norm=2.0), dict(top_k=100),
                                      dict(min_count=2, top_k=50)])
def test_prune_keeps_exactly_what_numpy_says(table_path, tmp_path, criteria):
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
    np.testing.assert_array_equal(prune_mask(t, quiet=True, **criteria), expected)
    out = str(tmp_path / "pruned")
    args = ["prune", table_path, out, "--quiet"] + sum(([f"--{k.replace('_', '-')}", str(v)]
                                                        for k, v in criteria.items()), [])
    assert main(args) == 0
    pruned = load_table(out)
    assert sorted(pruned.export().keys.tolist()) == sorted(keys[expected].tolist())
    kept = pruned.read(keys[expected])
    np.testing.assert_array_equal(kept.rows, np.asarray(t.rows)[expected])
    np.testing.assert_array_equal(kept.counts, counts[expected])


def test_prune_needs_a_criterion(table_path, tmp_path):
    with pytest.raises(SystemExit):
        main(["prune", table_path, str(tmp_path / "x")])

"""The JAX DLRM example (examples/jax_dlrm.py): its NumPy stream is cn-dlrm's stream, its AUC is
torchmetrics', it runs end to end in one command with tiny settings, and the boundary benchmark
(asv_bench/scripts/jax_boundary.py) measures, the boundary and the whole train step (the usual Flax
NNX step against the explicit one)."""
import glob
import math
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("optax")

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "jax_dlrm.py"
sys.path[:0] = [str(ROOT / "examples"), str(ROOT / "asv_bench" / "scripts")]  # the example and the bench script
import jax_dlrm as dlrm  # noqa: E402
from jax_criteo import SyntheticCriteo  # noqa: E402

import jax_boundary as bench  # noqa: E402


def test_the_numpy_stream_is_cn_dlrms_stream():
    pytest.importorskip("torchrec")
    from cn_dlrm.data import SyntheticCriteo as TorchCriteo
    ours, theirs = SyntheticCriteo(seed=3, batch_size=64), TorchCriteo(seed=3, batch_size=64)
    assert ours.cardinalities == theirs.cardinalities
    assert ours.items_by_batch(50) == theirs.items_by_batch(50)
    for index in (0, 7, 500):
        a, b = ours.batch(index), theirs.batch(index)
        np.testing.assert_array_equal(a.dense, b.dense.numpy())
        np.testing.assert_array_equal(a.labels, b.labels.numpy())
        np.testing.assert_array_equal(a.probabilities, b.probabilities.numpy())
        np.testing.assert_array_equal(a.lengths.reshape(-1), b.sparse.lengths().numpy())
        used = [ids[:n] for ids, n in zip(a.ids, a.lengths.sum(1))]
        np.testing.assert_array_equal(np.concatenate(used), b.sparse.values().numpy())
        assert all((ids[n:] == 0).all() for ids, n in zip(a.ids, a.lengths.sum(1)))


def test_auc_counts_pairs_with_ties_as_half_and_equals_torchmetrics():
    torchmetrics = pytest.importorskip("torchmetrics")
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    labels = (rng.random(500) < 0.3).astype(np.float32)
    scores = np.round(rng.random(500) + labels * 0.3, 2).astype(np.float32)  # rounded: many ties
    metric = torchmetrics.classification.BinaryAUROC()
    metric.update(torch.from_numpy(scores), torch.from_numpy(labels).long())
    pos, neg = scores[labels == 1][:, None], scores[labels == 0][None, :]
    pairs = ((pos > neg) + 0.5 * (pos == neg)).mean()  # the definition, every pair
    assert math.isclose(dlrm.auc(scores, labels), pairs, abs_tol=1e-12)
    # torchmetrics integrates its ROC curve in float32: equal to that precision
    assert math.isclose(dlrm.auc(scores, labels), float(metric.compute()), abs_tol=1e-4)


@pytest.mark.slow
def test_the_example_runs_in_one_command_and_ends_with_its_auc(tmp_path):
    done = subprocess.run([sys.executable, str(EXAMPLE), "--steps", "3", "--batch-size", "128",
                           "--eval-batches", "1", "--no-progress", "--save", str(tmp_path / "tables")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("AUC 0.") and 0.0 < float(last.split()[1]) < 1.0, done.stdout
    assert len(list((tmp_path / "tables").iterdir())) == 26


def test_bad_options_exit_2_with_one_line():
    done = subprocess.run([sys.executable, str(EXAMPLE), "--steps", "0"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "--steps must be at least 1, got 0" in done.stderr


def test_the_benchmark_measures_every_column():
    build_folders = set(glob.glob(os.path.join(tempfile.gettempdir(), "cncore_jax_ffi_*")))
    rows = bench.measure(n_bags=32, poolings=(1, 20), dim=8, vocab=1000, repeats=2, number=2)
    # the FFI no-op's build folder is removed once its library is loaded
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "cncore_jax_ffi_*"))) <= build_folders
    for row in rows:
        for key, value in row.items():
            if key.startswith("ffi_") and shutil.which("g++") is None:
                continue  # the FFI floor needs a C++ compiler
            assert value > 0, (key, value)
    text = bench.table(rows, 32, 8)
    assert text.count("\n| 1 | 32 |") == 3 and text.count("\n| 20 | 640 |") == 3  # eval, train, no-op


@pytest.mark.slow
def test_the_step_benchmark_times_the_usual_nnx_step_and_the_explicit_one():
    pytest.importorskip("flax.nnx")
    r = bench.measure_steps(n_bags=16, n_tables=2, pooling=2, dim=4, vocab=100, repeats=1, number=2)
    assert sorted(r) == ["explicit_ms", "jax_jit_split_ms", "nnx_jit_ms"]
    assert all(v > 0 for v in r.values()), r
    text = bench.steps_table(r, 16, 2, 2, 4)
    assert text.count("\n| ") == 4 and "usual NNX" in text and "| 1.00x |" in text


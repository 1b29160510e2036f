"""The main job (cn-dlrm): it learns, reads Criteo's text format, and resumes exactly."""
import json
import math

import numpy as np
import pytest
import torch

pytest.importorskip("torchrec")
from cncore_torch.dlrm.data import SPARSE_KEYS, SyntheticCriteo, read_criteo_tsv  # noqa: E402
from cncore_torch.dlrm.train import main  # noqa: E402

SMALL = ["--batch-size", "256", "--embedding-dim", "8", "--no-progress", "--threads", "2"]


def run(tmp_path, *extra):
    out = tmp_path / "summary.json"
    assert main([*SMALL, "--summary-json", str(out), *extra]) == 0
    return json.loads(out.read_text())


def test_learns_and_beats_a_trivial_predictor(tmp_path):
    summary = run(tmp_path, "--steps", "120", "--eval-every", "40", "--eval-batches", "6")
    ours = summary["runs"][0]
    history = ours["history"]
    assert [h["step"] for h in history] == [40, 80, 120]
    assert history[-1]["logloss"] < history[0]["logloss"]
    # a trivial predictor (the base rate) has AUC 0.5 and log loss = the labels' entropy
    gen = SyntheticCriteo(seed=0, batch_size=256)
    labels = torch.cat([gen.batch(120 + k).labels for k in range(6)])
    p = labels.mean().item()
    trivial = -(p * math.log(p) + (1 - p) * math.log(1 - p))
    assert ours["auc"] > 0.6
    assert ours["logloss"] < trivial
    assert 0.6 < summary["best_attainable_auc"] < 1.0
    assert ours["rows"] > 1000  # the tables grew with the stream


def test_resume_continues_exactly(tmp_path):
    straight = run(tmp_path, "--steps", "40", "--eval-every", "20", "--eval-batches", "2")
    ck = tmp_path / "ck.pt"
    run(tmp_path, "--steps", "20", "--eval-every", "20", "--eval-batches", "2", "--checkpoint", str(ck))
    # the second half of the run, from the checkpoint (the eval set is the same: batches 40, 41)
    resumed = run(tmp_path, "--steps", "40", "--eval-every", "20", "--eval-batches", "2", "--resume", str(ck))
    a, b = straight["runs"][0], resumed["runs"][0]
    assert b["history"][-1]["step"] == 40
    assert b["auc"] == pytest.approx(a["auc"], abs=1e-6)
    assert b["logloss"] == pytest.approx(a["logloss"], rel=1e-5)
    assert b["rows"] == a["rows"]
    # the checkpoint's tables open as table files, for cn-table
    from cncore_numpy import open_table
    from cncore_torch.checkpoint import main as convert
    assert convert(["to-tables", str(ck), str(tmp_path / "tables"), "--entry", "model"]) == 0
    names = sorted(p.name for p in (tmp_path / "tables").iterdir())
    assert len(names) == 26 and all(".tables." in n for n in names)
    assert sum(len(open_table(str(tmp_path / "tables" / n))) for n in names) > 1000


CRITEO_LINES = [
    "1\t5\t\t3\t0\t1382\t4\t15\t2\t181\t1\t2\t\t2\t68fd1e64\t80e26c9b\tfb936136\t7b4723c4\t25c83c98\t7e0ccccf\t"
    "de7995b8\t1f89b562\ta73ee510\ta8cd5504\tb2cb9c98\t37c9c164\t2824a5f6\t1adce6ef\t8ba8b39a\t891b62e7\te5ba7672\t"
    "f54016b9\t21ddcdc9\tb1252a9d\t07b5194c\t\t3a171ecb\tc5c50484\te8b83407\t9727dd16",
    "0\t\t\t\t\t\t\t\t\t\t\t\t\t\t" + "\t".join(["0000000f"] * 26),
]


def test_reads_the_criteo_text_format(tmp_path):
    path = tmp_path / "day.tsv"
    path.write_text("\n".join(CRITEO_LINES * 3) + "\n")
    batches = list(read_criteo_tsv(str(path), batch_size=4))
    assert [len(b.labels) for b in batches] == [4, 2]
    first = batches[0]
    assert first.labels.tolist() == [1.0, 0.0, 1.0, 0.0]
    np.testing.assert_allclose(first.dense[0, :3].numpy(), np.log1p([5.0, 0.0, 3.0]), rtol=1e-6)
    assert not first.dense[1].any()
    by_key = first.sparse.to_dict()
    assert by_key["cat_0"].values().tolist() == [0x68FD1E64, 0xF, 0x68FD1E64, 0xF]
    assert by_key["cat_21"].lengths().tolist() == [0, 1, 0, 1]  # the empty category is an empty bag
    assert first.sparse.keys() == SPARSE_KEYS


def test_trains_on_a_criteo_file(tmp_path):
    rng = np.random.default_rng(0)
    lines = []
    for _ in range(600):
        cats = [f"{rng.integers(0, 50):08x}" if rng.random() > 0.1 else "" for _ in range(26)]
        ints = [str(rng.integers(0, 100)) if rng.random() > 0.2 else "" for _ in range(13)]
        label = str(int(cats[0] != "" and int(cats[0], 16) < 20))
        lines.append("\t".join([label, *ints, *cats]))
    path = tmp_path / "train.tsv"
    path.write_text("\n".join(lines) + "\n")
    summary = run(tmp_path, "--criteo-tsv", str(path), "--steps", "4", "--batch-size", "100", "--eval-batches", "1",
                  "--eval-every", "2")
    assert summary["runs"][0]["steps"] == 4 and summary["best_attainable_auc"] is None


def test_compare_runs_torchrec_side_by_side(tmp_path):
    summary = run(tmp_path, "--steps", "20", "--eval-every", "20", "--eval-batches", "2", "--compare")
    names = [r["name"] for r in summary["runs"]]
    assert names == ["cncore (dynamic tables)", "TorchRec EBC (collision-free, remapped)",
                     "TorchRec DMP (fused FBGEMM, collision-free)", "TorchRec EBC (hashed, same memory)"]
    for r in summary["runs"]:
        assert 0.5 < r["auc"] < 1.0 and r["samples_per_s"] > 0

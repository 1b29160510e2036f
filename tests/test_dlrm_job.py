"""The main job (cn-dlrm): it learns, reads Criteo's text format, resumes exactly, and answers
bad options and files with one line and exit code 2."""
import json
import math
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("torchrec")
from cn_dlrm.cli import main
from cn_dlrm.data import SPARSE_KEYS, SyntheticCriteo, read_criteo_tsv
from cn_dlrm.train import Progress

SMALL = ["--batch-size", "256", "--embedding-dim", "8", "--no-progress", "--threads", "2"]


def run(tmp_path, *extra):
    out = tmp_path / "summary.json"
    assert main([*SMALL, "--summary-json", str(out), *extra]) == 0
    return json.loads(out.read_text())


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_criteo_files_with_nproc_2_train_as_one_process(tmp_path):
    """--criteo-tsv with --nproc 2: every process reads the file and takes its share of each batch
    (as with the synthetic stream), so the run is the one-process run up to fp32 reassociation."""
    tsv = criteo_file(tmp_path / "day.tsv", 700)
    argv = ["--criteo-tsv", tsv, "--steps", "5", "--batch-size", "100", "--eval-batches", "2", "--eval-every", "5"]
    one = run(tmp_path, *argv)["runs"][0]
    two = run(tmp_path, *argv, "--nproc", "2")["runs"][0]
    assert two["name"] == "cncore (dynamic tables, 2 processes)" and two["steps"] == 5
    assert two["rows"] == one["rows"]
    assert two["logloss"] == pytest.approx(one["logloss"], abs=1e-4)
    assert two["auc"] == pytest.approx(one["auc"], abs=1e-3)


@pytest.mark.slow
def test_compare_runs_torchrec_side_by_side(tmp_path):
    summary = run(tmp_path, "--steps", "20", "--eval-every", "20", "--eval-batches", "2", "--compare")
    names = [r["name"] for r in summary["runs"]]
    assert names == ["cncore (dynamic tables)", "TorchRec EBC (collision-free, remapped)",
                     "TorchRec DMP (fused FBGEMM, collision-free)", "TorchRec EBC (hashed, same memory)"]
    for r in summary["runs"]:
        assert 0.5 < r["auc"] < 1.0 and r["samples_per_s"] > 0


def criteo_file(path, n_lines, seed=0, bad=None):
    """n_lines random Criteo lines (a learnable label); bad = {line number (1-based): text}."""
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(n_lines):
        cats = [f"{rng.integers(0, 50):08x}" if rng.random() > 0.1 else "" for _ in range(26)]
        ints = [str(rng.integers(0, 100)) if rng.random() > 0.2 else "" for _ in range(13)]
        lines.append("\t".join([str(int(cats[0] != "" and int(cats[0], 16) < 20)), *ints, *cats]))
    for number, text in (bad or {}).items():
        lines[number - 1] = text
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def test_reads_wide_hex_and_negative_integers(tmp_path):
    line = "0\t-3" + "\t" * 13 + "\t".join(["ffffffffffffffff", "8000000000000000"] + ["1"] * 24)
    path = tmp_path / "day.tsv"
    path.write_text(line + "\n")
    batch = next(read_criteo_tsv(str(path), batch_size=1))
    assert batch.dense[0, 0].item() == 0.0  # a negative count reads as 0 (documented)
    by_key = batch.sparse.to_dict()
    assert by_key["cat_0"].values().tolist() == [-1]  # 2^64 - 1: 64-bit IDs wrap to int64
    assert by_key["cat_1"].values().tolist() == [-(2**63)]


def exit_line(capsys, *argv):
    """Run cn-dlrm in-process; assert exit code 2 and one line on stderr, no traceback; return it."""
    try:
        code = main([*argv])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err.strip()


@pytest.mark.parametrize("argv, expected", [
    (["--batch-size", "-5"], "argument --batch-size: must be at least 1, got -5"),
    (["--batch-size", "0"], "argument --batch-size: must be at least 1, got 0"),
    (["--eval-every", "0"], "argument --eval-every: must be at least 1, got 0"),
    (["--threads", "-1"], "argument --threads: must be at least 1, got -1"),
    (["--steps", "ten"], "argument --steps: expected a whole number, got 'ten'"),
    (["--sparse-lr", "-0.1"], "argument --sparse-lr: must be a positive number, got -0.1"),
    (["--criteo-tsv", "missing.tsv"], "argument --criteo-tsv: no such file: missing.tsv"),
    (["--resume", "missing.pt"], "argument --resume: no such file: missing.pt"),
    (["--checkpoint", "no/such/dir/ck.pt"], "argument --checkpoint: cannot write no/such/dir/ck.pt"),
])
def test_bad_options_exit_2_with_one_line(capsys, tmp_path, monkeypatch, argv, expected):
    monkeypatch.chdir(tmp_path)
    if "--criteo-tsv" not in argv:  # with a good file: bad values used to pass (--batch-size -5 trained nothing)
        argv = [*argv, "--criteo-tsv", criteo_file(tmp_path / "ok.tsv", 10)]
    assert exit_line(capsys, *argv).startswith(f"cn-dlrm: error: {expected}")


BAD_LINES = [  # (line number, text, what the message says); batch 100, line 1-100 held out
    (3, "1\t2\t3", "line 3: 3 tab-separated fields, a Criteo line has 40 (label, 13 integers, 26 hex categories)"),
    (150, "\t".join(["1", "x7", *[""] * 12, *["a"] * 26]),
     "line 150: integer feature 1 is 'x7', not a whole number as Criteo writes them (ASCII digits 0-9, '-' before a "
     "negative one, or nothing)"),
    (150, "\t".join(["0", *[""] * 13, "zz", *["a"] * 25]),
     "line 150: category 1 is 'zz', not a hex ID as Criteo writes them (lower-case hex digits 0-9 a-f, 8 in Criteo's "
     "files, at most 16, or nothing)"),
    (150, "\t".join(["0", *[""] * 13, "1" + "0" * 16, *["a"] * 25]),
     "line 150: category 1 is '10000000000000000', more than 16 hex digits (IDs are 64-bit)"),
    (250, "\t".join(["2", *[""] * 13, *["a"] * 26]), "line 250: the label is '2', it must be 0 or 1"),
    (250, "\t".join(["", *[""] * 13, *["a"] * 26]), "line 250: the label is '', it must be 0 or 1"),
]


@pytest.mark.parametrize("number, text, expected", BAD_LINES)
def test_a_bad_criteo_line_exits_2_naming_file_and_line(capsys, tmp_path, number, text, expected):
    # lines past 100 are read while training (lazily): the error still ends the run with one line
    tsv = criteo_file(tmp_path / "day.tsv", 300, bad={number: text})
    line = exit_line(capsys, *SMALL, "--criteo-tsv", tsv, "--batch-size", "100", "--eval-batches", "1",
                     "--steps", "3")
    assert line == f"cn-dlrm: error: {tsv}, {expected}"


def test_an_empty_or_held_out_only_file_exits_2(capsys, tmp_path):
    empty = tmp_path / "empty.tsv"
    empty.write_text("")
    assert exit_line(capsys, *SMALL, "--criteo-tsv", str(empty)) == f"cn-dlrm: error: {empty}: the file is empty"
    tsv = criteo_file(tmp_path / "day.tsv", 200)
    line = exit_line(capsys, *SMALL, "--criteo-tsv", tsv, "--batch-size", "100", "--eval-batches", "2")
    assert line == (f"cn-dlrm: error: {tsv}: its 200 lines are all held out for evaluation (the first --eval-batches 2 "
                    f"x --batch-size 100 = 200 lines are); nothing is left to train on: lower --eval-batches or "
                    f"--batch-size")


def test_a_corrupt_gz_file_exits_2(capsys, tmp_path):
    gz = tmp_path / "day.tsv.gz"
    gz.write_bytes(b"not gzip at all")
    assert exit_line(capsys, *SMALL, "--criteo-tsv", str(gz)).startswith(f"cn-dlrm: error: {gz}: cannot read it")


def test_resume_at_or_past_steps_is_refused(capsys, tmp_path):
    ck = tmp_path / "ck.pt"
    run(tmp_path, "--steps", "4", "--eval-every", "4", "--eval-batches", "1", "--checkpoint", str(ck))
    capsys.readouterr()
    for steps in ("4", "2"):
        line = exit_line(capsys, *SMALL, "--steps", steps, "--eval-batches", "1", "--resume", str(ck))
        assert line == (f"cn-dlrm: error: --resume {ck} is at step 4, and --steps {steps} would train nothing "
                        f"(--steps counts from the start of the run): pass --steps above 4")
    line = exit_line(capsys, *SMALL, "--steps", "8", "--embedding-dim", "4", "--resume", str(ck))
    assert line == f"cn-dlrm: error: --resume {ck} was saved with --embedding-dim 8, this run has 4"
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"junk")
    assert exit_line(capsys, *SMALL, "--resume", str(junk)).startswith(
        f"cn-dlrm: error: --resume {junk}: not a checkpoint of cn-dlrm (")


def test_a_file_shorter_than_the_run_trains_what_it_holds_and_checkpoints(capsys, tmp_path):
    # 100 held-out lines + 250 training lines = 3 batches of 100 (the last one 50), then the file ends
    tsv = criteo_file(tmp_path / "day.tsv", 350)
    ck = tmp_path / "ck.pt"
    summary = run(tmp_path, "--criteo-tsv", tsv, "--batch-size", "100", "--eval-batches", "1", "--steps", "50",
                  "--eval-every", "20", "--checkpoint", str(ck))
    out = capsys.readouterr().out
    assert f"[cncore (dynamic tables)] {tsv} ended: trained 3 steps (to step 3) of --steps 50" in out
    ours = summary["runs"][0]
    assert ours["steps"] == 3 and [h["step"] for h in ours["history"]] == [3]  # evaluated at the end
    assert torch.load(ck, weights_only=False)["step"] == 3  # and checkpointed there, before any --eval-every
    # resuming past the file's end says so
    line = exit_line(capsys, *SMALL, "--criteo-tsv", tsv, "--batch-size", "100", "--eval-batches", "1",
                     "--steps", "50", "--resume", str(ck))
    assert line == f"cn-dlrm: error: {tsv}: no training lines left after step 3 (the checkpoint's); nothing to train"


def test_small_criteo_run_allocates_little_and_reports_used_and_allocated(tmp_path):
    tsv = criteo_file(tmp_path / "day.tsv", 1500)
    ours = run(tmp_path, "--criteo-tsv", tsv, "--batch-size", "100", "--eval-batches", "1")["runs"][0]
    assert 0 < ours["rows"] < 1500  # 26 features, 50 values each
    # 1,300 rows of 8 floats + metadata, and index buckets: well under 1 MiB in use
    assert 0 < ours["table_mib"] < 1.0 <= ours["table_mib_allocated"] * 4
    # capacity hints of 512 rows per table, grown as needed (it was 65,536 per table: 182 MiB)
    assert ours["table_mib"] <= ours["table_mib_allocated"] < 4.0


def test_progress_is_a_bar_on_a_terminal_and_plain_lines_elsewhere(capsys):
    class Terminal:
        def __init__(self):
            self.text = []

        def isatty(self):
            return True

        def write(self, s):
            self.text.append(s)

        def flush(self):
            pass

    terminal = Terminal()
    bar = Progress("job", total=4, start=0, stream=terminal)
    for step in range(1, 5):
        bar.update(step, 0.5, 1000.0)
    bar.close()
    assert bar.bar is not None and "\r" in "".join(terminal.text)
    log = Progress("job", total=20, start=0)  # capsys: stderr is not a terminal
    for step in range(1, 21):
        log.update(step, 0.5, 1234.5)
    err = capsys.readouterr().err
    assert log.bar is None
    assert err.splitlines() == [f"[job] step {s}/20: loss 0.5000, 1,234 samples/s" for s in range(2, 21, 2)]


@pytest.mark.slow
def test_a_short_run_logs_plain_lines_and_no_warnings(tmp_path):
    """As in CI: stderr is a pipe. No progress-bar debris, and none of torch's or TorchRec's
    warnings (not the user's to act on), with --compare's planner and DDP too."""
    proc = subprocess.run([sys.executable, "-m", "cn_dlrm", "--steps", "2", "--batch-size", "64",
                           "--eval-batches", "1", "--threads", "2", "--compare"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Warning" not in proc.stderr and "WARNING" not in proc.stderr, proc.stderr
    assert "batch/s" not in proc.stderr and "\r" not in proc.stderr
    assert re.findall(r"^\[(.*)\] step 2/2: loss \d\.\d{4}, [\d,]+ samples/s$", proc.stderr, re.M) == [
        "cncore (dynamic tables)", "TorchRec EBC (collision-free, remapped)",
        "TorchRec DMP (fused FBGEMM, collision-free)", "TorchRec EBC (hashed, same memory)"]
    assert "| cncore (dynamic tables) |" in proc.stdout


@pytest.mark.slow
def test_nproc_2_matches_one_process(tmp_path):
    """--nproc 2: two gloo processes, tables sharded row-wise over them; the global batch is split
    and the gradients summed, so it is the one-process run up to fp32 reassociation."""
    args = ["--steps", "40", "--eval-every", "20", "--eval-batches", "3"]
    one = run(tmp_path, *args)["runs"][0]
    two = run(tmp_path, *args, "--nproc", "2")["runs"][0]
    assert two["name"] == "cncore (dynamic tables, 2 processes)"
    assert [h["step"] for h in two["history"]] == [20, 40]
    assert abs(two["auc"] - one["auc"]) < 0.003
    assert two["logloss"] == pytest.approx(one["logloss"], abs=2e-3)
    assert two["rows"] == one["rows"]  # every key lives on exactly one rank


@pytest.mark.parametrize("option,expected", [
    (["--compare", "--batch-size", "255"], "--compare with --nproc 2 needs --batch-size a multiple of 2")])
def test_nproc_refuses_what_it_does_not_run_yet(capsys, tmp_path, monkeypatch, option, expected):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "day.tsv").write_text("")
    with pytest.raises(SystemExit) as e:
        main(["--nproc", "2", *option])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0]


@pytest.mark.slow
def test_nproc_compare_runs_torchrecs_row_wise_tables_beside_ours(tmp_path):
    summary = run(tmp_path, "--steps", "10", "--eval-every", "10", "--eval-batches", "1", "--nproc", "2",
                  "--compare")
    names = [r["name"] for r in summary["runs"]]
    assert names == ["cncore (dynamic tables, 2 processes)",
                     "TorchRec DMP (row-wise fused FBGEMM, collision-free, 2 processes)"]
    assert all(r["samples_per_s"] > 0 and 0.5 < r["auc"] < 1.0 for r in summary["runs"])


@pytest.mark.slow
def test_torchrun_runs_the_distributed_job(tmp_path):
    """`torchrun --nproc-per-node 2 -m cn_dlrm`: each process one rank, as --nproc 2."""
    from cncore_torch.distributed.launch import free_port
    args = ["--steps", "20", "--eval-every", "20", "--eval-batches", "2"]
    one = run(tmp_path, *args)["runs"][0]
    out = tmp_path / "torchrun.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend",
                           "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "-m", "cn_dlrm", *SMALL,
                           *args, "--summary-json", str(out)], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    two = json.loads(out.read_text())["runs"][0]
    assert two["name"] == "cncore (dynamic tables, 2 processes)"
    assert abs(two["auc"] - one["auc"]) < 0.003 and two["rows"] == one["rows"]
    assert proc.stdout.count("| cncore (dynamic tables, 2 processes) |") == 1  # rank 0 prints, rank 1 does not


@pytest.mark.slow
def test_checkpoints_move_between_process_counts(tmp_path):
    """A checkpoint is one file whatever the number of processes (rank 0 merges the shards):
    2 processes save at step 20; one process, and 2 processes, resume from it to step 40 and
    end where one process training straight to step 40 ends."""
    args = ["--eval-every", "20", "--eval-batches", "2"]
    straight = run(tmp_path, "--steps", "40", *args)["runs"][0]
    ck = tmp_path / "ck.pt"
    run(tmp_path, "--steps", "20", *args, "--nproc", "2", "--checkpoint", str(ck))
    for extra in ([], ["--nproc", "2"]):
        resumed = run(tmp_path, "--steps", "40", *args, "--resume", str(ck), *extra)["runs"][0]
        assert resumed["history"][-1]["step"] == 40
        assert resumed["auc"] == pytest.approx(straight["auc"], abs=1e-3)
        assert resumed["logloss"] == pytest.approx(straight["logloss"], abs=1e-3)
        assert resumed["rows"] == straight["rows"]


@pytest.mark.slow
def test_prefill_gives_every_table_each_reachable_item_in_memory_and_on_the_tier(tmp_path):
    """--data-scale sizes the synthetic tables, --prefill gives them a row for every item the run
    can reach before training; the tier run (rows on disk under a small cache) ends with the same
    rows, AUC and log loss as the in-memory one."""
    args = ["--steps", "6", "--eval-every", "6", "--eval-batches", "2", "--data-scale", "0.002", "--prefill"]
    memory = run(tmp_path, *args)["runs"][0]
    gen = SyntheticCriteo(seed=0, batch_size=256, scale=0.002)
    assert memory["rows"] == sum(gen.items_by_batch(6 + 2))
    tier = run(tmp_path, *args, "--ssd-path", str(tmp_path / "tier"), "--cache-mb", "1")["runs"][0]
    assert tier["rows"] == memory["rows"]
    assert tier["auc"] == memory["auc"] and tier["logloss"] == memory["logloss"]
    # the report's tier totals: the caches hold a part of the rows, so lookups read some from disk
    # (no more rows than IDs missed), and prefill's rows went to disk as the caches filled
    assert 0 < tier["tier_cache_rows"] < tier["rows"]
    assert 0 < tier["tier_rows_read"] <= tier["tier_misses"] and tier["tier_hits"] > 0
    assert tier["tier_rows_written"] >= tier["rows"] - tier["tier_cache_rows"]
    assert "tier_cache_rows" not in memory


@pytest.mark.slow
def test_zipf_alpha_sets_the_streams_skew(tmp_path):
    """--zipf-alpha is the exponent of the synthetic stream's item ranks: the run's tables end
    with exactly the distinct IDs of SyntheticCriteo(zipf_alpha=...)'s training batches, more at
    1.05 (a longer tail) than at the default 1.2."""
    def distinct_ids(alpha, steps):
        gen = SyntheticCriteo(seed=0, batch_size=256, zipf_alpha=alpha)
        return len(np.unique(np.concatenate([gen.batch(i).sparse.values().numpy() for i in range(steps)])))

    args = ["--steps", "4", "--eval-every", "4", "--eval-batches", "1"]
    flat = run(tmp_path, *args, "--zipf-alpha", "1.05")["runs"][0]
    default = run(tmp_path, *args)["runs"][0]
    assert flat["rows"] == distinct_ids(1.05, 4)
    assert default["rows"] == distinct_ids(1.2, 4) < flat["rows"]


@pytest.mark.parametrize("argv, expected", [
    (["--zipf-alpha", "1"], "argument --zipf-alpha: must be a number above 1 (a Zipf exponent), got 1"),
    (["--zipf-alpha", "inf"], "argument --zipf-alpha: must be a number above 1 (a Zipf exponent), got inf"),
    (["--zipf-alpha", "steep"], "argument --zipf-alpha: expected a number above 1, got 'steep'"),
    (["--prefill", "--max-rows", "50%"], "--prefill gives every table a row for each item, which --max-rows"),
    (["--prefill", "--nproc", "2"], "--prefill does not run on 2 processes yet"),
    (["--data-scale", "0"], "argument --data-scale: must be a positive number, got 0"),
])
def test_prefill_and_data_scale_refuse_what_they_cannot_do(capsys, tmp_path, monkeypatch, argv, expected):
    monkeypatch.chdir(tmp_path)
    assert expected in exit_line(capsys, *argv)


def test_data_scale_and_prefill_refuse_a_criteo_file(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "day.tsv").write_text("0" + "\t1" * 13 + "\tab" * 26 + "\n")
    assert "--prefill shapes the synthetic stream, not --criteo-tsv day.tsv" in exit_line(
        capsys, "--criteo-tsv", "day.tsv", "--prefill")
    assert "--zipf-alpha shapes the synthetic stream, not --criteo-tsv day.tsv" in exit_line(
        capsys, "--criteo-tsv", "day.tsv", "--zipf-alpha", "1.1")


def test_the_command_loads_cncore_torch_before_torch_loads_its_openmp(monkeypatch):
    """cncore_torch bounds the spin of torch's idle OpenMP threads only if it is imported before
    torch loads libgomp (cncore_torch._openmp_env); job.py imports torch first, so the command
    imports cncore_torch before it imports the job."""
    import builtins

    from cn_dlrm import job
    monkeypatch.setattr(job, "run", lambda args: 0)
    order, real_import = [], builtins.__import__

    def recording(name, globals=None, locals=None, fromlist=(), level=0):
        order.append(name + "." + ".".join(fromlist or ()))
        return real_import(name, globals, locals, fromlist, level)

    monkeypatch.setattr(builtins, "__import__", recording)
    assert main(["--steps", "1"]) == 0
    assert order.index("cncore_torch.") < order.index("cn_dlrm.job")

"""cn-dlrm --nproc 2 with bounded tables: TTL expiry runs on every shard after every step (the
same rows expire as on one process: expiry depends on a key's last step only), incremental
checkpoints are one chain per rank and table (tables/<table>/shard-R-of-2) that one process or
two resume from, and a --criteo-tsv rank parses only its share of each batch's lines."""
import json
import os

import numpy as np
import pytest
import torch

pytest.importorskip("torchrec")
from cn_dlrm import train as job
from cn_dlrm.chains import open_checkpoint
from cn_dlrm.cli import main
from cn_dlrm.data import read_criteo_tsv
from cn_dlrm.options import parse_args
from cncore.routing import shard_name
from cncore.tablefile import chain_length, load_store

SMALL = ["--batch-size", "256", "--embedding-dim", "4", "--no-progress", "--threads", "1", "--eval-batches", "1"]


def run_job(tmp_path, *argv):
    out = tmp_path / "summary.json"
    assert main([*SMALL, "--summary-json", str(out), *argv]) == 0
    return json.loads(out.read_text())["runs"][0]


@pytest.mark.slow
def test_ttl_expires_the_same_rows_on_two_processes_as_on_one(tmp_path):
    argv = ["--steps", "8", "--eval-every", "8", "--evict", "ttl", "--ttl-steps", "2"]
    one = run_job(tmp_path, *argv)
    two = run_job(tmp_path, *argv, "--nproc", "2")
    assert two["name"] == "cncore (dynamic tables, 2 processes)"
    assert two["evicted"] > 0
    assert two["rows_per_table"] == one["rows_per_table"]
    assert two["evicted_per_table"] == one["evicted_per_table"]


@pytest.mark.slow
def test_incremental_checkpoints_on_two_processes_are_per_rank_chains_that_resume_anywhere(tmp_path):
    opts = ["--max-rows", "600", "--eval-every", "6"]
    ck = tmp_path / "ck"
    run_job(tmp_path, "--steps", "6", *opts, "--nproc", "2", "--checkpoint", str(ck),
            "--incremental-checkpoint-every", "4")
    # saved at step 4 (the bases) and 6 (the end: a delta) by each rank, then dense.pt by rank 0
    names = sorted(os.listdir(ck / "tables"))
    assert len(names) == 26 and os.path.isfile(ck / "dense.pt")
    for n in names:
        assert sorted(os.listdir(ck / "tables" / n)) == [shard_name(0, 2), shard_name(1, 2)]
        shards = [load_store(str(ck / "tables" / n / shard_name(r, 2))) for r in range(2)]
        assert all(chain_length(str(ck / "tables" / n / shard_name(r, 2))) == 1 for r in range(2))
        assert {s.step for s in shards} == {6} and all(s.config.max_rows == 300 for s in shards)
    # the same 2-process run writing one checkpoint file holds the same tables, exactly
    full = tmp_path / "full.pt"
    run_job(tmp_path, "--steps", "6", *opts, "--nproc", "2", "--checkpoint", str(full))
    state, reference = open_checkpoint(str(ck), job.TABLE_PREFIX), torch.load(full, weights_only=False)
    assert state["step"] == reference["step"] == 6
    tables = [k for k in reference["model"] if k.startswith(job.TABLE_PREFIX) and k.endswith(".keys")]
    assert len(tables) == 26
    for key in tables:
        prefix = key[:-len("keys")]
        oa, ob = torch.argsort(state["model"][key]), torch.argsort(reference["model"][key])
        for field in ("keys", "rows", "optimizer_state", "counts", "last_steps"):
            assert torch.equal(state["model"][prefix + field][oa], reference["model"][prefix + field][ob]), key
    # resumed on 2 processes and on one, both end where 2 processes training straight end
    straight = run_job(tmp_path, "--steps", "10", *opts, "--nproc", "2")
    for extra in (["--nproc", "2"], []):
        resumed = run_job(tmp_path, "--steps", "10", *opts, "--resume", str(ck), *extra)
        assert resumed["history"][-1]["step"] == 10
        assert resumed["auc"] == pytest.approx(straight["auc"], abs=1e-3)
        assert resumed["logloss"] == pytest.approx(straight["logloss"], abs=1e-3)
        assert sum(resumed["rows_per_table"].values()) == pytest.approx(sum(straight["rows_per_table"].values()),
                                                                        rel=0.01)


def test_a_chain_directory_of_another_process_count_is_refused(capsys, tmp_path):
    ck = tmp_path / "ck"
    (ck / "tables" / "t_cat_0" / shard_name(1, 2)).mkdir(parents=True)
    with pytest.raises(SystemExit):
        parse_args(["--checkpoint", str(ck), "--incremental-checkpoint-every", "2", "--nproc", "3"])
    err = capsys.readouterr().err
    assert "holds table chains of 2 processes; this run has 3" in err and err.count("\n") == 1
    args = parse_args(["--checkpoint", str(ck), "--incremental-checkpoint-every", "2", "--nproc", "2",
                       "--max-rows", "9000"])
    assert args.incremental_checkpoint_every == 2 and args.evict == "lru"


def _criteo_lines(n, seed=0):
    rng = np.random.default_rng(seed)
    return ["\t".join([str(rng.integers(0, 2)), *[str(v) for v in rng.integers(-1, 50, 13)],
                       *[format(int(v), "x") if v % 7 else "" for v in rng.integers(0, 2**40, 26)]])
            for _ in range(n)]


def test_a_criteo_reader_for_one_rank_parses_only_its_share(tmp_path):
    """Rank r's view of a batch has the batch's size; its own share equals the whole batch's."""
    from cn_dlrm.distributed import share
    path = tmp_path / "day.tsv"
    lines = _criteo_lines(23)
    lines[1] = "2" + "\t" * 39  # a bad line in the skipped batch, then one in rank 0's share of batch 1
    lines[11] = lines[11].replace("\t", "\tx", 1)
    path.write_text("\n".join(lines) + "\n")
    whole = list(read_criteo_tsv(str(path), 10, skip_batches=2))
    assert [len(b.labels) for b in whole] == [3]
    for r in range(3):
        view = list(read_criteo_tsv(str(path), 10, skip_batches=2, rank=r, world_size=3))
        assert len(view) == 1 and len(view[0].labels) == 3
        mine, want = share(view[0], r, 3), share(whole[0], r, 3)
        assert torch.equal(mine.labels, want.labels) and torch.equal(mine.dense, want.dense)
        assert torch.equal(mine.sparse.values(), want.sparse.values())
        assert torch.equal(mine.sparse.lengths(), want.sparse.lengths())
        others = [s for s in range(3) if s != r]
        assert all(share(view[0], s, 3).sparse.values().numel() == 0 for s in others)
    # batch 1 (lines 11..20): line 12 is rank 0's (lines 11..13), not rank 1's or 2's
    with pytest.raises(Exception, match="line 12: integer feature 1 is 'x"):
        list(read_criteo_tsv(str(path), 10, skip_batches=1, rank=0, world_size=3))
    assert len(list(read_criteo_tsv(str(path), 10, skip_batches=1, rank=1, world_size=3))) == 2


@pytest.mark.slow
def test_criteo_file_on_two_processes_stops_every_rank_at_a_bad_line(tmp_path):
    """Rank 1's share holds the bad line; rank 0 stops too (no wait in a collective), with its message."""
    from cncore_torch.distributed.launch import spawn
    path = tmp_path / "day.tsv"
    lines = _criteo_lines(40)
    lines[28] = "7" + lines[28][1:]  # batch 2 of 10 lines (after 1 held out): rank 1's share is lines 26..30
    path.write_text("\n".join(lines) + "\n")
    spawn(_read_all, 2, str(path), timeout=60)


def _read_all(rank, world_size, path):
    from cn_dlrm.distributed import rank_batches
    from cn_dlrm.options import InputError
    args = parse_args(["--criteo-tsv", path, "--batch-size", "10", "--eval-batches", "1", "--steps", "3"])
    got = []
    with pytest.raises(InputError) as e:
        for b in rank_batches(args, 0, rank, world_size):
            got.append(len(b.labels))
    assert got == [10]
    # every rank raises rank 1's error: the launcher reports whichever rank failed first
    assert "line 29: the label is '7'" in str(e.value), str(e.value)


@pytest.mark.slow
def test_the_smallest_budget_the_options_allow_trains_on_two_processes(tmp_path):
    """--max-rows 2 x --batch-size (the floor on 2 processes: a shard of ceil(budget / 2) rows
    holds the most IDs one batch can route to it) trains, evicting, each table within budget."""
    r = run_job(tmp_path, "--steps", "6", "--eval-every", "6", "--max-rows", "512", "--nproc", "2")
    assert set(r["max_rows_per_table"].values()) == {512}
    assert max(r["rows_per_table"].values()) <= 512 and r["evicted"] > 0
    with pytest.raises(SystemExit):
        parse_args([*SMALL, "--max-rows", "511", "--nproc", "2"])

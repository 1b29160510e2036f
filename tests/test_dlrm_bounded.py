"""cn-dlrm's bounded tables: --max-rows / --evict / --ttl-steps / --lfu-halve-every / --admit-min-count checked and
applied (tables within budget, evictions reported), --incremental-checkpoint-every writing table
chains that reload exactly and resume, --row-dtype passed to the collection."""
import contextlib
import io
import json
import os

import numpy as np
import pytest
import torch

pytest.importorskip("torchrec")
import cncore
from cn_dlrm import bounded
from cn_dlrm import train as job
from cn_dlrm.chains import open_checkpoint
from cn_dlrm.cli import main
from cn_dlrm.data import SyntheticCriteo
from cn_dlrm.options import parse_args, row_budget
from cncore.tablefile import chain_length, load_store

SMALL = ["--batch-size", "256", "--embedding-dim", "4", "--no-progress", "--threads", "1", "--eval-batches", "1"]


def trained(*argv):
    """(args, run, summary) of a single-process run of the job's own pieces, stores at hand."""
    args = parse_args([*SMALL, *argv])
    data = job.Data(args)
    run = job.dynamic_run(args, data)
    with contextlib.redirect_stdout(io.StringIO()):
        summary = job.train(run, data, args)
    return args, run, summary


def distinct_ids(steps, batch_size=256):
    gen = SyntheticCriteo(seed=0, batch_size=batch_size)
    arrays = [gen.arrays(i) for i in range(steps)]
    return [np.unique(np.concatenate([a.values[f] for a in arrays])) for f in range(26)], arrays


# --- options ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, expected", [
    (["--ttl-steps", "5"], "--ttl-steps applies to --evict ttl, not no --evict"),
    (["--max-rows", "4096", "--evict", "lru", "--ttl-steps", "5"], "--ttl-steps applies to --evict ttl, not lru"),
    (["--evict", "ttl"], "--evict ttl needs --ttl-steps S"),
    (["--evict", "lfu"], "--evict lfu needs --max-rows"),
    (["--max-rows", "4096", "--lfu-halve-every", "64"], "--lfu-halve-every applies to --evict lfu, not lru"),
    (["--max-rows", "4096", "--evict", "lfu", "--lfu-halve-every", "48"],
     "--lfu-halve-every must be a power of two up to 2**31, got 48"),
    (["--lfu-halve-every", "0"], "argument --lfu-halve-every: must be at least 1, got 0"),
    (["--max-rows", "100", "--batch-size", "256"], "--max-rows 100 is below --batch-size 256"),
    (["--max-rows", "0"], "argument --max-rows: must be at least 1, got 0"),
    (["--max-rows", "150%"], "argument --max-rows: a percentage must be in (0, 100], got 150%"),
    (["--max-rows", "a%"], "argument --max-rows: expected rows per table (N) or a percentage (P%), got 'a%'"),
    (["--admit-min-count", "0"], "argument --admit-min-count: must be at least 1, got 0"),
    (["--admit-probability", "0"], "argument --admit-probability: expected a number in (0, 1], got '0'"),
    (["--admit-probability", "2", "--steps", "1"],
     "argument --admit-probability: expected a number in (0, 1], got '2'"),
    (["--admit-min-count", "2", "--admit-probability", "0.5"],
     "argument --admit-probability: not allowed with argument --admit-min-count"),
    (["--incremental-checkpoint-every", "5"], "--incremental-checkpoint-every needs --checkpoint DIR"),
    (["--row-dtype", "float64"], "argument --row-dtype: invalid choice: 'float64'"),
    (["--auto-split"], "--auto-split splits a row budget: set --max-rows too"),
    (["--auto-split", "--max-rows", "4096", "--admit-min-count", "2"], "--auto-split chooses from every ID's arrival"),
    (["--auto-split", "--max-rows", "8192", "--nproc", "2"],
     "--auto-split: this job's checkpoints of several processes merge"),
    (["--nproc", "2", "--max-rows", "4096", "--batch-size", "4096"],
     "--max-rows 4096 is below 2 x --batch-size 8192: one batch can bring 4096 distinct IDs to each of the 2 "
     "shards of a table"),
])
def test_bad_bounded_options_exit_2_with_one_line(capsys, argv, expected):
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert expected in err and err.count("\n") == 1


def test_options_refused_by_what_they_need_of_files(capsys, tmp_path):
    tsv = tmp_path / "day.tsv"
    tsv.write_text("0" + "\t" * 39 + "\n")
    for argv, expected in [(["--max-rows", "25%", "--criteo-tsv", str(tsv)], "with --criteo-tsv give rows per table"),
                           (["--checkpoint", str(tmp_path)], "it is a folder"),
                           (["--checkpoint", str(tsv), "--incremental-checkpoint-every", "2"],
                            "with --incremental-checkpoint-every it names a directory")]:
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert expected in capsys.readouterr().err


def test_torchrun_ranks_check_the_budget_against_their_shards(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit):
        parse_args(["--max-rows", "4096", "--batch-size", "4096"])
    assert "below 2 x --batch-size 8192" in capsys.readouterr().err
    assert parse_args(["--max-rows", "8192", "--batch-size", "4096"]).evict == "lru"


def test_good_bounded_options():
    args = parse_args(["--max-rows", "25%"])
    assert (args.max_rows, args.evict, row_budget(args.max_rows)) == ("25%", "lru", (None, 25.0))
    args = parse_args(["--max-rows", "4096", "--evict", "ttl", "--ttl-steps", "0", "--admit-min-count", "3"])
    assert (row_budget(args.max_rows), args.evict, args.ttl_steps, args.admit_min_count) == ((4096, None), "ttl", 0, 3)
    assert parse_args([]).row_dtype == "float32" and parse_args([]).evict is None
    options = bounded.collection_options(args, ["a", "b"], None)
    assert options == {"max_rows": {"a": 4096, "b": 4096}, "eviction": cncore.TTL(0), "admission": cncore.MinCount(3),
                       "fallback_rows": 0}  # a row per ID unless --auto-split
    assert bounded.collection_options(parse_args(["--row-dtype", "bfloat16"]), ["a"], None) == {"row_dtype": "bfloat16"}
    aging = parse_args(["--max-rows", "4096", "--evict", "lfu", "--lfu-halve-every", "64"])
    assert bounded.collection_options(aging, ["a"], None)["eviction"] == cncore.LFU(halve_every=64)


def test_percent_budgets_count_the_training_stream():
    ids, arrays = distinct_ids(6)
    counts = bounded.stream_counts(SyntheticCriteo(seed=0, batch_size=256), 6)
    assert counts.distinct == [len(u) for u in ids]
    assert counts.peak_batch == [max(len(np.unique(a.values[f])) for a in arrays) for f in range(26)]
    budgets = bounded.percent_budgets(counts, 25)
    assert budgets == [min(d, max(-(-d * 25 // 100), p)) for d, p in zip(counts.distinct, counts.peak_batch)]
    assert bounded.percent_budgets(counts, 100) == counts.distinct


# --- bounded runs --------------------------------------------------------------------------------------

def test_tables_stay_within_the_budget_and_report_evictions():
    steps, budget = 10, 300
    ids, _ = distinct_ids(steps)
    _, run, summary = trained("--steps", str(steps), "--max-rows", str(budget))
    stores = run.tables.stores
    for f, (name, store) in enumerate(stores.items()):
        assert store.config.max_rows == budget and store.config.eviction == cncore.LRU()
        assert summary["rows_per_table"][name] == len(store) <= budget
        assert summary["evicted_per_table"][name] == store.evicted_count
        if len(ids[f]) <= budget:  # the table never filled: every ID kept, nothing evicted
            assert (len(store), store.evicted_count) == (len(ids[f]), 0)
        else:  # every ID got a row once: held or evicted (an evicted ID that came back counts twice)
            assert len(store) + store.evicted_count >= len(ids[f]) and store.evicted_count > 0
            assert np.isin(store.export().keys, ids[f]).all()
    assert summary["evicted"] == sum(s.evicted_count for s in stores.values()) > 0
    assert summary["rows"] == sum(len(s) for s in stores.values())


def test_auto_split_lets_a_table_split_its_budget_and_the_report_counts_its_fallback_rows():
    """--auto-split: the tables are fallback_rows="auto"; at this small batch the large tables
    fill fast with IDs seen about once and split; each reports keyed + fallback rows as its
    budget, and its keyed rows stay within its keyed share. Without it, a row per ID."""
    _, run, _ = trained("--steps", "10", "--max-rows", "300")
    assert all(s.config.fallback_rows == 0 for s in run.tables.stores.values())
    _, run, summary = trained("--steps", "10", "--max-rows", "300", "--auto-split")
    stores = run.tables.stores
    split = [name for name, s in stores.items() if s.fallback_rows]
    assert split and all(stores[n].config.fallback_rows == 270 and stores[n].config.max_rows == 30 for n in split)
    for name, store in stores.items():
        assert store.config.fallback_rows in ("auto", 0, 270)
        assert summary["max_rows_per_table"][name] == 300 and len(store) <= store.config.max_rows


def test_percent_budget_and_lfu_reach_the_stores():
    steps = 8
    counts = bounded.stream_counts(SyntheticCriteo(seed=0, batch_size=256), steps)
    _, run, summary = trained("--steps", str(steps), "--max-rows", "50%", "--evict", "lfu")
    budgets = bounded.percent_budgets(counts, 50)
    assert [s.config.max_rows for s in run.tables.stores.values()] == budgets
    assert all(isinstance(s.config.eviction, cncore.LFU) for s in run.tables.stores.values())
    assert all(len(s) <= b for s, b in zip(run.tables.stores.values(), budgets)) and summary["evicted"] > 0


def test_ttl_sweeps_rows_unused_for_more_than_ttl_steps():
    _, run, summary = trained("--steps", "12", "--evict", "ttl", "--ttl-steps", "2")
    for store in run.tables.stores.values():
        assert store.config.max_rows is None and store.step == 12
        assert (store.step - store.export().last_steps.astype(np.int64) <= 2).all()
    assert summary["evicted"] > 0


def test_admission_gives_rows_only_to_ids_seen_twice():
    steps = 6
    ids, arrays = distinct_ids(steps)
    _, run, _ = trained("--steps", str(steps), "--admit-min-count", "2")
    for f, store in enumerate(run.tables.stores.values()):
        values, counts = np.unique(np.concatenate([a.values[f] for a in arrays]), return_counts=True)
        keys = store.export().keys
        assert np.isin(values[counts >= 2], keys).all()  # admitted at the second sighting (or earlier: the sketch)
        assert np.isin(keys, values).all() and len(keys) <= len(values)
    assert sum(len(s) for s in run.tables.stores.values()) < sum(len(u) for u in ids)


def test_admission_by_probability_gives_rows_to_the_ids_the_rule_draws():
    from test_admission_probability import admitted
    steps = 4
    ids, arrays = distinct_ids(steps)
    _, run, _ = trained("--steps", str(steps), "--admit-probability", "0.5")
    for f, store in enumerate(run.tables.stores.values()):
        assert store.config.admission == cncore.Probability(0.5)
        seen = np.unique(np.concatenate([a.values[f] for a in arrays])).tolist()
        assert sorted(store.export().keys.tolist()) == [k for k in seen if admitted(store.config.seed, k, 0.5)]


def test_row_dtype_reaches_the_stores(capsys):
    _, run, _ = trained("--steps", "2", "--row-dtype", "float32")
    assert {s.config.dtype for s in run.tables.stores.values()} == {"float32"}
    if "bfloat16" in cncore.config.SUPPORTED_DTYPES:
        _, run, _ = trained("--steps", "2", "--row-dtype", "bfloat16")
        assert {s.config.dtype for s in run.tables.stores.values()} == {"bfloat16"}
    else:  # the core does not store 16-bit rows yet: one line naming the option, exit 2
        assert main([*SMALL, "--steps", "2", "--row-dtype", "bfloat16"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("cn-dlrm: error: --row-dtype bfloat16:") and err.count("\n") == 1


# --- incremental checkpoints -----------------------------------------------------------------------------

def run_job(tmp_path, *argv):
    out = tmp_path / "summary.json"
    assert main([*SMALL, "--summary-json", str(out), *argv]) == 0
    return json.loads(out.read_text())["runs"][0]


def tables_of(state_dict):
    prefix = job.TABLE_PREFIX
    names = sorted({k[len(prefix):].split(".")[0] for k in state_dict if k.startswith(prefix)})
    return {n: {f: state_dict[f"{prefix}{n}.{f}"] for f in ("keys", "rows", "optimizer_state", "counts",
                                                              "last_steps", "step")} for n in names}


def assert_same_tables(a, b):
    assert sorted(a) == sorted(b) and len(a) == 26
    for name in a:
        oa, ob = torch.argsort(a[name]["keys"]), torch.argsort(b[name]["keys"])
        for field in ("keys", "rows", "optimizer_state", "counts", "last_steps"):
            assert torch.equal(a[name][field][oa], b[name][field][ob]), (name, field)
        assert int(a[name]["step"]) == int(b[name]["step"])


@pytest.mark.slow
def test_incremental_checkpoints_are_chains_that_reload_exactly(tmp_path):
    bounded_opts = ["--max-rows", "300", "--eval-every", "10"]
    ck = tmp_path / "ck"
    run_job(tmp_path, "--steps", "10", *bounded_opts, "--checkpoint", str(ck), "--incremental-checkpoint-every", "4")
    # saved at steps 4 (the base), 8 and 10 (the end): two deltas on every table
    names = sorted(os.listdir(ck / "tables"))
    assert len(names) == 26 and all(chain_length(str(ck / "tables" / n)) == 2 for n in names)
    assert all(load_store(str(ck / "tables" / n)).step == 10 for n in names)
    # the same run with a full single-file checkpoint at its end holds the same tables, exactly
    full = tmp_path / "full.pt"
    run_job(tmp_path, "--steps", "10", *bounded_opts, "--checkpoint", str(full))
    state = open_checkpoint(str(ck), job.TABLE_PREFIX)
    reference = torch.load(full, weights_only=False)
    assert state["step"] == reference["step"] == 10
    assert_same_tables(tables_of(state["model"]), tables_of(reference["model"]))
    dense = {k: v for k, v in reference["model"].items() if not k.startswith(job.TABLE_PREFIX)}
    assert all(torch.equal(state["model"][k], v) for k, v in dense.items())


def test_resume_from_an_incremental_checkpoint_continues_exactly(tmp_path):
    opts = ["--max-rows", "300", "--eval-every", "6"]
    straight = run_job(tmp_path, "--steps", "12", *opts)
    ck = tmp_path / "ck"
    run_job(tmp_path, "--steps", "6", *opts, "--checkpoint", str(ck), "--incremental-checkpoint-every", "3")
    resumed = run_job(tmp_path, "--steps", "12", *opts, "--resume", str(ck))
    assert resumed["auc"] == pytest.approx(straight["auc"], abs=1e-6)
    assert resumed["logloss"] == pytest.approx(straight["logloss"], rel=1e-5)
    assert resumed["rows_per_table"] == straight["rows_per_table"]
    assert resumed["evicted_per_table"] == straight["evicted_per_table"] and straight["evicted"] > 0


def test_a_save_cut_off_between_tables_and_dense_is_refused(capsys, tmp_path):
    ck = tmp_path / "ck"
    run_job(tmp_path, "--steps", "4", "--checkpoint", str(ck), "--incremental-checkpoint-every", "2")
    dense = torch.load(ck / "dense.pt", weights_only=False)
    dense["table_steps"]["t_cat_3"] = 2  # as if the tables were saved at 4 and dense.pt still at 2
    torch.save(dense, ck / "dense.pt")
    assert main([*SMALL, "--steps", "8", "--resume", str(ck)]) == 2
    err = capsys.readouterr().err
    assert "table t_cat_3 is at step 4 but dense.pt at 2: the last save was cut off" in err
    (tmp_path / "empty").mkdir()
    assert main([*SMALL, "--steps", "8", "--resume", str(tmp_path / "empty")]) == 2
    assert "not an incremental checkpoint of cn-dlrm (no dense.pt)" in capsys.readouterr().err


# --- the AUC study's script --------------------------------------------------------------------------------

def test_bounded_auc_script_runs_every_method_at_the_same_budget(tmp_path, capsys):
    from bench_scripts import load_bounded_auc
    script = load_bounded_auc()
    out = tmp_path / "auc.json"
    assert script.main(["--steps", "3", "--batch-size", "128", "--eval-batches", "1", "--budgets", "50",
                        "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["method"] for r in rows] == script.METHODS
    budget = bounded.percent_budgets(bounded.stream_counts(SyntheticCriteo(seed=0, batch_size=128), 3), 50)
    for r in rows:
        assert r["budget_rows"] == sum(budget) and 0.0 <= r["auc"] <= 1.0
        if r["method"] != "hashed-same-memory":
            assert 0 < r["rows_used"] <= sum(budget)
        if r["method"].startswith("ours") or r["method"] == "mch-lru":
            assert r["evicted"] > 0  # 3 batches bring more than half their distinct IDs twice over
    printed = capsys.readouterr().out
    assert printed.count("| 50% |") == len(script.METHODS)


def test_percent_budgets_on_shards_cover_the_most_one_batch_routes_to_a_shard():
    """With W processes each shard holds ceil(budget / W) rows, so a budget's floor is W times the
    most distinct IDs one batch routes to one shard (owner_of), not the batch's distinct IDs."""
    from cncore_torch.distributed.routing import owner_of
    _, arrays = distinct_ids(5)
    counts = bounded.stream_counts(SyntheticCriteo(seed=0, batch_size=256), 5, world_size=2)
    for f in range(26):
        per_shard = max(np.bincount(owner_of(torch.from_numpy(np.unique(a.values[f])), 2).numpy(), minlength=2).max()
                        for a in arrays)
        assert counts.peak_batch[f] == 2 * per_shard


@pytest.mark.slow
def test_nproc_2_bounded_tables_stay_within_their_shard_budgets(tmp_path):
    """--nproc 2 with a row budget and LRU: every shard within ceil(budget / 2) rows, evictions
    reported summed over the ranks, and the run trains (AUC well above chance)."""
    out = tmp_path / "s.json"
    assert main([*SMALL, "--steps", "12", "--eval-every", "12", "--max-rows", "600", "--nproc", "2",
                     "--summary-json", str(out)]) == 0
    r = json.loads(out.read_text())["runs"][0]
    assert r["name"] == "cncore (dynamic tables, 2 processes)"
    assert set(r["max_rows_per_table"].values()) == {600}  # 2 shards x 300
    assert all(rows <= 600 for rows in r["rows_per_table"].values())
    assert r["evicted"] == sum(r["evicted_per_table"].values()) > 0
    assert r["auc"] > 0.6

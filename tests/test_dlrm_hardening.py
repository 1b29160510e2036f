"""cn-dlrm against an adversarial user: the Criteo reader takes exactly Criteo's spellings (a
literal parser written here is the oracle), every user error is one line on stderr and exit 2,
and a resume, on any number of processes, continues from the saved state (eviction counts
included) or is refused before anything changes."""
import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

pytest.importorskip("torchrec")
from reference import tree
from test_dlrm_job import exit_line  # cn-dlrm in this process: exit 2 and one line

from cn_dlrm import distributed
from cn_dlrm import train as job
from cn_dlrm.cli import main
from cn_dlrm.data import SPARSE_KEYS, read_criteo_tsv
from cn_dlrm.options import InputError, parse_args

SMALL = ["--batch-size", "32", "--embedding-dim", "4", "--no-progress", "--threads", "1", "--eval-batches", "1"]
TABLES = [f"t_{key}" for key in SPARSE_KEYS]


def run_job(tmp_path, *argv):
    out = tmp_path / "summary.json"
    assert main([*SMALL, "--summary-json", str(out), *argv]) == 0
    return json.loads(out.read_text())["runs"][0]


def command(*argv, cwd=None):
    """cn-dlrm in a fresh interpreter (its real stderr, the spawned processes' included)."""
    return subprocess.run([sys.executable, "-m", "cn_dlrm", *argv], capture_output=True, text=True,
                          timeout=300, cwd=cwd)


# --- the Criteo reader: a literal parser of the format ------------------------------------------

HEX = "0123456789abcdef"


def _shown(text):
    return repr(text[:20]) + ("..." if len(text) > 20 else "")


def literal_parse(line):
    """What a Criteo line holds, by the format's words and nothing else: ("ok", label, 13 integers
    (None: empty), 26 IDs (None: empty)) or ("bad", the start of the message). Spellings are
    checked field by field first, then the integers' range. A refusal also names its kind."""
    while line and line[-1] in "\r\n":
        line = line[:-1]
    fields, start = [], 0
    for i, c in enumerate(line):
        if c == "\t":
            fields.append(line[start:i])
            start = i + 1
    fields.append(line[start:])
    if len(fields) != 40:
        return "bad", f"{len(fields)} tab-separated fields, a Criteo line has 40", "field count"
    if fields[0] not in ("0", "1"):
        return "bad", f"the label is {_shown(fields[0])}, it must be 0 or 1", "label"
    integers = []
    for j, v in enumerate(fields[1:14]):
        digits = v[1:] if v[:1] == "-" else v
        if v and not (digits and all(c in "0123456789" for c in digits)):
            return "bad", f"integer feature {j + 1} is {_shown(v)}, not a whole number", "integer spelling"
        number = None
        if v:
            number = 0
            for c in digits:
                number = number * 10 + "0123456789".index(c)
            number = -number if v[0] == "-" else number
        integers.append(number)
    ids = []
    for f, v in enumerate(fields[14:]):
        if v and not all(c in HEX for c in v):
            return "bad", f"category {f + 1} is {_shown(v)}, not a hex ID", "category spelling"
        if len(v) > 16:
            return "bad", f"category {f + 1} is {_shown(v)}, more than 16 hex digits", "category length"
        value = None
        if v:
            value = 0
            for c in v:
                value = value * 16 + HEX.index(c)
            value = value - 2**64 if value >= 2**63 else value
        ids.append(value)
    for j, number in enumerate(integers):
        if number is not None and not -(2**63) <= number < 2**64:
            return "bad", f"integer feature {j + 1} is {_shown(fields[1 + j])}, outside -2^63 .. 2^64-1", \
                "integer range"
    return "ok", int(fields[0]), integers, ids


good_integer = st.one_of(st.just(""), st.integers(0, 5000).map(str), st.integers(-3, -1).map(str),
                         st.integers(-(2**63), 2**64 - 1).map(str))
good_category = st.one_of(st.just(""), st.integers(0, 2**32 - 1).map(lambda v: f"{v:08x}"),
                          st.integers(0, 2**64 - 1).map(lambda v: f"{v:016x}"),
                          st.text(alphabet=HEX, min_size=1, max_size=16))
# spellings int() and int(, 16) take that Criteo never writes, and plain junk
bad_integer = st.one_of(st.sampled_from(["1_000", "+5", " 5", "5 ", "0x1f", "\u0661\u0662", "\uff15", "1.5", "-",
                                         "--1", "1e3", "\u00b2", str(2**64), str(-(2**63) - 1)]),
                        st.integers(2**64, 2**70).map(str), st.integers(-(2**70), -(2**63) - 1).map(str),
                        st.text(alphabet="0123456789-+_ x.e\u0661", min_size=1, max_size=22))
bad_category = st.one_of(st.sampled_from(["0x1f", "FF", "68FD1E64", "1_f", " ff", "ff ", "-1", "+1", "g",
                                          "\u0661", "ff\u00a0", "\uff11"]),
                         st.text(alphabet=HEX, min_size=17, max_size=24),
                         st.text(alphabet=HEX + "ABCDEFx_- g\u0661", min_size=1, max_size=18))
bad_label = st.sampled_from(["", "2", "01", "1.0", " 1", "\uff11", "-0", "00", "true"])


@st.composite
def criteo_line(draw):
    fields = [draw(st.sampled_from(["0", "1"]))] + [draw(good_integer) for _ in range(13)] + \
        [draw(good_category) for _ in range(26)]
    for _ in range(draw(st.integers(0, 2))):  # 0: a valid line
        kind = draw(st.sampled_from(["label", "integer", "category", "fields"]))
        if kind == "label":
            fields[0] = draw(bad_label)
        elif kind == "integer":
            fields[1 + draw(st.integers(0, 12))] = draw(bad_integer)
        elif kind == "category":
            fields[14 + draw(st.integers(0, 25))] = draw(bad_category)
        elif draw(st.booleans()):
            fields.insert(draw(st.integers(0, len(fields))), draw(good_category))
        else:
            del fields[draw(st.integers(0, len(fields) - 1))]
    return "\t".join(fields) + draw(st.sampled_from(["", "\r"]))


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(lines=st.lists(criteo_line(), min_size=1, max_size=4), batch_size=st.integers(1, 3))
def test_the_reader_takes_exactly_what_a_literal_criteo_parser_takes(tmp_path_factory, lines, batch_size):
    path = str(tmp_path_factory.mktemp("tsv") / "day.tsv")
    with open(path, "w", encoding="utf-8", newline="") as fh:
        fh.write("".join(line + "\n" for line in lines))
    parsed = [literal_parse(line) for line in lines]
    bad = next((i for i, p in enumerate(parsed) if p[0] == "bad"), None)
    got = []
    try:
        for b in read_criteo_tsv(path, batch_size):
            got.append(b)
        error = None
    except InputError as e:
        error = str(e)
    if bad is None:
        event("every line read")
        assert error is None, error
    else:
        event(f"refused by its {parsed[bad][2]}")
        assert error is not None and error.startswith(f"{path}, line {bad + 1}: {parsed[bad][1]}"), (error, parsed[bad])
        assert "\n" not in error
    # the batches before the one holding the bad line: exactly the literal parser's values
    good = parsed[:len(got) * batch_size]
    assert len(got) == (math.ceil(len(lines) / batch_size) if bad is None else bad // batch_size)
    for k, b in enumerate(got):
        part = good[k * batch_size:(k + 1) * batch_size]
        assert b.labels.tolist() == [float(p[1]) for p in part]
        want = [[math.log1p(n) if n is not None and n > 0 else 0.0 for n in p[2]] for p in part]
        np.testing.assert_allclose(b.dense.numpy(), np.array(want, dtype=np.float32), rtol=1e-6)
        by_key = b.sparse.to_dict()
        for f, key in enumerate(SPARSE_KEYS):
            assert by_key[key].values().tolist() == [p[3][f] for p in part if p[3][f] is not None]
            assert by_key[key].lengths().tolist() == [int(p[3][f] is not None) for p in part]


GENUINE = ("1\t5\t\t3\t0\t1382\t4\t15\t2\t181\t1\t2\t\t2\t68fd1e64\t80e26c9b\tfb936136\t7b4723c4\t25c83c98\t"
           "7e0ccccf\tde7995b8\t1f89b562\ta73ee510\ta8cd5504\tb2cb9c98\t37c9c164\t2824a5f6\t1adce6ef\t8ba8b39a\t"
           "891b62e7\te5ba7672\tf54016b9\t21ddcdc9\tb1252a9d\t07b5194c\t\t3a171ecb\tc5c50484\te8b83407\t9727dd16")


def _with(field, value, line=GENUINE):
    fields = line.split("\t")
    fields[field] = value
    return "\t".join(fields)


@pytest.mark.parametrize("field, value, message", [
    (1, "1_000", "integer feature 1 is '1_000', not a whole number as Criteo writes them (ASCII digits 0-9, '-' "
                 "before a negative one, or nothing)"),
    (2, "\u0661\u0662", "integer feature 2 is '\u0661\u0662', not a whole number as Criteo writes them"),
    (3, "+5", "integer feature 3 is '+5', not a whole number as Criteo writes them"),
    (13, str(2**64), "integer feature 13 is '18446744073709551616', outside -2^63 .. 2^64-1 (Criteo's integer "
                     "features are counts, which fit 32 bits)"),
    (1, "-" + str(2**63 + 1), "integer feature 1 is '-9223372036854775809', outside -2^63 .. 2^64-1"),
    (14, "0x1f", "category 1 is '0x1f', not a hex ID as Criteo writes them (lower-case hex digits 0-9 a-f, 8 in "
                 "Criteo's files, at most 16, or nothing)"),
    (15, "68FD1E64", "category 2 is '68FD1E64', not a hex ID as Criteo writes them"),
    (39, "1_f", "category 26 is '1_f', not a hex ID as Criteo writes them"),
    (20, "\u0661", "category 7 is '\u0661', not a hex ID as Criteo writes them"),
    (14, "f" * 24, "category 1 is 'ffffffffffffffffffff'..., more than 16 hex digits (IDs are 64-bit)"),
])
def test_spellings_criteo_never_writes_are_refused_naming_file_line_and_field(tmp_path, field, value, message):
    path = tmp_path / "day.tsv"
    path.write_text(GENUINE + "\n" + _with(field, value) + "\n", encoding="utf-8")
    with pytest.raises(InputError) as e:
        list(read_criteo_tsv(str(path), batch_size=1))
    assert str(e.value).startswith(f"{path}, line 2: {message}")


def test_every_genuine_criteo_spelling_reads_as_its_value(tmp_path):
    """Empty and negative integers, 2^64-1, 8- and 16-digit IDs (wrapping to int64), empty IDs."""
    line = _with(2, "-2", _with(5, str(2**64 - 1), _with(14, "ffffffffffffffff", _with(15, "0000000f",
                                                                                    _with(16, "")))))
    path = tmp_path / "day.tsv"
    path.write_text(line + "\r\n", encoding="utf-8")
    b = next(read_criteo_tsv(str(path), batch_size=1))
    assert b.dense[0, 1].item() == 0.0 and b.dense[0, 4].item() == pytest.approx(math.log1p(2**64 - 1))
    by_key = b.sparse.to_dict()
    assert by_key["cat_0"].values().tolist() == [-1] and by_key["cat_1"].values().tolist() == [15]
    assert by_key["cat_2"].lengths().tolist() == [0] and by_key["cat_3"].values().tolist() == [0x7B4723C4]


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_an_integer_over_64_bits_stops_the_job_with_one_line(tmp_path, nproc):
    """On 1 and 2 processes, in the held-out lines and in a training batch (read as the run goes)."""
    lines = [GENUINE] * 12
    lines[9] = _with(4, str(2**64))  # line 10: the third training batch (4 lines a batch, 4 held out)
    path = tmp_path / "day.tsv"
    path.write_text("".join(line + "\n" for line in lines))
    before = tree(tmp_path)
    proc = command(*SMALL, "--batch-size", "4", "--steps", "3", "--criteo-tsv", str(path), "--nproc", str(nproc),
                   cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"cn-dlrm: error: {path}, line 10: integer feature 4 is '18446744073709551616', outside -2^63 .. 2^64-1 "
        f"(Criteo's integer features are counts, which fit 32 bits)"], proc.stderr
    assert tree(tmp_path) == before


# --- resuming: eviction counts and budgets ------------------------------------------------------

@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints of bounded tables (--max-rows 64, LRU, evicting): 2 processes at step 6 (a
    file), 1 process at step 4 (a file, and an incremental directory); their summaries."""
    root = tmp_path_factory.mktemp("saved")
    two = run_job(root, "--max-rows", "64", "--steps", "6", "--eval-every", "6", "--nproc", "2", "--checkpoint",
                  str(root / "two.pt"))
    one = run_job(root, "--max-rows", "64", "--steps", "4", "--eval-every", "4", "--checkpoint", str(root / "one.pt"))
    run_job(root, "--max-rows", "64", "--steps", "4", "--checkpoint", str(root / "chains"),
            "--incremental-checkpoint-every", "2")
    assert two["evicted"] > 0 and one["evicted"] > 0
    return root, {"two.pt": two, "one.pt": one, "chains": one}


def _restored_counts(rank, world_size, argv, out):
    """A rank of `world_size`: the run built and restored as the job does; every rank's
    evicted counts gathered on rank 0, written to `out`."""
    import torch.distributed as dist
    args = parse_args(argv)
    state = job.load_checkpoint(args.resume, args)
    run = distributed.distributed_run(args, job.Data(args), rank, world_size)
    start = job.restore(run, state, args, rank, world_size)
    counts = [None] * world_size
    dist.all_gather_object(counts, {name: int(s.evicted_count) for name, s in run.tables.stores.items()})
    if rank == 0:
        with open(out, "w") as fh:
            json.dump({"start": start, "counts": counts}, fh)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_a_resume_on_several_processes_keeps_every_tables_eviction_count(saved, tmp_path, world_size):
    """The counts summed over the ranks right after the resume are the saved ones (rank 0 holds
    each table's total, as the 2-process run reported it at the save); 1 process keeps them too."""
    from cncore_torch.distributed.launch import spawn
    root, summaries = saved
    before = summaries["two.pt"]["evicted_per_table"]
    assert sum(before.values()) == summaries["two.pt"]["evicted"] > 0
    out = str(tmp_path / "counts.json")
    argv = [*SMALL, "--max-rows", str(64 * world_size), "--steps", "7", "--resume", str(root / "two.pt")]
    spawn(_restored_counts, world_size, argv, out, timeout=120)
    got = json.load(open(out))
    assert got["start"] == 6
    assert {name: sum(c[name] for c in got["counts"]) for name in TABLES} == before
    assert all(not any(c.values()) for c in got["counts"][1:])  # the other ranks count from 0
    args = parse_args([*SMALL, "--max-rows", "64", "--steps", "7", "--resume", str(root / "two.pt")])
    run = job.dynamic_run(args, job.Data(args))
    job.restore(run, job.load_checkpoint(args.resume, args), args)
    assert {name: int(s.evicted_count) for name, s in run.tables.stores.items()} == before


@pytest.mark.slow
def test_a_two_process_resume_reports_the_counts_a_straight_run_reports(saved, tmp_path):
    root, _ = saved
    opts = ["--max-rows", "64", "--steps", "7", "--eval-every", "7", "--nproc", "2"]
    straight = run_job(tmp_path, *opts)
    resumed = run_job(tmp_path, *opts, "--resume", str(root / "two.pt"))
    assert resumed["evicted_per_table"] == straight["evicted_per_table"]
    assert resumed["evicted"] == straight["evicted"] > 0


def test_a_resume_over_this_runs_budget_exits_2_with_one_line(saved, capsys):
    root, _ = saved
    ck = str(root / "two.pt")
    keys = {name: torch.load(ck, weights_only=False)["model"][f"{job.TABLE_PREFIX}{name}.keys"].numel()
            for name in TABLES}
    over = [name for name in TABLES if keys[name] > 32]
    worst = max(over, key=lambda name: keys[name])
    before = tree(root)
    line = exit_line(capsys, *SMALL, "--max-rows", "32", "--steps", "7", "--resume", ck)
    assert line == (f"cn-dlrm: error: --resume {ck}: {len(over)} tables hold more rows than this run's budget "
                    f"({worst}: {keys[worst]} rows, --max-rows 32 gives it 32); it was saved with --max-rows 64 on "
                    f"2 processes: resume with --max-rows {keys[worst]} or more")
    assert tree(root) == before


@pytest.mark.slow
def test_a_resume_whose_keys_overfill_a_shard_exits_2_with_one_line(saved):
    """A one-process checkpoint of full tables on 2 processes of half the budget each: the hash
    puts more than half of some table's keys on one process."""
    root, _ = saved
    ck = str(root / "one.pt")
    proc = command(*SMALL, "--max-rows", "64", "--steps", "5", "--nproc", "2", "--resume", ck, cwd=root)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"cn-dlrm: error: --resume {ck}: on 2 processes the keys one process owns of ")
    assert "ceil(--max-rows 64 / 2) gives it 32; a hash does not split a full table evenly); it was saved with " \
           "--max-rows 64 on 1 process: resume with --nproc 1 or --max-rows " in line


# --- every other user error: one line, exit 2, nothing written ----------------------------------

def test_user_errors_of_files_exit_2_with_one_line(saved, tmp_path, capsys, monkeypatch):
    root, _ = saved
    monkeypatch.chdir(tmp_path)
    torch.save([1, 2], tmp_path / "list.pt")
    torch.save({"step": 1, "args": {"embedding_dim": 4}, "model": [], "optimizers": []}, tmp_path / "model.pt")
    torch.save({"step": 1, "args": {"embedding_dim": 4}, "model": {}, "optimizers": []}, tmp_path / "empty.pt")
    (tmp_path / "folder").mkdir()
    cases = [
        (["--resume", "list.pt"], "--resume list.pt: not a checkpoint of cn-dlrm (TypeError: it holds a list, "
                                  "cn-dlrm writes a dict)"),
        (["--resume", "model.pt"], "--resume model.pt: not a checkpoint of cn-dlrm (TypeError: its 'model' is a "
                                   "list, cn-dlrm writes a dict)"),
        (["--resume", "empty.pt"], "--resume empty.pt: not a checkpoint of cn-dlrm (ValueError: its model holds no "
                                   "table t_cat_0)"),
        (["--resume", "folder"], "--resume folder: a folder, but not an incremental checkpoint of cn-dlrm"),
        (["--resume", str(root / "one.pt"), "--embedding-dim", "8"],
         f"--resume {root / 'one.pt'} was saved with --embedding-dim 4, this run has 8"),
        (["--resume", str(root / "chains"), "--steps", "4"], f"--resume {root / 'chains'} is at step 4, and --steps 4"),
        (["--checkpoint", "/proc/ck.pt"], "--checkpoint /proc/ck.pt: cannot write it ("),
        (["--summary-json", "/proc/out.json"], "--summary-json /proc/out.json: cannot write it ("),
        (["--ssd-path", "/proc/ssd", "--cache-mb", "1"], "--ssd-path /proc/ssd: cannot make the directory /proc/ssd"),
    ]
    before = tree(tmp_path)
    for argv, expected in cases:
        line = exit_line(capsys, *SMALL, "--steps", "5", "--eval-every", "100", *argv)
        assert line.startswith(f"cn-dlrm: error: {expected}"), (argv, line)
    assert tree(tmp_path) == before


# --- generated option / resume combinations ----------------------------------------------------

def _oracle(saved_keys, saved_step, dim, max_rows, steps, batch_size):
    """What a one-process resume with these options must do: ("ok",) or ("exit 2", the start of the
    message after 'cn-dlrm: error: ')."""
    if max_rows is not None and max_rows < batch_size:
        return "exit 2", f"--max-rows {max_rows} is below --batch-size {batch_size}"
    if dim != 4:
        return "exit 2", "--resume {ck} was saved with --embedding-dim 4"
    if steps <= saved_step:
        return "exit 2", f"--resume {{ck}} is at step {saved_step}"
    if max_rows is not None and max(saved_keys.values()) > max_rows:
        over = sum(n > max_rows for n in saved_keys.values())
        return "exit 2", f"--resume {{ck}}: {over} table{'s' * (over > 1)} hold more rows than this run's budget"
    return ("ok",)


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(which=st.sampled_from(["two.pt", "one.pt", "chains"]), dim=st.sampled_from([4, 4, 4, 4, 8]),
       max_rows=st.sampled_from([None, None, 64, 96, 128, 48, 32, 20]), evict=st.sampled_from([None, "lru", "lfu"]),
       steps=st.sampled_from([4, 6, 7, 7, 9, 9]), admit=st.booleans())
def test_generated_resumes_load_the_saved_state_exactly_or_exit_2(saved, capsys, which, dim, max_rows, evict,
                                                                    steps, admit):
    """(capsys is read, and so emptied, by every exit_line: one example's output never reaches another's.)"""
    root, _ = saved
    ck = str(root / which)
    state = job.load_checkpoint(ck, parse_args([*SMALL, "--steps", "100", "--resume", ck]))
    model = state["model"]
    saved_keys = {name: model[f"{job.TABLE_PREFIX}{name}.keys"].numel() for name in TABLES}
    argv = [*SMALL, "--embedding-dim", str(dim), "--steps", str(steps), "--resume", ck]
    argv += [] if max_rows is None else ["--max-rows", str(max_rows)]
    argv += [] if evict is None or max_rows is None else ["--evict", evict]
    argv += ["--admit-min-count", "2"] if admit else []
    expected = _oracle(saved_keys, int(state["step"]), dim, max_rows, steps, 32)
    event(f"{which}: {expected[0]}{': ' + expected[1].split(': ')[-1][:40] if len(expected) > 1 else ''}")
    if expected[0] == "exit 2":
        line = exit_line(capsys, *argv)
        assert line.startswith("cn-dlrm: error: " + expected[1].format(ck=ck)), line
        return
    args = parse_args(argv)
    run = job.dynamic_run(args, job.Data(args))
    assert job.restore(run, job.load_checkpoint(ck, args), args) == state["step"]
    for name, store in run.tables.stores.items():
        prefix = f"{job.TABLE_PREFIX}{name}."
        e = store.export()
        order, want = np.argsort(e.keys), torch.argsort(model[prefix + "keys"]).numpy()
        np.testing.assert_array_equal(e.keys[order], model[prefix + "keys"].numpy()[want])
        np.testing.assert_array_equal(e.rows[order], model[prefix + "rows"].numpy()[want])
        np.testing.assert_array_equal(e.optimizer_state[order], model[prefix + "optimizer_state"].numpy()[want])
        np.testing.assert_array_equal(e.counts[order], model[prefix + "counts"].numpy()[want])
        np.testing.assert_array_equal(e.last_steps[order], model[prefix + "last_steps"].numpy()[want])
        assert store.step == int(model[prefix + "step"])
        assert store.evicted_count == int(model[prefix + "evicted_count"])


def test_an_output_that_is_also_an_input_is_refused_before_anything_is_written(saved, tmp_path, capsys, monkeypatch):
    """--summary-json or --checkpoint over the --resume checkpoint or the --criteo-tsv file would
    replace it at the first save (--checkpoint P --resume P continues a checkpoint in place)."""
    root, _ = saved
    monkeypatch.chdir(tmp_path)
    ck = str(tmp_path / "ck.pt")
    with open(root / "one.pt", "rb") as src, open(ck, "wb") as dst:
        dst.write(src.read())
    (tmp_path / "day.tsv").write_text(GENUINE + "\n")
    before = tree(tmp_path)
    for argv, expected in [
        (["--resume", ck, "--summary-json", ck], f"--summary-json {ck} is also --resume {ck}: the job would write "
                                                 f"over it; give another path"),
        (["--criteo-tsv", "day.tsv", "--checkpoint", "./day.tsv"], "--checkpoint ./day.tsv is also --criteo-tsv "
                                                                   "day.tsv: the job would write over it"),
        (["--checkpoint", "s.json", "--summary-json", "s.json"], "--checkpoint s.json is also --summary-json s.json"),
    ]:
        line = exit_line(capsys, *SMALL, "--steps", "5", *argv)
        assert line.startswith(f"cn-dlrm: error: {expected}"), line
    assert tree(tmp_path) == before

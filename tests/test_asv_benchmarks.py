"""Runs every asv benchmark once, every parameter combination, the way asv calls it
(setup, the benchmark, teardown), so a benchmark that breaks or measures nothing is caught."""
import importlib
import inspect
import itertools
import os
import pathlib
import re
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCH_DIR = ROOT / "asv_bench"
PREFIXES = ("time_", "peakmem_", "track_", "mem_")
# Benchmark classes whose one smoke run takes more than a few seconds.
SLOW = {"bench_large.LargeTableForward", "bench_large.LargeTableStep", "bench_training.TrainingStep"}


def discover():
    os.environ["CNCORE_ASV_SMOKE"] = "1"
    sys.path.insert(0, str(BENCH_DIR))
    found = []
    for path in sorted((BENCH_DIR / "benchmarks").glob("bench_*.py")):
        module = importlib.import_module(f"benchmarks.{path.stem}")
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ != module.__name__:
                continue
            methods = [m for m in dir(cls) if m.startswith(PREFIXES)]
            name = f"{path.stem}.{cls.__name__}"
            if methods:
                found.append(pytest.param(cls, methods, id=name, marks=[pytest.mark.slow] if name in SLOW else []))
    return found


BENCHMARKS = discover()


def test_the_suite_is_not_empty():
    names = {p.id for p in BENCHMARKS}
    for expected in ("bench_store.Find", "bench_store.FindOrInsertNew", "bench_store.Export",
                     "bench_training.PooledLookup", "bench_training.TrainingStep", "bench_training.GroupedDLRM",
                     "bench_large.LargeTableForward", "bench_large.LargeTableStep",
                     "bench_serving.FrozenRequest", "bench_serving.DeltaApply"):
        assert expected in names


@pytest.mark.parametrize("cls,methods", BENCHMARKS)
def test_benchmark_runs_once(cls, methods):
    params = getattr(cls, "params", [])
    if params and not isinstance(params[0], (list, tuple)):
        params = [params]
    names = getattr(cls, "param_names", [])
    assert len(names) == len(params), "param_names must name every parameter"
    for method in methods:
        sig = inspect.signature(getattr(cls, method))
        assert list(sig.parameters)[1:] == list(names), f"{method}: arguments must match param_names"
    combos = list(itertools.product(*params)) if params else [()]
    ran = 0
    for combo in combos:
        for method in methods:
            bench = cls()
            if hasattr(bench, "setup"):
                bench.setup(*combo)
            result = getattr(bench, method)(*combo)
            if method.startswith("track_"):
                assert isinstance(result, (int, float)) and result > 0
            if hasattr(bench, "teardown"):
                bench.teardown(*combo)
            ran += 1
    assert ran == len(combos) * len(methods)


def test_flush_is_larger_than_the_last_level_cache():
    sys.path.insert(0, str(BENCH_DIR))
    from benchmarks import machine
    assert machine.Flush(2).buf.nbytes >= 2 * machine.llc_bytes() > 0


def test_background_load_keeps_every_core_busy_and_ends():
    from benchmarks import machine
    with machine.background_load() as n:
        assert n == machine.cpu_count()
        # Polled: on a machine already busy (the suite's other worker), starting n interpreters
        # can take longer than the 0.3 s this test once slept, and it failed then.
        deadline = time.monotonic() + 10
        while not [p for p in live_children() if p[1] == "R"] and time.monotonic() < deadline:
            time.sleep(0.05)
        busy = [p for p in live_children() if p[1] == "R"]
        assert len(busy) >= 1, "the spinning processes are not running"
    assert live_children() == []


def live_children():
    """(pid, state) of this process's live children, from /proc (no psutil needed)."""
    out = []
    me = str(os.getpid())
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me and fields[0] != "Z":
            out.append((int(pid), fields[0]))
    return out


@pytest.mark.slow
def test_forward_large_quick_prints_every_cell(tmp_path):
    """asv_bench/scripts/forward_large.py --quick beside a busy process per core: every contender
    has a speed and a bandwidth share, every ratio a number (the script first checks that all
    contenders return EmbeddingBag's output on the same rows)."""
    script = BENCH_DIR / "scripts" / "forward_large.py"
    res = subprocess.run([sys.executable, str(script), "--quick", "--background-load"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.splitlines()
    assert "LLC" in lines[0] and "load average" in lines[0]  # the machine, printed with the table
    head = next(i for i, ln in enumerate(lines) if ln.startswith("| rows |"))
    cols = [c.strip() for c in lines[head].strip("|").split("|")]
    for name in ("EB fp32", "TBE fp16", "ours fp32", "ours fp16", "ours bf16", "fp16/TBE fp16"):
        assert name in cols
    body = [ln for ln in lines[head + 2:] if ln.startswith("|")]
    assert len(body) == 1
    cells = dict(zip(cols, (c.strip() for c in body[0].strip("|").split("|"))))
    for name in cols[4:-1]:
        if "/" in name:
            assert re.fullmatch(r"\*\*\d+\.\d\dx\*\*", cells[name]), (name, cells[name])
        else:
            assert re.fullmatch(r"\d+\.\d · \d+%", cells[name]) and float(cells[name].split()[0]) > 0, \
                (name, cells[name])
    assert "background load: one busy process per core" in res.stdout


@pytest.mark.slow
def test_step_large_quick_prints_every_cell_with_and_without_huge_pages(tmp_path):
    """asv_bench/scripts/step_large.py --quick with each fused optimizer TBE has on CPU (SGD,
    Adagrad, row-wise Adagrad): one table with torch's weights on huge pages and one without
    (each run in its own child, as torch reads the setting once), each naming the CPU, its
    caches and the load, one row per optimizer, every speed and ratio a positive number (the
    script first checks that every forward reads the same rows as EmbeddingBag, and ours the
    same as TBE's after their steps)."""
    script = BENCH_DIR / "scripts" / "step_large.py"
    optimizers = ["sgd", "adagrad", "rowwise-adagrad"]
    res = subprocess.run([sys.executable, str(script), "--quick", "--optimizer", *optimizers], capture_output=True,
                         text=True, timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    out = res.stdout
    assert "torch weights on huge pages: yes (THP_MEM_ALLOC_ENABLE=1)" in out
    assert "torch weights on huge pages: no (4 KiB pages)" in out
    machine_lines = [ln for ln in out.splitlines() if ln.startswith("# Training step and forward")]
    assert len(machine_lines) == 2 and all("LLC" in ln and "L1d" in ln and "load average" in ln
                                           for ln in machine_lines), machine_lines
    lines = out.splitlines()
    heads = [i for i, ln in enumerate(lines) if ln.startswith("| rows |")]
    assert len(heads) == 2
    for head in heads:
        cols = [c.strip() for c in lines[head].strip("|").split("|")]
        assert cols[4:11] == ["optimizer", "EB fwd", "TBE fwd", "ours fwd", "gather", "TBE step", "ours step"]
        for k, optimizer in enumerate(optimizers):  # one row each, the same table and IDs as TBE's
            cells = [c.strip().strip("*").rstrip("x") for c in lines[head + 2 + k].strip("|").split("|")]
            assert cells[4] == optimizer, cells
            assert all(float(c) > 0 for c in cells[5:-1]), lines[head + 2 + k]
            assert re.fullmatch(r"[\d.]+/[\d.]+/[\d.]+", cells[-1]), cells[-1]  # the load average


@pytest.mark.slow
def test_compare_reference_quick_prints_every_cell(tmp_path):
    """asv_bench/scripts/compare_reference.py --quick --background-load --table-only: one row of
    speeds and ratios, each a positive number, and the machine line."""
    script = BENCH_DIR / "scripts" / "compare_reference.py"
    res = subprocess.run([sys.executable, str(script), "--quick", "--background-load", "--table-only"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "LLC" in res.stdout and "background load: one busy process per core" in res.stdout
    head = res.stdout.index("| dim |")
    body = [ln for ln in res.stdout[head:].splitlines()[2:] if ln.startswith("|")]
    assert len(body) == 1
    cells = [c.strip().strip("*").rstrip("x") for c in body[0].strip("|").split("|")][3:]
    assert len(cells) == 11 and all(float(c) > 0 for c in cells), body[0]


def test_module_overhead_prints_both_ratios(tmp_path):
    """asv_bench/scripts/module_overhead.py on a small batch: the three rows (forward, training
    step, the step against the core's step plus an empty autograd.Function), each with positive times and a
    ratio, and autograd's own share."""
    script = BENCH_DIR / "scripts" / "module_overhead.py"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "frontends"),
                                                       os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, str(script), "--batch", "64", "--calls", "6"], capture_output=True,
                         text=True, timeout=300, cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "load average" in res.stdout
    rows = [ln for ln in res.stdout.splitlines() if ln.startswith(("| forward", "| training"))]
    assert len(rows) == 3 and "empty autograd.Function" in rows[2], res.stdout
    assert re.search(r"autograd's own cost, .*: \d+\.\d\dx the core's step;", res.stdout), res.stdout
    for row in rows:
        m = re.fullmatch(r"\| [^|]+ \| (\d+) \| (\d+) \| \*\*(\d+\.\d\d)x\*\* \|", row)
        assert m and int(m[1]) > 0 and int(m[2]) > 0 and float(m[3]) > 0, row


@pytest.mark.slow
def test_dlrm_step_parts_prints_every_part_for_both_runs(tmp_path):
    """asv_bench/scripts/dlrm_step_parts.py on a few steps: a row per part with two non-negative
    times (ours, DMP), ours' remap (none: a mode check) below DMP's, the parts adding up to the step
    (within rounding), and the ratio line."""
    script = BENCH_DIR / "scripts" / "dlrm_step_parts.py"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "frontends"),
                                                       os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, str(script), "--steps", "6", "--warm", "2", "--block", "2"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    cells = {}
    for line in res.stdout.splitlines():
        m = re.fullmatch(r"\| ([^|]+) \| (-?\d+\.\d\d) \| (-?\d+\.\d\d) \|", line)
        if m:
            cells[m[1]] = (float(m[2]), float(m[3]))
    assert len(cells) == 10, res.stdout
    assert 0 <= cells["remap"][0] < cells["remap"][1], res.stdout  # ours has no remap (train()'s check only)
    for run in (0, 1):
        parts = sum(v[run] for k, v in cells.items() if k != "step")
        assert cells["step"][run] > 0 and abs(parts - cells["step"][run]) < 0.1, res.stdout
    assert re.search(r"^ours / DMP: \d+\.\d\dx$", res.stdout, re.M), res.stdout

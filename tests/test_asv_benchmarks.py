"""Runs every asv benchmark once, every parameter combination, the way asv calls it
(setup, the benchmark, teardown), so a benchmark that breaks or measures nothing is caught."""
import importlib
import inspect
import itertools
import os
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCH_DIR = ROOT / "asv_bench"
PREFIXES = ("time_", "peakmem_", "track_", "mem_")


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
            if methods:
                found.append(pytest.param(cls, methods, id=f"{path.stem}.{cls.__name__}"))
    return found


BENCHMARKS = discover()


def test_the_suite_is_not_empty():
    names = {p.id for p in BENCHMARKS}
    for expected in ("bench_store.Find", "bench_store.FindOrInsertNew", "bench_store.Export",
                     "bench_training.PooledLookup", "bench_training.TrainingStep", "bench_training.GroupedDLRM"):
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

"""asv_bench/scripts/step_two_builds.py on a small table: the repo's own build loaded twice and
TBE take the same steps; the row names the CPU and load, every time is positive, and the two
builds' rows come out bit for bit the same."""
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_one_build_against_itself_and_tbe(tmp_path):
    pytest.importorskip("fbgemm_gpu")
    script = ROOT / "asv_bench" / "scripts" / "step_two_builds.py"
    res = subprocess.run([sys.executable, str(script), str(ROOT), str(ROOT), "--rows", "2e4", "--batch", "64",
                          "--rounds", "2", "--dist", "uniform"], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.splitlines()
    assert any(ln.startswith("# ") and "L3" in ln and "load average" in ln for ln in lines), res.stdout
    row = [c.strip() for c in next(ln for ln in lines if ln.startswith("| 0.02M x 16")).strip("|").split("|")]
    assert row[3] == "old-first" and row[13] == "yes", row
    assert all(float(c.rstrip("x")) > 0 for c in row[4:13]), row
    assert re.fullmatch(r"[\d.]+/[\d.]+/[\d.]+", row[14]), row

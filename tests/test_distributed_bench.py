"""The distributed benchmark (asv_bench/scripts/distributed_bench.py) runs both setups and
measures something (a smoke run, 2 ranks)."""
import pathlib
import re

import pytest

pytest.importorskip("torchrec")


SCRIPTS = pathlib.Path(__file__).resolve().parents[1] / "asv_bench" / "scripts"


@pytest.mark.slow
def test_bench_measures_both_runs_and_the_traffic(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))  # (the ranks import the script by name, from the same path)
    from distributed_bench import main
    assert main(["--nproc", "2", "--steps", "2", "--warmup", "1", "--batch-size", "64", "--dim", "4"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 2 |")]
    assert len(lines) == 3
    ours, packed, torchrec = (line.split(" | ") for line in lines)
    assert float(ours[2].replace(",", "")) > 0 and float(torchrec[2].replace(",", "")) > 0
    assert "pack_pools" in packed[1] and float(packed[2].replace(",", "")) > 0

    def traffic(row):
        sent = [float(s.replace(",", "")) for s in re.findall(r"([\d,]+) \(", row[3])]
        pools = [float(s.replace(",", "")) for s in re.findall(r"\+ ([\d,]+)\)", row[3])]
        minimum = [float(s.replace(",", "")) for s in row[4].rstrip(" |").split(" / ")]
        return sent, pools, minimum

    (sent, pools, minimum), (p_sent, p_pools, p_minimum) = traffic(ours), traffic(packed)
    assert len(sent) == len(minimum) == len(p_sent) == 2 and minimum == p_minimum
    # Every sample's pool against only the non-zero ones: packing sends fewer pool bytes, and two
    # ranks together no fewer than the minimum (a rank's own minimum counts its bags' pools twice).
    assert all(p < q for p, q in zip(p_pools, pools))
    assert sum(p_sent) >= sum(minimum) > 0 and sum(sent) >= sum(minimum)

"""The distributed benchmark runs both setups and measures something (a smoke run, 2 ranks)."""
import re

import pytest

pytest.importorskip("torchrec")


def test_bench_measures_both_runs_and_the_traffic(capsys):
    from cncore_torch.distributed.bench import main
    assert main(["--nproc", "2", "--steps", "2", "--warmup", "1", "--batch-size", "64", "--dim", "4"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 2 |")]
    assert len(lines) == 2
    ours, torchrec = (line.split(" | ") for line in lines)
    assert float(ours[2].replace(",", "")) > 0 and float(torchrec[2].replace(",", "")) > 0
    sent = [float(s.replace(",", "")) for s in re.findall(r"([\d,]+) \(", ours[3])]
    minimum = [float(s.replace(",", "")) for s in ours[4].rstrip(" |").split(" / ")]
    assert len(sent) == len(minimum) == 2
    # A rank sends the pools of other ranks' bags it holds keys of and the gradients of its own
    # bags' foreign pools; the minimum counts the latter twice, so only the totals compare.
    assert sum(sent) >= sum(minimum) > 0 and all(m > 0 for m in minimum)

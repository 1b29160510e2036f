"""bounded_auc.py's eviction-policy options (issue 33, which policy `max_rows=` defaults to):
the auto-split methods of every policy are accepted, and --lfu-halve-every sets the aging
constant of ours-lfu-aging (cncore.LFU(halve_every=N)), refusing what cncore.LFU refuses."""
import os
import sys

import pytest

import cncore

pytest.importorskip("torch")
pytest.importorskip("torchrec")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "asv_bench", "scripts"))
from bench_scripts import load_bounded_auc


def policies_seen(argv):
    """The policy each name builds as the run sees them (before its data loads), and the methods."""
    script = load_bounded_auc()
    seen = {}

    def run_and_look(args, job):
        seen.update({name: make() for name, make in script.POLICIES.items()}, methods=args.methods)
        raise SystemExit(0)
    script.load_data = run_and_look
    with pytest.raises(SystemExit):
        script.main(argv)
    return seen


def test_auto_methods_of_each_policy_and_the_aging_constant():
    seen = policies_seen(["--methods", "ours-lfu+auto", "ours-lru+auto", "ours-lfu-aging+auto",
                          "--lfu-halve-every", "8"])
    assert seen["methods"] == ["ours-lfu+auto", "ours-lru+auto", "ours-lfu-aging+auto"]
    assert seen["lfu-aging"] == cncore.LFU(halve_every=8)
    assert seen["lfu"] == cncore.LFU() and seen["lru"] == cncore.LRU()
    assert policies_seen([])["lfu-aging"] == cncore.LFU(halve_every=32)  # the default


@pytest.mark.parametrize("bad", ["3", "0", "-4"])
def test_halve_every_that_lfu_refuses_is_refused_by_name(bad, capsys):
    script = load_bounded_auc()
    with pytest.raises(SystemExit) as e:
        script.main(["--lfu-halve-every", bad])
    assert e.value.code == 2
    assert "--lfu-halve-every" in capsys.readouterr().err

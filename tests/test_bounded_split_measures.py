"""bounded_auc.py's tools for choosing a table's split (issue 33): the candidate measures at a
table's fill (asv_bench/scripts/bounded_churn.py: head coverage, victims' return) on a literal
FIFO table and a hand-worked stream; `force_splits` (--split-tables / --keep-tables) against
what an auto table would have chosen; --flip-tables' paired gains on a tiny synthetic run."""
import json
import os
import sys
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest

import cncore

torch = pytest.importorskip("torch")
pytest.importorskip("torchrec")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "asv_bench", "scripts"))
from bench_scripts import load_bounded_auc  # noqa: E402

import bounded_churn  # noqa: E402


def load_script():
    return load_bounded_auc()


@pytest.mark.parametrize("seed", range(5))
def test_head_coverage_against_a_counter(seed):
    rng = np.random.default_rng(seed)
    seen = rng.zipf(1.5, 300) % 50
    call = seen[-40:]
    for max_rows in (1, 5, 49, 80):
        counts = Counter(seen.tolist())
        head = {k for k, _ in sorted(counts.items(), key=lambda kc: (-kc[1], kc[0]))[:max_rows]}
        want_all = sum(c for k, c in counts.items() if k in head) / len(seen)
        want_call = sum(k in head for k in call.tolist()) / len(call)
        assert bounded_churn.head_coverage(seen, call, max_rows) == pytest.approx((want_all, want_call))


class FifoStore:
    """A literal bounded table: inserts a call's missing keys, then evicts the oldest down to max_rows."""

    def __init__(self, max_rows):
        self.config = SimpleNamespace(max_rows=max_rows)
        self.rows: list[int] = []
        self.sinks = []

    def on_evict(self, sink):
        self.sinks.append(sink)

    def contains(self, keys):
        return np.isin(keys, self.rows)

    def __len__(self):
        return len(self.rows)

    def take(self, keys):
        self.rows += [k for k in dict.fromkeys(keys.tolist()) if k not in self.rows]
        victims, self.rows = self.rows[:-self.config.max_rows], self.rows[-self.config.max_rows:]
        for sink in self.sinks:
            sink(SimpleNamespace(keys=np.array(victims, np.int64)))


def test_measures_of_run_on_a_hand_worked_stream():
    """Table a (2 rows, FIFO): [1 1 2] / [3] fills at call 2 (2 held + 1 new): churn 3 keys / 2
    calls / 2 rows, repeat 4 lookups / 3 distinct; the 2 most-counted keys (1, then 2 before 3 on
    the tie) cover 3 of 4 lookups and none of call 2's. Call 3 [1 4] misses 1 (evicted at call 2)
    and 4; call 4 [2 5 1] misses 2 (evicted at call 3) and 5: 2 of 4 misses returned; call 5 is
    past after=2. Head coverage of the next calls: the 2 most-counted before call 3 (1, 2)
    cover 1 of its 2 lookups, before call 4 (1, 2) 2 of 3: 3 / 5. Table b (10 rows) never fills."""
    stores = {"a": FifoStore(2), "b": FifoStore(10)}
    calls = [[1, 1, 2], [3], [1, 4], [2, 5, 1], [3]]
    batches = [SimpleNamespace(keys=np.array(c, np.int64), sparse=SimpleNamespace(
        to_dict=lambda c=c: {f: SimpleNamespace(values=lambda: torch.tensor(c)) for f in ("fa", "fb")}))
        for c in calls]

    def step(batch):
        for s in stores.values():
            s.take(batch.keys)
    configs = [SimpleNamespace(name="a", feature_names=["fa"]), SimpleNamespace(name="b", feature_names=["fb"])]
    run = SimpleNamespace(tables=SimpleNamespace(stores=stores, embedding_bag_configs=lambda: configs), step=step)
    a, b = bounded_churn.measures_of_run(run, batches, after=2)
    assert a == pytest.approx({"table": "a", "max_rows": 2, "fill_calls": 2, "churn": 0.75, "repeat": 4 / 3,
                               "head_all": 0.75, "head_call": 0.0, "victims_return": 0.5,
                               "head_after": 0.6, "seen_return": 0.5})
    assert b["fill_calls"] is None and b["victims_return"] is None


def auto_store():
    return cncore.EmbeddingStore(dim=1, max_rows=4, fallback_rows="auto", optimizer=cncore.SGD(lr=1.0))


def train(store, keys):
    out, ctx = store.pooled_lookup(np.array(keys), lengths=[len(keys)])
    store.apply_gradients(ctx, np.ones((1, 1), np.float32))


def test_forced_decisions_override_auto_at_the_fill_and_unknown_tables_are_refused():
    """Repeated keys (repeat (8 + 12) / 5 = 4 > 3): auto keeps, --split-tables splits it 1 + 3;
    a churning table (repeat 1): auto splits, --keep-tables keeps its 4 rows."""
    script = load_script()
    repeated, churning, free = auto_store(), auto_store(), auto_store()
    script.force_splits(SimpleNamespace(stores={"rep": repeated, "churn": churning, "free": free}),
                        {"rep": True, "churn": False})
    for s in (repeated, free):
        train(s, [0] * 4 + [1] * 4)
        train(s, [2] * 4 + [3] * 4 + [4] * 4)
    for s in (churning,):
        train(s, [0, 1, 2])
        train(s, [3, 4, 5])
    assert repeated.split_measures.repeat == 4.0 and repeated.split_measures.fallback_rows == 0  # auto's choice
    assert (repeated.config.max_rows, repeated.fallback_rows, repeated.forced_fallback_rows) == (1, 3, 3)
    assert free.fallback_rows == 0 and free.config.max_rows == 4 and not hasattr(free, "forced_fallback_rows")
    assert churning.split_measures.fallback_rows == 3  # auto would have split
    assert (churning.config.max_rows, churning.fallback_rows) == (4, 0)
    with pytest.raises(ValueError, match="--split-tables / --keep-tables: no table"):
        script.force_splits(SimpleNamespace(stores={"a": auto_store()}), {"b": True})


def test_flip_tables_options_refused_by_name():
    script = load_script()
    with pytest.raises(SystemExit):
        script.main(["--flip-tables", "--methods", "ours-lfu"])
    with pytest.raises(SystemExit):
        script.main(["--split-tables", "t_a", "--keep-tables", "t_a"])
    with pytest.raises(SystemExit):
        script.main(["--auto-share", "1.0"])


@pytest.mark.slow
def test_flip_tables_reports_each_tables_paired_gain_of_splitting(tmp_path, capsys):
    """A tiny synthetic run: the auto run at 2 seeds, then each decided table flipped alone; a
    table's gain is the mean over seeds of (AUC with it split - AUC with it keyed)."""
    script = load_script()
    out = tmp_path / "flip.json"
    assert script.main(["--steps", "4", "--batch-size", "64", "--eval-batches", "1", "--budgets", "5",
                        "--budget-floor", "none", "--methods", "ours-lfu+auto", "--flip-tables", "--seeds", "2",
                        "--json", str(out)]) == 0
    flips = json.loads(out.read_text())["flips"]
    assert flips
    for f in flips:
        split, keep = ((f["aucs_auto"], f["aucs_flipped"]) if f["auto_split"] else (f["aucs_flipped"], f["aucs_auto"]))
        gains = np.subtract(split, keep)
        assert f["split_gain"] == pytest.approx(gains.mean())
        assert f["split_gain_se"] == pytest.approx(gains.std(ddof=1) / np.sqrt(2))
    assert "| 5% | " in capsys.readouterr().out


def test_overflow_knobs_set_autos_overflow_branch_and_main_puts_the_rule_back(monkeypatch):
    """--overflow-churn 1 --overflow-share 0.5 --overflow-min-rows 3 are auto's own overflow branch
    (cncore.store_split): a 10-row table auto's first branch keeps (repeat 9) splits 5 at churn 2,
    not at 0.5; the first branch's split (9) stands; a 1- or 2-row table cannot split by it, a
    3-row one splits round(1.5) = 2. The script sets the constants and puts them back."""
    from cncore import store_split
    script = load_script()
    seen = {}

    def run_and_look(args, job):  # the knobs as the run sees them, before its data loads
        seen.update(churn=store_split.OVERFLOW_CHURN, share=store_split.OVERFLOW_SHARE,
                    min_rows=store_split.OVERFLOW_MIN_ROWS)
        rule = store_split.auto_fallback_rows
        seen["values"] = [rule(10, 2.0, 9.0), rule(10, 0.5, 9.0), rule(10, 0.5, 1.0), rule(1, 2.0, 9.0),
                          rule(2, 2.0, 9.0), rule(3, 2.0, 9.0)]
        raise SystemExit(0)
    monkeypatch.setattr(script, "load_data", run_and_look)
    original = (store_split.AUTO_CHURN, store_split.OVERFLOW_CHURN, store_split.OVERFLOW_SHARE,
                store_split.OVERFLOW_MIN_ROWS)
    with pytest.raises(SystemExit):
        script.main(["--overflow-churn", "1", "--overflow-share", "0.5", "--overflow-min-rows", "3"])
    assert seen == {"churn": 1.0, "share": 0.5, "min_rows": 3, "values": [5, 0, 9, 0, 0, 2]}
    with pytest.raises(SystemExit):
        script.main(["--overflow-churn", "7", "--overflow-share", "0.25", "--overflow-min-rows", "4"])
    assert seen == {"churn": 7.0, "share": 0.25, "min_rows": 4, "values": [0, 0, 9, 0, 0, 0]}
    with pytest.raises(SystemExit):  # refused after the knobs are set: they are put back all the same
        script.main(["--overflow-churn", "1", "--overflow-share", "1.5", "--auto-churn", "0.01"])
    assert (store_split.AUTO_CHURN, store_split.OVERFLOW_CHURN, store_split.OVERFLOW_SHARE,
            store_split.OVERFLOW_MIN_ROWS) == original == (0.25, 1.0, 0.5, 3)
    rule = store_split.auto_fallback_rows
    assert [rule(10, 2.0, 9.0), rule(10, 0.5, 9.0), rule(10, 0.5, 1.0), rule(1, 2.0, 9.0), rule(2, 2.0, 9.0),
            rule(3, 2.0, 9.0)] == [5, 0, 9, 0, 0, 2]

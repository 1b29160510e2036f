"""Table files of sharded tables: one per rank and table (`save_shard_tables`), re-split offline
by the owner hash (`cn-table reshard`, `cn-table merge-shards`) and loaded into any number of
ranks (`load_shard_tables`). A 3-rank run (gloo) trains a bounded, Adagrad collection and saves
its shards; they are re-split into 2 and 1 and loaded into 2 ranks and into one process: every
key's row, optimizer state, count and last step equals the 3 ranks' state_dicts merged, bit for
bit. Bad inputs (a shard missing, shards overlapping, dims, steps or world sizes mixed, an output
that is not new) are refused with one line naming what, and the output is left as it was."""
import os
import shutil

import numpy as np
import pytest

import cncore
from cncore.routing import owner_of, shard_name
from cncore.tablefile import open_table, save_table
from cncore_numpy.cli import main as cn_table

TIMEOUT = 120.0
FIELDS = ("keys", "rows", "optimizer_state", "counts", "last_steps")


# --- the NumPy owner hash is the torch one --------------------------------------------------------

def test_numpy_owner_of_equals_the_torch_routing():
    torch = pytest.importorskip("torch")
    from cncore_torch.distributed.routing import owner_of as torch_owner_of
    keys = np.concatenate([np.random.default_rng(0).integers(-2**63, 2**63 - 1, 20000, dtype=np.int64),
                           np.array([0, 1, -1, 2**63 - 1, -2**63], np.int64)])
    for world in (1, 2, 3, 5, 8, 64):
        np.testing.assert_array_equal(owner_of(keys, world), torch_owner_of(torch.from_numpy(keys), world).numpy())


# --- shards made without torch: the tool's checks ------------------------------------------------

def _trained_store(keys, dim=3, seed=1, step_to=3, max_rows=None):
    config = cncore.StoreConfig(dim=dim, optimizer=cncore.Adagrad(lr=0.1), seed=seed, max_rows=max_rows,
                                eviction=cncore.LRU() if max_rows else None)
    store = cncore.EmbeddingStore(config)
    rng = np.random.default_rng(seed)
    for _ in range(step_to):
        _, ctx = store.pooled_lookup(keys, lengths=np.ones(len(keys), np.int64))
        store.apply_gradients(ctx, rng.standard_normal((len(keys), dim)).astype(np.float32))
    return store


def _save_shards(folder, keys, world, **kw):
    """The shards of a table whose rows are those of one store over `keys`, split by owner."""
    whole = _trained_store(keys, **kw)
    e = whole.export()
    paths = []
    for r in range(world):
        mine = owner_of(e.keys, world) == r
        shard = cncore.EmbeddingStore(whole.config)
        shard.load(e.keys[mine], e.rows[mine], e.optimizer_state[mine], e.counts[mine], e.last_steps[mine])
        shard.step = whole.step
        paths.append(os.path.join(folder, shard_name(r, world)))
        save_table(shard, paths[-1])
    return whole, paths


def _by_key(table_arrays):
    order = np.argsort(table_arrays["keys"])
    return {f: np.asarray(a)[order] for f, a in table_arrays.items()}


def _arrays(path):
    t = open_table(path)
    return {f: t.read(f, 0, len(t)) for f in FIELDS}


def _assert_same_rows(a, b):
    a, b = _by_key(a), _by_key(b)
    for f in FIELDS:
        np.testing.assert_array_equal(a[f], b[f], err_msg=f)


def test_reshard_and_merge_shards_keep_every_row_exactly(tmp_path, capsys):
    keys = np.random.default_rng(2).integers(-2**63, 2**63 - 1, 500, dtype=np.int64)
    whole, paths = _save_shards(str(tmp_path / "three"), keys, 3)
    e = whole.export()
    want = {f: getattr(e, f) for f in FIELDS}
    assert cn_table(["reshard", "--world-size", "2", *paths, str(tmp_path / "two"), "--quiet"]) == 0
    assert "wrote 500 rows of 3 shards as 2" in capsys.readouterr().out
    for r in range(2):
        got = _arrays(str(tmp_path / "two" / shard_name(r, 2)))
        assert (owner_of(got["keys"], 2) == r).all()
        mine = owner_of(want["keys"], 2) == r
        _assert_same_rows(got, {f: a[mine] for f, a in want.items()})
        assert open_table(str(tmp_path / "two" / shard_name(r, 2))).step == whole.step
    assert cn_table(["inspect", paths[1], "--quiet"]) == 0
    assert "shard 1 of 3: the keys of a table sharded over 3 ranks that rank 1 owns" in capsys.readouterr().out
    assert cn_table(["merge-shards", *paths, str(tmp_path / "one"), "--quiet"]) == 0
    _assert_same_rows(_arrays(str(tmp_path / "one")), want)
    assert open_table(str(tmp_path / "one")).config == whole.config
    # and back: the 2 shards re-split into 3 are the original 3
    two = [str(tmp_path / "two" / shard_name(r, 2)) for r in range(2)]
    assert cn_table(["reshard", "--world-size", "3", *two, str(tmp_path / "again"), "--quiet"]) == 0
    for r in range(3):
        _assert_same_rows(_arrays(str(tmp_path / "again" / shard_name(r, 3))), _arrays(paths[r]))


def test_a_bounded_tables_budget_is_split_and_evictions_summed(tmp_path):
    keys = np.arange(90, dtype=np.int64)
    whole, paths = _save_shards(str(tmp_path / "in"), keys, 3, max_rows=120)
    # each shard saved with the whole budget here; the tool adds them up and splits the sum
    out = str(tmp_path / "out")
    assert cn_table(["reshard", "--world-size", "2", *paths, out, "--quiet"]) == 0
    assert open_table(os.path.join(out, shard_name(0, 2))).config.max_rows == 3 * 120 // 2
    assert cn_table(["reshard", "--world-size", "2", *paths, str(tmp_path / "small"), "--quiet",
                     "--max-rows", "60"]) == 0
    assert open_table(str(tmp_path / "small" / shard_name(1, 2))).config.max_rows == 60


def _refused(capsys, argv, *expected):
    assert cn_table([*argv, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"cn-table {argv[0]}: error: "), err
    for text in expected:
        assert text in err, err
    return err


@pytest.fixture
def shards(tmp_path):
    keys = np.random.default_rng(4).integers(0, 2**40, 300, dtype=np.int64)
    _, paths = _save_shards(str(tmp_path / "s"), keys, 3)
    return paths


@pytest.mark.parametrize("out_state", ["new", "empty", "full"])
def test_bad_shards_are_refused_and_the_output_left_as_it_was(tmp_path, capsys, shards, out_state):
    out = tmp_path / "out"
    if out_state != "new":
        out.mkdir()
    if out_state == "full":
        (out / "keep.txt").write_text("mine")

    def untouched():
        if out_state == "new":
            assert not out.exists()
        else:
            assert sorted(os.listdir(out)) == ([] if out_state == "empty" else ["keep.txt"])
        assert not [e for e in os.listdir(tmp_path) if ".tmp-" in e]

    # a shard missing
    _refused(capsys, ["reshard", "--world-size", "2", shards[0], shards[2], str(out)], "shard 1 of 3 missing")
    untouched()
    _refused(capsys, ["merge-shards", shards[0], shards[1], str(out)], "shard 2 of 3 missing")
    untouched()
    # the same shard twice
    _refused(capsys, ["reshard", "--world-size", "2", *shards, shards[1], str(out)], "shard 1 of 3 given twice")
    untouched()
    # overlapping: shard 0's rows under shard 1's name
    fake = tmp_path / "fake" / shard_name(1, 3)
    shutil.copytree(shards[0], fake)
    _refused(capsys, ["reshard", "--world-size", "2", shards[0], str(fake), shards[2], str(out)],
             "which shard 0 of 3 owns, not 1", "overlap")
    untouched()
    # shards of two splits
    other = tmp_path / "other" / shard_name(1, 2)
    shutil.copytree(shards[1], other)
    _refused(capsys, ["reshard", "--world-size", "2", shards[0], str(other), shards[2], str(out)], "2-way split")
    untouched()
    # a directory that is not a shard table's
    plain = tmp_path / "plain"
    shutil.copytree(shards[1], plain)
    _refused(capsys, ["merge-shards", shards[0], str(plain), shards[2], str(out)], "not a shard table")
    untouched()
    # a path that does not exist
    _refused(capsys, ["reshard", "--world-size", "2", shards[0], str(tmp_path / "s" / "shard-1-of-3x"), shards[2],
                      str(out)])
    untouched()
    if out_state == "full":  # good shards, but the output holds something else
        _refused(capsys, ["reshard", "--world-size", "2", *shards, str(out)], "not an empty directory")
        untouched()


def test_mismatched_dims_and_steps_are_refused(tmp_path, capsys, shards):
    keys = np.random.default_rng(4).integers(0, 2**40, 300, dtype=np.int64)
    for what, kw, expected in (("dim", {"dim": 4}, "dim 4 differs"), ("step", {"step_to": 5}, "step 5 differs")):
        _, other = _save_shards(str(tmp_path / what), keys, 3, **kw)
        out = tmp_path / f"out_{what}"
        _refused(capsys, ["reshard", "--world-size", "2", shards[0], other[1], shards[2], str(out)], expected)
        assert not out.exists()


def test_a_shard_past_its_new_budget_is_refused(tmp_path, capsys):
    keys = np.arange(200, dtype=np.int64)
    _, paths = _save_shards(str(tmp_path / "s"), keys, 2, max_rows=200)
    out = tmp_path / "out"
    _refused(capsys, ["reshard", "--world-size", "4", *paths, str(out), "--max-rows", "40"],
             "past its budget of 40", "--max-rows")
    assert not out.exists()


def test_a_chain_is_refused_with_what_to_run(tmp_path, capsys):
    keys = np.arange(50, dtype=np.int64)
    store = _trained_store(keys)
    path = str(tmp_path / shard_name(0, 1))
    base = save_table(store, path)
    _, ctx = store.pooled_lookup(keys[:5], lengths=np.ones(5, np.int64))
    store.apply_gradients(ctx, np.ones((5, 3), np.float32))
    save_table(store, path, since=base)
    _refused(capsys, ["merge-shards", path, str(tmp_path / "out")], "cn-table compact")


# --- a sharded collection's files: 3 ranks -> 2 ranks and one process ------------------------------

BUDGET = 60  # rows per table in training: 20 a shard on 3 ranks, so every shard evicts
# Loading: a full table's keys do not split evenly by the hash (31 + 29 of 60, say), and a shard
# never loads more rows than its budget; the loading model has room for that.
ROOMY = 4 * BUDGET


def _configs(budget):
    from torchrec import EmbeddingBagConfig
    return [EmbeddingBagConfig(name="t_a", embedding_dim=4, num_embeddings=budget, feature_names=["fa"]),
            EmbeddingBagConfig(name="t_b", embedding_dim=2, num_embeddings=budget, feature_names=["fb"])]


def _model(device, budget=BUDGET):
    from cncore_torch import CNEmbeddingBagCollection
    # a row per key (fallback_rows=0): a shard's trained fallback rows do not re-split
    # (test_distributed_fallback.py), and this test re-splits the keyed rows
    return CNEmbeddingBagCollection(_configs(budget), device=device, optimizer=cncore.Adagrad(lr=0.1),
                                    max_rows="num_embeddings", eviction=cncore.LRU(), seed=3, fallback_rows=0)


def _dmp(budget=BUDGET):
    import torch
    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel

    from cncore_torch.distributed import CNEmbeddingBagCollectionSharder, plan_for
    model = torch.nn.Sequential(_model("meta", budget))
    return DistributedModelParallel(model, device=torch.device("cpu"), sharders=[CNEmbeddingBagCollectionSharder()],
                                    plan=plan_for(model, dist.get_world_size()))


def _train_and_save(rank, world_size, folder):
    import torch
    import torch.distributed as dist
    from torchrec import KeyedJaggedTensor

    from cncore_torch.distributed.checkpoint import save_shard_tables

    dmp = _dmp()
    rng = np.random.default_rng(rank)
    for _ in range(8):
        ids = rng.integers(0, 400, 24)  # more IDs than the budget: every shard evicts
        kjt = KeyedJaggedTensor.from_lengths_sync(["fa", "fb"], torch.from_numpy(ids),
                                                  torch.ones(24, dtype=torch.int64))
        dmp(kjt).wait().values().sum().backward()
    written = save_shard_tables(dmp.module[0], os.path.join(folder, "files"))
    assert written == [os.path.join(folder, "files", n, shard_name(rank, world_size)) for n in ("t_a", "t_b")]
    everyone = [None] * world_size
    dist.all_gather_object(everyone, dict(dmp.module[0].state_dict().items()))
    if rank == 0:
        torch.save(everyone, os.path.join(folder, "state_dicts.pt"))


def _load_and_compare(rank, world_size, folder):
    import torch

    from cncore_torch.distributed.checkpoint import load_shard_tables, merge_shards

    want = merge_shards(torch.load(os.path.join(folder, "state_dicts.pt"), weights_only=False))
    for source in ("two", "files"):  # the files re-split offline, and the 3 ranks' files re-routed on load
        dmp = _dmp(ROOMY)
        load_shard_tables(dmp.module[0], os.path.join(folder, source))
        for name in ("t_a", "t_b"):
            e = dmp.module[0].stores[name].export()
            keys = want[f"tables.{name}.keys"].numpy()
            mine = owner_of(keys, world_size) == rank
            _assert_same_rows({f: getattr(e, f) for f in FIELDS},
                              {f: want[f"tables.{name}.{f}"].numpy()[mine].astype(getattr(e, f).dtype)
                               for f in FIELDS})
            assert dmp.module[0].stores[name].step == int(want[f"tables.{name}.step"])


@pytest.mark.slow
def test_three_rank_shard_files_reshard_into_two_ranks_and_one_process(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    pytest.importorskip("torchrec")
    from cncore_torch.distributed.checkpoint import load_shard_tables, merge_shards
    from cncore_torch.distributed.launch import spawn

    folder = str(tmp_path)
    spawn(_train_and_save, 3, folder, timeout=TIMEOUT)
    files = tmp_path / "files"
    assert sorted(os.listdir(files / "t_a")) == [shard_name(r, 3) for r in range(3)]
    shards = torch.load(tmp_path / "state_dicts.pt", weights_only=False)
    want = merge_shards(shards)
    for name in ("t_a", "t_b"):
        inputs = [str(files / name / shard_name(r, 3)) for r in range(3)]
        # each file is exactly that rank's state_dict shard, budget ceil(300 / 3) in its config
        for r, path in enumerate(inputs):
            t = open_table(path)
            assert t.config.max_rows == BUDGET // 3
            assert t.evicted_count == int(shards[r][f"tables.{name}.evicted_count"])
            _assert_same_rows(_arrays(path), {f: shards[r][f"tables.{name}.{f}"].numpy().astype(
                _arrays(path)[f].dtype) for f in FIELDS})
        assert cn_table(["reshard", "--world-size", "2", *inputs, str(tmp_path / "two" / name), "--quiet",
                         "--max-rows", str(BUDGET)]) == 0
        assert cn_table(["reshard", "--world-size", "1", *inputs, str(tmp_path / "one" / name), "--quiet"]) == 0
        assert cn_table(["merge-shards", *inputs, str(tmp_path / "merged" / name), "--quiet"]) == 0
        for r in range(2):
            assert open_table(str(tmp_path / "two" / name / shard_name(r, 2))).config.max_rows == BUDGET
        merged = open_table(str(tmp_path / "merged" / name))
        assert merged.config.max_rows == BUDGET and merged.step == int(want[f"tables.{name}.step"])
        assert merged.evicted_count == int(want[f"tables.{name}.evicted_count"]) > 0
        _assert_same_rows(_arrays(str(tmp_path / "merged" / name)),
                          {f: want[f"tables.{name}.{f}"].numpy().astype(_arrays(str(tmp_path / "merged" / name))[f]
                                                                         .dtype) for f in FIELDS})
    capsys.readouterr()
    # one process: the re-split-into-1 files, and the 3 ranks' files directly
    for source in ("one", "files"):
        one = _model("cpu")
        load_shard_tables(one, str(tmp_path / source))
        reference = _model("cpu")
        reference.load_state_dict(want)
        for name in ("t_a", "t_b"):
            got, ref = one.stores[name], reference.stores[name]
            _assert_same_rows({f: getattr(got.export(), f) for f in FIELDS},
                              {f: getattr(ref.export(), f) for f in FIELDS})
            assert got.step == ref.step and got.evicted_count == int(want[f"tables.{name}.evicted_count"])
    spawn(_load_and_compare, 2, folder, timeout=TIMEOUT)


def test_loading_shard_files_of_another_dim_changes_nothing(tmp_path):
    pytest.importorskip("torchrec")
    from cncore_torch.distributed.checkpoint import load_shard_tables
    one = _model("cpu")
    keys = np.arange(20, dtype=np.int64)
    for name, dim in (("t_a", 4), ("t_b", 3)):  # t_b has dim 2 here
        _save_shards(str(tmp_path / name), keys, 2, dim=dim)
    with pytest.raises(ValueError, match=r"shard-0-of-2: dim 3 .* table 't_b' here has dim 2.*nothing was loaded"):
        load_shard_tables(one, str(tmp_path))
    assert len(one.stores["t_a"]) == 0 and len(one.stores["t_b"]) == 0
    shutil.rmtree(tmp_path / "t_b" / shard_name(1, 2))
    with pytest.raises(ValueError, match="shard 1 of 2 missing"):
        load_shard_tables(one, str(tmp_path))


def test_shard_chains_load_whole_into_one_process(tmp_path):
    """Shards saved as chains (the job's per-rank incremental checkpoints) load as their last state."""
    pytest.importorskip("torchrec")
    from cncore_torch.distributed.checkpoint import load_shard_tables
    keys = np.random.default_rng(5).integers(0, 2**40, 120, dtype=np.int64)
    want = {}
    for name, dim in (("t_a", 4), ("t_b", 2)):
        whole = _trained_store(keys, dim=dim)
        e = whole.export()
        parts = []
        for r in range(2):
            mine = owner_of(e.keys, 2) == r
            shard = cncore.EmbeddingStore(whole.config)
            shard.load(e.keys[mine], e.rows[mine], e.optimizer_state[mine], e.counts[mine], e.last_steps[mine])
            shard.step = whole.step
            path = str(tmp_path / name / shard_name(r, 2))
            base = save_table(shard, path)
            k = e.keys[mine][:5]
            _, ctx = shard.pooled_lookup(k, lengths=np.ones(len(k), np.int64))
            shard.apply_gradients(ctx, np.ones((len(k), dim), np.float32))
            shard.erase(e.keys[mine][-3:])
            assert save_table(shard, path, since=base).delta
            parts.append({f: getattr(shard.export(), f) for f in FIELDS})
        want[name] = {f: np.concatenate([p[f] for p in parts]) for f in FIELDS}
    one = _model("cpu", ROOMY)
    load_shard_tables(one, str(tmp_path))
    for name in ("t_a", "t_b"):
        _assert_same_rows({f: getattr(one.stores[name].export(), f) for f in FIELDS}, want[name])
        assert one.stores[name].step == 4


def test_reshard_runs_without_torch(tmp_path, shards):
    """cn-table (cncore_numpy) re-splits with the NumPy owner hash: no framework is imported."""
    import subprocess
    import sys
    code = ("import sys; from cncore_numpy.cli import main; "
            f"rc = main(['reshard', '--world-size', '2', *{shards!r}, {str(tmp_path / 'out')!r}, '--quiet']); "
            "assert rc == 0; print(sorted(m for m in ('torch', 'jax', 'tensorflow') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"
    assert sorted(os.listdir(tmp_path / "out")) == [shard_name(0, 2), shard_name(1, 2)]


def test_an_unpooled_collection_on_one_process_round_trips_through_three_shards(tmp_path):
    """save_shard_tables on one process writes shard-0-of-1 files; re-split into 3 by the tool,
    they load back into a fresh collection (reading all 3), every row and its state exact."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("torchrec")
    from torchrec import EmbeddingConfig, KeyedJaggedTensor

    from cncore_torch import CNEmbeddingCollection
    from cncore_torch.distributed.checkpoint import load_shard_tables, save_shard_tables

    def collection():
        return CNEmbeddingCollection([EmbeddingConfig(name="t_u", embedding_dim=3, num_embeddings=100,
                                                      feature_names=["u"])], optimizer=cncore.Adam(lr=0.01), seed=7)
    ec = collection()
    ids = torch.from_numpy(np.random.default_rng(6).integers(-2**63, 2**63 - 1, 50, dtype=np.int64))
    out = ec(KeyedJaggedTensor.from_lengths_sync(["u"], ids, torch.ones(50, dtype=torch.int64)))
    out["u"].values().sum().backward()
    assert save_shard_tables(ec, str(tmp_path / "one")) == [str(tmp_path / "one" / "t_u" / shard_name(0, 1))]
    assert cn_table(["reshard", "--world-size", "3", str(tmp_path / "one" / "t_u" / shard_name(0, 1)),
                     str(tmp_path / "three" / "t_u"), "--quiet"]) == 0
    back = collection()
    load_shard_tables(back, str(tmp_path / "three"))
    want, got = ec.stores["t_u"], back.stores["t_u"]
    _assert_same_rows({f: getattr(got.export(), f) for f in FIELDS}, {f: getattr(want.export(), f) for f in FIELDS})
    assert got.step == want.step == 1

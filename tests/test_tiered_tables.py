"""A tier's directory read as a table: `open_table`, `load_store` and every read-only `cn-table`
command give what they give for the same table saved with `save_table` (keys, rows, optimizer
state, counts, last steps, config, step, eviction counter), walking it in bounded memory; a
tier never flushed, or damaged, is refused with a message that says which, and is left as it was."""
import json
import os
import re
import tracemalloc

import numpy as np
import pytest

import cncore
from cncore.tablefile import TableFormatError, load_store, open_table, save_table
from cncore.tier import TierFile
from cncore_numpy.cli import main
from cncore_numpy.exchange import export_table

COLUMNS = ("keys", "rows", "optimizer_state", "counts", "last_steps")


def trained_tier(directory, optimizer=cncore.RowWiseAdagrad(lr=0.1), dim=6, dtype="float32", n_keys=3000,
                 steps=40, cache_rows=200, seed=0):
    """A tier trained with Zipf-skewed IDs, most rows on disk, some cached, then flushed; its
    table also saved with save_table (as `directory`/t.cnt) at that moment; then trained on
    without a flush (so the tier's directory is its table of the flush, no newer)."""
    path = str(directory / "t.tier")
    state_floats = cncore.StoreConfig(dim=dim, optimizer=optimizer).state_floats
    per_row = dim * (4 if dtype == "float32" else 2) + 4 * state_floats + 47
    store = cncore.make_store(cncore.StoreConfig(dim=dim, dtype=dtype, optimizer=optimizer, seed=seed,
                                                 initializer=cncore.Normal(0, 1),
                                                 storage=cncore.Tiered(path, cache_bytes=cache_rows * per_row)))
    rng = np.random.default_rng(seed)

    def train(n_steps):
        for _ in range(n_steps):
            keys = np.concatenate([[-2**63, 2**63 - 1, 0, -1], rng.zipf(1.2, 60) % n_keys - n_keys // 2])
            _, ctx = store.pooled_lookup(keys, lengths=np.full(8, 8))
            if optimizer is None:
                store.accumulate_gradients(ctx, rng.standard_normal((8, dim)).astype(np.float32))
                store.step = store.step + 1
            else:
                store.apply_gradients(ctx, rng.standard_normal((8, dim)).astype(np.float32))

    train(steps)
    store.flush()
    save_table(store, str(directory / "t.cnt"))
    assert 0 < store.cached_rows < len(store)
    train(5)  # spills into slots the flush does not use
    # (those spills are written behind, by the tier's background thread: wait for them, so that
    # the directory the tests compare before and after a cn-table command is the store's last word)
    store._wait_writes()
    return store, path, str(directory / "t.cnt")


def columns(table, batch_rows=1 << 18):
    """Every column of a table, sorted by key, read through batches()."""
    parts = {name: [] for name in COLUMNS}
    for _, b in table.batches(batch_rows):
        for name in COLUMNS:
            parts[name].append(b[name])
    out = {name: np.concatenate(p) if p else np.zeros(0) for name, p in parts.items()}
    order = np.argsort(out["keys"])
    return {name: v[order] for name, v in out.items()}


@pytest.mark.parametrize("optimizer, dtype", [(None, "float32"), (cncore.RowWiseAdagrad(lr=0.1), "float32"),
                                              (cncore.Adam(lr=0.01), "float32"), (cncore.Adam(lr=0.01), "float16"),
                                              (cncore.RowWiseAdagrad(lr=0.1), "bfloat16")])
def test_open_table_reads_a_tier_as_its_saved_table(tmp_path, optimizer, dtype):
    store, tier_path, table_path = trained_tier(tmp_path, optimizer, dtype=dtype)
    tier, table = open_table(tier_path), open_table(table_path)
    assert isinstance(tier, TierFile)
    assert (len(tier), tier.dim, tier.config, tier.step, tier.evicted_count) == (
        len(table), table.dim, table.config, table.step, table.evicted_count)
    want = columns(table)
    for batch_rows in (1, 97, 1 << 18):
        got = columns(tier, batch_rows)
        for name in COLUMNS:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    keys = np.concatenate([want["keys"][::7], [12345678, -987654321]])
    np.testing.assert_array_equal(tier.lookup(keys), table.lookup(keys))
    np.testing.assert_array_equal(tier.pooled_lookup(keys, lengths=[len(keys) - 5, 5], mode="mean"),
                                  table.pooled_lookup(keys, lengths=[len(keys) - 5, 5], mode="mean"))
    loaded, reference = load_store(tier_path).export(), load_store(table_path).export()
    ia, ib = np.argsort(loaded.keys), np.argsort(reference.keys)
    for name in ("keys", "rows", "optimizer_state", "counts", "last_steps"):
        np.testing.assert_array_equal(getattr(loaded, name)[ia], getattr(reference, name)[ib], err_msg=name)
    assert load_store(tier_path).step == table.step


def test_take_and_read_give_the_records_of_those_row_numbers(tmp_path):
    """take / read against batches() of the same tier: row numbers name the same records."""
    _, tier_path, _ = trained_tier(tmp_path)
    tier = open_table(tier_path)
    whole = {name: np.concatenate([b[name] for _, b in tier.batches(1 << 18)]) for name in COLUMNS}
    rows = np.random.default_rng(1).integers(0, len(tier), 500)
    for name in COLUMNS:
        np.testing.assert_array_equal(tier.take(name, rows, chunk=64), whole[name][rows], err_msg=name)
        np.testing.assert_array_equal(tier.read(name, 10, 90), whole[name][10:90], err_msg=name)
    with pytest.raises(IndexError, match=r"rows: row numbers must be in \[0, "):
        tier.take("rows", np.array([len(tier)]))


def test_cn_table_commands_on_a_tier_equal_them_on_its_saved_table(tmp_path, capsys):
    store, tier_path, table_path = trained_tier(tmp_path, cncore.Adam(lr=0.01))
    before = {e: os.path.getsize(os.path.join(tier_path, e)) for e in os.listdir(tier_path)}
    summaries = []
    for path in (tier_path, table_path):
        assert main(["inspect", path, "--json", "--quiet"]) == 0
        summaries.append(json.loads(capsys.readouterr().out))
    assert summaries[0].pop("bytes") > 0 and summaries[1].pop("bytes") > 0
    assert summaries[0] == summaries[1]
    for ext in ("npz", "npy"):
        exported = []
        for name, path in (("tier", tier_path), ("table", table_path)):
            out = str(tmp_path / f"{name}.{ext}")
            assert main(["export", path, out, "--quiet"]) == 0
            data = np.load(out)
            if ext == "npz":
                order = np.argsort(data["keys"])
                exported.append({k: data[k][order] if data[k].ndim else data[k] for k in data.files})
            else:
                exported.append({"records": np.sort(data, order="key")})
        assert exported[0].keys() == exported[1].keys()
        for k in exported[0]:
            np.testing.assert_array_equal(exported[0][k], exported[1][k], err_msg=k)
    for name, path in (("tier", tier_path), ("table", table_path)):
        assert main(["to-fixed", path, str(tmp_path / f"{name}-fixed.npz"), "--quiet"]) == 0
        assert main(["prune", path, str(tmp_path / f"{name}-pruned"), "--min-count", "2", "--quiet"]) == 0
    for name in ("fixed.npz",):
        a, b = np.load(str(tmp_path / f"tier-{name}")), np.load(str(tmp_path / f"table-{name}"))
        for k in a.files:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    pruned = [columns(open_table(str(tmp_path / f"{name}-pruned"))) for name in ("tier", "table")]
    assert 0 < len(pruned[0]["keys"]) < len(store)
    for name in COLUMNS:
        np.testing.assert_array_equal(pruned[0][name], pruned[1][name], err_msg=name)
    capsys.readouterr()
    assert main(["diff", tier_path, table_path, "--json", "--quiet"]) == 0
    assert json.loads(capsys.readouterr().out)["changed"] == 0
    assert main(["diff", table_path, tier_path, "--json", "--quiet"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert (d["added"], d["removed"], d["changed"]) == (0, 0, 0)
    assert main(["merge", tier_path, table_path, str(tmp_path / "merged"), "--policy", "left", "--quiet"]) == 0
    merged, want = columns(open_table(str(tmp_path / "merged"))), columns(open_table(table_path))
    for name in COLUMNS:
        np.testing.assert_array_equal(merged[name], want[name], err_msg=name)
    assert main(["compact", tier_path, "--quiet"]) == 0
    assert "not a chain" in capsys.readouterr().out
    # read-only: the tier's directory is as it was, and it still reopens as the store's flush
    assert {e: os.path.getsize(os.path.join(tier_path, e)) for e in os.listdir(tier_path)} == before


def test_a_tier_walks_in_bounded_memory(tmp_path):
    """Exporting a tier reads a batch of records at a time: the traced peak (NumPy's buffers)
    stays far below the rows file, and opening reads only the index (16 bytes a row)."""
    path = str(tmp_path / "big.tier")
    config = cncore.StoreConfig(dim=64, optimizer=cncore.RowWiseAdagrad(),
                                storage=cncore.Tiered(path, cache_bytes=1 << 20))
    store = cncore.make_store(config)
    for start in range(0, 40_000, 2000):
        store.find_or_insert(np.arange(start, start + 2000))
    store.flush()
    store.close()
    rows_file = os.path.getsize(os.path.join(path, "rows.dat"))
    assert rows_file > 40_000 * 260
    tracemalloc.start()
    try:
        tier = open_table(path)
        _, opened = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        export_table(tier, str(tmp_path / "big.npy"), batch_rows=1024)
        _, walked = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert opened < 48 * 40_000, opened           # the index and its sort, no rows
    # a few batches' buffers (the records read, their columns, the export's records; two batches
    # alive as the loop moves on): bounded by the batch, not the table
    assert walked < 8 * 1024 * tier.record_bytes < rows_file / 4, (walked, rows_file)
    assert len(np.load(str(tmp_path / "big.npy"), mmap_mode="r")) == 40_000


def test_a_tier_never_flushed_or_damaged_is_refused_and_left_as_it_was(tmp_path, capsys):
    path = str(tmp_path / "t.tier")
    config = cncore.StoreConfig(dim=4, storage=cncore.Tiered(path, cache_bytes=16 * (4 * 4 + 47)))
    store = cncore.make_store(config)
    for start in range(0, 200, 10):  # rows spilled to rows.dat, never flushed
        store.find_or_insert(np.arange(start, start + 10))
    store._wait_writes()  # (written behind: in the file before the listings below are taken)
    assert os.path.getsize(os.path.join(path, "rows.dat")) > 0

    def refused(match):
        listing = {e: open(os.path.join(path, e), "rb").read() for e in os.listdir(path)}
        for opener in (open_table, load_store):
            with pytest.raises(TableFormatError, match=match):
                opener(path)
        assert main(["inspect", path, "--quiet"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("cn-table inspect: error: ") and len(err.splitlines()) == 1
        assert re.search(match, err), err
        assert {e: open(os.path.join(path, e), "rb").read() for e in os.listdir(path)} == listing

    refused(r"holds no flushed table \(no meta.json: the tier was never flushed.*TieredStore.flush\(\)")
    store.flush()
    store.close()
    assert len(open_table(path)) == 200
    meta_path = os.path.join(path, "meta.json")
    meta = json.load(open(meta_path))
    index = os.path.join(path, meta["index"])
    rows_dat = os.path.join(path, "rows.dat")
    good = {name: open(name, "rb").read() for name in (meta_path, index, rows_dat)}

    def restore():
        for name, data in good.items():
            with open(name, "wb") as fh:
                fh.write(data)

    os.remove(index)
    refused(r"index-\d+\.npz is missing \(meta.json names it; the tier is damaged\)")
    restore()
    with open(rows_dat, "r+b") as fh:
        fh.truncate(len(good[rows_dat]) - 100)
    refused(r"rows.dat has \d+ bytes, the index needs \d+ \(truncated\)")
    restore()
    with open(meta_path, "w") as fh:
        fh.write('{"format": "cn-tier", ')
    refused(r"meta.json is not valid JSON .*damaged")
    restore()
    with open(meta_path, "w") as fh:
        json.dump({k: v for k, v in meta.items() if k != "step"}, fh)
    refused(r"meta.json lacks or mistypes fields \(\['step'\]\)")
    restore()
    with open(rows_dat, "r+b") as fh:  # a record's key overwritten
        fh.seek(0)
        fh.write(np.int64(-424242).tobytes())
    with pytest.raises(TableFormatError, match=r"rows.dat holds key -424242 in slot 0, the index says"):
        list(open_table(path).batches())
    restore()
    assert len(load_store(path)) == 200


"""Incremental saves of (bounded) tables: a base and deltas load as the store they saved (rows,
state, counts, last steps, step), a delta holds only the rows trained or inserted since and
the keys removed since, a save that could miss a change is a full one, a chain is refused by
open_table and merged by compact_table, and a kill during delta saves leaves a chain that
opens as the last complete save."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from reference import assert_unchanged, snapshot

import cncore
from cncore.tablefile import (
    MAX_CHAIN,
    TableFormatError,
    compact_table,
    load_store,
    open_table,
    open_table_rows,
    save_table,
)


def bounded(max_rows=300):
    return cncore.EmbeddingStore(dim=3, seed=2, fallback_rows=0, max_rows=max_rows, eviction=cncore.LRU(),
                                 optimizer=cncore.RowWiseAdagrad(lr=0.1))


def train(store, keys, bags=4):
    keys = np.asarray(keys, dtype=np.int64)
    lengths = np.full(bags, len(keys) // bags)
    lengths[-1] += len(keys) - lengths.sum()
    _, ctx = store.pooled_lookup(keys, lengths=lengths)
    store.apply_gradients(ctx, np.ones((bags, store.dim), np.float32))


def test_a_chain_of_deltas_loads_as_the_store_it_saved(tmp_path):
    path = str(tmp_path / "t")
    rng = np.random.default_rng(0)
    s = bounded()
    train(s, rng.integers(0, 1000, 250))
    checkpoint = save_table(s, path)
    assert not checkpoint.delta
    for round_ in range(6):
        train(s, rng.integers(0, 1000, 60))          # trains, inserts and evicts
        s.erase(rng.integers(0, 1000, 5))
        s.find_or_insert(rng.integers(1000, 1100, 3))  # inserted, never trained
        if round_ == 3:
            s.evict(10)
        checkpoint = save_table(s, path, since=checkpoint)
        assert checkpoint.delta and checkpoint.chain == round_ + 1
        back = load_store(path)
        assert_unchanged(back, snapshot(s))
        assert back.evicted_count == s.evicted_count  # the counter is in the file
    assert s.evicted_count >= 10  # the explicit evict(10) at least
    assert len(os.listdir(path)) == 1 + 7  # CURRENT and the chain: base + 6 deltas


def test_a_delta_holds_the_rows_trained_since_and_the_keys_removed_since(tmp_path):
    path = str(tmp_path / "t")
    s = cncore.EmbeddingStore(dim=2, optimizer=cncore.SGD(lr=0.1), eviction=cncore.LFU())
    train(s, np.arange(10_000))
    base = save_table(s, path)
    train(s, np.arange(100, 200))
    s.erase(np.arange(5000, 5007))
    s.evict(3)  # the lowest (count 1, last step 0) keys: 0, 1, 2
    delta = save_table(s, path, since=base)
    assert delta.delta and open_table_rows(path, delta.version) == 100
    with open(os.path.join(path, delta.version, "manifest.json")) as fh:
        assert json.load(fh)["delta"]["parent"] == base.version
    removed = np.load(os.path.join(path, delta.version, "removed_keys.npy"))
    assert sorted(removed.tolist()) == [0, 1, 2] + list(range(5000, 5007))
    assert_unchanged(load_store(path), snapshot(s))


def test_a_save_that_could_miss_a_change_is_a_full_one(tmp_path):
    path = str(tmp_path / "t")
    s = bounded()
    train(s, np.arange(50))
    base = save_table(s, path)
    s.assign(np.array([3]), np.full((1, 3), 9.0, np.float32))  # no step recorded: a delta would miss it
    full = save_table(s, path, since=base)
    assert not full.delta and full.chain == 0
    assert_unchanged(load_store(path), snapshot(s))
    other = bounded()
    train(other, np.arange(50))
    assert not save_table(other, path, since=full).delta              # another store's checkpoint
    mine = save_table(s, path)
    assert not save_table(s, str(tmp_path / "elsewhere"), since=mine).delta  # another path
    save_table(s, path)
    assert not save_table(s, path, since=mine).delta                  # the table was saved since
    checkpoint = save_table(s, path)
    for _ in range(MAX_CHAIN):
        checkpoint = save_table(s, path, since=checkpoint)
        assert checkpoint.delta
    assert not save_table(s, path, since=checkpoint).delta             # the chain is full
    with pytest.raises(TypeError, match="since must be the Checkpoint"):
        save_table(s, path, since="v000001")


def test_open_table_refuses_a_chain_and_compact_table_merges_it(tmp_path):
    path = str(tmp_path / "t")
    s = bounded()
    train(s, np.arange(200))
    base = save_table(s, path)
    train(s, np.arange(150, 260))  # evicts
    save_table(s, path, since=base)
    with pytest.raises(TableFormatError, match="is a delta .* load_store"):
        open_table(path)
    merged = compact_table(path)
    assert not merged.delta and sorted(os.listdir(path)) == ["CURRENT", merged.version]
    table = open_table(path)
    e = s.export()
    assert sorted(table.keys.tolist()) == sorted(e.keys.tolist()) and table.step == s.step


def test_a_damaged_delta_is_refused_naming_its_file(tmp_path):
    path = str(tmp_path / "t")
    s = bounded()
    train(s, np.arange(100))
    base = save_table(s, path)
    s.erase(np.arange(10))
    delta = save_table(s, path, since=base)
    file = os.path.join(path, delta.version, "removed_keys.npy")
    os.chmod(file, 0o644)
    with open(file, "r+b") as fh:
        fh.seek(-1, 2)
        fh.write(b"\x7f")
    with pytest.raises(TableFormatError, match="removed_keys.npy fails its SHA-256 check"):
        load_store(path)


CHILD = r"""
import sys, json, numpy as np, cncore
from cncore.tablefile import save_table
path = sys.argv[1]
rng = np.random.default_rng(0)
s = cncore.EmbeddingStore(dim=8, max_rows=20000, eviction=cncore.LRU(), optimizer=cncore.SGD(lr=0.1))
checkpoint = None
for i in range(1000):
    keys = rng.integers(0, 60000, 4096)
    _, ctx = s.pooled_lookup(keys, lengths=np.full(64, 64))
    s.apply_gradients(ctx, np.ones((64, 8), np.float32))
    e = s.export()
    digest = float(e.rows.astype(np.float64).sum() + e.keys.sum() % 1000003)
    print(json.dumps({"step": s.step, "rows": len(s), "digest": digest}), flush=True)  # the state about to be saved
    checkpoint = save_table(s, path, since=checkpoint) if checkpoint is not None and i % 8 else save_table(s, path)
"""


def test_a_kill_during_delta_saves_leaves_the_last_complete_chain(tmp_path):
    """SIGKILL at random moments of a loop of delta saves (a base every 8): the table always
    loads, and as one of the states the child was saving (matched by step and content)."""
    rng = np.random.default_rng(3)
    for trial in range(4):
        path = str(tmp_path / f"t{trial}")
        child = subprocess.Popen([sys.executable, "-c", CHILD, path], stdout=subprocess.PIPE, text=True)
        states = []
        deadline = time.monotonic() + 30
        while len(states) < 3 + rng.integers(0, 6) and time.monotonic() < deadline:
            states.append(json.loads(child.stdout.readline()))
        time.sleep(float(rng.uniform(0, 0.05)))
        child.send_signal(signal.SIGKILL)
        child.wait()
        states += [json.loads(line) for line in child.stdout.read().splitlines() if line.startswith("{")]
        loaded = load_store(path)
        e = loaded.export()
        digest = float(e.rows.astype(np.float64).sum() + e.keys.sum() % 1000003)
        match = [st for st in states if st["step"] == loaded.step]
        assert match and match[0]["rows"] == len(loaded)
        assert digest == pytest.approx(match[0]["digest"], rel=1e-9)


def test_export_without_rows_gives_keys_and_metadata_only():
    s = bounded()
    train(s, np.arange(40))
    full, meta = s.export(), s.export(with_rows=False)
    assert meta.rows.shape == (40, 0) and meta.optimizer_state.shape == (40, 0)
    assert meta.keys.tolist() == full.keys.tolist() and meta.counts.tolist() == full.counts.tolist()
    assert meta.last_steps.tolist() == full.last_steps.tolist()
    with pytest.raises(TypeError, match="with_rows must be True or False"):
        s.export(with_rows="no")


def test_the_eviction_counter_is_saved_with_the_table(tmp_path):
    """Format version 3 keeps `evicted_count`: a full save, `open_table` and the torch
    checkpoint <-> table files conversion carry it."""
    torch = pytest.importorskip("torch")
    from cncore_torch.checkpoint import checkpoint_to_tables, tables_to_checkpoint
    s = bounded(max_rows=50)
    for start in range(0, 400, 40):
        train(s, np.arange(start, start + 40))
    assert s.evicted_count == 400 - len(s) > 300  # every row admitted and not kept was evicted
    save_table(s, str(tmp_path / "t"))
    on_disk = str(tmp_path / "t")
    assert open_table(on_disk).evicted_count == s.evicted_count == load_store(on_disk).evicted_count
    entries = tables_to_checkpoint(str(tmp_path))
    assert int(entries["t.evicted_count"]) == s.evicted_count
    checkpoint_to_tables(entries, str(tmp_path / "again"), configs={"t.": s.config})
    assert open_table(str(tmp_path / "again" / "t")).evicted_count == s.evicted_count
    entries["t.evicted_count"] = torch.tensor(-1)
    with pytest.raises(ValueError, match="t.evicted_count: must be >= 0"):
        checkpoint_to_tables(entries, str(tmp_path / "refused"))
    assert not os.path.exists(tmp_path / "refused")

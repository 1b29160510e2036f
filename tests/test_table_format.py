"""The table file format: exact round trips, damage refused, atomic against SIGKILL."""
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import cncore
from cncore_numpy import TableFormatError, load_table, save_table
from reference import EDGE_KEYS


def trained_store(optimizer, initializer=cncore.Uniform(-0.1, 0.1), n=500, seed=0):
    store = cncore.EmbeddingStore(dim=6, seed=seed, optimizer=optimizer, initializer=initializer)
    rng = np.random.default_rng(seed)
    keys = np.concatenate([np.array(EDGE_KEYS), rng.integers(-(2**63), 2**63 - 1, n)])
    for _ in range(3):
        _, ctx = store.pooled_lookup(keys, lengths=np.ones(len(keys), dtype=np.int64))
        store.apply_gradients(ctx, rng.standard_normal((len(keys), 6)).astype(np.float32))
    return store


def assert_same(a: cncore.EmbeddingStore, b: cncore.EmbeddingStore):
    ea = a.export()
    rb = b.read(ea.keys)
    assert len(a) == len(b) and rb.found.all()
    np.testing.assert_array_equal(rb.rows, ea.rows)
    np.testing.assert_array_equal(rb.optimizer_state, ea.optimizer_state)
    np.testing.assert_array_equal(rb.counts, ea.counts)
    np.testing.assert_array_equal(rb.last_steps, ea.last_steps)
    assert a.config == b.config and a.step == b.step


@pytest.mark.parametrize("optimizer", [None, cncore.SGD(lr=0.1), cncore.Adagrad(lr=0.1), cncore.RowWiseAdagrad(lr=0.1),
                                       cncore.Adam(lr=0.01, betas=(0.8, 0.9))], ids=str)
def test_round_trip_is_exact(tmp_path, optimizer):
    if optimizer is None:
        store = cncore.EmbeddingStore(dim=6, initializer=cncore.TruncatedNormal(0, 1, -1, 1))
        store.find_or_insert(np.array(EDGE_KEYS))
    else:
        store = trained_store(optimizer)
    save_table(store, str(tmp_path / "t"), batch_rows=97)  # several export batches
    assert_same(store, load_table(str(tmp_path / "t"), batch_rows=101))


def test_readable_by_plain_numpy_without_the_core(tmp_path):
    save_table(trained_store(cncore.SGD()), str(tmp_path / "t"))
    code = f"""
import json, os, sys, numpy as np
root = {str(tmp_path / 't')!r}
version = open(os.path.join(root, 'CURRENT')).read().strip()
manifest = json.load(open(os.path.join(root, version, 'manifest.json')))
rows = np.load(os.path.join(root, version, 'rows.npy'), mmap_mode='r')
assert rows.shape == tuple(manifest['arrays']['rows']['shape'])
assert 'cncore' not in sys.modules
print(rows.shape[0])
"""
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert int(out) == 10 + 500


def test_saving_again_replaces_the_version_and_keeps_one(tmp_path):
    path = str(tmp_path / "t")
    a, b = trained_store(cncore.SGD(), seed=1), trained_store(cncore.SGD(), seed=2)
    save_table(a, path)
    save_table(b, path)
    assert sorted(os.listdir(path)) == ["CURRENT", "v000002"]
    assert_same(b, load_table(path))


def damage(path, how):
    version = open(os.path.join(path, "CURRENT")).read().strip()
    rows = os.path.join(path, version, "rows.npy")
    if how == "flip":
        with open(rows, "r+b") as fh:
            fh.seek(os.path.getsize(rows) - 7)
            byte = fh.read(1)
            fh.seek(-1, 1)
            fh.write(bytes([byte[0] ^ 0x40]))
    elif how == "truncate":
        with open(rows, "r+b") as fh:
            fh.truncate(os.path.getsize(rows) - 100)
    elif how == "manifest":
        with open(os.path.join(path, version, "manifest.json"), "w") as fh:
            fh.write("{ not json")
    elif how == "current":
        os.remove(os.path.join(path, "CURRENT"))
    elif how == "missing":
        os.remove(rows)


@pytest.mark.parametrize("how,message", [("flip", "SHA-256"), ("truncate", "truncated"), ("manifest", "damaged"),
                                         ("current", "no CURRENT"), ("missing", "missing")])
def test_damage_is_refused_with_a_reason(tmp_path, how, message):
    path = str(tmp_path / "t")
    save_table(trained_store(cncore.RowWiseAdagrad()), path)
    damage(path, how)
    with pytest.raises(TableFormatError, match=message):
        load_table(path)


SAVER = """
import sys, numpy as np, cncore
from cncore_numpy import save_table
path = sys.argv[1]
stores = []
for seed in (1, 2):
    s = cncore.EmbeddingStore(dim=32, seed=seed, optimizer=cncore.Adagrad())
    s.find_or_insert(np.arange(seed * 10**6, seed * 10**6 + 60_000))
    stores.append(s)
print("ready", flush=True)
i = 0
while True:
    save_table(stores[i % 2], path, batch_rows=5000)
    i += 1
"""


def test_sigkill_during_saves_always_leaves_the_old_or_the_new_table(tmp_path):
    path = str(tmp_path / "t")
    expected = {}
    for seed in (1, 2):
        s = cncore.EmbeddingStore(dim=32, seed=seed, optimizer=cncore.Adagrad())
        s.find_or_insert(np.arange(seed * 10**6, seed * 10**6 + 60_000))
        expected[seed] = s
    rng = np.random.default_rng(0)
    kills = 0
    for _ in range(12):
        proc = subprocess.Popen([sys.executable, "-c", SAVER, path], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(float(rng.uniform(0.01, 0.4)))  # somewhere inside a save
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kills += 1
        if not os.path.exists(os.path.join(path, "CURRENT")):
            continue  # killed before the very first save committed: nothing to check yet
        got = load_table(path)
        first = int(got.export(max_rows=1).keys[0]) // 10**6
        assert_same(expected[first], got)
    assert kills == 12
    assert os.path.exists(os.path.join(path, "CURRENT"))


def test_a_save_killed_after_its_rename_but_before_the_commit_is_harmless(tmp_path):
    path = str(tmp_path / "t")
    a, b = trained_store(cncore.SGD(), seed=1), trained_store(cncore.SGD(), seed=2)
    save_table(a, path)
    os.makedirs(os.path.join(path, "v000002"))  # what such a kill leaves: the next version, uncommitted
    open(os.path.join(path, "v000002", "rows.npy"), "w").write("partial")
    assert_same(a, load_table(path))  # CURRENT still names the old table
    save_table(b, path)
    assert_same(b, load_table(path))

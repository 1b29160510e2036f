"""The table file format: exact round trips, damage refused, atomic against SIGKILL."""
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from reference import EDGE_KEYS, tree

import cncore
from cncore_numpy import FORMAT_VERSION, TableFormatError, TableWriter, load_table, open_table, save_table


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


@pytest.mark.parametrize("target", ["project", "file", "table-with-notes"])
def test_a_save_into_a_directory_holding_other_files_is_refused_and_touches_nothing(tmp_path, target):
    """save_table(store, "project") used to delete everything in "project" but CURRENT and its version."""
    path = tmp_path / "target"
    if target == "project":
        path.mkdir()
        (path / "notes.txt").write_text("mine")
        (path / "src").mkdir()
        (path / "src" / "main.py").write_text("print()")
    elif target == "file":
        path.write_text("a file")
    else:
        save_table(trained_store(cncore.SGD(), n=5), str(path))
        (path / "notes.txt").write_text("mine")
    before = tree(tmp_path)
    message = "is not a directory" if target == "file" else r"not a table directory \(it holds 'notes.txt'"
    with pytest.raises(TableFormatError, match=message):
        save_table(trained_store(cncore.SGD(), n=5), str(path))
    assert tree(tmp_path) == before


def test_a_save_goes_into_a_new_path_or_an_empty_directory(tmp_path):
    (tmp_path / "empty").mkdir()
    store = trained_store(cncore.SGD(), n=5)
    for path in (tmp_path / "empty", tmp_path / "new" / "nested"):
        save_table(store, str(path))
        assert sorted(os.listdir(path)) == ["CURRENT", "v000001"]
        assert_same(store, load_table(str(path)))


def test_a_refused_save_leaves_no_directory_behind(tmp_path):
    """A writer that fails removes what it made, directories it created included, and nothing else."""
    (tmp_path / "keep.txt").write_text("x")
    before = tree(tmp_path)
    with pytest.raises(ValueError, match="counts"):
        with TableWriter(str(tmp_path / "new" / "t"), cncore.StoreConfig(dim=2), n_rows=1) as w:
            w.write([1], np.zeros((1, 2), np.float32), counts=[-1])
    assert tree(tmp_path) == before


def test_a_save_removes_only_what_saves_make(tmp_path):
    path = tmp_path / "t"
    a, b = trained_store(cncore.SGD(), seed=1, n=5), trained_store(cncore.SGD(), seed=2, n=5)
    save_table(a, str(path))
    (path / ".v000009.tmp-123").mkdir()  # an interrupted save's temporaries and an uncommitted version
    (path / ".CURRENT.tmp-123").write_text("v000009\n")
    (path / "v000009").mkdir()
    save_table(b, str(path))
    assert sorted(os.listdir(path)) == ["CURRENT", "v000010"]  # numbered after every version present
    assert_same(b, load_table(str(path)))


def test_table_writer_refuses_values_a_cast_would_change(tmp_path):
    config = cncore.StoreConfig(dim=1)
    cases = [(dict(keys=[1.2, 1.7]), "keys: expected integers, got float64"),
             (dict(keys=np.array([2**63], np.uint64)), "keys: values must fit int64"),
             (dict(counts=[-1, 0]), r"counts: values must be in \[0, 2\*\*32 - 1\]"),
             (dict(last_steps=[2**40, 0]), r"last_steps: values must be in \[0, 2\*\*32 - 1\]"),
             (dict(rows=np.array([["a"], ["b"]])), "rows: expected real numbers")]
    for change, message in cases:
        batch = dict(keys=[1, 2], rows=np.zeros((2, 1), np.float32), **dict.fromkeys(("counts", "last_steps")))
        batch.update(change)
        with pytest.raises(ValueError, match=message):
            with TableWriter(str(tmp_path / "t"), config, n_rows=2) as w:
                w.write(**batch)
        assert not (tmp_path / "t").exists()


def test_an_open_table_reads_on_after_saves_replace_it(tmp_path):
    """A TableFile used to raise FileNotFoundError once a save had removed its version."""
    path = str(tmp_path / "t")
    a, b = trained_store(cncore.Adagrad(), seed=1, n=50), trained_store(cncore.Adagrad(), seed=2, n=50)
    save_table(a, path)
    table = open_table(path)
    save_table(b, path)
    save_table(a, path)
    assert sorted(os.listdir(path)) == ["CURRENT", "v000003"]  # table's version is gone from the directory
    ea = a.export()
    np.testing.assert_array_equal(table.lookup(ea.keys), ea.rows)
    np.testing.assert_array_equal(table.take("optimizer_state", np.arange(len(table))), table.optimizer_state)
    assert sum(len(batch["keys"]) for _, batch in table.batches(7)) == len(a)
    assert table.nbytes > 0 and sorted(table.read("keys", 0, len(table)).tolist()) == sorted(ea.keys.tolist())


LOOP_SAVER = """
import sys, numpy as np, cncore
from cncore_numpy import save_table
path = sys.argv[1]
stores = []
for seed in (1, 2):
    s = cncore.EmbeddingStore(dim=8, seed=seed, optimizer=cncore.Adagrad(), initializer=cncore.Constant(seed))
    s.find_or_insert(np.arange(seed * 10**6, seed * 10**6 + 20_000))
    stores.append(s)
save_table(stores[0], path)
print("ready", flush=True)
i = 1
while True:
    save_table(stores[i % 2], path, batch_rows=4000)
    i += 1
"""


def test_readers_never_fail_while_another_process_saves_in_a_loop(tmp_path):
    """Before: 899 of 2131 open + lookup attempts failed beside a saving loop. Each open must see
    one whole version (all rows 1.0 and A's keys, or all 2.0 and B's keys) and finish with it."""
    path = str(tmp_path / "t")
    saver = subprocess.Popen([sys.executable, "-c", LOOP_SAVER, path], stdout=subprocess.PIPE, text=True)
    try:
        assert saver.stdout.readline().strip() == "ready"
        probe = np.concatenate([np.arange(10**6, 10**6 + 20_000, 997), np.arange(2 * 10**6, 2 * 10**6 + 20_000, 997)])
        half = len(probe) // 2
        attempts, versions, failures = 0, set(), []
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            attempts += 1
            try:
                table = open_table(path)
                versions.add(os.path.basename(os.path.dirname(table.keys.filename)))
                time.sleep(0.002)  # let a save or two replace the version while it is in use
                got = table.lookup(probe)
                seed = int(got[0, 0]) or 2
                expected = np.zeros_like(got)
                expected[slice(0, half) if seed == 1 else slice(half, None)] = seed
                np.testing.assert_array_equal(got, expected)
                assert len(table) == 20_000 and (table.read("optimizer_state", 0, 100) == 0).all()
            except Exception as exc:  # counted, not raised: the test reports how many failed
                failures.append(repr(exc))
    finally:
        saver.kill()
        saver.wait()
    assert failures == [], f"{len(failures)} of {attempts} attempts failed, e.g. {failures[:3]}"
    assert attempts > 50 and len(versions) > 5, (attempts, versions)  # it really raced the saves


def test_version_1_tables_without_a_manifest_checksum_still_open(tmp_path):
    """Format version 2 added manifest.sha256; a table written as version 1 (none) still opens,
    every other check applied."""
    import json
    path = str(tmp_path / "t")
    store = trained_store(cncore.Adam(), n=20)
    save_table(store, path)
    version = os.path.join(path, open(os.path.join(path, "CURRENT")).read().strip())
    manifest = json.load(open(os.path.join(version, "manifest.json")))
    assert manifest["version"] == 3 and FORMAT_VERSION == 3
    manifest["version"] = 1
    del manifest["evicted"]  # version 3 added it
    with open(os.path.join(version, "manifest.json"), "w") as fh:
        json.dump(manifest, fh)
    os.remove(os.path.join(version, "manifest.sha256"))
    assert_same(store, load_table(path))
    manifest["config"]["dim"] = 7  # and a version 1 manifest is still cross-checked
    with open(os.path.join(version, "manifest.json"), "w") as fh:
        json.dump(manifest, fh)
    with pytest.raises(TableFormatError, match=r"arrays\.rows\.shape must be \[\d+, 7\]"):
        open_table(path)


def test_the_manifest_checksum_sees_an_edit(tmp_path):
    """An edited config.dim used to open (and export the wrong half of each row)."""
    path = str(tmp_path / "t")
    save_table(trained_store(cncore.SGD(), n=20), path)
    version = os.path.join(path, open(os.path.join(path, "CURRENT")).read().strip())
    text = open(os.path.join(version, "manifest.json")).read()
    with open(os.path.join(version, "manifest.json"), "w") as fh:
        fh.write(text.replace('"dim": 6', '"dim": 3'))
    with pytest.raises(TableFormatError, match=r"manifest\.json fails its SHA-256 check against manifest\.sha256"):
        open_table(path, verify=False)  # cheap: checked even without verify

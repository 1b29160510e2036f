"""The SSD tier (cncore/tier/) against a second writer, a crash, damaged files and misuse:
every outcome is the exact rows of the last flush, or a clear refusal that leaves the directory
as it was; never a silent change, a crash or a hang.

- One writer a directory: an exclusive flock(2) on the directory for a store's life; a second
  store (same process, another process) is refused at once naming the holder's pid; a killed
  writer's lock goes with it; a forked child's copy of a store refuses every verb.
- Readers (TierFile: open_table, load_store, cn-table) take no lock: they read the flush they
  opened, consistently, and refuse once the writer has flushed again.
- Records carry a checksum (directory version 4), checked by every read of the store and of
  the readers; older directories read as before, without one.
- The harness at the end drives generated sequences of opens, training, flushes, closes,
  SIGKILLed writers (mid-write and mid-flush), second opens, truncations and byte flips, and
  compares every outcome with an in-memory replay of what was flushed.
"""
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule, run_state_machine_as_test
from reference import assert_unchanged, run_isolated, snapshot, tree

import cncore
from cncore.tablefile import TableFormatError, load_store, open_table
from cncore.tier import records as tiered_module

DIM = 4


def config_at(path, cache_rows=24, optimizer=None):
    row = DIM * 4 + 8 + 47  # the row, row-wise Adagrad's float, metadata and index share
    return cncore.StoreConfig(dim=DIM, seed=5, optimizer=optimizer or cncore.RowWiseAdagrad(lr=0.1),
                              storage=cncore.Tiered(str(path), cache_bytes=cache_rows * row))


def train(store, keys, scale=1.0):
    """Training steps over keys, 10 IDs a step (a step must fit the smallest cache here)."""
    keys = np.asarray(keys, np.int64)
    for a in range(0, len(keys), 10):
        part = keys[a:a + 10]
        _, ctx = store.pooled_lookup(part, lengths=np.ones(len(part), np.int64))
        store.apply_gradients(ctx, np.full((len(part), DIM), scale, np.float32))


def sorted_export(store):
    b = store.export()
    order = np.argsort(b.keys)
    return {"keys": b.keys[order], "rows": b.rows[order], "optimizer_state": b.optimizer_state[order],
            "counts": b.counts[order], "last_steps": b.last_steps[order], "step": np.int64(store.step)}


def table_export(path):
    """What a reader (open_table) holds, as sorted_export gives it."""
    table = open_table(str(path))
    parts = [b for _, b in table.batches(50)]
    if not parts:
        c = table.config
        return {"keys": np.empty(0, np.int64), "rows": np.empty((0, c.dim), np.float32),
                "optimizer_state": np.empty((0, c.state_floats), np.float32), "counts": np.empty(0, np.uint32),
                "last_steps": np.empty(0, np.uint32), "step": np.int64(table.step)}
    got = {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}
    order = np.argsort(got["keys"])
    return {"keys": got["keys"][order], "rows": got["rows"][order], "optimizer_state": got["optimizer_state"][order],
            "counts": got["counts"][order], "last_steps": got["last_steps"][order], "step": np.int64(table.step)}


def same(a, b) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def filled(path, n=200):
    """A store at path holding n trained rows (most on disk), flushed."""
    store = cncore.make_store(config_at(path))
    for start in range(0, n, 10):
        train(store, np.arange(start, start + 10))
    store.flush()
    return store


# --- one writer a directory ------------------------------------------------------------------------

def test_a_second_store_on_an_open_directory_is_refused_and_changes_nothing(tmp_path):
    """Before: both opens were accepted, and their spills overwrote each other's slots."""
    path = tmp_path / "t"
    first = filled(path)
    train(first, np.arange(300, 340))  # unflushed rows, some spilled to the file
    first._wait_writes()
    expected = sorted_export(first)
    before = tree(path)
    with pytest.raises(BlockingIOError) as info:
        cncore.make_store(config_at(path))
    message = str(info.value)
    assert message == (f"Tiered.path: {path} is open in another TieredStore (held by this process, {os.getpid()}); "
                       "a tier directory has one writer at a time: close that store first, or read its last flush "
                       "with cncore.tablefile.open_table")
    assert tree(path) == before
    assert same(sorted_export(first), expected)  # the first store goes on, whole
    train(first, np.arange(0, 40))
    first.flush()
    expected = sorted_export(first)
    first.close()
    assert sorted(os.listdir(path)) == ["index-000002.npz", "meta.json", "rows.dat"]  # the pid file goes at close
    again = cncore.make_store(config_at(path))  # the lock went with close()
    assert same(sorted_export(again), expected)


_HOLD = """
import sys, numpy as np, cncore
sys.path.insert(0, {tests!r})
from test_tier_hardening import config_at, train
store = cncore.make_store(config_at({path!r}))
for start in range(0, 200, 10):
    train(store, np.arange(start, start + 10))
store.flush()
print("ready", flush=True)
sys.stdin.readline()
"""


def test_another_process_is_refused_naming_the_holders_pid(tmp_path):
    path = str(tmp_path / "t")
    child = subprocess.Popen([sys.executable, "-c", _HOLD.format(tests=os.path.dirname(__file__), path=path)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        before = tree(path)
        with pytest.raises(BlockingIOError, match=rf"^Tiered.path: {path} is open in another TieredStore \(held by "
                                                  rf"process {child.pid}\); a tier directory has one writer"):
            cncore.make_store(config_at(path))
        assert tree(path) == before
        assert len(open_table(path)) == 200  # a reader is not refused: it reads the last flush
    finally:
        child.kill()
        child.wait(30)


_KILLED_MID_WRITE = """
import os, sys, threading, numpy as np, cncore
sys.path.insert(0, {tests!r})
from test_tier_hardening import config_at, train, sorted_export
store = cncore.make_store(config_at({path!r}))
for start in range(0, 200, 10):
    train(store, np.arange(start, start + 10))
store.flush()
np.savez({snap!r}, **sorted_export(store))
gate = threading.Event()
from cncore.tier import background as tiered
tiered._prefetcher().submit(gate.wait)  # the spills below queue behind it: killed with writes pending
for start in range(500, 700, 10):
    train(store, np.arange(start, start + 10), 2.0)
assert store._spills.pending
os.kill(os.getpid(), 9)
"""


def test_a_writer_killed_mid_write_leaves_no_lock_and_the_last_flush(tmp_path):
    path = str(tmp_path / "t")
    snap = str(tmp_path / "snap.npz")
    run = subprocess.run([sys.executable, "-c", _KILLED_MID_WRITE.format(tests=os.path.dirname(__file__), path=path,
                                                                         snap=snap)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == -signal.SIGKILL, run.stderr
    with open(os.path.join(path, "lock")) as fh:  # its pid file stays; the kernel's lock does not
        dead = int(fh.read())
    assert dead != os.getpid()
    store = cncore.make_store(config_at(path))
    expected = dict(np.load(snap))
    assert same(sorted_export(store), expected)
    with open(os.path.join(path, "lock")) as fh:
        assert int(fh.read()) == os.getpid()


def test_a_forked_child_is_refused_the_parents_store_and_cannot_release_its_lock():
    """The child inherits the store and the directory's descriptor (the lock's). Its verbs refuse,
    naming the parent; a new store in the child is refused too; and the child's exit (its
    copies closed, never unlocked) leaves the parent holding the directory."""
    out = run_isolated(f"""
        import os, sys, json, tempfile, numpy as np, cncore
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_tier_hardening import config_at, train, sorted_export, same
        path = os.path.join(tempfile.mkdtemp(), "t")
        store = cncore.make_store(config_at(path))
        for start in range(0, 200, 10):
            train(store, np.arange(start, start + 10))
        store.flush()
        expected = sorted_export(store)
        parent = os.getpid()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            said = []
            for verb in (lambda: store.lookup(np.arange(5)), lambda: train(store, np.arange(5)), store.flush,
                         lambda: len(store), store.export):
                try:
                    verb()
                    said.append("ran")
                except ValueError as exc:
                    said.append(str(exc))
            try:
                cncore.make_store(config_at(path))
                said.append("opened")
            except BlockingIOError as exc:
                said.append(str(exc))
            store.close()  # a no-op in the child
            os.write(w, json.dumps(said).encode())
            sys.exit(0)  # a normal exit: finalizers run
        os.close(w)
        _, status = os.waitpid(pid, 0)
        said = json.loads(os.read(r, 1 << 16))
        try:
            cncore.make_store(config_at(path))
            still_held = False
        except BlockingIOError as exc:
            still_held = f"held by this process, {{parent}}" in str(exc)
        ok = same(sorted_export(store), expected)
        train(store, np.arange(0, 20))
        store.flush()
        store.close()
        again = cncore.make_store(config_at(path))
        print(json.dumps({{"status": status, "said": said, "parent": parent, "child": pid, "path": path,
                          "still_held": still_held, "unchanged": ok, "reopened": len(again)}}))
    """, timeout=120)
    assert out["status"] == 0 and out["still_held"] and out["unchanged"] and out["reopened"] == 200
    refusal = (f"this TieredStore of {out['path']} belongs to process {out['parent']}, which forked this process "
               f"({out['child']}); a tier directory has one writer: use the store in the parent only, or read its "
               "last flush here with cncore.tablefile.open_table")
    assert out["said"][:5] == [refusal] * 5
    assert out["said"][5].startswith(f"Tiered.path: {out['path']} is open in another TieredStore (held by process "
                                     f"{out['parent']})")


# --- load with repeated keys -------------------------------------------------------------------------

@pytest.mark.parametrize("n", [10, 13, 40])
def test_load_with_a_repeated_key_matches_memory(tmp_path, n):
    """Before: a key given twice, over more than half the cache (so in two chunks), came back
    found=True the second time. In memory `found` says which keys had a row before the call."""
    tier = cncore.make_store(config_at(tmp_path / "t"))  # 24 rows: chunks of 12
    memory = cncore.make_store(dataclasses.replace(tier.config, storage=None))
    for store in (tier, memory):
        store.find_or_insert(np.array([3, 100]))
    keys = np.concatenate([np.arange(n), [0, 3, 7 % n], np.arange(n, 2 * n)]).astype(np.int64)
    rows = np.arange(len(keys) * DIM, dtype=np.float32).reshape(-1, DIM)
    found = tier.load(keys, rows)
    assert found.tolist() == memory.load(keys, rows).tolist() == [k in (3, 100) for k in keys.tolist()]
    assert same(sorted_export(tier), sorted_export(memory))


def test_a_load_over_several_chunks_checks_every_argument_before_the_first_chunk(tmp_path):
    """A bad argument past the first chunk (half the cache) is refused before anything changes."""
    store = filled(tmp_path / "t")
    snap = snapshot(store)
    keys = np.arange(1000, 1040, dtype=np.int64)
    rows = np.ones((40, DIM), np.float32)
    with pytest.raises(ValueError, match="counts"):
        store.load(keys, rows, counts=np.ones(39, np.uint32))
    with pytest.raises(ValueError, match="optimizer_state"):
        store.load(keys, rows, optimizer_state=np.ones((40, 2), np.float32))
    assert_unchanged(store, snap)


# --- damaged directories ---------------------------------------------------------------------------------

def test_a_truncated_rows_dat_is_refused_at_reopen_and_left_as_it_is(tmp_path):
    """Before: the store reopened and failed later with OSError EIO; cn-table refused up front."""
    path = tmp_path / "t"
    filled(path).close()
    rows_dat = path / "rows.dat"
    size = os.path.getsize(rows_dat)
    with open(rows_dat, "r+b") as fh:
        fh.truncate(size - 100)
    (path / "lock").write_text("424242\n")  # a killed writer's pid file: the refusal leaves it too
    before = tree(path)
    with pytest.raises(TableFormatError, match=rf"^Tiered.path: {path}: rows.dat has {size - 100} bytes, the index "
                                               rf"needs {size} \(truncated\); the directory is left as it is"):
        cncore.make_store(config_at(path))
    with pytest.raises(TableFormatError, match=rf"rows.dat has {size - 100} bytes, the index needs {size} "
                                               r"\(truncated\)"):
        open_table(str(path))
    assert tree(path) == before
    os.remove(rows_dat)
    before = tree(path)
    with pytest.raises(TableFormatError, match=r"rows.dat is missing, the index needs \d+ \(truncated\)"):
        cncore.make_store(config_at(path))
    assert tree(path) == before  # not created empty


@pytest.mark.parametrize("where", ["key", "row", "state", "count", "check"])
def test_a_flipped_byte_in_a_record_is_refused_by_the_store_and_the_readers(tmp_path, where):
    """Before: a flipped byte of a row was read back silently, by the store and by load_store."""
    path = tmp_path / "t"
    store = filled(path)
    keys, slots = next(store._disk.items(1 << 20))
    key, slot = int(keys[0]), int(slots[0])
    record = store._record
    store.close()
    offset = int(tiered_module.record_offsets(np.array([slot]), record.itemsize, 4096 // record.itemsize)[0])
    field = {"key": "key", "row": "row", "state": "state", "count": "count", "check": "check"}[where]
    at = offset + record.fields[field][1] + (3 if where == "row" else 0)
    with open(path / "rows.dat", "r+b") as fh:
        fh.seek(at)
        byte = fh.read(1)[0]
        fh.seek(at)
        fh.write(bytes([byte ^ 0x10]))
    if where == "key":
        held = key ^ 0x10
        message = rf"{path}: rows.dat holds key {held} in slot {slot}, the index says {key}: "
    else:
        message = (rf"{path}: rows.dat: the record of key {key} in slot {slot} fails its checksum "
                   r"\(the file is damaged\)")
    before = tree(path)
    store = cncore.make_store(config_at(path))
    with pytest.raises(TableFormatError, match=message + r".*the table is unchanged"):
        store.lookup(np.array([key]))
    with pytest.raises(TableFormatError, match=message):
        store.export()
    assert len(store) == 200
    store.close()
    for read in (lambda: load_store(str(path)), lambda: open_table(str(path)).lookup([key])):
        with pytest.raises(TableFormatError, match=message + ".*the tier is damaged"):
            read()
    from cncore_numpy.cli import main
    assert main(["export", str(path), str(tmp_path / "out.npz")]) == 2
    assert tree(path) == before


def test_a_version_3_directory_reads_and_writes_as_before_without_checksums(tmp_path, monkeypatch):
    """Directories written before checksums keep their layout: no record is refused, nothing is
    rewritten in another layout, and readers read them."""
    path = tmp_path / "t"
    monkeypatch.setattr(tiered_module, "_VERSION", 3)
    old = filled(path)
    old_bytes = old.record_bytes
    expected = sorted_export(old)
    old.close()
    monkeypatch.undo()
    assert tiered_module._VERSION == 4
    store = cncore.make_store(config_at(path))
    assert store.record_bytes == old_bytes == 40 and "check" not in store._record.names
    assert same(sorted_export(store), expected)
    train(store, np.arange(150, 260, 10))
    store.flush()
    expected = sorted_export(store)
    store.close()
    assert json.load(open(path / "meta.json"))["version"] == 3
    assert same(sorted_export(load_store(str(path))), dict(expected.items()))
    new = cncore.make_store(config_at(tmp_path / "new"))  # 36 bytes of fields: the checksum in the padding
    assert new.record_bytes == 40 and new._record.fields["check"][1] == 36


def test_a_dangling_symlink_as_the_path_is_refused_by_name(tmp_path):
    """Before: a raw FileExistsError from makedirs."""
    link = tmp_path / "t"
    os.symlink(tmp_path / "gone", link)
    with pytest.raises(ValueError, match=rf"^Tiered.path: {link} is a symbolic link to {tmp_path}/gone, which does "
                                         "not exist; create the directory it points to, or give another path"):
        cncore.make_store(config_at(link))
    assert os.listdir(tmp_path) == ["t"] and os.path.islink(link)
    (tmp_path / "gone").mkdir()
    store = cncore.make_store(config_at(link))  # a link to a directory is a directory
    train(store, np.arange(10))
    assert len(store) == 10



@pytest.mark.parametrize("build", ["make_store", "TieredStore", "EmbeddingStore"])
def test_a_config_and_fields_together_are_refused_by_every_constructor_and_make_no_directory(tmp_path, build):
    """TieredStore(config, dim=8) used to drop the fields without a word; every constructor and
    the factory read their config through one check."""
    from cncore.tier import TieredStore
    make = {"make_store": cncore.make_store, "TieredStore": TieredStore, "EmbeddingStore": cncore.EmbeddingStore}[build]
    with pytest.raises(TypeError, match=r"^pass either a StoreConfig or its fields as keywords, not both$"):
        make(config_at(tmp_path / "t"), dim=8)
    with pytest.raises(TypeError, match=r"^config must be a cncore.StoreConfig, got dict$"):
        make({"dim": 8})
    assert os.listdir(tmp_path) == []

# --- a closed store -----------------------------------------------------------------------------------

def test_every_verb_of_a_closed_store_raises_one_clear_error(tmp_path):
    """Before: a read or export after close() raised TypeError: an integer is required."""
    path = tmp_path / "t"
    store = filled(path)
    train(store, np.arange(0, 30))
    _, ctx = store.pooled_lookup(np.arange(5), lengths=np.ones(5, np.int64))
    store.close()
    store.close()  # a second close does nothing
    before = tree(path)
    verbs = {
        "lookup": lambda: store.lookup(np.arange(5)), "read": lambda: store.read(np.arange(50)),
        "find": lambda: store.find(np.arange(5)), "contains": lambda: store.contains(np.arange(5)),
        "find_or_insert": lambda: store.find_or_insert(np.arange(5)),
        "insert_or_assign": lambda: store.insert_or_assign(np.arange(2), np.ones((2, DIM), np.float32)),
        "assign": lambda: store.assign(np.arange(2), np.ones((2, DIM), np.float32)),
        "load": lambda: store.load(np.arange(2), np.ones((2, DIM), np.float32)),
        "erase": lambda: store.erase(np.arange(2)), "clear": store.clear, "reserve": lambda: store.reserve(10),
        "export": store.export, "iter_export": lambda: store.iter_export(), "len": lambda: len(store),
        "flush": store.flush, "compact": store.compact, "prefetch": lambda: store.prefetch(np.arange(5)),
        "pooled_lookup": lambda: store.pooled_lookup(np.arange(5), lengths=np.ones(5, np.int64)),
        "apply_gradients": lambda: store.apply_gradients(ctx, np.ones((5, DIM), np.float32)),
        "accumulate_gradients": lambda: store.accumulate_gradients(ctx, np.ones((5, DIM), np.float32)),
        "evict": lambda: store.evict(3), "evict_expired": store.evict_expired,
        "evict_if": lambda: store.evict_if(lambda b: np.ones(len(b.keys), bool)),
        "decay_admission": store.decay_admission,
    }
    message = (f"I/O operation on closed store: {path} was closed (TieredStore.close()); open the directory again "
               "with cncore.make_store(config) to use it")
    for name, verb in verbs.items():
        with pytest.raises(ValueError) as info:
            verb()
        assert str(info.value) == message, name
    assert repr(store) == f"TieredStore(path={str(path)!r}, unusable: {message})"
    assert tree(path) == before


# --- readers beside a writer ----------------------------------------------------------------------------

def test_a_reader_reads_the_flush_it_opened_and_refuses_after_a_new_one(tmp_path):
    """A reader takes no lock: beside a training store it reads the flush it opened, exactly;
    once the store flushes again (here compacting, which moves and truncates records) its reads
    refuse naming the writer, and a new open reads the new flush."""
    path = tmp_path / "t"
    store = filled(path)
    flushed = sorted_export(store)
    table = open_table(str(path))
    for start in range(0, 200, 10):  # spills meanwhile land only on slots the flush does not use
        train(store, np.arange(start + 1000, start + 1010), 3.0)
    np.testing.assert_array_equal(table.lookup(flushed["keys"]), flushed["rows"])
    assert same(sorted_export(load_store(str(path))), flushed)
    store.flush()
    store.compact()
    with pytest.raises(TableFormatError, match=rf"^{path}: the tier was flushed again since it was opened \(held by "
                                               rf"this process, {os.getpid()}\).*open the directory again"):
        table.lookup(flushed["keys"][:3])
    assert same(sorted_export(load_store(str(path))), sorted_export(store))


_FLUSHING = """
import json, os, sys, numpy as np, cncore
sys.path.insert(0, {tests!r})
from test_tier_hardening import config_at, train, sorted_export
path, side = {path!r}, {side!r}

def commit():
    meta = os.path.join(path, "meta.json")
    return json.load(open(meta))["commit"] if os.path.exists(meta) else 0

def flushed(verb):  # the table of each commit the verb made (a compaction makes two), named by its index
    first = commit() + 1
    verb()
    table = sorted_export(store)
    for c in range(first, commit() + 1):
        name = f"index-{{c:06d}}.npz"
        np.savez(os.path.join(side, "tmp.npz"), **table)
        os.replace(os.path.join(side, "tmp.npz"), os.path.join(side, name))

store = cncore.make_store(config_at(path, cache_rows=40))
for start in range(0, 200, 10):
    train(store, np.arange(start, start + 10))
flushed(store.flush)
print("ready", flush=True)
for i in range(400):
    train(store, (np.arange(0, 200, 7) + i) % 230, 1.0 + i)
    flushed(store.flush)
    if i % 5 == 0:
        flushed(store.compact)
"""


def test_readers_racing_flushes_and_compactions_read_a_flush_or_refuse(tmp_path, capsys):
    """Before: cn-table reads of a tier being flushed sometimes raised a raw FileNotFoundError
    or OSError EIO. Every read is now either exactly the flush it opened (the writer saves each
    commit's table beside the directory, named by its index) or TableFormatError."""
    from cncore_numpy.cli import main
    path, side = str(tmp_path / "t"), str(tmp_path / "side")
    os.mkdir(side)
    child = subprocess.Popen([sys.executable, "-c", _FLUSHING.format(tests=os.path.dirname(__file__), path=path,
                                                                     side=side)],
                             stdout=subprocess.PIPE, text=True)
    outcomes = {"read": 0, "refused": 0}
    try:
        assert child.stdout.readline().strip() == "ready"
        while child.poll() is None and sum(outcomes.values()) < 150:
            try:
                table = open_table(path)
                parts = [b for _, b in table.batches(16)]
                got = {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}
                version = table.version
            except TableFormatError:
                outcomes["refused"] += 1
            else:
                saved = os.path.join(side, version)
                for _ in range(500):  # the writer saves it right after the commit
                    if os.path.exists(saved):
                        break
                    time.sleep(0.01)
                want = dict(np.load(saved))
                order = np.argsort(got["keys"])
                for name in ("keys", "rows", "optimizer_state", "counts", "last_steps"):
                    np.testing.assert_array_equal(got[name][order], want[name], err_msg=name)
                outcomes["read"] += 1
            code = main(["inspect", path, "--quiet"])
            err = capsys.readouterr().err
            assert code == 0 or (code == 2 and "Errno" not in err and len(err.splitlines()) == 1), err
    finally:
        child.kill()
        child.wait(30)
    print("readers racing flushes:", outcomes)
    assert outcomes["read"] > 0, outcomes


# --- the adversarial harness --------------------------------------------------------------------------

COUNTS = {"cases": 0, "steps": 0, "kills": 0, "damaged": 0, "crashes": 0, "hangs": 0, "silent_changes": 0,
          "refusals": 0, "exact": 0}

_CHILD = """
import os, sys, threading, time, numpy as np, cncore
sys.path.insert(0, {tests!r})
from test_tier_hardening import config_at, train, sorted_export
path, side, seed, kill_at, flush_every = {path!r}, {side!r}, {seed}, {kill_at}, {flush_every}
try:
    store = cncore.make_store(config_at(path))
except BlockingIOError as exc:
    print("refused:" + str(exc), flush=True)
    sys.exit(0)
rng = np.random.default_rng(seed)
for step in range(1000):
    train(store, rng.integers(0, 120, 12), float(rng.integers(1, 4)))
    if step == kill_at:
        os.kill(os.getpid(), 9)  # mid-write: spills queued or being written
    if step % flush_every == flush_every - 1:
        np.savez(os.path.join(side, "candidate.npz"), **sorted_export(store))
        if step + 1 == kill_at:  # killed during this flush, from another thread
            threading.Timer(0.002 * (seed % 5), os.kill, (os.getpid(), 9)).start()
        store.flush()
        os.replace(os.path.join(side, "candidate.npz"), os.path.join(side, "flushed.npz"))
"""


class TierHarness(RuleBasedStateMachine):
    """A tier directory driven by generated operations; the model is what its last flush holds
    (a sorted export) and, while a store is open here, an in-memory store trained alike."""

    @initialize()
    def start(self):
        import tempfile
        self.root = tempfile.mkdtemp()
        self.path = os.path.join(self.root, "t")
        self.side = os.path.join(self.root, "side")
        os.mkdir(self.side)
        self.flushed = None  # the model: the last flush (None: never flushed)
        self.store = self.memory = None
        COUNTS["cases"] += 1

    def teardown(self):
        if self.store is not None:
            self.store.close()
        import shutil
        shutil.rmtree(self.root, ignore_errors=True)

    def expect_flushed(self, outcome):
        """An opened store or a read table must hold exactly the last flush."""
        if self.flushed is None:
            expect = {"keys": np.empty(0, np.int64)}
            ok = len(outcome["keys"]) == 0
        else:
            ok = same(outcome, self.flushed)
            expect = self.flushed
        if not ok:
            COUNTS["silent_changes"] += 1
        assert ok, (len(outcome["keys"]), len(expect["keys"]))
        COUNTS["exact"] += 1

    def step(self):
        COUNTS["steps"] += 1

    @precondition(lambda self: self.store is None)
    @rule()
    def open(self):
        self.step()
        try:
            self.store = cncore.make_store(config_at(self.path))
        except (TableFormatError, BlockingIOError) as exc:
            raise AssertionError(f"an intact directory was refused: {exc}") from exc
        got = sorted_export(self.store)
        self.expect_flushed(got)
        self.memory = cncore.make_store(dataclasses.replace(self.store.config, storage=None))
        if self.flushed is not None:
            f = self.flushed
            self.memory.load(f["keys"], f["rows"], f["optimizer_state"], f["counts"], f["last_steps"])
            self.memory.step = int(f["step"])

    @precondition(lambda self: self.store is not None)
    @rule(keys=st.lists(st.integers(0, 150), min_size=1, max_size=20), scale=st.sampled_from([0.5, 1.0, 2.0]))
    def train(self, keys, scale):
        self.step()
        for s in (self.store, self.memory):
            train(s, keys, scale)

    @precondition(lambda self: self.store is not None)
    @rule()
    def flush(self):
        self.step()
        self.store.flush()
        self.flushed = sorted_export(self.memory)
        assert same(sorted_export(self.store), self.flushed)

    @precondition(lambda self: self.store is not None)
    @rule()
    def close(self):
        self.step()
        self.store.close()
        self.store = self.memory = None

    @precondition(lambda self: self.store is not None)
    @rule()
    def second_open(self):
        self.step()
        before = tree(self.path)
        try:
            cncore.make_store(config_at(self.path))
        except BlockingIOError as exc:
            assert f"held by this process, {os.getpid()}" in str(exc)
            COUNTS["refusals"] += 1
        else:
            COUNTS["silent_changes"] += 1
            raise AssertionError("a second store opened an open directory")
        assert tree(self.path) == before

    @rule()
    def read(self):
        """A reader beside the writer (or none): the last flush, exactly."""
        self.step()
        if self.flushed is None:
            return
        self.expect_flushed(table_export(self.path))

    def close_here(self):
        if self.store is not None:
            self.store.close()
            self.store = self.memory = None

    @rule(seed=st.integers(0, 1000), kill_at=st.integers(0, 12), flush_every=st.integers(1, 5),
          holder=st.booleans())
    def killed_writer(self, seed, kill_at, flush_every, holder):
        """A child process opens the directory (or is refused: `holder`, this process holds it),
        trains, flushes, and is SIGKILLed mid-write or mid-flush. The directory then holds the
        last flush it finished, or the one it was killed in (past its commit point)."""
        self.step()
        if holder and self.store is None:
            self.open()
        elif not holder:
            self.close_here()
        for name in ("candidate.npz", "flushed.npz"):
            if os.path.exists(os.path.join(self.side, name)):
                os.remove(os.path.join(self.side, name))
        code = _CHILD.format(tests=os.path.dirname(__file__), path=self.path, side=self.side, seed=seed,
                             kill_at=kill_at, flush_every=flush_every)
        before = tree(self.path) if holder else None
        try:
            run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        except subprocess.TimeoutExpired:
            COUNTS["hangs"] += 1
            raise
        if holder:
            if not (run.returncode == 0 and run.stdout.startswith("refused:")
                    and f"held by process {os.getpid()}" in run.stdout):
                COUNTS["crashes" if run.returncode not in (0, -9) else "silent_changes"] += 1
                raise AssertionError(run.stdout + run.stderr)
            COUNTS["refusals"] += 1
            assert tree(self.path) == before
            return
        COUNTS["kills"] += 1
        if run.returncode != -signal.SIGKILL:
            COUNTS["crashes"] += 1
            raise AssertionError(f"exit {run.returncode}: {run.stderr[-3000:]}")
        candidates = [self.flushed]
        for name in ("flushed.npz", "candidate.npz"):
            p = os.path.join(self.side, name)
            if os.path.exists(p):
                candidates.append(dict(np.load(p)))
        store = cncore.make_store(config_at(self.path))
        got = sorted_export(store)
        store.close()
        match = [c for c in candidates if (c is None and len(got["keys"]) == 0) or (c is not None and same(got, c))]
        if not match:
            COUNTS["silent_changes"] += 1
            raise AssertionError("the directory after a kill holds none of the flushes")
        self.flushed = match[-1]
        COUNTS["exact"] += 1

    @precondition(lambda self: self.flushed is not None)
    @rule(data=st.data(), what=st.sampled_from(["truncate", "flip"]), file=st.sampled_from(["rows", "meta", "index"]))
    def damage(self, data, what, file):
        """Truncate or flip a byte of one of the directory's files (its store closed first): every
        open and read is then either the last flush exactly or TableFormatError, and a refusal
        changes nothing. The file is put back afterwards."""
        self.step()
        self.close_here()
        meta = json.load(open(os.path.join(self.path, "meta.json")))
        name = {"rows": "rows.dat", "meta": "meta.json", "index": meta["index"]}[file]
        target = os.path.join(self.path, name)
        good = open(target, "rb").read()
        if not good:
            return
        at = data.draw(st.integers(0, len(good) - 1))
        with open(target, "r+b") as fh:
            if what == "truncate":
                fh.truncate(at)
            else:
                fh.seek(at)
                fh.write(bytes([good[at] ^ (1 << data.draw(st.integers(0, 7)))]))
        COUNTS["damaged"] += 1
        before = tree(self.path)
        for reader in ("store", "table", "load_store"):
            try:
                if reader == "store":
                    store = cncore.make_store(config_at(self.path))
                    try:
                        got = sorted_export(store)
                    finally:
                        store.close()
                elif reader == "table":
                    got = table_export(self.path)
                else:
                    got = sorted_export(load_store(self.path))
            except (TableFormatError, ValueError) as exc:
                assert isinstance(exc, TableFormatError) or "Tiered.path" in str(exc), exc
                COUNTS["refusals"] += 1
                assert tree(self.path) == before, reader
                continue
            self.expect_flushed(got)
            assert {k: v for k, v in tree(self.path).items() if not k.endswith("lock")} == \
                {k: v for k, v in before.items() if not k.endswith("lock")}
        with open(target, "wb") as fh:
            fh.write(good)


def test_the_adversarial_harness_finds_only_exact_rows_or_clear_refusals():
    """Generated sequences (opens, training, flushes, closes, second opens, readers, SIGKILLed
    writers mid-write and mid-flush, truncations and byte flips of each file), each outcome
    compared with the model of the last flush."""
    for key in COUNTS:
        COUNTS[key] = 0
    run_state_machine_as_test(TierHarness, settings=settings(
        max_examples=int(os.environ.get("CN_TIER_HARNESS_EXAMPLES", 8)), stateful_step_count=12, deadline=None,
        suppress_health_check=list(HealthCheck)))
    print("tier harness:", COUNTS)
    assert COUNTS["crashes"] == COUNTS["hangs"] == COUNTS["silent_changes"] == 0
    assert COUNTS["exact"] > 0 and COUNTS["refusals"] > 0

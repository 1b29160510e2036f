"""SIGKILL at every durability point of the SSD tier (cncore/tier/), not at a random moment.

A child process trains a tiered table (a cache of 48 rows over 600 keys, so rows go to disk and
back all the time), flushes once, trains on (rewriting every row several times, so that the
second flush also compacts: the file passes twice the rows), then flushes again. Every file
operation the tier makes (a batch of record reads or writes, a spill's write on the background
thread, fsync, rename, remove, truncate) is an *event*; the child is told to SIGKILL itself at
event N: a record write is cut in the middle (the first half of its records written, then the
kill), as a crash mid-I/O leaves it. Events before the second flush are training (spills); those
inside it are the flush, the index commit and the compaction.

For every N the directory must reopen as exactly the state at the last flush that completed:
the first one for a kill during training or before the second flush's commit point (the rename
of meta.json), the second one from that rename on. The state saved by the child before each
flush (keys, rows, optimizer state, counts, last steps, step) is the reference. After reopening,
the table trains on and flushes again, and reopens once more equal to an in-memory store driven
through the same steps: a crash leaves no slot the next flushes would wrongly reuse.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import cncore

CHILD = r"""
import os, signal, sys
import numpy as np
import cncore
from cncore import _core

path, kill_at = sys.argv[1], int(sys.argv[2])
events = []
in_flush = [False]

def event(name):
    events.append(name)
    print(len(events), name, "flush" if in_flush[0] else "train", flush=True)
    return len(events) == kill_at

def die():
    os.kill(os.getpid(), signal.SIGKILL)

real_block_io = _core.block_io
def block_io(fd, offsets, buf, write, threads=0):
    if event("write" if write else "read"):
        if write and len(offsets) > 1:  # a crash mid-I/O: half the records reach the file
            half = len(offsets) // 2
            real_block_io(fd, offsets[:half], buf[:half], True, threads)
        die()
    return real_block_io(fd, offsets, buf, write, threads)
_core.block_io = block_io

# Spills are written behind, on the background thread (cncore.tier.background._run_spill): an event too, cut in
# the middle as a crash mid-I/O leaves it. The child waits for each queued write, so that the
# events come in the same order in every run.
from cncore.tier import background as tiered
real_run_spill, real_submit_write = tiered._run_spill, tiered._submit_write
def run_spill(job):
    if event("spill"):
        job.run(len(job) // 2)
        die()
    real_run_spill(job)
def submit_write(job):
    future = real_submit_write(job)
    future.result()
    return future
tiered._run_spill, tiered._submit_write = run_spill, submit_write

for name in ("fsync", "replace", "remove", "ftruncate"):
    real = getattr(os, name)
    def wrapped(*a, _real=real, _name=name):
        if event(_name):
            die()
        return _real(*a)
    setattr(os, name, wrapped)

config = cncore.StoreConfig(dim=4, seed=5, optimizer=cncore.Adam(lr=0.05),
                            storage=cncore.Tiered(path, cache_bytes=48 * (4 * 4 + 4 * 8 + 47)))
store = cncore.make_store(config)
rng = np.random.default_rng(0)

def train(steps):
    for _ in range(steps):
        keys = rng.integers(0, 600, 40)
        _, ctx = store.pooled_lookup(keys, lengths=np.full(4, 10))
        store.apply_gradients(ctx, rng.standard_normal((4, 4)).astype(np.float32))

def save(n):
    b = store.export()
    np.savez(os.path.join(os.path.dirname(path), f"expected-{n}.npz"), keys=b.keys, rows=b.rows,
             state=b.optimizer_state, counts=b.counts, last_steps=b.last_steps, step=store.step)

train(40)
save(1)
in_flush[0] = True
store.flush()
in_flush[0] = False
print("mark", len(events), "first-flush-done", flush=True)
train(120)
save(2)
compactions = store.stats.get("compactions", 0)
in_flush[0] = True
store.flush()
print("mark", len(events), "second-flush-done", "compacted", store.stats.get("compactions", 0) - compactions,
      flush=True)
"""

CONFIG = dict(dim=4, seed=5, optimizer=cncore.Adam(lr=0.05))
CACHE = 48 * (4 * 4 + 4 * 8 + 47)


def run_child(path, kill_at):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return subprocess.run([sys.executable, "-c", CHILD, path, str(kill_at)], capture_output=True, text=True,
                          timeout=120)


def events_of(stdout):
    out = []
    for line in stdout.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0].isdigit():
            out.append((parts[1], parts[2]))
    return out


def the_event_list(tmp_path):
    """The events of a run that is not killed, and how many came before the second flush."""
    done = run_child(str(tmp_path / "count" / "t"), 0)
    assert done.returncode == 0, done.stderr
    events = events_of(done.stdout)
    marks = [line.split() for line in done.stdout.splitlines() if line.startswith("mark ")]
    assert marks[1][1:] == [str(len(events)), "second-flush-done", "compacted", "1"]  # its compaction is tested too
    return events, int(marks[0][1])


def assert_state(store, expected):
    got = store.export()
    order, want = np.argsort(got.keys), np.argsort(expected["keys"])
    np.testing.assert_array_equal(got.keys[order], expected["keys"][want])
    for name, field in (("rows", "rows"), ("optimizer_state", "state"), ("counts", "counts"),
                        ("last_steps", "last_steps")):
        np.testing.assert_array_equal(getattr(got, name)[order], expected[field][want], err_msg=name)
    assert store.step == int(expected["step"])


def test_a_kill_at_every_file_operation_leaves_the_last_completed_flush(tmp_path):
    events, first_flush_end = the_event_list(tmp_path)
    kinds = {k for k, _ in events[first_flush_end:]}
    assert {"write", "read", "fsync", "replace", "remove", "ftruncate"} <= kinds, kinds
    assert "spill" in {k for k, where in events[first_flush_end:] if where == "train"}
    flush_events = [i for i, (_, where) in enumerate(events, 1) if where == "flush"]
    renames = [i for i, (k, where) in enumerate(events, 1) if k == "replace"]
    # The second flush's commit point: its first rename of meta.json (a compaction commits again).
    second_commit = min(r for r in renames if r > first_flush_end)
    # Every event of the second flush, and a sample of the training ones between the flushes.
    training = [i for i, (_, where) in enumerate(events, 1) if where == "train" and i > first_flush_end]
    points = sorted({i for i in flush_events if i > first_flush_end} | set(training[::max(1, len(training) // 6)]))
    assert len(points) >= 15, points
    for n in points:
        path = tmp_path / f"kill-{n}" / "t"
        done = run_child(str(path), n)
        assert done.returncode == -9, (n, done.returncode, done.stderr[-2000:])
        assert events_of(done.stdout)[-1] == events[n - 1]  # it died where it was told to
        meta = json.loads((path / "meta.json").read_text())
        flushed = 1 if n <= second_commit else 2  # killed at the rename: it did not happen
        assert meta["flush"] == flushed, (n, events[n - 1], meta["flush"])
        store = cncore.make_store(cncore.StoreConfig(**CONFIG, storage=cncore.Tiered(str(path), CACHE)))
        assert store.cached_rows == 0
        expected = np.load(path.parent / f"expected-{flushed}.npz")
        assert_state(store, expected)
        if n in (points[0], second_commit, second_commit + 1, points[-1]):
            train_on_after_reopen(store, expected, str(path))


def train_on_after_reopen(store, expected, path):
    """The reopened tier trains and flushes as an in-memory store loaded with the same state."""
    memory = cncore.make_store(cncore.StoreConfig(**CONFIG))
    memory.load(expected["keys"], expected["rows"], expected["state"], expected["counts"], expected["last_steps"])
    memory.step = int(expected["step"])
    rng = np.random.default_rng(1)
    for _ in range(60):
        keys = rng.integers(0, 900, 40)
        grad = rng.standard_normal((4, 4)).astype(np.float32)
        for s in (store, memory):
            _, ctx = s.pooled_lookup(keys, lengths=np.full(4, 10))
            s.apply_gradients(ctx, grad)
    store.flush()
    store.close()
    again = cncore.make_store(cncore.StoreConfig(**CONFIG, storage=cncore.Tiered(path, CACHE)))
    b = memory.export()
    assert_state(again, dict(keys=b.keys, rows=b.rows, state=b.optimizer_state, counts=b.counts,
                             last_steps=b.last_steps, step=memory.step))


@pytest.mark.parametrize("bad", ["meta", "index"])
def test_a_damaged_commit_is_refused_not_read_as_a_table(tmp_path, bad):
    """A flipped byte in meta.json or the index is refused naming the file, not silently loaded."""
    path = tmp_path / "t"
    store = cncore.make_store(cncore.StoreConfig(**CONFIG, storage=cncore.Tiered(str(path), CACHE)))
    for start in range(0, 120, 40):  # 120 rows, most of them on disk
        store.find_or_insert(np.arange(start, start + 40))
    store.flush()
    store.close()
    meta = json.loads((path / "meta.json").read_text())
    if bad == "meta":
        (path / "meta.json").write_text((path / "meta.json").read_text()[:-20])
        match = "meta.json"
    else:
        index = path / meta["index"]
        data = bytearray(index.read_bytes())
        data[len(data) // 2] ^= 0xFF
        index.write_bytes(bytes(data))
        match = "fails its checksum"
    with pytest.raises(ValueError, match=match):
        cncore.make_store(cncore.StoreConfig(**CONFIG, storage=cncore.Tiered(str(path), CACHE)))

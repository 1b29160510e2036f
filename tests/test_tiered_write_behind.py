"""Write-behind in the SSD tier (cncore/tier/write_behind.py, _core.SpillJob): the rows the cache evicts are
written by the background thread, after the call that evicted them returned.

Each test holds the background thread with a job that waits on an event, so that the spills of
the foreground queue behind it and are provably not in the file yet (the record at a spilled
key's slot is checked not to hold that key), then does what must wait for them: a read of such
a key, a flush, a close, a failed write. Every case runs in a subprocess with a timeout: a
wait that never ends (a deadlock between the foreground and the background thread) fails the
test instead of hanging the suite. The reference is an in-memory store driven through the same
steps.
"""
import subprocess
import sys
import textwrap

PRELUDE = r"""
import os, sys, threading, time
import numpy as np
import cncore
from cncore import _core
from cncore.tier import background, records

DIM = 4
path = sys.argv[1]
config = cncore.StoreConfig(dim=DIM, seed=3, optimizer=cncore.Adam(lr=0.05),
                            storage=cncore.Tiered(path, cache_bytes=64 * (DIM * 4 + 4 * 8 + 47)))
store = cncore.make_store(config)
memory = cncore.make_store(cncore.StoreConfig(dim=DIM, seed=3, optimizer=cncore.Adam(lr=0.05)))
rng = np.random.default_rng(0)

def train(keys):
    grad = rng.standard_normal((len(keys), DIM)).astype(np.float32)
    for s in (store, memory):
        _, ctx = s.pooled_lookup(np.asarray(keys, np.int64), lengths=np.ones(len(keys), np.int64))
        s.apply_gradients(ctx, grad)

def assert_same(a, b):
    x, y = a.export(), b.export()
    assert len(a) == len(b) == len(x.keys) == len(y.keys), (len(a), len(b))
    ix, iy = np.argsort(x.keys), np.argsort(y.keys)
    for name in ("keys", "rows", "optimizer_state", "counts", "last_steps"):
        np.testing.assert_array_equal(getattr(x, name)[ix], getattr(y, name)[iy], err_msg=name)
    assert a.step == b.step

def on_disk_unwritten():
    # Keys indexed on disk whose record is not in the file yet (the file holds another key, or
    # ends before the slot).
    keys, slots = next(store._disk.items(1 << 20))
    offs = records.record_offsets(slots, store.record_bytes, store._per_page)
    size = os.fstat(store._fd).st_size
    out = []
    for k, o in zip(keys, offs):
        data = os.pread(store._fd, 8, int(o)) if o + 8 <= size else b""
        if len(data) < 8 or int.from_bytes(data, "little", signed=True) != k:
            out.append(int(k))
    return np.array(out, np.int64)

for start in range(0, 400, 40):  # 400 rows, most on disk, all written (no job held yet)
    train(np.arange(start, start + 40))
store._wait_writes()
assert len(on_disk_unwritten()) == 0
gate = threading.Event()
_hook = sys.excepthook
def _release(*exc):  # a failure must not leave the held thread blocking the interpreter's exit
    gate.set()
    _hook(*exc)
sys.excepthook = _release
background._prefetcher().submit(gate.wait)  # holds the background thread: spills queue behind it
train(np.arange(1000, 1040))  # new keys: rows evicted, their writes queued
train(np.arange(1040, 1080))
queued = on_disk_unwritten()
assert len(store._spills.pending) > 0 and len(queued) > 0, (len(store._spills.pending), len(queued))
"""


def run_case(tmp_path, body, timeout=60):
    code = PRELUDE + textwrap.dedent(body) + "\nprint('ok', flush=True)\n"
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "t")], capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
    return done.stdout


def test_a_read_of_a_row_whose_write_is_queued_waits_for_the_write(tmp_path):
    """A lookup of keys whose records are still queued (the background thread is held for 0.3 s)
    returns their rows as memory holds them, after waiting for the writes; never zeros, a fresh
    initial row or a stale record."""
    run_case(tmp_path, """
        jobs = [job for job, _ in store._spills.pending]
        threading.Timer(0.3, gate.set).start()
        t0 = time.perf_counter()
        got = store.lookup(queued)
        waited = time.perf_counter() - t0
        np.testing.assert_array_equal(got, memory.lookup(queued))
        assert waited > 0.1, waited  # it waited for the writes (they were held until 0.3 s)
        assert all(job.written for job in jobs)  # (its own evictions may have queued more since)
        train(np.concatenate([queued[:20], np.arange(2000, 2020)]))
        assert_same(store, memory)
    """)


def test_a_flush_waits_for_queued_writes_and_the_directory_reopens_equal_to_memory(tmp_path):
    """A flush with writes queued (the background thread held for 0.3 s) commits only once they
    are in the file: the directory reopens as memory holds the table. close() waits too."""
    run_case(tmp_path, """
        threading.Timer(0.3, gate.set).start()
        store.flush()
        assert len(store._spills.pending) == 0 and len(on_disk_unwritten()) == 0
        from cncore.tablefile import load_store
        assert_same(load_store(path), memory)  # the flush, read beside the store (one writer)
        held = threading.Event()
        background._prefetcher().submit(held.wait)
        train(np.arange(3000, 3040))  # more writes queued behind a held thread, then close
        jobs = [job for job, _ in store._spills.pending]
        assert jobs and not any(job.written for job in jobs)
        threading.Timer(0.2, held.set).start()
        store.close()
        assert all(job.written for job in jobs)
    """)


def test_a_failed_background_write_keeps_its_rows_and_raises_until_it_succeeds(tmp_path):
    """A queued write that fails (here the writer's descriptor made invalid while the writes
    wait) keeps its rows in memory: a read that needs the file raises OSError saying so and
    leaves the table as it was; once the file can be written again, the next call writes them
    and every row is as memory holds it."""
    run_case(tmp_path, """
        fd = store._writer.fd
        store._writer.fd = -1  # every queued write fails (EBADF), and so does the retry
        gate.set()
        background._prefetcher().submit(int).result()  # the queued jobs ran (and failed)
        jobs = [job for job, _ in store._spills.pending]
        assert jobs and not any(job.written for job in jobs)
        n = len(store)
        for attempt in range(2):
            try:
                store.lookup(queued)
            except OSError as exc:
                assert "evicted rows failed" in str(exc) and "kept in memory" in str(exc), exc
            else:
                raise AssertionError("the lookup read a record that was never written")
            assert len(store) == n and len(store._spills.pending) > 0
        store._writer.fd = fd
        np.testing.assert_array_equal(store.lookup(queued), memory.lookup(queued))
        assert all(job.written for job in jobs)
        store.flush()
        store.close()
        assert_same(cncore.make_store(config), memory)
    """)


def test_queued_writes_are_bounded(tmp_path):
    """At most two eviction rounds' rows wait to be written: with the background thread held,
    the foreground's spills beyond that wait for the oldest (they would otherwise hold every
    evicted row in memory)."""
    run_case(tmp_path, """
        bound = 2 * (store.cache.config.headroom + store._evict_chunk)
        threading.Timer(0.3, gate.set).start()
        for start in range(5000, 5400, 40):
            train(np.arange(start, start + 40))
            assert store._spills.rows <= bound + 40, (store._spills.rows, bound)
        store._wait_writes()
        assert_same(store, memory)
    """)


def test_a_fork_with_writes_queued_writes_them_first_and_the_child_is_refused_the_store(tmp_path):
    """A fork first lets the background thread finish (queued writes included): the file holds
    their records at the fork. The child's copy of the store is the parent's (one writer a
    directory): its verbs refuse, naming the parent, and write nothing; the parent goes on."""
    run_case(tmp_path, """
        threading.Timer(0.2, gate.set).start()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:
            try:
                store.lookup(queued)
                ok = False
            except ValueError as exc:
                ok = f"belongs to process {parent}, which forked this process" in str(exc)
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert status == 0, status
        assert len(on_disk_unwritten()) == 0  # written before the fork
        assert np.array_equal(store.lookup(queued), memory.lookup(queued))
        assert_same(store, memory)
    """)


def test_a_prefetch_read_helped_by_the_training_thread_reads_the_same_records(tmp_path):
    """A prefetch's reads are shared (StageJob, cn_tier_share): the training thread, needing the
    records early, claims chunks beside the background thread. Run against each other many times
    (the helper spinning on help() until the job is over), the records and keys equal those of
    an unshared read, and the lookups after a helped prefetch equal memory's."""
    run_case(tmp_path, """
        gate.set()
        store._wait_writes()
        keys_on_disk = next(store._disk.items(1 << 20))[0]
        assert len(keys_on_disk) > 200  # several chunks of 64 records
        w, rec = store._writer, store.record_bytes
        plain = np.zeros((len(keys_on_disk), rec), np.uint8)
        k0, s0 = w.stage(keys_on_disk, len(keys_on_disk), plain, 1)
        helped_any = 0
        for trial in range(30):
            job = _core.StageJob()
            buf = np.zeros_like(plain)
            out = {}
            t = threading.Thread(target=lambda: out.update(r=w.stage(keys_on_disk, len(keys_on_disk), buf, 1, job)))
            t.start()
            while job.state != 2:
                job.help()
                helped_any += job.state == 1
            t.join(timeout=30)
            assert not t.is_alive()
            k, s = out["r"]
            np.testing.assert_array_equal(k, k0)
            np.testing.assert_array_equal(s, s0)
            np.testing.assert_array_equal(buf[:len(k)], plain[:len(k0)])
        want = keys_on_disk[:40]
        store.prefetch(np.concatenate([want, want]))
        store._prefetch.job.help()
        np.testing.assert_array_equal(store.lookup(want), memory.lookup(want))
        assert store.stats.get("prefetched", 0) > 0
    """)

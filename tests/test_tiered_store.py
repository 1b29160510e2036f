"""The SSD tier (cncore/tier/) against the in-memory store with the same config.

- A hypothesis state machine drives a TieredStore whose cache holds 16 rows (so rows go back
  and forth between memory and disk all the time) and an in-memory EmbeddingStore through the
  same training steps (pooled lookup + fused Adam / row-wise Adagrad backward), evaluation
  lookups, writes, erases, background prefetches, evictions on demand, flushes, compactions and
  reopenings (LRU, LFU and TTL caches; without admission and with MinCount, zeros or initial
  rows for keys not admitted, and its decay; float32, float16 and bfloat16 rows, stored at
  their size on disk; spills and loads in rounds of 2 records, room made 3 rows a round, or
  in the default rounds; disk-index erases of loaded rows left to the background thread
  for every one-round fault-in, or only for large ones; prefetch jobs handed every ID missing
  from memory, whose find the fault-in takes, or only the keys on disk of a few): after every
  step both hold the same keys, rows,
  optimizer state, counts and last steps, and give the same outputs.
- Threads sharing one tiered store read the right rows and train as one thread would.
- The disk index (cn_slotindex.h) against a dict.
- Crash tests: a subprocess trains and flushes, and is SIGKILLed at a random moment (during
  training, during a flush); the directory reopens as the state of the last completed flush.
- Bad input (a missing parent directory, a cache of fewer than 16 rows, another table's
  directory, bad options) is refused naming the argument, and leaves the directory as it was.
"""
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import cncore
from cncore.tier import TieredStore

DIM = 4


def assert_same_rows(tiered, memory):
    a, b = tiered.export(), memory.export()
    assert len(tiered) == len(memory) == len(a.keys) == len(b.keys)
    ia, ib = np.argsort(a.keys), np.argsort(b.keys)
    for name in ("keys", "rows", "optimizer_state", "counts", "last_steps"):
        np.testing.assert_array_equal(getattr(a, name)[ia], getattr(b, name)[ib], err_msg=name)
    assert tiered.step == memory.step


def in_memory(store):
    """An in-memory copy of a store's rows, state, metadata and step (to compare with after the
    store is closed)."""
    b = store.export()
    copy = cncore.make_store(dataclasses.replace(store.config, storage=None))
    copy.load(b.keys, b.rows, b.optimizer_state, b.counts, b.last_steps)
    copy.step = store.step
    return copy


key_batches = st.lists(st.one_of(st.integers(-30, 30), st.sampled_from([-2**63, 2**63 - 1])), min_size=1,
                       max_size=12)


class TieredMachine(RuleBasedStateMachine):
    @initialize(optimizer=st.sampled_from(["adam", "rowwise"]), eviction=st.sampled_from(["lru", "lfu", "ttl"]),
                admission=st.sampled_from([None, "min2", "min3-initial"]),
                dtype=st.sampled_from(["float32", "float16", "bfloat16"]), small_rounds=st.booleans(),
                erase_behind=st.booleans(), whole_jobs=st.booleans())
    def setup(self, optimizer, eviction, admission, dtype, small_rounds, erase_behind, whole_jobs):
        import tempfile
        self.path = os.path.join(tempfile.mkdtemp(), "t.tier")
        opt = cncore.Adam(lr=0.05) if optimizer == "adam" else cncore.RowWiseAdagrad(lr=0.1)
        ev = {"lru": cncore.LRU(), "lfu": cncore.LFU(), "ttl": cncore.TTL(steps=2)}[eviction]
        # one sketch wide enough that keys rarely collide, one narrow (64 counters a row), so that
        # colliding keys are admitted early too
        adm = {None: None, "min2": cncore.MinCount(2, width=4096, depth=2),
               "min3-initial": cncore.MinCount(3, unadmitted="initial", width=64, depth=2)}[admission]
        per_row = DIM * (4 if dtype == "float32" else 2) + 4 * (2 * DIM if optimizer == "adam" else 1) + 47
        self.config = cncore.StoreConfig(dim=DIM, seed=3, optimizer=opt, eviction=ev, admission=adm, dtype=dtype,
                                         storage=cncore.Tiered(self.path, cache_bytes=16 * per_row))
        self.small_rounds, self.erase_behind, self.whole_jobs = small_rounds, erase_behind, whole_jobs
        self.tiered = self.open_tier()
        assert isinstance(self.tiered, TieredStore) and self.tiered.cache_rows == 16
        self.memory_config = cncore.StoreConfig(dim=DIM, seed=3, optimizer=opt, admission=adm, dtype=dtype)
        self.memory = cncore.make_store(self.memory_config)
        self.flushed = None  # the in-memory state at the last flush

    def open_tier(self):
        tiered = cncore.make_store(self.config)
        if self.small_rounds:  # spills and loads 2 records at a time, room made 3 rows a round
            tiered._io_rows, tiered._evict_chunk = 2, 3
        if self.erase_behind:  # every one-round fault-in leaves its disk-index erase behind
            tiered._erase_behind_at = 1
        if self.whole_jobs:  # every prefetch hands its job all IDs missing from memory, and the
            tiered._find_on_disk_here = 0  # fault-in of the same keys takes the job's find (_own_plan)
        return tiered

    @rule(keys=key_batches, seed=st.integers(0, 99), mode=st.sampled_from(["sum", "mean"]))
    def train(self, keys, seed, mode):
        keys = np.array(keys, np.int64)
        lengths = np.array([len(keys) // 2, len(keys) - len(keys) // 2])
        grad = np.random.default_rng(seed).standard_normal((2, DIM)).astype(np.float32)
        outs = []
        for store in (self.tiered, self.memory):
            out, ctx = store.pooled_lookup(keys, lengths=lengths, mode=mode)
            store.apply_gradients(ctx, grad)
            outs.append(out)
        np.testing.assert_array_equal(outs[0], outs[1])

    @rule(keys=st.lists(st.one_of(st.integers(-30, 30), st.integers(1000, 1500)), min_size=10, max_size=16,
                        unique=True), seed=st.integers(0, 99))
    def train_wide(self, keys, seed):
        """A batch of up to the cache's 16 rows: many keys on disk at once, so faulting them in
        must first make room (evicting only rows the batch does not use), beside keys seen for
        the first time (which admission may refuse)."""
        self.train(keys, seed, "sum")

    @rule(keys=key_batches)
    def evaluate(self, keys):
        keys = np.array(keys, np.int64)
        np.testing.assert_array_equal(self.tiered.lookup(keys), self.memory.lookup(keys))
        assert self.tiered.contains(keys).tolist() == self.memory.contains(keys).tolist()

    @rule(keys=key_batches, seed=st.integers(0, 99))
    def write(self, keys, seed):
        keys = np.array(keys, np.int64)
        rows = np.random.default_rng(seed).standard_normal((len(keys), DIM)).astype(np.float32)
        assert self.tiered.insert_or_assign(keys, rows).tolist() == self.memory.insert_or_assign(keys, rows).tolist()

    @rule(keys=key_batches)
    def erase(self, keys):
        keys = np.array(keys, np.int64)
        assert self.tiered.erase(keys).tolist() == self.memory.erase(keys).tolist()

    @rule(keys=key_batches)
    def prefetch(self, keys):
        """Read ahead in the background; whatever runs next must see the current rows."""
        self.tiered.prefetch(np.array(keys, np.int64))

    @rule(keys=st.lists(st.one_of(st.integers(-30, 30), st.integers(1000, 1500)), min_size=1, max_size=16),
          seed=st.integers(0, 99))
    def prefetch_then_train(self, keys, seed):
        """The pipeline's order: the batch's keys handed in early, then its step. The step takes
        the prefetch's cache find, makes its room before waiting for the job, pools from the slots
        its fault-in found."""
        self.tiered.prefetch(np.array(keys, np.int64))
        self.train(keys, seed, "sum")

    @rule(n=st.integers(0, 20))
    def evict(self, n):
        """Rows evicted on demand (and, with TTL, the expired ones) go to disk, not away."""
        before = self.tiered.cached_rows
        got = self.tiered.evict(n)
        assert got == min(n, before) and self.tiered.cached_rows == before - got
        if isinstance(self.config.eviction, cncore.TTL):
            self.tiered.evict_expired()

    @rule()
    def flush(self):
        self.tiered.flush()
        self.flushed = self.memory.export()

    @rule()
    def compact(self):
        self.tiered.compact()

    @rule()
    def decay_admission(self):
        if self.config.admission is not None:
            self.tiered.decay_admission()
            self.memory.decay_admission()

    @rule()
    def reopen_after_flush(self):
        self.tiered.flush()
        self.tiered.close()
        self.tiered = self.open_tier()
        assert self.tiered.cached_rows == 0  # reopening reads only the index
        if self.config.admission is not None:
            # the sketch lives in memory: a reopened tier starts it over, as a table loaded from a
            # file does; so does the reference, rebuilt from its rows
            b, step = self.memory.export(), self.memory.step
            self.memory = cncore.make_store(self.memory_config)
            self.memory.load(b.keys, b.rows, b.optimizer_state, b.counts, b.last_steps)
            self.memory.step = step

    @invariant()
    def same_table(self):
        if hasattr(self, "tiered"):
            assert self.tiered.cached_rows <= self.tiered.cache_rows
            assert_same_rows(self.tiered, self.memory)

    def teardown(self):
        """Each example's directory goes with it (every run of the suite left one per example)."""
        if hasattr(self, "tiered"):
            self.tiered.close()
            shutil.rmtree(os.path.dirname(self.path), ignore_errors=True)


TestTieredMachine = TieredMachine.TestCase


def test_a_table_ten_times_its_cache_trains_as_in_memory(tmp_path):
    """Zipf-like skew over 2,000 keys, a cache of 200 rows: same outputs every step, same rows at the end."""
    opt = cncore.RowWiseAdagrad(lr=0.1)
    tiered = cncore.make_store(cncore.StoreConfig(dim=8, optimizer=opt, storage=cncore.Tiered(
        str(tmp_path / "t"), cache_bytes=200 * (8 * 4 + 4 + 47))))
    memory = cncore.make_store(cncore.StoreConfig(dim=8, optimizer=opt))
    rng = np.random.default_rng(0)
    for _ in range(60):
        keys = (rng.zipf(1.2, 64) % 2000).astype(np.int64)
        for store in (tiered, memory):
            out, ctx = store.pooled_lookup(keys, lengths=np.full(8, 8))
            store.apply_gradients(ctx, np.ones((8, 8), np.float32))
        np.testing.assert_array_equal(tiered.pooled_lookup(keys, lengths=np.full(8, 8), insert_missing=False)[0],
                                      memory.pooled_lookup(keys, lengths=np.full(8, 8), insert_missing=False)[0])
    assert tiered.cached_rows <= 200 < len(tiered)
    assert tiered.stats["rows_written"] > 0 and tiered.stats["rows_read"] > 0
    assert_same_rows(tiered, memory)
    # lookup / read of more keys than the cache holds go in chunks: the same answers, unknown keys included
    keys = np.concatenate([np.arange(-50, 2100), np.arange(2000)[::-1]])
    np.testing.assert_array_equal(tiered.lookup(keys), memory.lookup(keys))
    a, b = tiered.read(keys), memory.read(keys)
    for name in ("keys", "rows", "optimizer_state", "counts", "last_steps", "found"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    new = np.arange(5000, 5600)
    np.testing.assert_array_equal(tiered.lookup(new, insert_missing=True), memory.lookup(new, insert_missing=True))
    assert_same_rows(tiered, memory)


def test_flush_then_reopen_and_the_file_reuses_space(tmp_path):
    """The same 200 keys rewritten over and over: the file stops growing. Spills go to whole free
    pages and the end of the file (log-structured); with compact_ratio=2 every flush leaves at most
    twice the rows (it compacts past that), and compact() exactly one record per row."""
    config = cncore.StoreConfig(dim=DIM, optimizer=cncore.SGD(lr=0.1),
                                storage=cncore.Tiered(str(tmp_path / "t"), cache_bytes=16 * (DIM * 4 + 47),
                                                      compact_ratio=2))
    store = cncore.make_store(config)
    sizes = []
    for _round in range(12):
        for start in range(0, 200, 10):
            _, ctx = store.pooled_lookup(np.arange(start, start + 10), lengths=np.array([10]))
            store.apply_gradients(ctx, np.ones((1, DIM), np.float32))
        store.flush()
        sizes.append(os.path.getsize(tmp_path / "t" / "rows.dat"))
    rec = store.record_bytes
    per_page = 4096 // rec
    bound = (2 * 200 // per_page + 5) * 4096  # twice the rows, a few pages of slack, after every flush
    assert max(sizes) <= bound, sizes
    gave_back = store.compact()
    assert os.path.getsize(tmp_path / "t" / "rows.dat") == (199 // per_page) * 4096 + (199 % per_page + 1) * rec
    assert gave_back == sizes[-1] - os.path.getsize(tmp_path / "t" / "rows.dat") > 0
    expected = in_memory(store)
    store.close()  # a directory has one store at a time
    again = cncore.make_store(config)
    assert_same_rows(again, expected)
    _, ctx = again.pooled_lookup(np.arange(200, 210), lengths=np.array([10]))  # and it trains on
    again.apply_gradients(ctx, np.ones((1, DIM), np.float32))
    assert len(again) == 210
    with pytest.raises(ValueError, match=r"17 distinct keys, more than the cache's 16 rows.*cache_bytes"):
        again.pooled_lookup(np.arange(17), lengths=np.array([17]))
    assert len(again) == 210


def test_bad_input_is_refused_naming_it_and_leaves_the_directory(tmp_path):
    with pytest.raises(ValueError, match="Tiered.cache_bytes"):
        cncore.Tiered(str(tmp_path / "t"), cache_bytes=0)
    with pytest.raises(TypeError, match="Tiered.path"):
        cncore.Tiered(None, cache_bytes=10)
    for ratio in (0.5, float("nan"), True, "3"):
        with pytest.raises(ValueError, match=r"Tiered.compact_ratio must be a number in \[1, 1e6\]"):
            cncore.Tiered(str(tmp_path / "t"), cache_bytes=10**6, compact_ratio=ratio)
    for threads in (0, 257, 2.0, None):
        with pytest.raises(ValueError, match=r"Tiered.io_threads must be an int in \[1, 256\]"):
            cncore.Tiered(str(tmp_path / "t"), cache_bytes=10**6, io_threads=threads)
    with pytest.raises(ValueError, match=r"the directory .*/missing that should hold .* does not exist; create it"):
        cncore.make_store(cncore.StoreConfig(dim=2, storage=cncore.Tiered(str(tmp_path / "missing" / "t"), 10**6)))
    assert not (tmp_path / "missing").exists()
    row = 64 * 4 + 4 + 47  # dim 64, row-wise Adagrad: the row, its state, metadata and index share
    with pytest.raises(ValueError, match=rf"cache_bytes={16 * row - 1} holds 15 rows .*{row} bytes each.*"
                                         rf"give cache_bytes >= {16 * row}"):
        cncore.make_store(cncore.StoreConfig(dim=64, optimizer=cncore.RowWiseAdagrad(), storage=cncore.Tiered(
            str(tmp_path / "small"), 16 * row - 1)))
    assert not (tmp_path / "small").exists()
    assert cncore.make_store(cncore.StoreConfig(dim=64, optimizer=cncore.RowWiseAdagrad(), storage=cncore.Tiered(
        str(tmp_path / "small"), 16 * row))).cache_rows == 16
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="holds other files"):
        cncore.make_store(cncore.StoreConfig(dim=2, storage=cncore.Tiered(str(other), 10**6)))
    assert os.listdir(other) == ["notes.txt"]
    path = str(tmp_path / "t")
    store = cncore.make_store(cncore.StoreConfig(dim=2, storage=cncore.Tiered(path, 10**6)))
    store.find_or_insert(np.arange(5))
    store.flush()
    with pytest.raises(TypeError, match="on_evict: a tiered store"):
        store.on_evict(print)
    store.close()
    before = sorted(os.listdir(path))
    with pytest.raises(ValueError, match="holds a table of another config"):
        cncore.make_store(cncore.StoreConfig(dim=3, storage=cncore.Tiered(path, 10**6)))
    assert sorted(os.listdir(path)) == before


CRASH_CHILD = r"""
import sys, os, numpy as np, cncore
path, seed = sys.argv[1], int(sys.argv[2])
config = cncore.StoreConfig(dim=8, optimizer=cncore.RowWiseAdagrad(lr=0.1),
                            storage=cncore.Tiered(path, cache_bytes=300 * 90))
store = cncore.make_store(config)
rng = np.random.default_rng(seed)
flush = 0
while True:
    for _ in range(5):
        keys = rng.integers(0, 3000, 256)
        _, ctx = store.pooled_lookup(keys, lengths=np.full(16, 16))
        store.apply_gradients(ctx, rng.standard_normal((16, 8)).astype(np.float32))
    b = store.export()
    flush += 1
    np.savez(os.path.join(os.path.dirname(path), f"expected-{flush}.npz"), keys=b.keys, rows=b.rows,
             state=b.optimizer_state, counts=b.counts, last_steps=b.last_steps, step=store.step)
    print(flush, flush=True)
    store.flush()
"""


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_kill_at_any_moment_leaves_the_last_flush(tmp_path, seed):
    path = str(tmp_path / "t")
    child = subprocess.Popen([sys.executable, "-c", CRASH_CHILD, path, str(seed)], stdout=subprocess.PIPE,
                             text=True)
    try:
        lines = 0
        deadline = time.monotonic() + 60
        while lines < 2 + seed and time.monotonic() < deadline:  # a few flushes in, then a kill mid-whatever
            if child.stdout.readline():
                lines += 1
        time.sleep(0.01 * seed)
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait(timeout=30)
    meta = json.load(open(os.path.join(path, "meta.json")))
    expected = np.load(str(tmp_path / f"expected-{meta['flush']}.npz"))
    config = cncore.StoreConfig(dim=8, optimizer=cncore.RowWiseAdagrad(lr=0.1),
                                storage=cncore.Tiered(path, cache_bytes=300 * 90))
    back = cncore.make_store(config).export()
    order, want = np.argsort(back.keys), np.argsort(expected["keys"])
    np.testing.assert_array_equal(back.keys[order], expected["keys"][want])
    np.testing.assert_array_equal(back.rows[order], expected["rows"][want])
    np.testing.assert_array_equal(back.optimizer_state[order], expected["state"][want])
    np.testing.assert_array_equal(back.counts[order], expected["counts"][want])
    np.testing.assert_array_equal(back.last_steps[order], expected["last_steps"][want])


def test_the_benchmark_script_measures_every_cell():
    """asv_bench/scripts/tiered_bench.py --quick: a row per (multiple, stream) with numbers, the
    tiered table holding more rows than its cache, write amplification and compaction reported
    (a smoke test, so that the script cannot silently stop measuring)."""
    script = os.path.join(os.path.dirname(__file__), "..", "asv_bench", "scripts", "tiered_bench.py")
    out = subprocess.run([sys.executable, script, "--quick"], check=True, capture_output=True, text=True,
                         timeout=300).stdout
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines() if line.startswith("| 3x")]
    assert [c[1] for c in cells] == ["zipf-1.05", "uniform"]
    for c in cells:
        rows, tiered_ms, memory_ms, hit_rate = int(c[2].replace(",", "")), float(c[3]), float(c[4]), float(c[6])
        assert rows > 3 * 3000 and tiered_ms > 0 and memory_ms > 0 and 0 < hit_rate < 1
    assert "write amplification" in out and "after (record 280 bytes)" in out


# --- the front ends ----------------------------------------------------------------------------

def test_torch_modules_and_collections_on_the_tier_equal_in_memory(tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("torchrec")
    from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

    from cncore_torch import CNEmbeddingBag, CNEmbeddingBagCollection
    rng = np.random.default_rng(0)
    bag = CNEmbeddingBag(10**6, 8, mode="sum", optimizer=cncore.SGD(lr=0.1),
                         storage=cncore.Tiered(str(tmp_path / "bag"), 50_000))
    ref = CNEmbeddingBag(10**6, 8, mode="sum", optimizer=cncore.SGD(lr=0.1))
    for _ in range(20):
        ids = torch.from_numpy(rng.integers(0, 3000, (32, 4)))
        a, b = bag(ids), ref(ids)
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        a.sum().backward(), b.sum().backward()
    assert bag.store.cached_rows < len(bag.store) == len(ref.store)
    again = CNEmbeddingBag(10**6, 8, mode="sum", optimizer=cncore.SGD(lr=0.1),
                           storage=cncore.Tiered(str(tmp_path / "again"), 50_000))
    again.load_state_dict(bag.state_dict())  # a state_dict larger than the cache loads in chunks
    assert_same_rows(again.store, ref.store)
    tables = [EmbeddingBagConfig(name="t_a", embedding_dim=4, num_embeddings=1000, feature_names=["a", "a2"]),
              EmbeddingBagConfig(name="t_b", embedding_dim=4, num_embeddings=1000, feature_names=["b"])]
    ebc = CNEmbeddingBagCollection(tables, optimizer=cncore.SGD(lr=0.1),
                                   storage=cncore.Tiered(str(tmp_path / "ebc"), 2 * 600 * 63))
    ref = CNEmbeddingBagCollection(tables, optimizer=cncore.SGD(lr=0.1))
    assert {n: s.config.storage.path for n, s in ebc.stores.items()} == {
        "t_a": str(tmp_path / "ebc" / "t_a"), "t_b": str(tmp_path / "ebc" / "t_b")}
    for _ in range(40):  # past each table's cache (65,536 bytes, the floor of a table's share: 1,040 rows)
        kjt = KeyedJaggedTensor.from_lengths_sync(["a", "a2", "b"], torch.from_numpy(rng.integers(0, 10**5, 96)),
                                                  torch.full((48,), 2))
        x, y = ebc(kjt).values(), ref(kjt).values()
        torch.testing.assert_close(x, y, rtol=0, atol=0)
        x.sum().backward(), y.sum().backward()
    for name in ref.stores:
        assert ebc.stores[name].cached_rows < len(ebc.stores[name])
        assert_same_rows(ebc.stores[name], ref.stores[name])


def test_the_job_on_the_tier_trains_exactly_as_in_memory(tmp_path, capsys):
    pytest.importorskip("torchrec")
    from cn_dlrm.cli import main
    from cn_dlrm.options import parse_args
    small = ["--batch-size", "256", "--embedding-dim", "4", "--no-progress", "--threads", "1", "--eval-batches", "1",
             "--steps", "16", "--eval-every", "16"]
    out = {}
    admit = ["--admit-min-count", "2"]
    for name, extra in (("memory", []), ("tier", ["--ssd-path", str(tmp_path / "ssd"), "--cache-mb", "1"]),
                        ("memory-admit", admit), ("tier-admit", ["--ssd-path", str(tmp_path / "ssd2"), "--cache-mb",
                                                                 "1", *admit])):
        assert main([*small, *extra, "--summary-json", str(tmp_path / f"{name}.json")]) == 0
        out[name] = json.loads((tmp_path / f"{name}.json").read_text())["runs"][0]
    for tier, memory in (("tier", "memory"), ("tier-admit", "memory-admit")):
        assert out[tier]["auc"] == out[memory]["auc"] and out[tier]["logloss"] == out[memory]["logloss"]
        assert out[tier]["rows"] == out[memory]["rows"]
    assert out["memory-admit"]["rows"] < out["memory"]["rows"]  # admission kept keys seen once out
    spilled = sum(os.path.getsize(tmp_path / "ssd" / t / "rows.dat") for t in os.listdir(tmp_path / "ssd"))
    assert spilled > 0  # rows went to disk
    for argv, expected in [(["--ssd-path", str(tmp_path / "x")], "--ssd-path DIR and --cache-mb N go together"),
                           (["--ssd-path", str(tmp_path / "ssd"), "--cache-mb", "4"], "must be a new or empty"),
                           (["--ssd-path", str(tmp_path / "y"), "--cache-mb", "4", "--max-rows", "9000"],
                            "does not go with --max-rows")]:
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert expected in capsys.readouterr().err


# --- the disk index ------------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["put", "erase", "erase_at"]),
                          st.lists(st.one_of(st.integers(-40, 40), st.sampled_from([-2**63, 2**63 - 1])),
                                   max_size=60)), max_size=30), st.integers(1, 50))
def test_the_disk_index_is_a_dict_of_key_to_slot(ops, batch_size):
    """cn_slotindex.h against a dict: puts (a key given twice keeps its last slot), erases (each
    key's old slot once, -1 for a repeat or an absent key), erases of keys still at a given slot
    (half the slots given are the key's own, half another's), finds, and the walk of every entry,
    through growth past several rehashes."""
    from cncore._core import SlotIndex
    ix, model, next_slot = SlotIndex(), {}, 0
    for op, keys in ops + [("put", list(range(1000, 1700)))]:  # the last one grows it past 1,024 buckets
        arr = np.array(keys, np.int64)
        if op == "put":
            slots = np.arange(next_slot, next_slot + len(arr), dtype=np.int64)
            next_slot += len(arr)
            ix.put(arr, slots)
            model.update(zip(keys, slots.tolist()))
        elif op == "erase_at":
            at = np.array([model.get(k, -1) + (i % 2) for i, k in enumerate(keys)], np.int64)
            removed = 0
            for k, s in zip(keys, at.tolist()):
                if k in model and model[k] == s:
                    del model[k]
                    removed += 1
            assert ix.erase_at(arr, at) == removed
        else:
            want = []
            for k in keys:
                want.append(model.pop(k, -1))
            assert ix.erase(arr).tolist() == want
        probe = np.array(keys + [-2**63, 2**63 - 1, 99], np.int64)
        assert ix.find(probe).tolist() == [model.get(k, -1) for k in probe.tolist()]
        assert len(ix) == len(model)
    walked = {}
    for k, s in ix.items(batch_size):
        assert len(k) <= batch_size
        walked.update(zip(k.tolist(), s.tolist()))
    assert walked == model and sum(len(k) for k, _ in ix.items(batch_size)) == len(model)
    assert ix.nbytes >= 16 * len(model) / 0.7
    before = ix.nbytes
    ix.reserve(5000)  # grown once, now: 5,000 more keys go in without another rehash
    grown = ix.nbytes
    assert grown >= 16 * (len(model) + 5000) / 0.7 > before
    ix.put(np.arange(10**6, 10**6 + 5000), np.arange(5000))
    assert ix.nbytes == grown
    with pytest.raises(ValueError, match="extra: must be >= 0"):
        ix.reserve(-1)
    with pytest.raises(ValueError, match="slots: expected 1, got 2"):  # erase_at's lengths must match
        ix.erase_at(np.array([10**6], np.int64), np.array([0, 1], np.int64))
    assert ix.find(np.array([10**6])).tolist() == [0]  # unchanged
    ix.clear()
    assert len(ix) == 0 and ix.find(np.array([1000])).tolist() == [-1]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.one_of(st.integers(-30, 30), st.sampled_from([-2**63, 2**63 - 1])), max_size=40),
       st.lists(st.one_of(st.integers(-30, 30), st.sampled_from([-2**63, 2**63 - 1])), max_size=200),
       st.integers(0, 2**32 - 1))
def test_the_disk_indexs_missing_split_is_a_dict_model_of_the_uncached_ids(on_disk, ids, seed):
    """SlotIndex.missing (a fault-in's split of the IDs missing from memory): of the IDs not
    flagged cached, the distinct keys on disk in ascending signed order with their slots, the
    distinct others in ascending order, and how many of the IDs are keys on disk (repeats
    counted), against a dict and sorted(); a flag array of another length is refused, naming it."""
    from cncore._core import SlotIndex
    ix, model = SlotIndex(), {}
    for i, k in enumerate(on_disk):
        model[k] = 3 * i
    if model:
        ix.put(np.array(list(model), np.int64), np.array(list(model.values()), np.int64))
    keys = np.array(ids, np.int64)
    cached = (np.random.default_rng(seed).random(len(keys)) < 0.3).astype(np.uint8)
    uncached = [k for k, c in zip(ids, cached.tolist()) if not c]
    disk_keys, slots, absent, n_ids = ix.missing(keys, cached)
    assert disk_keys.tolist() == sorted({k for k in uncached if k in model})
    assert slots.tolist() == [model[k] for k in disk_keys.tolist()]
    assert absent.tolist() == sorted({k for k in uncached if k not in model})
    assert n_ids == sum(k in model for k in uncached)
    with pytest.raises(ValueError, match=rf"cached: expected {len(keys)} flags, got {len(keys) + 1}"):
        ix.missing(keys, np.zeros(len(keys) + 1, np.uint8))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(-2**63, 2**63 - 1), max_size=30), st.lists(st.integers(-2**63, 2**63 - 1), max_size=30),
       st.booleans())
def test_same_int64_is_numpys_array_equal(a, b, copy):
    """_core.same_int64 (the tier's compare of a prefetch's keys, and of staged keys and slots,
    with a call's): np.array_equal on int64 arrays, over equal arrays, arrays of other lengths,
    and arrays that differ in one value anywhere (in the high or the low bytes)."""
    from cncore._core import same_int64
    x = np.array(a, np.int64)
    y = x.copy() if copy else np.array(b, np.int64)
    assert same_int64(x, y) == np.array_equal(x, y)
    for i in range(len(x)):
        for delta in (1, 2**40):
            z = x.copy()
            z[i] = np.int64(int(z[i]) ^ delta)
            assert same_int64(x, z) is False


def test_threads_reading_and_training_at_once_see_the_right_rows(tmp_path):
    """Several threads use one tiered store (as they may use any store): lookups running
    beside other threads' faults-in and spills return the rows the table holds, never zeros
    or a fresh initial row for a key that was on its way to disk; training threads on
    disjoint keys end with the rows of the same training done one thread at a time."""
    import threading
    opt = cncore.SGD(lr=0.1)
    per_row = DIM * 4 + 47
    tiered = cncore.make_store(cncore.StoreConfig(dim=DIM, optimizer=opt, storage=cncore.Tiered(
        str(tmp_path / "t"), cache_bytes=64 * per_row)))
    memory = cncore.make_store(cncore.StoreConfig(dim=DIM, optimizer=opt))
    for start in range(0, 600, 30):
        for s in (tiered, memory):
            s.find_or_insert(np.arange(start, start + 30))
    want = memory.lookup(np.arange(600))
    errors = []

    def reader(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(300):
                keys = rng.integers(0, 600, 12)
                np.testing.assert_array_equal(tiered.lookup(keys), want[keys])
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    def trainer(base, seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(150):
                keys = base + rng.integers(0, 40, 8)
                grad = rng.standard_normal((2, DIM)).astype(np.float32)
                while True:
                    _, ctx = tiered.pooled_lookup(keys, lengths=np.array([4, 4]))
                    try:
                        tiered.apply_gradients(ctx, grad)
                        break
                    except RuntimeError as exc:  # another thread evicted a row of this lookup: redo it
                        assert "since this lookup" in str(exc), exc
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=reader, args=(s,)) for s in range(3)]
    threads += [threading.Thread(target=trainer, args=(b, s)) for s, b in ((7, 1000), (8, 2000))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    for base, seed in ((1000, 7), (2000, 8)):  # the same training, one thread at a time
        rng = np.random.default_rng(seed)
        for _ in range(150):
            keys = base + rng.integers(0, 40, 8)
            grad = rng.standard_normal((2, DIM)).astype(np.float32)
            _, ctx = memory.pooled_lookup(keys, lengths=np.array([4, 4]))
            memory.apply_gradients(ctx, grad)
    a, b = tiered.export(), memory.export()
    ia, ib = np.argsort(a.keys), np.argsort(b.keys)
    np.testing.assert_array_equal(a.keys[ia], b.keys[ib])
    np.testing.assert_array_equal(a.rows[ia], b.rows[ib])
    np.testing.assert_array_equal(a.counts[ia], b.counts[ib])


def test_admission_keeps_unadmitted_keys_out_of_both_tiers(tmp_path):
    """MinCount(3) on a tier whose cache holds 16 rows: a key seen twice has no row, in memory
    or on disk (nor in the flushed directory); a key already on disk is trained on at once (it
    exists, so admission does not ask); outputs and rows equal an in-memory store's."""
    from cncore.tablefile import open_table
    adm = cncore.MinCount(3)
    config = cncore.StoreConfig(dim=DIM, optimizer=cncore.SGD(lr=0.1), admission=adm,
                                storage=cncore.Tiered(str(tmp_path / "t"), cache_bytes=16 * (DIM * 4 + 47)))
    tiered, memory = cncore.make_store(config), cncore.make_store(dim=DIM, optimizer=cncore.SGD(lr=0.1),
                                                                     admission=adm)
    for store in (tiered, memory):
        for start in range(0, 100, 10):  # find_or_insert is not gated: 100 rows, most spill to disk
            store.find_or_insert(np.arange(start, start + 10))
    assert tiered.cached_rows <= 16 and len(tiered) == 100

    def train(keys):
        outs = []
        for store in (tiered, memory):
            out, ctx = store.pooled_lookup(np.array(keys), lengths=np.array([len(keys)]))
            store.apply_gradients(ctx, np.ones((1, DIM), np.float32))
            outs.append(out)
        np.testing.assert_array_equal(outs[0], outs[1])

    before = tiered.read(np.arange(6)).rows
    # 0-5 are on disk, more than the cache has room for: faulting them in makes room first
    train([0, 1, 2, 3, 4, 5, 500, 501])  # 0-5 trained at once; 500, 501 seen once
    train([10, 11, 12, 13, 14, 15, 500, 501, 502])  # seen twice
    assert tiered.contains(np.array([3, 500, 501, 502])).tolist() == [True, False, False, False]
    assert not np.array_equal(tiered.read(np.arange(6)).rows, before)
    tiered.flush()
    assert not np.isin([500, 501, 502], open_table(str(tmp_path / "t")).keys).any()
    train([500, 600])  # the third sighting of 500: admitted
    assert tiered.contains(np.array([500, 501, 600])).tolist() == [True, False, False]
    assert_same_rows(tiered, memory)


def test_16_bit_rows_are_stored_at_their_size_and_a_version_2_directory_still_opens(tmp_path, monkeypatch):
    """Records of float16 / bfloat16 rows hold 2 bytes a value (dim 64, row-wise Adagrad: 152
    bytes against float32's 280); the rows come back exactly. A directory written in format 2
    (float32 records) reopens, keeps its layout through more training and flushes, and reads
    as a table."""
    import cncore.tier.records as tiered_module
    from cncore.tablefile import open_table
    sizes = {}
    for dtype in ("float32", "float16", "bfloat16"):
        config = cncore.StoreConfig(dim=64, dtype=dtype, optimizer=cncore.RowWiseAdagrad(),
                                    storage=cncore.Tiered(str(tmp_path / dtype), cache_bytes=1 << 16))
        store = cncore.make_store(config)
        sizes[dtype] = store.record_bytes
    assert sizes == {"float32": 280, "float16": 152, "bfloat16": 152}

    def trained(path, dtype):
        config = cncore.StoreConfig(dim=DIM, dtype=dtype, optimizer=cncore.Adam(lr=0.05),
                                    storage=cncore.Tiered(path, cache_bytes=16 * (DIM * 2 + 8 * DIM + 47)))
        tiered = cncore.make_store(config)
        memory = cncore.make_store(dataclasses.replace(config, storage=None))
        rng = np.random.default_rng(0)
        for _ in range(30):
            keys = rng.integers(0, 200, 12)
            for store in (tiered, memory):
                _, ctx = store.pooled_lookup(keys, lengths=np.array([12]))
                store.apply_gradients(ctx, np.full((1, DIM), 0.3, np.float32))
        return config, tiered, memory

    monkeypatch.setattr(tiered_module, "_VERSION", 2)
    config, old, memory = trained(str(tmp_path / "v2"), "bfloat16")
    old.flush()
    old.close()
    assert old.record_bytes == 8 + 4 + 4 + DIM * 4 + 2 * DIM * 4  # float32 rows
    monkeypatch.setattr(tiered_module, "_VERSION", 3)
    again = cncore.make_store(config)
    assert again.record_bytes == old.record_bytes
    for _ in range(5):
        keys = np.arange(150, 170)[:16]
        for store in (again, memory):
            _, ctx = store.pooled_lookup(keys, lengths=np.array([16]))
            store.apply_gradients(ctx, np.full((1, DIM), 0.3, np.float32))
    again.flush()
    assert json.load(open(tmp_path / "v2" / "meta.json"))["version"] == 2
    assert_same_rows(again, memory)
    b = memory.export()
    table = open_table(str(tmp_path / "v2"))
    np.testing.assert_array_equal(table.lookup(b.keys), b.rows)


def bucket_bytes(n_buckets: int) -> int:
    """What n 16-byte buckets take (cn_alloc.h rounds an allocation up to 64 bytes)."""
    return -(-16 * n_buckets // 64) * 64


def test_capacity_sizes_the_disk_index_once_and_exactly(tmp_path):
    """StoreConfig.capacity (the rows the table will hold) reserves the disk index up front, to
    exactly the buckets the most keys it can hold at once need (all rows but the cache's
    low-water mark, plus a fault-in's round and two rounds whose erase is left behind): filling
    a table 10x its cache and then training, prefetching the next batch,
    on it (every step faults in hundreds of rows while the cache evicts) never rehashes it,
    and it takes no power-of-two slack."""
    from cncore._core import SlotIndex
    config = cncore.StoreConfig(dim=DIM, optimizer=cncore.SGD(lr=0.1), capacity=5000, storage=cncore.Tiered(
        str(tmp_path / "t"), cache_bytes=500 * (DIM * 4 + 47)))
    store = cncore.make_store(config)
    most = store.disk_keys_at_most(5000)
    low_water = store.cache_rows - store.cache.config.headroom
    assert most == 5000 - low_water + 3 * store._evict_chunk
    reserved = store.disk_index_bytes
    assert SlotIndex.buckets_for(most) == -(-most * 10 // 7)
    assert reserved == bucket_bytes(SlotIndex.buckets_for(most))
    for start in range(0, 5000, 100):
        store.find_or_insert(np.arange(start, start + 100))
    assert len(store) == 5000 and store.cached_rows <= store.cache_rows
    assert store.disk_index_bytes == reserved
    rng = np.random.default_rng(0)
    lengths = np.full(40, 10)
    store._erase_behind_at = 1  # the loads' disk-index erases left to the background thread too
    batches = [rng.integers(0, 5000, 400) for _ in range(31)]
    for step in range(30):  # 400 IDs a step over 5,000 rows: ~330 read from disk a step, evicting as many
        _, ctx = store.pooled_lookup(batches[step], lengths=lengths)
        store.prefetch(batches[step + 1])
        store.apply_gradients(ctx, np.ones((40, DIM), np.float32))
        assert store.disk_index_bytes == reserved
    assert store.stats["rows_read"] > 30 * 250 and len(store) == 5000


def test_the_disk_index_grows_by_the_index_growth_rule_without_a_hint():
    """Without a reservation, put() grows the disk index by cn_index.h's rule (x1.25 of the
    buckets at least, the keys' exact need at most when more), not to powers of two."""
    from cncore._core import SlotIndex
    ix = SlotIndex()
    ix.put(np.arange(700), np.arange(700))
    assert ix.nbytes == bucket_bytes(SlotIndex.buckets_for(700))  # one batch from 16 buckets: its exact need
    ix.put(np.arange(700, 701), np.arange(1))                       # one more key: 1.25x, not 2048
    assert ix.nbytes == bucket_bytes(int(SlotIndex.buckets_for(700) * 1.25))
    ix.reserve(5000 - len(ix))
    assert ix.nbytes == bucket_bytes(SlotIndex.buckets_for(5000))


@pytest.mark.parametrize("seed", range(4))
def test_block_io_joins_runs_across_page_padding_and_writes_nothing_else(tmp_path, seed):
    """cn_blockio.h: a run of records crosses the gap at a page's end (shorter than a record, so
    padding), written as zeros; every other byte of the file is left as it was, and a read of
    any records (runs across gaps too) returns exactly what was written."""
    from cncore import _core
    from cncore.tier.records import record_offsets
    rng = np.random.default_rng(seed)
    rec, per_page, n_slots = 280, 14, 14 * 40
    path = str(tmp_path / "f")
    before = np.full(40 * 4096, 0xAA, np.uint8)
    before.tofile(path)
    slots = np.sort(rng.choice(n_slots, size=int(rng.integers(1, n_slots)), replace=False))
    order = rng.permutation(len(slots))  # records in any buffer order
    data = rng.integers(0, 255, (len(slots), rec), dtype=np.uint8)
    fd = os.open(path, os.O_RDWR)
    try:
        _core.block_io(fd, record_offsets(slots[order], rec, per_page), data[order], True, int(rng.integers(1, 4)))
        after = np.fromfile(path, np.uint8)
        expect = before.copy()
        offsets = record_offsets(slots, rec, per_page)
        for o, row in zip(offsets, data):
            expect[o:o + rec] = row
        written = np.zeros(len(after), bool)
        for o in offsets:
            written[o:o + rec] = True
        untouched = ~written
        padding = np.zeros(len(after), bool)
        for page in range(40):
            padding[page * 4096 + per_page * rec:(page + 1) * 4096] = True
        assert (after[written] == expect[written]).all()
        # outside the records only padding may change, and only to zeros
        changed = untouched & (after != before)
        assert (padding[changed]).all() and (after[changed] == 0).all()
        assert (after[untouched & ~padding] == 0xAA).all()
        pick = rng.permutation(len(slots))[:int(rng.integers(1, len(slots) + 1))]
        back = np.zeros((len(pick), rec), np.uint8)
        _core.block_io(fd, record_offsets(slots[pick], rec, per_page), back, False, int(rng.integers(1, 4)))
        np.testing.assert_array_equal(back, data[pick])
    finally:
        os.close(fd)


def test_a_closed_store_never_writes_to_a_reused_descriptor(tmp_path):
    """The record writer holds the file's descriptor: after close() a spill must fail, not write
    into whatever file the process opened next under the same number."""
    store = cncore.make_store(cncore.StoreConfig(dim=2, storage=cncore.Tiered(str(tmp_path / "t"),
                                                                              cache_bytes=16 * 60)))
    store.find_or_insert(np.arange(16))
    store.close()
    other = os.open(str(tmp_path / "other"), os.O_RDWR | os.O_CREAT)
    try:
        with pytest.raises(ValueError, match="I/O operation on closed store"):
            for start in range(100, 140, 8):
                store.find_or_insert(np.arange(start, start + 8))
        assert os.fstat(other).st_size == 0
    finally:
        os.close(other)


_FORK_DURING_PREFETCH = """
import os, sys, time, threading
import numpy as np
import cncore, cncore.tier.background as tiered
store = cncore.make_store(cncore.StoreConfig(dim=4, seed=1, storage=cncore.Tiered(sys.argv[1], cache_bytes=64 * 60)))
for start in range(0, 2000, 40):  # most of them on disk
    store.find_or_insert(np.arange(start, start + 40))
expected = np.concatenate([store.lookup(np.arange(s, s + 40)) for s in range(0, 2000, 40)])
done = threading.Event()
tiered._prefetcher().submit(lambda: (time.sleep(0.3), done.set()))  # a job still running at the fork
store.prefetch(np.arange(40))  # queued behind it: its disk-index lookup holds the index's mutex
parent = os.getpid()
pid = os.fork()
if pid == 0:  # the child: every job given before the fork has ended; the store is the parent's
    try:
        store.lookup(np.arange(40))
        ok = False
    except ValueError as exc:
        ok = done.is_set() and f"belongs to process {parent}" in str(exc)
    os._exit(0 if ok else 1)
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    got, status = os.waitpid(pid, os.WNOHANG)
    if got:
        rows = np.concatenate([store.lookup(np.arange(s, s + 40)) for s in range(0, 2000, 40)])
        assert np.array_equal(rows, expected)  # the parent's store goes on as it was
        sys.exit(os.waitstatus_to_exitcode(status))
    time.sleep(0.05)
os.kill(pid, 9)
sys.exit(3)
"""


def test_a_fork_waits_for_the_prefetch_thread_and_the_child_is_refused_the_store(tmp_path):
    """The prefetch thread's job holds a disk index's mutex in C; a fork first lets the thread
    finish its jobs, so nothing of the child's is left locked by a thread it lacks. The child's
    copy of the store is the parent's (a directory has one writer): its verbs refuse at once,
    naming the parent, and the parent's store goes on. (In a subprocess, bounded in time: 3 =
    the child hung.)"""
    run = subprocess.run([sys.executable, "-c", _FORK_DURING_PREFETCH, str(tmp_path / "t")], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr


@pytest.mark.parametrize("held", [True, False])
def test_a_prefetch_never_brings_back_a_row_older_than_memory(tmp_path, held):
    """The prefetch's find and reads run on the background thread (RecordWriter.stage), while
    the foreground goes on with verbs that need no disk row (a fault-in waits for the job).
    Rows that change and go back to disk meanwhile come back as they are in memory, never as a
    record the prefetch staged before. `held`: the background thread is kept busy (0.3 s), so
    the job is still to run when the foreground evicts: the spill waits for it (spilled records
    are written behind, on that thread, after the job: its find must not see their keys), the
    job stages the 20 rows on disk then, and the 10 rows trained since go to disk after it
    (reread: 20 taken); otherwise the job ran first, and the records it staged for the 10 rows
    erased and made anew (new slots) are stale: reread, 20 taken."""
    import threading

    from cncore.tier import background as tiered
    config = cncore.StoreConfig(dim=DIM, optimizer=cncore.SGD(lr=0.5), storage=cncore.Tiered(
        str(tmp_path / "t"), cache_bytes=80 * (DIM * 4 + 47)))
    store = cncore.make_store(config)
    memory = cncore.make_store(dataclasses.replace(config, storage=None))
    both = (store, memory)

    def train(keys, grad=1.0):
        for s in both:
            _, ctx = s.pooled_lookup(np.asarray(keys, np.int64), lengths=np.ones(len(keys), np.int64))
            s.apply_gradients(ctx, np.full((len(keys), DIM), grad, np.float32))

    wanted = np.arange(0, 30)
    for start in range(0, 400, 40):  # 400 rows, most on disk
        train(np.arange(start, start + 40))
    if held:
        train(wanted[:10], grad=-3.0)  # in memory when the prefetch is handed in
    assert (store._disk.find(wanted[10:]) >= 0).all()
    gate = threading.Event()
    if held:
        tiered._prefetcher().submit(gate.wait)  # the prefetch's job queues behind this
        threading.Timer(0.3, gate.set).start()
    store.prefetch(wanted)
    if not held:
        store._wait_prefetch()
        assert len(store._prefetch.staged[1]) == 30  # all 30 staged
        for s in both:
            s.erase(wanted[:10])
        train(wanted[:10], grad=-3.0)  # made anew, in memory
    for start in (1000, 1040):  # new keys: wanted[:10] go back to disk, to new slots
        train(np.arange(start, start + 40))
    assert (store._disk.find(wanted) >= 0).all()
    gate.set()
    before = store.stats.get("prefetched", 0)
    np.testing.assert_array_equal(store.lookup(wanted), memory.lookup(wanted))
    assert store.stats.get("prefetched", 0) - before == 20
    assert_same_rows(store, memory)


def small_tier_and_memory(tmp_path, rows: int = 300):
    """A tiered store of 80 cached rows (SGD) holding keys 0..rows-1, most of them on disk (the
    last filled in memory), and an in-memory store with the same rows."""
    config = cncore.StoreConfig(dim=DIM, optimizer=cncore.SGD(lr=0.5), storage=cncore.Tiered(
        str(tmp_path / "t"), cache_bytes=80 * (DIM * 4 + 47)))
    store, memory = cncore.make_store(config), cncore.make_store(dataclasses.replace(config, storage=None))
    for start in range(0, rows, 30):
        for s in (store, memory):
            s.find_or_insert(np.arange(start, min(start + 30, rows)))
    return store, memory


@pytest.mark.parametrize("seed", range(3))
def test_the_prefetch_job_stages_each_disk_key_once_in_key_order_with_its_record(tmp_path, seed):
    """RecordWriter.stage (cn_tier_stage, its sorts in cn_sort.h): of a batch of IDs with
    repeats, exactly the distinct keys on disk, in ascending (signed) key order, each with its
    disk slot and the record at that slot; `cap` keeps the first cap of them."""
    rng = np.random.default_rng(seed)
    config = cncore.StoreConfig(dim=DIM, optimizer=cncore.SGD(lr=0.5), storage=cncore.Tiered(
        str(tmp_path / "t"), cache_bytes=80 * (DIM * 4 + 47)))
    store = cncore.make_store(config)
    keys = rng.choice(np.arange(-2**62, 2**62, 2**52), 600, replace=False)
    for start in range(0, 600, 40):
        store.find_or_insert(keys[start:start + 40])
    store._wait_writes()
    ids = rng.choice(np.concatenate([keys, rng.integers(-2**62, 2**62, 50)]), 2000)  # repeats, some absent
    slots_all = store._disk.find(ids)
    want = np.unique(ids[slots_all >= 0])
    for cap in (len(ids), 7):
        buf = np.zeros((cap, store._record.itemsize), np.uint8)
        got_keys, got_slots = store._writer.stage(np.ascontiguousarray(ids), cap, buf, 1)
        np.testing.assert_array_equal(got_keys, want[:cap])
        np.testing.assert_array_equal(got_slots, store._disk.find(want[:cap]))
        np.testing.assert_array_equal(buf[:len(got_keys)],
                                      store._read(got_slots).view(np.uint8).reshape(len(got_keys), -1))
    store.close()


def test_the_rounds_past_the_prefetchs_keys_read_into_its_buffer(tmp_path, monkeypatch):
    """A fault-in of several rounds whose prefetch read only the first keys (its cap, 1/32 of
    the cache): once a round is past them, the prefetch's buffer is let go (or serves the later
    rounds' reads) and the later rounds share one buffer, instead of a new one each beside the
    prefetch's (a uniform step at 10x held both); every row still equals the reference."""
    config = cncore.StoreConfig(dim=DIM, optimizer=cncore.SGD(lr=0.5), storage=cncore.Tiered(
        str(tmp_path / "t"), cache_bytes=1024 * (DIM * 4 + 47)))
    store, memory = cncore.make_store(config), cncore.make_store(dataclasses.replace(config, storage=None))
    for start in range(0, 3000, 500):
        for s in (store, memory):
            s.find_or_insert(np.arange(start, start + 500))
    from cncore.tier import records as tiered
    monkeypatch.setattr(tiered, "_IO_ROWS", 8)  # the prefetch's cap is then the cache's 1/32
    store._evict_chunk = 8  # rounds of 8 rows
    keys = np.arange(0, 100)
    assert (store._disk.find(keys) >= 0).all()
    staged_buffers, round_buffers = [], []
    take, buffer = store._take_staged, store._buffer
    monkeypatch.setattr(store, "_take_staged", lambda: staged_buffers.append(take()) or staged_buffers[-1])
    monkeypatch.setattr(store, "_buffer", lambda n: round_buffers.append(buffer(n)) or round_buffers[-1])
    store.prefetch(keys)
    out = store.lookup(keys)
    (staged,) = staged_buffers
    assert staged is not None and 8 < len(staged[0]) < 100 - 16
    round_buffers = round_buffers[1:]  # the first: the prefetch's own, which it read into
    # The round that crosses the prefetch's last key takes a buffer (and one for the record it
    # lacks); every later round reads into that one (the spy keeps each buffer alive, so new
    # ones could not reuse freed memory). Before, each later round took a new buffer too.
    blocks = []
    for b in round_buffers:
        if not any(np.shares_memory(b, other) for other in blocks):
            blocks.append(b)
    assert len(round_buffers) >= (100 - len(staged[0])) // 8 and len(blocks) == 2
    np.testing.assert_array_equal(out, memory.lookup(keys))
    store.close()


@pytest.mark.parametrize("seed", range(4))
def test_the_fault_in_hands_the_lookup_every_keys_slot_or_none(tmp_path, seed):
    """faulted_in gives, once every key has a row in memory, the cache slot of each key that was
    in memory and -1 for each it read in (over several rounds while the cache evicts), which the
    lookup pools, finding only the -1 keys (grouped_forward's found_slots); None when some key
    has no row yet. Checked against a find inside the same held section, and the lookups
    against an in-memory store."""
    rng = np.random.default_rng(seed)
    store, memory = small_tier_and_memory(tmp_path)
    store._evict_chunk = 8  # rounds of 8 rows: a fault-in of tens of disk rows takes several
    gave = {"slots": 0, "none": 0}
    for _ in range(30):
        keys = rng.integers(0, 320, int(rng.integers(1, 40)))  # repeats; keys 300+ have no row yet
        insert = bool(rng.integers(0, 2))
        was_cached = store.cache.find(keys)[1]
        with store.faulted_in(keys, insert) as found:
            if found is None:
                gave["none"] += 1
            else:
                gave["slots"] += 1
                slots, present = store.cache.find(keys)
                assert present.all()
                np.testing.assert_array_equal(found[was_cached], slots[was_cached])
                assert (found[~was_cached] == -1).all()
        lengths = np.ones(len(keys), np.int64)
        if not insert:
            keys = keys[memory.contains(keys)]
            lengths = np.ones(len(keys), np.int64)
        outs = [s.pooled_lookup(keys, lengths=lengths, insert_missing=insert)[0] for s in (store, memory)]
        np.testing.assert_array_equal(outs[0], outs[1])
    assert gave["slots"] > 0 and gave["none"] > 0
    store.close()


@pytest.mark.parametrize("between", ["nothing", "backward", "other keys", "erase", "flush"])
def test_a_lookup_takes_the_prefetchs_cache_find_only_while_the_caches_keys_are_unchanged(tmp_path, monkeypatch,
                                                                                          between):
    """prefetch(keys) finds the keys in the cache (only the missing ones go to the background
    job); the lookup of the same keys takes that find instead of its own unless the cache's keys
    changed since (the table's version). Whatever happened between, the lookup equals an
    in-memory store's."""
    from cncore.store import EmbeddingStore
    store, memory = small_tier_and_memory(tmp_path)
    both = (store, memory)
    keys = np.array([5, 290, 7, 5, 299, 150, 290], np.int64)  # some cached (the last filled), some on disk
    store.prefetch(keys)
    ctxs = [s.pooled_lookup(np.array([290, 291], np.int64), lengths=np.array([2]))[1] for s in both]
    if between == "backward":
        for s, c in zip(both, ctxs):
            s.apply_gradients(c, np.ones((1, DIM), np.float32))
    elif between == "other keys":  # faults rows in, evicting others: the cache's keys change
        for s in both:
            s.lookup(np.arange(100, 140))
    elif between == "erase":
        for s in both:
            s.erase(np.array([299]))
    elif between == "flush":
        store.flush()
    finds = []
    real_find = EmbeddingStore.find
    monkeypatch.setattr(EmbeddingStore, "find", lambda self, k: finds.append(len(k)) or real_find(self, k))
    outs = [s.pooled_lookup(keys, lengths=np.ones(len(keys), np.int64), insert_missing=True)[0] for s in both]
    np.testing.assert_array_equal(outs[0], outs[1])
    took_prefound = len(keys) not in finds[:1]
    assert took_prefound == (between in ("nothing", "backward", "flush")), (between, finds)
    store.close()


def test_a_grouped_lookup_hands_each_tiered_feature_alone_on_its_store_its_found_slots(tmp_path):
    """grouped.tiers_faulted_in (the collections' path): a tiered store used by one feature of
    the call gives that feature's cache slots to the core lookup; a store shared by two
    features, or not tiered, gives none. The grouped lookup equals per-store in-memory lookups."""
    from cncore import grouped

    def tier(name):
        return cncore.StoreConfig(dim=DIM, optimizer=cncore.SGD(lr=0.5), storage=cncore.Tiered(
            str(tmp_path / name), cache_bytes=80 * (DIM * 4 + 47)))
    a, b = cncore.make_store(tier("a")), cncore.make_store(tier("b"))
    plain = cncore.make_store(cncore.StoreConfig(dim=DIM))
    refs = {id(s): cncore.make_store(dataclasses.replace(s.config, storage=None)) for s in (a, b)}
    refs[id(plain)] = plain
    for start in range(0, 300, 30):  # most rows of a and b on disk
        for s in (a, b, refs[id(a)], refs[id(b)], plain):
            s.find_or_insert(np.arange(start, start + 30))
    rng = np.random.default_rng(0)
    stores = [a, b, b, plain]
    keys = [rng.integers(0, 300, 12) for _ in stores]
    held, found = grouped.tiers_faulted_in(stores, keys, False)
    with held:
        assert found[1] is None and found[2] is None and found[3] is None  # b twice; plain not tiered
        now = a.cache.find(keys[0])[0]
        assert ((found[0] == now) | (found[0] == -1)).all() and (found[0] == now).any()
    offsets = [np.array([0, 5, 12], np.int64) for _ in stores]
    outs = [np.zeros((2, DIM), np.float32) for _ in stores]
    grouped.lookup_arrays(stores, keys, offsets, [None] * 4, [0] * 4, outs, False, contexts=False)
    for s, k, o, out in zip(stores, keys, offsets, outs):
        np.testing.assert_array_equal(out, refs[id(s)].pooled_lookup(k, o)[0])
    a.close()
    b.close()


def test_a_prefetch_of_a_few_ids_hands_in_a_job_only_for_keys_on_disk(tmp_path):
    """prefetch: when few IDs are missing from memory, the disk index is asked on the caller's
    thread and no background job is handed in unless some are on disk; the job then stages
    exactly those. Lookups equal an in-memory store's either way."""
    store, memory = small_tier_and_memory(tmp_path)
    cached_and_new = np.array([299, 298, 1000, 1001, 299], np.int64)  # in memory, or no row anywhere
    store.prefetch(cached_and_new)
    assert store._prefetch.future is None
    with_disk = np.array([299, 3, 1000, 4, 3], np.int64)  # 3 and 4 on disk
    store.prefetch(with_disk)
    assert store._prefetch.future is not None
    store._wait_prefetch()
    np.testing.assert_array_equal(store._prefetch.staged[1], [3, 4])
    for keys in (with_disk, cached_and_new):
        outs = [s.pooled_lookup(keys, lengths=np.ones(len(keys), np.int64), insert_missing=True)[0]
                for s in (store, memory)]
        np.testing.assert_array_equal(outs[0], outs[1])
    store.close()


@pytest.mark.parametrize("prefetched", ["the call's keys", "other keys"])
def test_a_fault_in_makes_room_before_waiting_only_for_its_own_prefetch(tmp_path, prefetched):
    """A fault-in whose keys are the running prefetch's (its cache find matched) evicts the room
    its disk rows need before it waits for the job's reads, and that spill does not wait for the
    job (the job looks up only this call's keys missing from memory; the eviction takes only rows
    the call does not use). With another prefetch running, the spill waits for it first, as
    before. The background thread is held (0.4 s) so that the job is provably still to run.
    Lookups equal an in-memory store's."""
    import threading
    import time

    from cncore.tier import background as tiered
    store, memory = small_tier_and_memory(tmp_path)
    assert store.cached_rows + 12 > store.cache_rows  # 12 disk rows need an eviction
    keys = np.concatenate([np.arange(290, 300), np.arange(0, 12)])  # 10 in memory, 12 on disk
    spilled_at = []
    behind = store._writer.behind
    store._writer.behind = lambda job: (spilled_at.append(time.monotonic()), behind(job))[1]
    gate = threading.Event()
    tiered._prefetcher().submit(gate.wait)  # the prefetch's job queues behind this
    opened = []
    threading.Timer(0.4, lambda: (opened.append(time.monotonic()), gate.set())).start()
    store.prefetch(keys if prefetched == "the call's keys" else np.arange(20, 32))
    outs = [s.pooled_lookup(keys, lengths=np.ones(len(keys), np.int64))[0] for s in (store, memory)]
    gate.set()
    np.testing.assert_array_equal(outs[0], outs[1])
    assert spilled_at and opened
    assert (spilled_at[0] < opened[0]) == (prefetched == "the call's keys"), (spilled_at, opened)
    assert_same_rows(store, memory)
    store.close()


@pytest.mark.parametrize("value", [0.0, float(np.finfo(np.float32).max)])
def test_found_slots_of_an_unbounded_table_are_checked_whatever_its_rows_hold(value):
    """An unbounded table keeps no live bits: its live slots are those below the high-water mark
    and off the free stack. Rows of zeros (no bit set) and of the largest float32 (nearly every
    bit set) must not decide which slots are live."""
    from cncore import _core
    store = cncore.make_store(cncore.StoreConfig(dim=4))
    slots = store.find_or_insert(np.arange(10))[0]
    store.assign(np.arange(10), np.full((10, 4), value, np.float32))
    keys, offsets = np.array([0, 1], np.int64), np.array([0, 1, 2], np.int64)
    out = np.zeros((2, 4), np.float32)
    _core.grouped_forward([store._table], [keys], [offsets], [None], [0], [out], False,
                          [np.array(slots[[0, 1]], np.int64)])
    np.testing.assert_array_equal(out, store.lookup(keys))
    store.erase(np.array([3]))
    with pytest.raises(ValueError, match=r"found_slots\[0\]: a slot that holds no row"):
        _core.grouped_forward([store._table], [keys], [offsets], [None], [0], [out], False,
                              [np.array([slots[0], slots[3]], np.int64)])


def test_found_slots_must_be_live_slots_of_the_table():
    """_core.grouped_forward's found_slots: a slot out of range or not live, or a -1 key with no
    row, is refused with a ValueError naming it, and the table is unchanged; a -1 key with a row
    is found."""
    from cncore import _core
    store = cncore.make_store(cncore.StoreConfig(dim=4))
    slots = store.find_or_insert(np.arange(10))[0]
    store.erase(np.array([3]))
    before = store.lookup(np.arange(10)[np.arange(10) != 3])
    keys, offsets = np.array([0, 1], np.int64), np.array([0, 1, 2], np.int64)
    for bad in ([slots[0], 10**6], [slots[0], -2], [slots[0], slots[3]]):
        out = np.zeros((2, 4), np.float32)
        with pytest.raises(ValueError, match=r"found_slots\[0\]: a slot that holds no row"):
            _core.grouped_forward([store._table], [keys], [offsets], [None], [0], [out], False,
                                  [np.array(bad, np.int64)])
    out = np.zeros((2, 4), np.float32)
    with pytest.raises(ValueError, match=r"found_slots\[0\]: a slot that holds no row"):
        _core.grouped_forward([store._table], [np.array([0, 3], np.int64)], [offsets], [None], [0], [out], False,
                              [np.array([slots[0], -1], np.int64)])  # key 3 (-1: to find) has no row
    with pytest.raises(ValueError, match=r"found_slots: one entry \(slots or None\) per table, got 2 for 1"):
        _core.grouped_forward([store._table], [keys], [offsets], [None], [0], [out], False, [None, None])
    with pytest.raises(ValueError, match=r"found_slots\[0\]: expected"):
        _core.grouped_forward([store._table], [keys], [offsets], [None], [0], [out], False,
                              [np.array([slots[0]], np.int64)])  # one slot for two keys
    out = np.zeros((2, 4), np.float32)
    _core.grouped_forward([store._table], [keys], [offsets], [None], [0], [out], False,
                          [np.array(slots[[1, 0]], np.int64)])
    np.testing.assert_array_equal(out, store.lookup(np.array([1, 0])))  # pooled from the slots given
    _core.grouped_forward([store._table], [np.array([5, 1], np.int64)], [offsets], [None], [0], [out], False,
                          [np.array([-1, slots[1]], np.int64)])
    np.testing.assert_array_equal(out, store.lookup(np.array([5, 1])))  # key 5 found
    np.testing.assert_array_equal(store.lookup(np.arange(10)[np.arange(10) != 3]), before)


@pytest.mark.parametrize("rec", [8, 152, 280, 4000, 4096, 4104, 9000])
def test_record_offsets_is_the_one_formula_and_never_straddles_a_page(rec):
    """tiered.record_offsets (the reads) is cn_tier_offset (the writer's spills) itself; here it
    is checked against the layout written out by hand: page = slot // per_page, the record at
    (slot % per_page) * rec within it, or whole pages for records of a page or more."""
    from cncore.tier.records import record_offsets
    rec_bytes = rec if rec < 4096 else -(-rec // 4096) * 4096
    per_page = max(1, 4096 // rec_bytes)
    slots = np.concatenate([np.arange(40), np.random.default_rng(rec).integers(0, 2**40 // rec_bytes, 200)])
    want = [s * rec_bytes if rec_bytes >= 4096 else (s // per_page) * 4096 + (s % per_page) * rec_bytes
            for s in slots.tolist()]
    got = record_offsets(slots, rec_bytes, per_page)
    assert got.dtype == np.int64 and got.tolist() == want
    if rec_bytes < 4096:  # each record's first and last byte on one page
        assert ((got // 4096) == ((got + rec_bytes - 1) // 4096)).all()
    else:
        assert (got % 4096 == 0).all()
    with pytest.raises(ValueError, match="per_page"):
        record_offsets(slots, rec_bytes, per_page + 1)


def test_the_heap_is_trimmed_once_the_processs_tiered_stores_together_spilled_their_shares(tmp_path,
                                                                                           monkeypatch):
    """_HeapTrim: malloc_trim runs at the first fault-in at which the bytes spilled by every
    tiered store of the process since the last trim exceed the sum of their shares (not one
    store's own share: 26 small tables trimmed 26x too often), counted by a literal model from
    each call's rows written; a closed store's share leaves the sum."""
    import cncore.tier.heap as tiered
    from cncore.tier.records import _row_bytes
    trims = []
    monkeypatch.setattr(tiered, "_MALLOC_TRIM", lambda pad: trims.append(pad) or 1)
    monkeypatch.setattr(tiered, "_HEAP_TRIM", tiered._HeapTrim())
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, _ = small_tier_and_memory(tmp_path / "a", rows=0)
    b, _ = small_tier_and_memory(tmp_path / "b", rows=0)
    row = _row_bytes(a._tier_config)
    a._trim_every, b._trim_every = 50 * row, 120 * row
    for s in (a, b):
        tiered._HEAP_TRIM.add(s)  # again, with the shares set above
    since, expected, key = 0, 0, 0
    for call in range(60):
        if call == 40:
            b.close()  # the sum is a's share alone from now on
        if since > (170 if call < 40 else 50) * row:  # checked at the call's fault-in, before its inserts
            expected, since = expected + 1, 0
        before = a.stats["rows_written"]
        a.lookup(np.arange(key, key + 30), insert_missing=True)
        key += 30
        since += (a.stats["rows_written"] - before) * row
        assert len(trims) == expected, call
    assert expected >= 8  # trims under both sums (about 5 of them, then 1 in 2 calls)
    assert len(a) == 60 * 30
    a.flush()  # a flush trims, and the count starts over
    assert len(trims) == expected + 1 and tiered._HEAP_TRIM._bytes == 0
    a.close()


def test_the_record_file_opens_without_access_times_where_allowed(tmp_path, monkeypatch):
    """_open_rows: O_NOATIME (no access-time check on every read) for the file's owner; where the
    kernel refuses it (EPERM: another owner's file) the file opens without it and works."""
    import cncore.tier.directory as tiered
    store, memory = small_tier_and_memory(tmp_path, rows=200)
    flags = int(open(f"/proc/self/fdinfo/{store._fd}").read().split("flags:")[1].split()[0], 8)
    assert flags & os.O_NOATIME
    store.flush()
    store.close()
    real_open = os.open

    def refuse_noatime(path, flags, *args):
        if flags & os.O_NOATIME:
            raise PermissionError(1, "Operation not permitted", path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(tiered.os, "open", refuse_noatime)
    again = cncore.make_store(store.config)
    flags = int(open(f"/proc/self/fdinfo/{again._fd}").read().split("flags:")[1].split()[0], 8)
    assert not flags & os.O_NOATIME
    keys = np.arange(200)
    np.testing.assert_array_equal(again.lookup(keys), memory.lookup(keys))
    again.close()


def test_a_loaded_rows_disk_entry_is_erased_behind_and_never_a_newer_one(tmp_path):
    """_erase_behind: a one-round fault-in leaves the disk-index erase of the rows it loaded to the
    background thread, handed over by the next prefetch. Until it runs, the rows are in memory and
    their old disk entries stay. Here the background thread is held, the rows are evicted again
    meanwhile (indexed anew at other slots), and then the erase runs: it leaves the newer entries
    (a plain erase would drop them: rows lost). Rows, len and a reopened flush equal an in-memory
    store's."""
    import threading

    from cncore.tier import background as tiered
    store, memory = small_tier_and_memory(tmp_path)
    store._erase_behind_at = 1
    store._wait_writes()
    keys = np.arange(0, 12)
    old = store._disk.find(keys)
    assert (old >= 0).all()  # on disk
    for s in (store, memory):
        _, ctx = s.pooled_lookup(keys, lengths=np.ones(12, np.int64))
        s.apply_gradients(ctx, np.ones((12, DIM), np.float32))
    assert store.contains(keys).all() and (store._disk.find(keys) == old).all()  # loaded; still indexed
    gate = threading.Event()
    tiered._prefetcher().submit(gate.wait)
    try:
        store.prefetch(keys)  # all in memory: no read job, only the erase, queued behind the gate
        assert store._erases.task is not None and not store._erases.task.done()
        store.evict(store.cached_rows)  # the loaded rows go back to disk, at other slots
        new = store._disk.find(keys)
        assert (new >= 0).all() and not np.isin(new, old).any()
    finally:
        gate.set()
    store._erases.task.result()
    assert (store._disk.find(keys) == new).all()
    assert len(store) == len(memory) == 300
    assert_same_rows(store, memory)
    store.flush()
    store.close()
    again = cncore.make_store(store.config)
    assert_same_rows(again, memory)
    again.close()


def test_a_fault_in_takes_its_prefetchs_find_only_while_the_disk_index_is_unchanged(tmp_path, monkeypatch):
    """_own_plan: a fault-in whose running prefetch was handed every ID missing from memory takes
    that job's find instead of its own when every missing key is on disk and the disk index is
    unchanged since. An erase of one of those keys in between (it leaves the cache's keys as they
    were, so the prefetch's cache find still matches) makes the fault-in find them itself, and
    the erased key stays erased (a new key: its initial row); so do new keys among them. Rows
    equal an in-memory store's throughout."""
    import time
    store, memory = small_tier_and_memory(tmp_path)
    store._find_on_disk_here = 0
    own_finds = []
    real = store._missing_rows
    monkeypatch.setattr(store, "_missing_rows", lambda *a: (own_finds.append(len(a[0])), real(*a))[1])

    def prefetched(keys):
        store.prefetch(keys)
        deadline = time.monotonic() + 30
        while store._prefetch.job.plan() is None and time.monotonic() < deadline:  # its find done
            time.sleep(0.001)

    def train(keys):
        outs = []
        for s in (store, memory):
            out, ctx = s.pooled_lookup(keys, lengths=np.ones(len(keys), np.int64), insert_missing=True)
            s.apply_gradients(ctx, np.ones((len(keys), DIM), np.float32))
            outs.append(out)
        np.testing.assert_array_equal(outs[0], outs[1])

    train(np.arange(0, 24))  # rows no longer their initial ones (so a resurrected row would show)
    store.evict(store.cached_rows)
    own_finds.clear()
    keys = np.arange(0, 12)  # on disk
    prefetched(keys)
    train(keys)
    assert own_finds == [] and store.stats["prefetched"] >= 12
    keys = np.arange(12, 24)
    prefetched(keys)
    for s in (store, memory):
        s.erase(np.array([15]))
    train(keys)
    assert own_finds == [12]
    keys = np.array([24, 25, 26, 10**6])  # a new key among them
    prefetched(keys)
    train(keys)
    assert own_finds == [12, 4]
    assert_same_rows(store, memory)
    store.close()

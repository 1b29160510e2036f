"""The victim selection at sizes where it samples or runs its radix passes (the state
machine's tables are small enough to be decided by the final sort alone): evict(k) on tens of
thousands of rows equals a full lexsort by (score, key), for spread scores, one shared score
(ties decided by the keys' digits), LFU counts near 2^32 (scores using all 64 bits), and LFU with
aging (counts halved by the steps since the last use, at the table's step); with
the sampled threshold (4096 rows), with the radix select alone (0), and with a sample too small
to guess well (16 rows: its misses fall back to the radix select)."""
import numpy as np
import pytest

import cncore
from cncore import _core


@pytest.fixture(params=[4096, 0, 16], ids=["sampled", "radix", "tiny-sample"])
def sample_rows(request):
    before = _core.set_evict_sample_rows(request.param)
    yield request.param
    _core.set_evict_sample_rows(before)


NOW, HALVE = 5000, 256  # lfu-aging: the table's step, and LFU's halving period


def expected_order(keys, counts, steps, policy):
    if policy == "lfu-aging":  # the count halves for every HALVE steps since the last use
        halvings = (NOW - steps) // HALVE
        counts = np.where(halvings >= 32, 0, counts >> np.minimum(halvings, 31))
    primary = [steps] if policy == "lru" else [steps, counts]  # lexsort: last key is primary
    return keys[np.lexsort([keys] + primary)]


@pytest.mark.parametrize("policy,spread", [("lru", "spread"), ("lru", "one_step"), ("lfu", "spread"),
                                           ("lfu", "huge_counts"), ("lru", "few_steps"), ("lfu-aging", "recent")])
def test_evict_k_equals_a_full_sort(policy, spread, sample_rows):
    rng = np.random.default_rng(7)
    n = 40_000
    keys = rng.choice(np.concatenate([rng.integers(-2**63, 2**63 - 1, n, dtype=np.int64),
                                      np.array([-2**63, 2**63 - 1, 0, -1])]), n, replace=False)
    counts = rng.integers(0, 5, n).astype(np.uint32)
    steps = {"spread": rng.integers(0, 2**32 - 1, n, dtype=np.uint64), "one_step": np.full(n, 77),
             "huge_counts": rng.integers(0, 3, n), "few_steps": rng.integers(100, 104, n),
             "recent": rng.integers(0, NOW + 1, n)}[spread].astype(np.uint32)
    if spread == "huge_counts":
        counts = rng.choice(np.array([0, 2**31, 2**32 - 1], dtype=np.uint32), n)
    if spread == "recent":  # 0-19 halvings; counts with many bits, so that halved counts still differ
        counts = rng.integers(0, 2**20, n).astype(np.uint32)
    eviction = {"lru": cncore.LRU(), "lfu": cncore.LFU(), "lfu-aging": cncore.LFU(halve_every=HALVE)}[policy]
    s = cncore.EmbeddingStore(dim=1, eviction=eviction, capacity=n)
    s.step = NOW
    s.load(keys, keys[:, None].astype(np.float32), counts=counts, last_steps=steps)
    sink = []
    s.on_evict(sink.append)
    want = expected_order(keys, counts.astype(np.int64), steps.astype(np.int64), policy)
    done = 0
    for k in (1, 4095, 4096, 4097, 9000, 0, 17, 12000):
        assert s.evict(k) == k
        if k:
            assert sink[-1].keys.tolist() == want[done:done + k].tolist()
            np.testing.assert_array_equal(sink[-1].rows[:, 0], want[done:done + k].astype(np.float32))
        done += k
    assert sorted(s.export().keys.tolist()) == sorted(want[done:].tolist())
    assert s.evict(10**9) == n - done and len(s) == 0


def test_a_budget_keeps_the_table_and_its_memory_bounded_over_a_long_stream(sample_rows):
    rng = np.random.default_rng(1)
    s = cncore.EmbeddingStore(dim=4, max_rows=10_000, eviction=cncore.LRU(), optimizer=cncore.SGD(lr=0.1))
    admitted, sizes = 0, []
    for step in range(40):
        keys = rng.integers(0, 100_000, 2048)
        admitted += int((~s.contains(np.unique(keys))).sum())
        out, ctx = s.pooled_lookup(keys, lengths=np.full(256, 8))
        s.apply_gradients(ctx, np.ones((256, 4), np.float32))
        sizes.append(len(s))
        if step == 10:
            nbytes = s.nbytes
    assert max(sizes) <= 10_000 and min(sizes[10:]) >= 10_000 - 10_000 // 32
    assert len(s) + s.evicted_count == admitted
    assert s.nbytes == nbytes  # full since step 10: slots are reused, nothing more is allocated


def test_the_benchmark_script_measures_every_cell():
    """asv_bench/scripts/bounded_tables.py on a tiny stream: every cell printed with numbers,
    the bounded table at most its budget, the eviction table filled (a smoke test, so that the
    script cannot silently stop measuring)."""
    import os
    import subprocess
    import sys
    script = os.path.join(os.path.dirname(__file__), "..", "asv_bench", "scripts", "bounded_tables.py")
    out = subprocess.run([sys.executable, script, "--max-rows", "2000", "--distinct", "20000", "--steps", "6",
                          "--batch", "64", "--bag", "8", "--dim", "4", "--repeat", "1", "--streams", "uniform",
                          "--policies", "none,lru"], check=True, capture_output=True, text=True).stdout
    cells = [line.split() for line in out.splitlines() if line.startswith("uniform")]
    assert [c[1] for c in cells] == ["none", "lru"]
    none, lru = ({"ms": float(c[2]), "rows": int(c[4]), "evicted": int(c[5])} for c in cells)
    assert none["ms"] > 0 and lru["ms"] > 0 and none["evicted"] == 0
    assert lru["rows"] <= 2000 and lru["evicted"] > 0 and none["rows"] > 2000
    throughput = [line.split() for line in out.splitlines() if line.startswith(("LRU ", "LFU "))]
    assert len(throughput) == 4 and all(float(t[-1]) > 0 for t in throughput)

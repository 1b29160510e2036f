"""Tiny tables cost what they hold (issue 33): the key index's minimum is one cache line (4
buckets, cn_index.h) and a bounded table whose budget fits in 64 KiB gets one page of the
fewest rows, a power of two, that hold it (cn_arena.h). Checked here: the index and the table at
tiny sizes against a dict of NumPy rows (a hypothesis state machine across the minimum: insert,
find, erase, evict, growth), the growth sequence from 4 buckets, the bytes a tiny table reports
against its layout, the benchmark's charge (cn_dlrm.train.used_bytes), and save/load of tiny
tables, including files written by the build with the 16-bucket minimum. Core calls that could
crash run in a subprocess."""
import base64
import io
import math
import tarfile

import numpy as np
import pytest
from reference import run_isolated

import cncore
from cncore.tablefile.reader import load_store
from cncore.tablefile.writer import save_table

MIN_BUCKETS = 4  # CN_INDEX_MIN_BUCKETS
GROWTH = 1.25  # CN_INDEX_GROWTH


def buckets_for(n_keys: int, max_load: float) -> int:
    """cn_index_buckets_for: the fewest buckets (>= 4) holding n_keys at max_load."""
    n = max(MIN_BUCKETS, math.ceil(n_keys / max_load))
    while int(max_load * n) < n_keys:
        n += 1
    return n


def grown(n_buckets: int, n_keys: int, max_load: float) -> int:
    """cn_index_growth_buckets without a budget: 1.25x (at least one bucket more), at least the need."""
    n = max(int(n_buckets * GROWTH), n_buckets + 1)
    return max(n, buckets_for(n_keys, max_load))


def rounded(nbytes: int) -> int:
    """cn_alloc_rounded: 64-byte blocks."""
    return max(64, -(-nbytes // 64) * 64)


def budget_page_bytes(budget: int, row_bytes: int, meta_bytes: int) -> int:
    """cn_arena_init's page for a bounded table whose budget fits in 64 KiB: the fewest rows, a
    power of two, holding the budget; rows, metadata (16-byte aligned), keys, live bits."""
    rows = 1 << max(0, (budget - 1).bit_length())
    nbytes = -(-rows * row_bytes // 16) * 16 + rows * meta_bytes
    nbytes = -(-nbytes // 8) * 8
    return nbytes + rows * 8 + -(-rows // 64) * 8


def test_an_unbounded_index_grows_from_one_cache_line_a_bucket_or_more_at_a_time():
    out = run_isolated("""
        import json, numpy as np, cncore
        s = cncore.EmbeddingStore(dim=2, capacity=0)
        sizes = [s._table.n_buckets]
        for k in range(40):
            s.find_or_insert(np.array([k * 7919 - 20], dtype=np.int64))
            sizes.append(s._table.n_buckets)
        slots, found = s.find(np.arange(40, dtype=np.int64) * 7919 - 20)
        print(json.dumps({"sizes": sizes, "found": bool(found.all()), "n": len(s)}))
    """)
    assert out["found"] and out["n"] == 40
    expected = [MIN_BUCKETS]
    for n_keys in range(1, 41):
        n = expected[-1]
        expected.append(n if n_keys <= int(0.7 * n) else grown(n, n_keys, 0.7))
    assert out["sizes"] == expected
    assert expected[:10] == [4, 4, 4, 5, 6, 8, 10, 10, 12, 15]  # 4 holds 2 keys at 0.7; 1.25 x 4 = 5
    assert all(b > a for a, b in zip(sorted(set(expected)), sorted(set(expected))[1:]))


@pytest.mark.parametrize("max_rows,max_load", [(1, 0.7), (2, 0.7), (3, 0.7), (1, 0.1), (2, 0.9), (12, 0.7)])
def test_a_tiny_bounded_index_is_what_its_budget_needs(max_rows, max_load):
    s = cncore.EmbeddingStore(dim=2, max_rows=max_rows, eviction=cncore.LRU(), fallback_rows=0,
                              max_load_factor=max_load)
    for k in range(3 * max_rows + 2):
        s.find_or_insert(np.array([k], dtype=np.int64))
    assert s._table.n_buckets == buckets_for(max_rows, max_load)
    assert 0 < len(s) <= max_rows


STATE_MACHINE = r'''
import json, numpy as np, cncore
from hypothesis import settings, strategies as st, HealthCheck
from hypothesis.stateful import RuleBasedStateMachine, rule, invariant, initialize, run_state_machine_as_test

DIM = 3
KEYS = st.integers(min_value=-6, max_value=14).map(lambda k: k if k < 12 else [-2**63, 2**63 - 1, 0][k - 12])
REFERENCE = cncore.EmbeddingStore(dim=DIM, seed=5)  # a new row's values depend on (seed, key) alone

def init_row(key):
    REFERENCE.find_or_insert(np.array([key], dtype=np.int64))
    return REFERENCE.read(np.array([key], dtype=np.int64)).rows[0].copy()

class TinyTable(RuleBasedStateMachine):
    """A tiny table against a dict of NumPy rows: the keys it holds and each one's row."""

    @initialize(max_rows=st.sampled_from([0, 1, 2, 3, 4, 5]), capacity=st.sampled_from([0, 1, 2, 3]))
    def make(self, max_rows, capacity):
        self.max_rows = max_rows
        kw = dict(max_rows=max_rows, eviction=cncore.LFU(), fallback_rows=0) if max_rows else {}
        self.s = cncore.EmbeddingStore(dim=DIM, seed=5, capacity=capacity, **kw)
        self.model = {}  # key -> its row

    def held(self):
        return set(self.s.export().keys.tolist())

    @rule(keys=st.lists(KEYS, min_size=1, max_size=4))
    def insert(self, keys):
        new = set(keys) - set(self.model)
        if self.max_rows and len(set(keys)) > self.max_rows:
            return  # refused with a ValueError, tested elsewhere
        self.s.find_or_insert(np.array(keys, dtype=np.int64))
        held = self.held()
        assert set(keys) <= held and held <= set(self.model) | new
        self.model = {k: self.model.get(k, None) for k in held}
        for k in held:
            if self.model[k] is None:
                self.model[k] = init_row(k)

    @rule(keys=st.lists(KEYS, min_size=1, max_size=4))
    def find(self, keys):
        slots, found = self.s.find(np.array(keys, dtype=np.int64))
        assert found.tolist() == [k in self.model for k in keys]

    @rule(keys=st.lists(KEYS, min_size=1, max_size=3))
    def erase(self, keys):
        erased = self.s.erase(np.array(keys, dtype=np.int64))
        for k in keys:
            self.model.pop(k, None)
        assert not self.s.contains(np.array(keys, dtype=np.int64)).any()

    @rule(n=st.integers(min_value=1, max_value=3))
    def evict(self, n):
        if not self.max_rows:
            return
        before = self.held()
        got = self.s.evict(n)
        after = self.held()
        assert after <= before and len(before) - len(after) == got == min(n, len(before))
        self.model = {k: self.model[k] for k in after}

    @invariant()
    def matches(self):
        e = self.s.export()
        assert sorted(e.keys.tolist()) == sorted(self.model)
        for k, row in zip(e.keys.tolist(), e.rows):
            np.testing.assert_array_equal(row, self.model[k])
        t = self.s._table
        assert t.n_buckets >= 4 and len(self.s) <= int(0.7 * t.n_buckets)
        if self.max_rows:
            assert len(self.s) <= self.max_rows and t.n_buckets <= max(4, -(-self.max_rows * 10 // 7))

run_state_machine_as_test(TinyTable, settings=settings(max_examples=EXAMPLES, stateful_step_count=25, deadline=None,
                                                        suppress_health_check=list(HealthCheck), database=None))
print(json.dumps({"ok": True}))
'''


@pytest.mark.slow
def test_a_tiny_table_matches_a_dict_of_rows_across_the_index_minimum():
    assert run_isolated(STATE_MACHINE.replace("EXAMPLES", "150"), timeout=600)["ok"]


@pytest.mark.parametrize("optimizer,row_floats,meta_bytes",
                         [(cncore.Adagrad(lr=0.1), 32, 8), (cncore.RowWiseAdagrad(lr=0.1), 16, 16)])
@pytest.mark.parametrize("max_rows", [1, 2, 4, 16, 64, 256])
@pytest.mark.parametrize("with_fallback", [False, True])
def test_a_tiny_bounded_table_allocates_its_layout_and_the_benchmark_charges_its_budget(
        optimizer, row_floats, meta_bytes, max_rows, with_fallback):
    from cn_dlrm.train import used_bytes

    fallback = max_rows // 2 if with_fallback else 0
    s = cncore.EmbeddingStore(dim=16, optimizer=optimizer, max_rows=max_rows, eviction=cncore.LFU(halve_every=128),
                              fallback_rows=fallback)
    for k in range(3 * max_rows + 5):  # full, and evicting
        s.find_or_insert(np.array([k], dtype=np.int64))
    budget = max_rows + fallback
    t = s._table
    page = rounded(budget_page_bytes(budget, 4 * row_floats, meta_bytes))
    index = rounded(16 * buckets_for(max_rows, 0.7))
    page_table = 64  # 8 entries: one block
    assert t.n_buckets == buckets_for(max_rows, 0.7)
    free_stack = s.nbytes - (index + page + page_table)  # 8 entries, doubled when a round evicts more
    assert free_stack == (64 if max_rows <= 64 else 128)  # headroom 8 at 256 rows: 16 entries
    slots = 1 << max(0, (budget - 1).bit_length())
    assert t.arena_slots == slots and t.slot_bytes == 4 * row_floats + meta_bytes + 8
    assert used_bytes(s) == s.nbytes - (slots - budget) * t.slot_bytes
    if max_rows == 1 and meta_bytes == 16:  # the 1-row table of the synthetic stream's 25 % budget
        assert s.nbytes == 320  # 91,136 with the 16-bucket index and the 64 KiB page


def test_a_big_table_keeps_its_huge_pages_and_its_index():
    from cn_dlrm.train import used_bytes

    s = cncore.EmbeddingStore(dim=16, optimizer=cncore.RowWiseAdagrad(lr=0.1), max_rows=5000,
                              eviction=cncore.LFU(), fallback_rows=0)
    s.find_or_insert(np.arange(4000, dtype=np.int64))
    s.find_or_insert(np.arange(4000, 8000, dtype=np.int64))
    assert s._table.n_buckets == buckets_for(5000, 0.7)
    rows_per_page = 1 << math.ceil(math.log2((2 << 20) / 68))  # a 68-byte row: 32,768 rows a page
    assert s._table.arena_slots == rows_per_page  # one 2 MiB-class page, as before
    assert used_bytes(s) == s.nbytes - (s._table.arena_slots - 5000) * s._table.slot_bytes


def test_a_tiny_table_saves_and_loads_as_it_was(tmp_path):
    from reference import assert_same_table

    for max_rows, fallback in ((1, 0), (2, 1), (3, 0)):
        s = cncore.EmbeddingStore(dim=4, max_rows=max_rows, eviction=cncore.LFU(halve_every=128),
                                  fallback_rows=fallback, optimizer=cncore.RowWiseAdagrad(lr=0.1), seed=11)
        for k in (4, -9, 2**63 - 1, 4, 17):
            s.find_or_insert(np.array([k], dtype=np.int64))
        path = str(tmp_path / f"t{max_rows}_{fallback}")
        save_table(s, path)
        loaded = load_store(path)
        assert_same_table(s.export(), loaded.export())
        assert loaded._table.n_buckets == s._table.n_buckets == buckets_for(max_rows, 0.7)
        assert s.nbytes - loaded.nbytes == 64  # the free stack, made at the first eviction


# Two tables saved by the build whose index had at least 16 buckets (2026-12-07, main f799766):
# "bounded" (dim 4, max_rows=2, LFU(128), row-wise Adagrad, seed 7; keys 11, -3, 5 inserted,
# one held) and "unbounded" (dim 4, capacity=8, Adagrad, seed 3; 11 keys, the int64 extremes
# among them), both with a 16-bucket index. A table file holds keys and rows, no bucket count.
OLD_TABLES = """
H4sIAAAAAAAAA+2bX4gkRx3HR82huUTxD+RJSGcENwd7e/W/qs+Zh1zIiRDDcXEJIehaf3fbzM4s0z17bsKRKPgWIRB9kmAe
ffTBB0lmRRDxT3wKiBIRLicovviWB0GJ1TOzu9npzs5OZqbnzq0Px01Xdc/Ur+rX36rqvu+tXaotHODhlA4+PeOfJcecUVSL
6OJDq9V6aSa7UVTrdjrZSddNOn+XsnZJdXptY80C74Op8w8h4iH/lXCU/0fXr19/7ImvLaCNPKmMkA/OPxzPP8KI1SKwgFgK
nPH87w4TcH7ZcQSWw5H+R3fCAtaB6ed/hPxHmP8roJh/7ctZutbe2ZtXG5PmfwTIWP4JwjzM/1XwyhPrX7329Edqu7XnV4xN
dXflcrTS6JGV1WjFdbpZV7Y3Ol1j8/qrspVaX59uyR3ryw/D1Qur0c1oBsK6s2SK+n/W7s1V/afQf2H/hxknQf9VUK7/RFSl
/3PLHoAzTlH/LZlmG2lmd+Y2C0y//lMIaNB/FYT1/2xT1P+2bCfOptnat9JOey5tTNA/9q2O7/8Zx0H/VfD8+ajudb4ts/rl
qK7bFzOpWra+6qt3bTdNOm1fj/Nit3Mj9ccwP86XB38M8mO7m+jMGl9EeVF32i7Z9CX/y1HdJNv+kKwOjrO9HZu34lodmWFU
H9Qm7SRLZCt5znZHX4rqBxeu+zvRxza4MKq3Ojd85UWwBuiwYivZ3Mqj8BW+fHPwc6kdhMIHBS13pE6yvTxsgIZRbMtvb/j2
zYaTOut0B98fXt3ZyZLt0jiud248laT2ESM3u9IchDP8LhyW/HKZt2IvAjGsGPVrQ2rd2+61pG9rY1e2enYY8WHAeTyjoUWD
isF4Dsf9eBSPX10fNb0lW7t2w/oEDbqGxOGvbVlp/J26PUqUH2vZaimpnz1ooy57Wad+/JTu7OS/k3V79viJ7Y4ZtLydpGn9
/KCJuux25V56kN/8YeEwUJe0BpcfPEGMoj3Mu99WjqoGK4iveiYvRTD/++vDM2ovs4ORxOzwUkRZ/nVhNNRSMn9KYy4s01Iw
akWsjaMEcGct5kwjw6S1VDrhYiO0NppoIaWV9cNRGo3F8ajzytKoHSmPelAZkbLgCRkPHipIsY6t0AxyShxSirKYIgolBwpY
wmJhFOfIkhgSpIUzyhLi0yAlMQIeBX94m/pNmsxsoR9j5z9El8rzgQr5EJARyBQwDiChfbQx1hZaaiWGTkADEFVMxMpoRLF1
GsQgNob7LynCJT/q0vCVU6EnR2+iCh3ofUAHThc58JnAghKDJZfGABE7JbTjkgjHtDKQxD5DDvknU8EJRZorLa0P2qD83ZQ+
ivxos1yI/vg++k7sgVf0+ZvLXoACS+WE/d/wbptDG5Oe/yAaf/9DOIZh/1cFjPup2ljrJLQaWwKFNU5ZoZjFsV9NjZ988jWV
O8kd19DEDMXMcWMZi5HAUXTseSE8z91lFPVfsn+YsY3p3/8w/wQY9F8F5e9/3Gnf/0RwtjdAYb5YMkX9HzwHza+NifovrP+Y
w/DvP5Uwq/7JjPrfazzYfOujv2y81L7af/FHX+wvezzOGmuXeu1FO0BzUU/p/2SYBv9PFbw//4tygE6a/0v8n/6xJMz/VRD8
n2eb9+t/UQ7Q6ed/RAkO838VlOV/3g7Qift/WvB/MhD8n5Uwm/9jZgNIWHeWTJn+5+0AnaR/jAvv/xFBQf9VMJv/c3b9vzfk
hftG8YzK7907Kt8/+vzk8bBf/PhYPw4mkk8sZJT+fynT/7wdoNOv/5TQ4P+shLD+n23K9D9vB+gE/SMK+bj+fV3QfxVM7/88
wQAK7hwDKB43gIoP7f48le0TglPbPhdopCxzjyFYcFJSChzVnGDAqAHCABArI2xMqWBaYI0JhYQaZ1xMFFQu95EpZ7VWWjAe
83k7KU+wUmJQsFIyAo3SsdZaUi6BIYZojojhgvo/kGvEAbYxRhA4yxj3oTtMYqa51YRYUo2Vcro++bgpksgqiBiDxiHFAIVC
Ap8iCDmmGkIolEJGciQYIhghZJCIrb/RgIgX4aUstSLyghVRI+MUBcwoain1w84UsMbGUsQa4xhLTKwQ0mrHGYaWCq589oQk
mvhLTbxIM2WVXbg73ZQnrv9zcgBO2v8X/X8Uhf//WQ3OCO5ETIV1yArnZSAkdSQmflaNheB+dyadsxIh4AiAnMYKQ2GI5Qhj
ymHw/93dlOl/3g7ASfonbFz/zC+HQf9VMJv/Z2YDUJgvlkyZ/uftAJxe/35bFfRfCcvW/0+fe/2NP9z/lcarP76n+f3Nzzcv
PPNI89Pv/rf/j9/s97/55h8vv/a7BxrpW1/e/+H3zu3Tb3xq/2XW/9J3k9uNV352q/+r9N/9z7z8QPOG+VhTvH1P4z8/eaoB
4X3N16481Ejf+Vf/76//opGsX2x+5/dfaF67/eYb5/56pfnPJ3Hzb5srzXN/unf/yc+K/dsX/tJ4Z2eleevBa/2HX7i0/2iG
mt3P/bpRq73781tPX+m/+tLj++rtHzSSPz/W/O3Nh4I/MRAIBAKBQCAQCAQCgUAgEAgEAoFAIBAIBAKBQCAQCNwx/A8L30Oy
AHgAAA==
"""


def test_tables_saved_with_the_16_bucket_minimum_still_load(tmp_path):
    with tarfile.open(fileobj=io.BytesIO(base64.b64decode(OLD_TABLES)), mode="r:gz") as tar:
        tar.extractall(tmp_path, filter="data")
    bounded = load_store(str(tmp_path / "bounded"))
    assert bounded.export().keys.tolist() == [5] and bounded.config.max_rows == 2
    assert bounded._table.n_buckets == buckets_for(2, 0.7)  # loaded into the new minimum
    keys = np.array([0, -1, 2**63 - 1, -2**63, 7, 8, 9, 10, 11, 12, 13], dtype=np.int64)
    unbounded = load_store(str(tmp_path / "unbounded"))
    e = unbounded.export()
    assert sorted(e.keys.tolist()) == sorted(keys.tolist())
    for store, seed, optimizer in ((bounded, 7, cncore.RowWiseAdagrad(lr=0.1)), (unbounded, 3, cncore.Adagrad(lr=0.1))):
        fresh = cncore.EmbeddingStore(dim=4, seed=seed, optimizer=optimizer)  # rows drawn by (seed, key) alone
        got = store.export()
        fresh.find_or_insert(got.keys)
        np.testing.assert_array_equal(fresh.read(got.keys).rows, got.rows)
        np.testing.assert_array_equal(fresh.read(got.keys).optimizer_state, got.optimizer_state)
    # and they keep working: more keys into the 16-bucket-era table grow its index as any other
    unbounded.find_or_insert(np.arange(100, 140, dtype=np.int64))
    assert len(unbounded) == 51 and unbounded.contains(keys).all()


def test_a_huge_budget_keeps_the_usual_pages():
    """The budget-page test must not overflow: max_rows 2**56 x a 8 KiB row is past int64."""
    out = run_isolated("""
        import json, numpy as np, cncore
        s = cncore.EmbeddingStore(dim=1024, optimizer=cncore.Adagrad(lr=0.1), max_rows=2**56, eviction=cncore.LFU(),
                                  fallback_rows=0)
        s.find_or_insert(np.array([1, 2, 3], dtype=np.int64))
        print(json.dumps({"n": len(s), "nbytes": s.nbytes, "slots": s._table.arena_slots}))
    """)
    assert out["n"] == 3 and out["slots"] == 1024  # the capacity hint's rows: 4 pages of 256 8-KiB rows (2 MiB)
    assert out["nbytes"] < 9 << 20

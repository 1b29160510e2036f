"""The catalogue of bad inputs for every public entry point of `cncore`, and the runner that
plays cases in a child process (so that a crash or a hang is one failed case, not a dead run).

A case is a call on a fresh `World` (a few small stores with rows, optimizer state, metadata
and a step, and the lookup contexts the backward calls need) and what it must do:

* ``refuse``: raise one of `types` (TypeError / ValueError / BufferError; MemoryError only for
  absurd sizes; RuntimeError only for stale contexts and stale export cursors) with a message
  matching `match` (the argument's name), and leave every store of the world byte-identical:
  the export sorted by key (keys, rows, optimizer_state, counts, last_steps), len, step and
  capacity.
* ``accept``: return without raising (the call checks its own result with `_expect`).
* ``either``: an input that may be refused or accepted (a big-endian or strided array): if
  refused, as ``refuse``; if accepted, the call's own checks of the result must hold.

Run ``python tests/bad_inputs_catalogue.py ID ...`` (or ids on stdin, one JSON list) to play
cases: one JSON line per case on stdout, prefixed by ``CASE ``.
"""
from __future__ import annotations

import dataclasses
import faulthandler
import json
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

import cncore
from cncore import (
    SGD,
    Adagrad,
    Adam,
    Constant,
    EmbeddingStore,
    Normal,
    RowWiseAdagrad,
    StoreConfig,
    TruncatedNormal,
    Uniform,
    grouped_apply_gradients,
    grouped_pooled_lookup,
    initial_rows,
    set_num_threads,
)

DIM = 4
F32 = np.float32
TVB = ("TypeError", "ValueError", "BufferError")
HUGE = TVB + ("MemoryError",)
STALE = TVB + ("RuntimeError",)


class CaseFailed(AssertionError):
    """An accepted call gave a wrong result (raised by the case itself)."""


class ForgeryImpossible(ValueError):
    """A context's array could not be changed in place (it is read-only): as good as refused."""


def _raised_in_cncore(exc: BaseException) -> bool:
    """Whether the exception went through cncore's code (and not only the case's own)."""
    if isinstance(exc, ForgeryImpossible):
        return True
    frames = traceback.extract_tb(exc.__traceback__)
    return any(f"{os.sep}cncore{os.sep}" in frame.filename or frame.filename.endswith("_core.pyx")
               for frame in frames)


def _expect(cond: bool, what: str) -> None:
    if not cond:
        raise CaseFailed(what)


# --- the world a case runs in ----------------------------------------------------------------

class World:
    """Stores with everything a row carries, and contexts of lookups on them.

    s: Adagrad dim 4 (keys 1..6 plus the lookups' new keys); sgd: SGD dim 4; plain: no optimizer
    dim 4; other: SGD dim 3. ctx: a weighted sum lookup on s (2 bags, key 100 inserted by it);
    ctx_max / ctx_mean: max / mean lookups on s; ctx3: 3 bags on s; ctx_sgd, ctx_plain,
    ctx_other: 2-bag lookups on those stores; gctxs: a grouped lookup on (s, other), 2 bags.
    """

    def __init__(self):
        keys = np.arange(1, 7, dtype=np.int64)
        rng = np.random.default_rng(7)
        self.s = EmbeddingStore(dim=DIM, seed=3, capacity=16, optimizer=Adagrad(lr=0.1))
        self.sgd = EmbeddingStore(dim=DIM, seed=5, initializer=Constant(0.25), optimizer=SGD(lr=0.1))
        self.plain = EmbeddingStore(dim=DIM, seed=6)
        self.other = EmbeddingStore(dim=3, seed=8, optimizer=SGD(lr=0.1))
        for st in self.stores():
            d, sf = st.dim, st.config.state_floats
            st.load(keys, rng.standard_normal((6, d)).astype(F32),
                    rng.random((6, sf)).astype(F32) if sf else None,
                    np.arange(10, 16, dtype=np.uint32), np.arange(1, 7, dtype=np.uint32))
            st.step = 3
        self.keys = np.array([1, 2, 3, 100], dtype=np.int64)
        self.offsets = np.array([0, 2, 4], dtype=np.int64)
        self.weights = np.array([0.5, 1.0, 2.0, -1.0], dtype=F32)
        self.out, self.ctx = self.s.pooled_lookup(self.keys, self.offsets, per_sample_weights=self.weights)
        _, self.ctx_max = self.s.pooled_lookup(np.array([1, 2, 3, 4]), lengths=np.array([2, 2]), mode="max")
        _, self.ctx_mean = self.s.pooled_lookup(np.array([1, 2, 5]), lengths=np.array([1, 2]), mode="mean")
        _, self.ctx3 = self.s.pooled_lookup(np.array([1, 2, 3]), lengths=np.array([1, 1, 1]))
        _, self.ctx_sgd = self.sgd.pooled_lookup(np.array([1, 2, 2]), lengths=np.array([2, 1]))
        _, self.ctx_plain = self.plain.pooled_lookup(np.array([1, 2]), lengths=np.array([1, 1]))
        _, self.ctx_other = self.other.pooled_lookup(np.array([1, 2]), lengths=np.array([1, 1]))
        self.gout, self.gctxs = grouped_pooled_lookup(
            [self.s, self.other], [np.array([1, 2, 3]), np.array([4, 5])],
            lengths=[np.array([2, 1]), np.array([1, 1])])
        self.g = np.ones((2, DIM), dtype=F32)           # grad of ctx, ctx_max, ctx_mean, ctx_sgd
        self.g3 = np.ones((3, DIM), dtype=F32)          # grad of ctx3
        self.gg = np.ones((2, DIM + 3), dtype=F32)      # grad of gctxs

    def stores(self):
        return [self.s, self.sgd, self.plain, self.other]


def snapshot(store) -> tuple:
    """Everything that must not change, as bytes (export sorted by key, len, step, capacity)."""
    e = store.export()
    order = np.argsort(e.keys, kind="stable")
    cols = tuple(np.ascontiguousarray(a[order]).tobytes() for a in
                 (e.keys, e.rows, e.optimizer_state, e.counts, e.last_steps))
    return cols + (len(store), store.step, store.capacity)


# --- the catalogue -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    id: str
    call: Callable[[World], object]
    kind: str = "refuse"                 # refuse | accept | either
    types: tuple[str, ...] = TVB
    match: str = ""


CASES: dict[str, Case] = {}


def _add(case: Case) -> None:
    if case.id in CASES:
        raise KeyError(f"duplicate case id {case.id}")
    CASES[case.id] = case


def refuse(id, call, match, types=TVB):
    _add(Case(id, call, "refuse", types, match))


def accept(id, call):
    _add(Case(id, call, "accept"))


def either(id, call, match, types=TVB):
    _add(Case(id, call, "either", types, match))


def rows(n, d=DIM, dtype=F32):
    return np.arange(n * d, dtype=dtype).reshape(n, d) / 8


UNSEEN2 = np.array([900, 901], dtype=np.int64)       # keys no store holds

# Wrong keys: anything but a 1-D int64 (or int32) array. Two entries where the length matters.
BAD_KEYS = {
    "float64": lambda: np.array([900.0, 1.0]),
    "float32": lambda: np.array([900, 1], dtype=np.float32),
    "float16": lambda: np.array([900, 1], dtype=np.float16),
    "bool": lambda: np.array([True, False]),
    "uint64": lambda: np.array([900, 1], dtype=np.uint64),
    "uint32": lambda: np.array([900, 1], dtype=np.uint32),
    "int16": lambda: np.array([900, 1], dtype=np.int16),
    "int8": lambda: np.array([9, 1], dtype=np.int8),
    "complex": lambda: np.array([900, 1], dtype=np.complex128),
    "object": lambda: np.array([900, None], dtype=object),
    "datetime64": lambda: np.array([900, 1], dtype="datetime64[s]"),
    "structured": lambda: np.zeros(2, dtype=[("k", np.int64)]),
    "2d": lambda: np.array([[900, 1], [2, 3]], dtype=np.int64),
    "2d-one-row": lambda: np.array([[900, 1]], dtype=np.int64),
    "0d": lambda: np.array(900, dtype=np.int64),
    "int": lambda: 900,
    "None": lambda: None,
    "str": lambda: "900",
    "bytes": lambda: b"\x01\x02",
    "dict": lambda: {900: 1},
    "list-of-floats": lambda: [900.5, 1.0],
    "list-of-str": lambda: ["a", "b"],
    "list-beyond-int64": lambda: [2**64, 1],
    "list-of-2**63": lambda: [2**63, 1],
    "nested-list": lambda: [[900, 1], [2, 3]],
}

# Arrays that hold valid keys in an unusual layout: accepted (with correct results) or refused.
ODD_KEYS = {
    "big-endian": lambda: np.array([1, 2], dtype=">i8"),
    "strided": lambda: np.array([1, 7, 2, 7], dtype=np.int64)[::2],
    "read-only": lambda: _readonly(np.array([1, 2], dtype=np.int64)),
    "int32": lambda: np.array([1, 2], dtype=np.int32),
    "list": lambda: [1, 2],
}


def _readonly(a):
    a.setflags(write=False)
    return a


def _keys_entry_points():
    """(name, call(world, keys), match) for every entry point that takes keys; the calls pass
    2-row companions so that only the keys are wrong."""
    cfg = StoreConfig(dim=DIM, seed=3)
    return [
        ("find", lambda w, k: w.s.find(k), r"\bkeys\b"),
        ("contains", lambda w, k: w.s.contains(k), r"\bkeys\b"),
        ("find_or_insert", lambda w, k: w.s.find_or_insert(k), r"\bkeys\b"),
        ("insert_or_assign", lambda w, k: w.s.insert_or_assign(k, rows(2)), r"\bkeys\b"),
        ("assign", lambda w, k: w.s.assign(k, rows(2)), r"\bkeys\b"),
        ("load", lambda w, k: w.s.load(k, rows(2), np.zeros((2, DIM), F32), np.ones(2, np.uint32),
                                       np.ones(2, np.uint32)), r"\bkeys\b"),
        ("erase", lambda w, k: w.s.erase(k), r"\bkeys\b"),
        ("lookup", lambda w, k: w.s.lookup(k), r"\bkeys\b"),
        ("lookup-insert", lambda w, k: w.s.lookup(k, insert_missing=True), r"\bkeys\b"),
        ("read", lambda w, k: w.s.read(k), r"\bkeys\b"),
        ("pooled_lookup", lambda w, k: w.s.pooled_lookup(k, lengths=np.array([1, 1])), r"\bkeys\b"),
        ("pooled_lookup-eval", lambda w, k: w.s.pooled_lookup(k, np.array([0, 1, 2]), insert_missing=False),
         r"\bkeys\b"),
        ("grouped_pooled_lookup", lambda w, k: grouped_pooled_lookup(
            [w.s, w.other], [np.array([800, 801]), k], lengths=[np.array([1, 1]), np.array([1, 1])]),
         r"keys\[1\]"),
        ("initial_rows", lambda w, k: initial_rows(cfg, k), r"\bkeys\b"),
    ]


def _odd_keys_check(name, w, k, result):
    """What an accepted odd-layout [1, 2] key array must give."""
    if name in ("find", "contains"):
        found = result[1] if name == "find" else result
        _expect(np.asarray(found).tolist() == [True, True], f"found {found!r}, want [True, True]")
    elif name in ("lookup", "lookup-insert"):
        _expect(np.array_equal(result, w.s.lookup(np.array([1, 2]))), "rows differ from an int64 lookup")


def _build_key_cases():
    for ep, call, match in _keys_entry_points():
        for kname, make in BAD_KEYS.items():
            refuse(f"{ep}/keys={kname}", lambda w, call=call, make=make: call(w, make()), match)
        if ep in ("find", "contains", "lookup"):
            for kname, make in ODD_KEYS.items():
                def odd(w, call=call, make=make, ep=ep):
                    _odd_keys_check(ep, w, make(), call(w, make()))
                either(f"{ep}/keys={kname}", odd, match)


def _build_row_cases():
    bad_rows = {
        "float64": lambda: rows(2, dtype=np.float64),
        "float16": lambda: rows(2, dtype=np.float16),
        "int64": lambda: np.ones((2, DIM), dtype=np.int64),
        "bool": lambda: np.ones((2, DIM), dtype=bool),
        "wide": lambda: rows(2, DIM + 1),
        "narrow": lambda: rows(2, DIM - 1),
        "too-many": lambda: rows(3),
        "too-few": lambda: rows(1),
        "1d": lambda: np.ones(2 * DIM, dtype=F32),
        "3d": lambda: np.ones((2, DIM, 1), dtype=F32),
        "transposed-shape": lambda: rows(DIM, 2),
        "None": lambda: None,
        "str": lambda: "rows",
        "scalar": lambda: np.float32(1.0),
        "list-of-float64": lambda: [[1.0] * DIM] * 2,
    }
    verbs = {
        "insert_or_assign": lambda w, r: w.s.insert_or_assign(UNSEEN2, r),
        "assign": lambda w, r: w.s.assign(np.array([1, 2]), r),
        "load": lambda w, r: w.s.load(UNSEEN2, r),
    }
    for verb, call in verbs.items():
        for rname, make in bad_rows.items():
            refuse(f"{verb}/rows={rname}", lambda w, call=call, make=make: call(w, make()), r"\brows\b")

    def stored(w, keys, r, exact=True):
        got = w.s.read(keys).rows
        _expect(got.tobytes() == np.ascontiguousarray(r, dtype=F32).tobytes(), f"stored rows {got!r}, want {r!r}")

    def nan_rows(w):  # rows may hold any float
        r = np.array([[np.nan, np.inf, -np.inf, -0.0]] * 2, dtype=F32)
        w.s.insert_or_assign(UNSEEN2, r)
        stored(w, UNSEEN2, r)
    accept("insert_or_assign/rows=nan-inf", nan_rows)

    def strided_rows(w):
        wide = rows(2, 2 * DIM)
        w.s.load(UNSEEN2, wide[:, ::2])
        stored(w, UNSEEN2, wide[:, ::2])
    either("load/rows=strided-columns", strided_rows, r"\brows\b")

    def fortran_rows(w):
        r = np.asfortranarray(rows(2))
        w.s.assign(np.array([1, 2]), r)
        stored(w, np.array([1, 2]), r)
    either("assign/rows=fortran-order", fortran_rows, r"\brows\b")

    def readonly_rows(w):
        r = _readonly(rows(2))
        w.s.insert_or_assign(UNSEEN2, r)
        stored(w, UNSEEN2, r)
    accept("insert_or_assign/rows=read-only", readonly_rows)

    # optimizer_state: float32 (N, state_floats); a stateless store refuses any state it would drop
    bad_state = {
        "float64": lambda: np.zeros((2, DIM)),
        "int": lambda: np.zeros((2, DIM), dtype=np.int32),
        "wide": lambda: np.zeros((2, DIM + 1), F32),
        "one-column": lambda: np.zeros((2, 1), F32),
        "too-many": lambda: np.zeros((3, DIM), F32),
        "1d": lambda: np.zeros(2 * DIM, F32),
        "str": lambda: "state",
    }
    for verb in ("insert_or_assign", "assign", "load"):
        for sname, make in bad_state.items():
            keys = UNSEEN2 if verb != "assign" else np.array([1, 2])
            refuse(f"{verb}/optimizer_state={sname}",
                   lambda w, verb=verb, make=make, keys=keys: getattr(w.s, verb)(keys, rows(2), make()),
                   r"optimizer_state")
        for store in ("sgd", "plain"):
            stateless_bad = {"(2,4)": lambda: np.zeros((2, DIM), F32), "(2,1)": lambda: np.ones((2, 1), F32)}
            for sname, make in stateless_bad.items():
                keys = UNSEEN2 if verb != "assign" else np.array([1, 2])
                refuse(f"{verb}/optimizer_state={sname}-to-stateless-{store}",
                       lambda w, verb=verb, make=make, keys=keys, store=store:
                       getattr(getattr(w, store), verb)(keys, rows(2), make()), r"optimizer_state")

    def roundtrip_stateless(w):  # an export of a stateless store loads back: its state is (N, 0)
        e = w.sgd.export()
        fresh = EmbeddingStore(w.sgd.config)
        fresh.load(e.keys, e.rows, e.optimizer_state, e.counts, e.last_steps)
        _expect(snapshot(fresh)[:5] == snapshot(w.sgd)[:5], "export -> load of a stateless store differs")
    accept("load/optimizer_state=(N,0)-of-a-stateless-export", roundtrip_stateless)

    bad_meta = {
        "-1": lambda: np.array([-1, 0]),
        "2**32": lambda: np.array([2**32, 0]),
        "2**63-1": lambda: np.array([2**63 - 1, 0]),
        "float": lambda: np.array([1.0, 2.0]),
        "bool": lambda: np.array([True, False]),
        "too-many": lambda: np.ones(3, np.uint32),
        "2d": lambda: np.ones((2, 1), np.uint32),
        "str": lambda: "12",
        "list-with-2**64": lambda: [2**64, 0],
        "list-with-minus-one": lambda: [-1, 0],
    }
    for field in ("counts", "last_steps"):
        for mname, make in bad_meta.items():
            refuse(f"load/{field}={mname}",
                   lambda w, field=field, make=make: w.s.load(UNSEEN2, rows(2), **{field: make()}), rf"\b{field}\b")

    def meta_ok(w):
        w.s.load(UNSEEN2, rows(2), counts=np.array([2**32 - 1, 0], dtype=np.uint64),
                 last_steps=np.array([7, 8], dtype=np.int8))
        b = w.s.read(UNSEEN2)
        _expect(b.counts.tolist() == [2**32 - 1, 0] and b.last_steps.tolist() == [7, 8], f"metadata {b!r}")
    accept("load/counts=uint64-max-and-last_steps=int8", meta_ok)


def _build_store_verb_cases():
    for name, value in {"-1": -1, "np.int64(-1)": np.int64(-1), "1.5": 1.5, "float-10.0": 10.0, "str": "10",
                        "None": None, "2**63": 2**63, "2**64": 2**64, "-2**63": -2**63, "nan": float("nan")}.items():
        refuse(f"reserve/n_rows={name}", lambda w, v=value: w.s.reserve(v), r"n_rows")
    for name, value in {"2**62": 2**62, "0.7*2**60": int(0.7 * 2**60), "2**63-1": 2**63 - 1,
                        "2**40": 2**40}.items():
        refuse(f"reserve/n_rows={name}", lambda w, v=value: w.s.reserve(v), r"n_rows|\brows\b", HUGE)

    def reserve_ok(w):
        w.s.reserve(np.int64(64))
        _expect(w.s.capacity >= 64, f"capacity {w.s.capacity} after reserve(64)")
    accept("reserve/n_rows=np.int64(64)", reserve_ok)

    for name, value in {"'no'": "no", "'yes'": "yes", "1": 1, "0": 0, "None": None, "array": np.array([True])}.items():
        refuse(f"lookup/insert_missing={name}", lambda w, v=value: w.s.lookup(UNSEEN2, insert_missing=v),
               r"insert_missing")
        refuse(f"pooled_lookup/insert_missing={name}",
               lambda w, v=value: w.s.pooled_lookup(UNSEEN2, lengths=[1, 1], insert_missing=v), r"insert_missing")

    def np_bool_ok(w):
        w.s.lookup(UNSEEN2, insert_missing=np.bool_(True))
        _expect(w.s.contains(UNSEEN2).all(), "np.bool_(True) did not insert")
    accept("lookup/insert_missing=np.bool_(True)", np_bool_ok)

    # step setter
    for name, value in {"-1": -1, "2**63": 2**63, "2**64": 2**64, "1.5": 1.5, "float-2.0": 2.0, "True": True,
                        "str": "3", "None": None, "nan": float("nan")}.items():
        refuse(f"step/value={name}", lambda w, v=value: setattr(w.s, "step", v), r"\bstep\b")

    def step_ok(w):
        w.s.step = np.int64(5)
        _expect(w.s.step == 5 and isinstance(w.s.step, int), f"step {w.s.step!r}")
    accept("step/value=np.int64(5)", step_ok)

    # set_num_threads: refused cleanly above a sane bound
    for name, value in {"0": 0, "-1": -1, "32768": 32768, "65536": 65536, "2**31": 2**31, "2**63": 2**63,
                        "1.5": 1.5, "True": True, "str": "2", "float-2.0": 2.0}.items():
        refuse(f"set_num_threads/n={name}", lambda w, v=value: set_num_threads(v), r"\bn\b")

    def threads_np(w):
        set_num_threads(np.int64(1))
        _expect(cncore.get_num_threads() == 1, "np.int64(1) threads")
    either("set_num_threads/n=np.int64(1)", threads_np, r"\bn\b")

    # initial_rows
    for name, make in {"None": lambda w: None, "dict": lambda w: {"dim": 4}, "store": lambda w: w.s,
                       "str": lambda w: "cfg"}.items():
        refuse(f"initial_rows/config={name}", lambda w, make=make: initial_rows(make(w), np.array([1])), r"config")


def _build_export_cases():
    def cur(w, pos=0, version=None):
        first = w.s.export(max_rows=1)
        nxt = first.next_cursor
        return (pos, nxt[1] if version is None else version)

    cursors = {
        "(-1,v)": lambda w: cur(w, -1),
        "(-2**63,v)": lambda w: cur(w, -2**63),
        "(2**62,v)": lambda w: cur(w, 2**62),
        "(2**63,v)": lambda w: cur(w, 2**63),
        "(n_buckets+1,v)": lambda w: cur(w, w.s._table.n_buckets + 1),
        "(0.5,v)": lambda w: cur(w, 0.5),
        "(1.0,v)": lambda w: cur(w, 1.0),
        "(None,v)": lambda w: cur(w, None),
        "('0',v)": lambda w: cur(w, "0"),
        "(True,v)": lambda w: cur(w, True),
        "(0,-1)": lambda w: cur(w, 0, -1),
        "(0,2**64)": lambda w: cur(w, 0, 2**64),
        "(0,'v')": lambda w: cur(w, 0, "v"),
        "(0,1.5)": lambda w: cur(w, 0, 1.5),
        "(0,)": lambda w: (0,),
        "(0,v,0)": lambda w: cur(w) + (0,),
        "list[0,v]": lambda w: list(cur(w)),
        "int": lambda w: 0,
        "str": lambda w: "cursor",
        "array": lambda w: np.array(cur(w)),
    }
    for name, make in cursors.items():
        refuse(f"export/cursor={name}", lambda w, make=make: w.s.export(make(w), 2), r"cursor")
    refuse("export/cursor=(0,v+1)-wrong-version", lambda w: w.s.export(cur(w, 0, cur(w)[1] + 1), 2),
           r"cursor|export", STALE)
    refuse("export/cursor=(0,v-1)-old-version", lambda w: w.s.export(cur(w, 0, cur(w)[1] - 1), 2),
           r"cursor|export", STALE)

    for name, value in {"0": 0, "-1": -1, "1.5": 1.5, "str": "2", "None-explicit-with-cursor": None,
                        "2**63": 2**63, "-2**63": -2**63, "True": True, "nan": float("nan")}.items():
        if value is None:
            continue
        refuse(f"export/max_rows={name}", lambda w, v=value: w.s.export(None, v), r"max_rows")
    for name, value in {"0": 0, "-1": -1, "1.5": 1.5, "str": "2", "True": True, "2**63": 2**63}.items():
        refuse(f"iter_export/batch_size={name}", lambda w, v=value: list(w.s.iter_export(v)), r"batch_size")

    def export_np_int(w):
        b = w.s.export(None, np.int64(2))
        _expect(len(b.keys) == 2, f"{len(b.keys)} rows for max_rows=np.int64(2)")
    accept("export/max_rows=np.int64(2)", export_np_int)


def _pooled(w, keys=UNSEEN2, offsets=None, **kw):
    if offsets is None and "lengths" not in kw:
        kw["lengths"] = np.array([1, 1])
    return w.s.pooled_lookup(keys, offsets, **kw)


def _build_pooled_cases():
    K4 = np.array([900, 901, 902, 903], dtype=np.int64)  # unseen: an early insert would show
    bad_offsets = {
        "not-starting-at-0": [1, 2, 4],
        "decreasing": [0, 3, 2, 4],
        "ending-short": [0, 2, 3],
        "ending-long": [0, 2, 5],
        "ending-far": [0, 2, 2**40],
        "ending-2**62": [0, 2**62],
        "negative": [0, -1, 4],
        "int64-min": [0, -2**63, 4],
        "empty": np.array([], dtype=np.int64),
        "2d": np.array([[0, 2], [2, 4]]),
        "float64": np.array([0.0, 2.0, 4.0]),
        "float32": np.array([0, 2, 4], dtype=F32),
        "bool": np.array([False, True]),
        "uint8": np.array([0, 2, 4], dtype=np.uint8),
        "str": "0,2,4",
        "scalar": 4,
        "list-of-floats": [0.0, 2.5, 4.0],
    }
    for name, value in bad_offsets.items():
        refuse(f"pooled_lookup/offsets={name}",
               lambda w, v=value: w.s.pooled_lookup(K4, v if not isinstance(v, list) else np.array(v)),
               r"\boffsets\b")
    bad_lengths = {
        "negative": [3, -1, 2],
        "negative-at-end": [5, -1],
        "not-summing-short": [1, 2],
        "not-summing-long": [2, 3],
        "wrapping-to-zero": [2**62, 2**62, 2**62, 2**62],
        "wrapping-to-four": [2**63 - 1, 2**63 - 1, 6],
        "2d": np.array([[2, 2]]),
        "float": np.array([2.0, 2.0]),
        "bool": np.array([True, True]),
        "str": "22",
        "scalar": 4,
    }
    for name, value in bad_lengths.items():
        refuse(f"pooled_lookup/lengths={name}",
               lambda w, v=value: w.s.pooled_lookup(K4, lengths=v if not isinstance(v, list) else np.array(v)),
               r"\blengths\b")
    refuse("pooled_lookup/offsets-and-lengths", lambda w: w.s.pooled_lookup(K4, np.array([0, 2, 4]),
                                                                            lengths=np.array([2, 2])),
           r"offsets.*lengths|lengths.*offsets")
    refuse("pooled_lookup/neither-offsets-nor-lengths", lambda w: w.s.pooled_lookup(K4),
           r"offsets.*lengths|lengths.*offsets")
    for name, mode in {"SUM": "SUM", "avg": "avg", "empty": "", "None": None, "int-2": 2, "list": ["sum"],
                       "bytes": b"sum", "tuple": ("sum",)}.items():
        refuse(f"pooled_lookup/mode={name}", lambda w, m=mode: _pooled(w, mode=m), r"\bmodes?\b")
    bad_w = {
        "too-short": np.ones(1, F32),
        "too-long": np.ones(3, F32),
        "float64": np.ones(2),
        "float16": np.ones(2, np.float16),
        "int": np.ones(2, np.int64),
        "2d": np.ones((2, 1), F32),
        "0d": np.float32(1.0),
        "str": "ww",
        "list-of-float64": [1.0, 1.0],
    }
    for name, value in bad_w.items():
        refuse(f"pooled_lookup/per_sample_weights={name}",
               lambda w, v=value: _pooled(w, per_sample_weights=v), r"per_sample_weights")
    refuse("pooled_lookup/per_sample_weights-with-max", lambda w: _pooled(w, mode="max",
                                                                         per_sample_weights=np.ones(2, F32)),
           r"per_sample_weights")

    def wide():
        return np.zeros((2, 2 * DIM), F32)
    bad_out = {
        "read-only": (lambda: _readonly(np.zeros((2, DIM), F32)), TVB),
        "wrong-rows": (lambda: np.zeros((3, DIM), F32), TVB),
        "wrong-cols": (lambda: np.zeros((2, DIM + 1), F32), TVB),
        "1d": (lambda: np.zeros(2 * DIM, F32), TVB),
        "3d": (lambda: np.zeros((2, DIM, 1), F32), TVB),
        "float64": (lambda: np.zeros((2, DIM)), TVB),
        "float16": (lambda: np.zeros((2, DIM), np.float16), TVB),
        "int32": (lambda: np.zeros((2, DIM), np.int32), TVB),
        "strided-columns": (lambda: wide()[:, ::2], TVB),
        "fortran-order": (lambda: np.asfortranarray(np.zeros((2, DIM), F32)), TVB),
        "overlapping-rows": (lambda: np.lib.stride_tricks.as_strided(np.zeros(DIM + 1, F32), (2, DIM), (4, 4)), TVB),
        "zero-row-stride": (lambda: np.lib.stride_tricks.as_strided(np.zeros(DIM, F32), (2, DIM), (0, 4)), TVB),
        "negative-row-stride": (lambda: np.zeros((2, DIM), F32)[::-1], TVB),
        "list": (lambda: [[0.0] * DIM] * 2, TVB),
        "str": (lambda: "out", TVB),
    }
    for name, (make, types) in bad_out.items():
        refuse(f"pooled_lookup/out={name}", lambda w, make=make: _pooled(w, out=make()), r"\bout\b", types)

    def out_column_block(w):  # a column block of a wider array: rows strided, values contiguous
        big = np.full((2, 2 * DIM), -7.0, F32)
        out, _ = w.s.pooled_lookup(np.array([1, 2]), lengths=np.array([1, 1]), out=big[:, DIM:])
        _expect(np.array_equal(big[:, DIM:], w.s.lookup(np.array([1, 2]))), "out block differs from the rows")
        _expect((big[:, :DIM] == -7.0).all(), "pooled_lookup wrote outside its out block")
    accept("pooled_lookup/out=column-block", out_column_block)


def _same(a, b) -> bool:
    return type(a) is type(b) and (a == b if not isinstance(a, np.ndarray) else a.tobytes() == b.tobytes())


def _forge(ctx, **changes):
    return dataclasses.replace(ctx, **changes)


def _build_backward_cases():
    def ap(w, ctx, g=None, **kw):
        return w.s.apply_gradients(ctx, w.g if g is None else g, **kw)

    def acc(w, ctx, g=None):
        return w.s.accumulate_gradients(ctx, w.g if g is None else g)

    def ap_ctx(w, ctx):
        w.s.apply_gradients(ctx, w.g)

    def acc_ctx(w, ctx):
        k, g = w.s.accumulate_gradients(ctx, w.g)
        return k.tolist(), g.tobytes()

    ctx_match = r"\bctx\b|context"
    # A forged context may be refused naming ctx, or the part of it that is wrong.
    ctx_part = r"\bctx|context|\b(slots|offsets|weights|argmax|mode|columns|keys|step|training)\b"
    forged_match = {"offsets-more-bags": ctx_part + r"|grad_output", "offsets-empty": ctx_part + r"|grad_output",
                    "erase_epoch-changed": ctx_part + r"|erased|cleared"}
    # Not a context at all, or a context of another store: refused.
    not_ours = {
        "None": lambda w: None,
        "str": lambda w: "ctx",
        "tuple": lambda w: (w.ctx.slots, w.ctx.offsets),
        "other-store": lambda w: w.ctx_sgd,
        "store-replaced": lambda w: _forge(w.ctx, store=w.sgd),
    }
    for name, make in not_ours.items():
        refuse(f"apply_gradients/ctx={name}", lambda w, make=make: ap(w, make(w)), ctx_part, STALE)
        refuse(f"accumulate_gradients/ctx={name}", lambda w, make=make: acc(w, make(w)), ctx_part, STALE)

    # A forged context (dataclasses.replace of its fields): refused naming ctx (or the part of
    # it that is wrong), or, if the core does not use the forged field, exactly the update of
    # the genuine context (a twin world where nothing was forged).
    forged = {
        "copy-unchanged": ("ctx", lambda w, c: {}),
        "slots-10**12": ("ctx", lambda w, c: dict(slots=np.full_like(c.slots, 10**12))),
        "slots-2**62": ("ctx", lambda w, c: dict(slots=np.full_like(c.slots, 2**62))),
        "slots-minus-2": ("ctx", lambda w, c: dict(slots=np.full_like(c.slots, -2))),
        "slots-int64-min": ("ctx", lambda w, c: dict(slots=np.full_like(c.slots, -2**63))),
        "slots-capacity": ("ctx", lambda w, c: dict(slots=np.full_like(c.slots, w.s.capacity))),
        "slots-of-other-rows": ("ctx", lambda w, c: dict(slots=w.s.find(np.array([4, 5, 6, 6]))[0])),
        "slots-short": ("ctx", lambda w, c: dict(slots=c.slots[:1].copy())),
        "slots-float": ("ctx", lambda w, c: dict(slots=c.slots.astype(np.float64))),
        "slots-int32": ("ctx", lambda w, c: dict(slots=c.slots.astype(np.int32))),
        "slots-strided": ("ctx", lambda w, c: dict(slots=np.repeat(c.slots, 2)[::2])),
        "slots-None": ("ctx", lambda w, c: dict(slots=None)),
        "offsets-beyond-keys": ("ctx", lambda w, c: dict(offsets=np.array([0, 2, 10**9]))),
        "offsets-decreasing": ("ctx", lambda w, c: dict(offsets=np.array([0, 3, 1]))),
        "offsets-negative": ("ctx", lambda w, c: dict(offsets=np.array([-5, 2, 4]))),
        "offsets-other-split": ("ctx", lambda w, c: dict(offsets=np.array([0, 1, 4]))),
        "offsets-more-bags": ("ctx", lambda w, c: dict(offsets=np.array([0, 1, 2, 3, 4]))),
        "offsets-empty": ("ctx", lambda w, c: dict(offsets=np.array([], dtype=np.int64))),
        "offsets-float": ("ctx", lambda w, c: dict(offsets=c.offsets.astype(np.float64))),
        "offsets-int32": ("ctx", lambda w, c: dict(offsets=c.offsets.astype(np.int32))),
        "keys-replaced": ("ctx", lambda w, c: dict(keys=np.array([9, 9, 9, 9]))),
        "weights-other-values": ("ctx", lambda w, c: dict(weights=np.full(4, 100.0, F32))),
        "weights-None": ("ctx", lambda w, c: dict(weights=None)),
        "weights-short": ("ctx", lambda w, c: dict(weights=np.ones(1, F32))),
        "weights-float64": ("ctx", lambda w, c: dict(weights=np.ones(4))),
        "weights-2d": ("ctx", lambda w, c: dict(weights=np.ones((4, 1), F32))),
        "mode-7": ("ctx", lambda w, c: dict(mode=7)),
        "mode--1": ("ctx", lambda w, c: dict(mode=-1)),
        "mode-mean": ("ctx", lambda w, c: dict(mode=1)),
        "mode-max-without-argmax": ("ctx", lambda w, c: dict(mode=2, weights=None)),
        "mode-str": ("ctx", lambda w, c: dict(mode="sum")),
        "mode-sum-on-max": ("ctx_max", lambda w, c: dict(mode=0)),
        "argmax-10**9": ("ctx_max", lambda w, c: dict(argmax=np.full_like(c.argmax, 10**9))),
        "argmax-minus-5": ("ctx_max", lambda w, c: dict(argmax=np.full_like(c.argmax, -5))),
        "argmax-zeros": ("ctx_max", lambda w, c: dict(argmax=np.zeros_like(c.argmax))),
        "argmax-wrong-shape": ("ctx_max", lambda w, c: dict(argmax=np.zeros((1, 1), np.int64))),
        "argmax-float": ("ctx_max", lambda w, c: dict(argmax=c.argmax.astype(np.float64))),
        "argmax-None": ("ctx_max", lambda w, c: dict(argmax=None)),
        "columns-wide": ("ctx", lambda w, c: dict(columns=slice(0, 100))),
        "columns-None": ("ctx", lambda w, c: dict(columns=None)),
        "erase_epoch-changed": ("ctx", lambda w, c: dict(erase_epoch=c.erase_epoch + 1)),
        "step-2**40": ("ctx", lambda w, c: dict(step=2**40)),
        "step--1": ("ctx", lambda w, c: dict(step=-1)),
        "step-str": ("ctx", lambda w, c: dict(step="3")),
        "training-flipped": ("ctx", lambda w, c: dict(training=not c.training)),
        "training-str": ("ctx", lambda w, c: dict(training="yes")),
    }

    def same_as_genuine(fn, base, forge):
        """fn(world, ctx) with a forged context must be refused, or equal the genuine call."""
        def call(w):
            twin = World()
            got = fn(w, forge(w, getattr(w, base)))
            want = fn(twin, getattr(twin, base))
            _expect(_same(got, want), f"accumulate_gradients with the forged context gave keys {got[0]} and "
                    f"{'the same' if got[1] == want[1] else 'other'} gradients; the genuine one keys {want[0]}"
                    if got and want else f"the forged context gave {got!r}, the genuine one {want!r}")
            for a, b in zip(w.stores(), twin.stores()):
                _expect(snapshot(a) == snapshot(b), "the forged context updated other rows than the genuine one")
        return call

    for name, (base, changes) in forged.items():
        match = forged_match.get(name, ctx_part)
        def forge(w, c, changes=changes):
            return _forge(c, **changes(w, c))

        either(f"apply_gradients/ctx={name}", same_as_genuine(ap_ctx, base, forge), match, STALE)
        if not name.startswith("columns"):  # accumulate_gradients has no output columns
            either(f"accumulate_gradients/ctx={name}", same_as_genuine(acc_ctx, base, forge), match, STALE)

    # The context's own arrays changed in place (the caller can reach them): refused, or
    # exactly the genuine update (the core kept its own copy). A read-only array that cannot
    # be changed counts as refused.
    inplace = {
        "slots[0]=10**12": ("ctx", lambda c: c.slots.__setitem__(0, 10**12)),
        "slots[0]=-2": ("ctx", lambda c: c.slots.__setitem__(0, -2)),
        "offsets[-1]=10**9": ("ctx", lambda c: c.offsets.__setitem__(-1, 10**9)),
        "offsets[1]=-3": ("ctx", lambda c: c.offsets.__setitem__(1, -3)),
        "weights[:]=100": ("ctx", lambda c: c.weights.__setitem__(slice(None), 100.0)),
        "keys[:]=9": ("ctx", lambda c: c.keys.__setitem__(slice(None), 9)),
        "argmax[0,0]=10**9": ("ctx_max", lambda c: c.argmax.__setitem__((0, 0), 10**9)),
        "argmax[0,0]=-5": ("ctx_max", lambda c: c.argmax.__setitem__((0, 0), -5)),
    }
    for name, (base, mutate) in inplace.items():
        def forge(w, c, mutate=mutate):
            try:
                mutate(c)
            except ValueError as exc:  # read-only arrays: the forgery cannot be made
                raise ForgeryImpossible(f"ctx: its arrays are read-only ({exc})") from None
            return c
        either(f"apply_gradients/ctx.{name}-in-place", same_as_genuine(ap_ctx, base, forge), ctx_part, STALE)
        either(f"accumulate_gradients/ctx.{name}-in-place", same_as_genuine(acc_ctx, base, forge), ctx_part, STALE)

    bad_grad = {
        "more-bags": lambda: np.ones((3, DIM), F32),
        "fewer-bags": lambda: np.ones((1, DIM), F32),
        "wide": lambda: np.ones((2, DIM + 1), F32),
        "narrow": lambda: np.ones((2, DIM - 1), F32),
        "1d": lambda: np.ones(2 * DIM, F32),
        "3d": lambda: np.ones((2, DIM, 1), F32),
        "float64": lambda: np.ones((2, DIM)),
        "float16": lambda: np.ones((2, DIM), np.float16),
        "int": lambda: np.ones((2, DIM), np.int64),
        "bool": lambda: np.ones((2, DIM), bool),
        "nan": lambda: np.full((2, DIM), np.nan, F32),
        "one-nan": lambda: np.where(np.eye(2, DIM, dtype=bool), np.float32(np.nan), np.float32(1.0)).astype(F32),
        "None": lambda: None,
        "str": lambda: "grad",
        "scalar": lambda: np.float32(1.0),
        "list-of-float64": lambda: [[1.0] * DIM] * 2,
    }
    for name, make in bad_grad.items():
        refuse(f"apply_gradients/grad_output={name}", lambda w, make=make: w.s.apply_gradients(w.ctx, make()),
               r"grad_output")
        refuse(f"accumulate_gradients/grad_output={name}",
               lambda w, make=make: w.s.accumulate_gradients(w.ctx, make()), r"grad_output")
        refuse(f"apply_gradients-max/grad_output={name}",
               lambda w, make=make: w.s.apply_gradients(w.ctx_max, make()), r"grad_output")

    for name, lr in {"-1": -1.0, "-0.1-np": np.float64(-0.1), "nan": float("nan"), "inf": float("inf"),
                     "1e39": 1e39, "True": True, "False": False, "str": "0.1", "complex": 0.1j,
                     "list-with-nan": [float("nan")],
                     "list-too-long": [0.1, 0.2], "array": np.array([0.1]), "np.float32-nan": np.float32("nan"),
                     "np.float64-1e39": np.float64(1e39)}.items():
        refuse(f"apply_gradients/lr={name}", lambda w, lr=lr: w.sgd.apply_gradients(w.ctx_sgd, w.g, lr=lr), r"\blr\b")

    for name, lr in {"np.float32(0.1)": np.float32(0.1), "np.float64(0.1)": np.float64(0.1),
                     "int-0": 0, "np.int64(1)": np.int64(1)}.items():
        def lr_ok(w, lr=lr):
            twin = World()
            w.sgd.apply_gradients(w.ctx_sgd, w.g, lr=lr)
            twin.sgd.apply_gradients(twin.ctx_sgd, twin.g, lr=float(lr))
            _expect(snapshot(w.sgd) == snapshot(twin.sgd), f"lr={lr!r} gives other rows than lr={float(lr)!r}")
        accept(f"apply_gradients/lr={name}", lr_ok)

    def grad_layout(make):
        def call(w):
            twin = World()
            w.sgd.apply_gradients(w.ctx_sgd, make(np.arange(2 * DIM, dtype=F32).reshape(2, DIM)))
            twin.sgd.apply_gradients(twin.ctx_sgd, np.arange(2 * DIM, dtype=F32).reshape(2, DIM))
            _expect(snapshot(w.sgd) == snapshot(twin.sgd), "the rows differ from those of a C-contiguous gradient")
        return call
    accept("apply_gradients/grad_output=read-only", grad_layout(_readonly))
    accept("apply_gradients/grad_output=column-block",
           grad_layout(lambda g: np.concatenate([np.full((2, 3), np.nan, F32), g], axis=1)[:, 3:]))
    accept("apply_gradients/grad_output=fortran-order", grad_layout(np.asfortranarray))
    accept("apply_gradients/grad_output=strided-columns",
           grad_layout(lambda g: np.repeat(g, 2, axis=1)[:, ::2]))

    refuse("apply_gradients/store-without-optimizer", lambda w: w.plain.apply_gradients(w.ctx_plain, w.g),
           r"optimizer")
    refuse("apply_gradients/ctx-of-another-store-same-dim", lambda w: w.s.apply_gradients(w.ctx_sgd, w.g),
           ctx_match)
    refuse("accumulate_gradients/ctx-of-another-store", lambda w: w.s.accumulate_gradients(w.ctx_other,
                                                                                           np.ones((2, 3), F32)),
           ctx_match)

    def eval_ctx(w):  # an evaluation lookup's unseen keys (slot -1) take no gradient
        _, c = w.sgd.pooled_lookup(np.array([1, 999]), lengths=np.array([1, 1]), insert_missing=False)
        before = w.sgd.read(np.array([1])).rows.copy()
        w.sgd.apply_gradients(c, w.g)
        _expect(not w.sgd.contains(np.array([999]))[0], "evaluation backward inserted a key")
        _expect(np.array_equal(w.sgd.read(np.array([1])).rows, before - np.float32(0.1)), "row 1 not updated")
    accept("apply_gradients/ctx-of-an-evaluation-lookup", eval_ctx)

    # stale contexts: erase one of its keys, or clear the store; the table must be unchanged after
    def stale(mutate, verb):
        def call(w):
            mutate(w)
            w.resnapshot()
            if verb == "apply":
                w.s.apply_gradients(w.ctx, w.g)
            elif verb == "accumulate":
                w.s.accumulate_gradients(w.ctx, w.g)
            else:
                grouped_apply_gradients(w.gctxs, w.gg)
        return call
    for mname, mutate in {"erase-one-of-its-keys": lambda w: w.s.erase(np.array([2])),
                          "erase-its-new-key": lambda w: w.s.erase(np.array([100])),
                          "clear": lambda w: w.s.clear(),
                          "clear-then-reinsert": lambda w: (w.s.clear(), w.s.find_or_insert(w.keys))}.items():
        for verb in ("apply", "accumulate", "grouped"):
            refuse(f"stale-ctx/{mname}/{verb}", stale(mutate, verb), r"ctx|context|erased|cleared", STALE)

    for mname, mutate in {"insert": lambda w: w.s.find_or_insert(np.array([555])),
                          "erase": lambda w: w.s.erase(np.array([3])),
                          "clear": lambda w: w.s.clear()}.items():
        def stale_cursor(w, mutate=mutate):
            c = w.s.export(max_rows=2).next_cursor
            mutate(w)
            w.resnapshot()
            w.s.export(c, 2)
        refuse(f"stale-cursor/{mname}", stale_cursor, r"cursor|export", STALE)

    def cursor_of_another_store(w):
        c = w.sgd.export(max_rows=2).next_cursor
        w.s.export(c, 2)
    refuse("stale-cursor/of-another-store", cursor_of_another_store, r"cursor|export", STALE)

    def deepcopy_ctx(w):
        import copy
        twin = copy.deepcopy(w.s)
        w.stores = lambda: [w.s, w.sgd, w.plain, w.other, twin]
        w.resnapshot()
        twin.apply_gradients(w.ctx, w.g)
    refuse("apply_gradients/ctx-on-a-deepcopy-of-its-store", deepcopy_ctx, ctx_match)

    def after_growth(w):  # slots are stable: a context stays valid while the store grows
        twin = World()
        w.s.find_or_insert(np.arange(1000, 5000))
        w.s.apply_gradients(w.ctx, w.g)
        twin.s.apply_gradients(twin.ctx, twin.g)
        twin.s.find_or_insert(np.arange(1000, 5000))
        _expect(snapshot(w.s) == snapshot(twin.s), "growing the store between lookup and backward changed the update")
    accept("apply_gradients/after-the-store-grew", after_growth)

    def after_unrelated_erase(w):  # refused as stale, or exactly the update made before the erase
        twin = World()
        w.s.erase(np.array([6]))
        w.resnapshot()
        w.s.apply_gradients(w.ctx, w.g)
        twin.s.apply_gradients(twin.ctx, twin.g)
        twin.s.erase(np.array([6]))
        _expect(snapshot(w.s)[:5] == snapshot(twin.s)[:5], "erasing an unrelated key changed the update")
    either("stale-ctx/erase-an-unrelated-key/apply", after_unrelated_erase, r"ctx|context|erased|cleared", STALE)


_DEFAULT = object()


def _build_grouped_cases():
    L = np.array([1, 1])
    ka, kb = np.array([800, 801]), np.array([802, 803])

    def gl(w, stores=_DEFAULT, keys=_DEFAULT, offsets=None, lengths=_DEFAULT, **kw):
        stores = [w.s, w.other] if stores is _DEFAULT else stores
        keys = [ka, kb] if keys is _DEFAULT else keys
        if lengths is _DEFAULT:
            lengths = None if offsets is not None else [L, L]
        return grouped_pooled_lookup(stores, keys, offsets, lengths=lengths, **kw)

    cases = {
        "stores=[]": (lambda w: grouped_pooled_lookup([], [], lengths=[]), r"\bstores\b"),
        "stores=store": (lambda w: gl(w, stores=w.s), r"\bstores\b"),
        "stores-list=None": (lambda w: gl(w, stores=None), r"\bstores\b"),
        "stores[1]=str": (lambda w: gl(w, stores=[w.s, "x"]), r"stores\[1\]"),
        "stores[1]=config": (lambda w: gl(w, stores=[w.s, w.other.config]), r"stores\[1\]"),
        "keys-one-short": (lambda w: gl(w, keys=[ka]), r"\bkeys\b"),
        "keys-one-long": (lambda w: gl(w, keys=[ka, kb, kb]), r"\bkeys\b"),
        "keys-list=array": (lambda w: gl(w, keys=np.array([ka, kb])), r"\bkeys\b"),
        "keys-list=None": (lambda w: gl(w, keys=None), r"\bkeys\b"),
        "lengths-one-short": (lambda w: gl(w, lengths=[L]), r"\blengths\b"),
        "offsets-one-short": (lambda w: gl(w, offsets=[np.array([0, 1, 2])], lengths=None), r"\boffsets\b"),
        "offsets[1]-bad": (lambda w: gl(w, offsets=[np.array([0, 1, 2]), np.array([0, 2, 1])], lengths=None),
                           r"offsets\[1\]"),
        "offsets[1]-not-ending-at-len": (lambda w: gl(w, offsets=[np.array([0, 1, 2]), np.array([0, 1, 5])],
                                                      lengths=None), r"offsets\[1\]"),
        "offsets[1]-not-starting-at-0": (lambda w: gl(w, offsets=[np.array([0, 1, 2]), np.array([1, 1, 2])],
                                                      lengths=None), r"offsets\[1\]"),
        "lengths[1]-negative": (lambda w: gl(w, lengths=[L, np.array([3, -1])]), r"lengths\[1\]"),
        "lengths[1]-not-summing": (lambda w: gl(w, lengths=[L, np.array([1, 2])]), r"lengths\[1\]"),
        "feature-1-both": (lambda w: gl(w, offsets=[None, np.array([0, 1, 2])], lengths=[L, L]),
                           r"feature 1|offsets\[1\]|lengths\[1\]"),
        "feature-1-neither": (lambda w: gl(w, offsets=None, lengths=[L, None]),
                              r"feature 1|offsets\[1\]|lengths\[1\]"),
        "bag-count-mismatch": (lambda w: gl(w, lengths=[L, np.array([1, 0, 1])]), r"bags|lengths\[1\]|feature 1"),
        "modes-one-short": (lambda w: gl(w, modes=["sum"]), r"\bmodes\b"),
        "modes[1]-bad": (lambda w: gl(w, modes=["sum", "median"]), r"modes\[1\]"),
        "modes[1]-list": (lambda w: gl(w, modes=["sum", ["sum"]]), r"modes\[1\]"),
        "per_sample_weights[1]-short": (lambda w: gl(w, per_sample_weights=[None, np.ones(1, F32)]),
                                        r"per_sample_weights\[1\]"),
        "per_sample_weights[1]-float64": (lambda w: gl(w, per_sample_weights=[None, np.ones(2)]),
                                          r"per_sample_weights\[1\]"),
        "per_sample_weights[1]-with-max": (lambda w: gl(w, modes=["sum", "max"],
                                                        per_sample_weights=[None, np.ones(2, F32)]),
                                           r"per_sample_weights\[1\]"),
        "per_sample_weights-one-short": (lambda w: gl(w, per_sample_weights=[np.ones(2, F32)]),
                                         r"per_sample_weights"),
        "out-wrong-width": (lambda w: gl(w, out=np.zeros((2, DIM), F32)), r"\bout\b"),
        "out-read-only": (lambda w: gl(w, out=_readonly(np.zeros((2, DIM + 3), F32))), r"\bout\b"),
        "insert_missing='no'": (lambda w: gl(w, insert_missing="no"), r"insert_missing"),
        # one store in two features: a bad second feature must leave the first one's inserts undone
        "same-store-offsets[1]-bad": (lambda w: gl(w, stores=[w.s, w.s], offsets=[np.array([0, 1, 2]),
                                                                                 np.array([0, 3, 2])],
                                                   lengths=None), r"offsets\[1\]"),
        "same-store-keys[1]-float": (lambda w: gl(w, stores=[w.s, w.s], keys=[ka, kb.astype(float)]), r"keys\[1\]"),
        "same-store-per_sample_weights[1]-short": (lambda w: gl(w, stores=[w.s, w.s],
                                                                per_sample_weights=[None, np.ones(1, F32)]),
                                                   r"per_sample_weights\[1\]"),
        "same-store-out-read-only": (lambda w: gl(w, stores=[w.s, w.s], out=_readonly(np.zeros((2, 2 * DIM), F32))),
                                     r"\bout\b"),
        "three-stores-lengths[2]-bad": (lambda w: gl(w, stores=[w.s, w.sgd, w.other], keys=[ka, kb, kb],
                                                     lengths=[L, L, np.array([2, 1])]), r"lengths\[2\]"),
    }
    for name, (call, match) in cases.items():
        refuse(f"grouped_pooled_lookup/{name}", call, match)

    ctx_match = r"\bctx|context|grad_output|bags"
    gcases = {
        # a second context with more bags than the first: the gradient is checked against every context
        "second-ctx-more-bags": (lambda w: grouped_apply_gradients([w.ctx_other, w.ctx3],
                                                                   np.ones((2, 3 + DIM), F32)), ctx_match),
        "second-ctx-more-bags-same-store": (lambda w: grouped_apply_gradients([w.ctx, w.ctx3],
                                                                              np.ones((2, DIM), F32)), ctx_match),
        "second-ctx-fewer-bags": (lambda w: grouped_apply_gradients([w.ctx3, w.ctx_other],
                                                                    np.ones((3, DIM), F32)), ctx_match),
        # contexts of different lookups mixed (their column blocks overlap)
        "contexts-of-different-lookups": (lambda w: grouped_apply_gradients([w.gctxs[0], w.ctx_sgd],
                                                                            np.ones((2, DIM + 3), F32)), ctx_match),
        "contexts-of-different-lookups-same-columns": (lambda w: grouped_apply_gradients(
            [w.ctx_sgd, w.ctx], np.ones((2, DIM), F32)), ctx_match),
        "grouped-ctx-with-single-ctx": (lambda w: grouped_apply_gradients([w.gctxs[1], w.ctx_sgd],
                                                                          np.ones((2, DIM + 3), F32)), ctx_match),
        "ctxs=ctx": (lambda w: grouped_apply_gradients(w.ctx, w.g), r"\bctxs?\b|context"),
        "ctxs=[None]": (lambda w: grouped_apply_gradients([None], w.g), r"\bctxs?\b|context"),
        "ctxs=[ctx,'x']": (lambda w: grouped_apply_gradients([w.gctxs[0], "x"], w.gg), r"\bctxs?\b|context"),
        "ctxs=None": (lambda w: grouped_apply_gradients(None, w.g), r"\bctxs?\b|context"),
        "grad-too-narrow": (lambda w: grouped_apply_gradients(w.gctxs, np.ones((2, DIM), F32)), r"grad_output"),
        "grad-too-wide": (lambda w: grouped_apply_gradients(w.gctxs, np.ones((2, DIM + 4), F32)), r"grad_output"),
        "grad-more-bags": (lambda w: grouped_apply_gradients(w.gctxs, np.ones((3, DIM + 3), F32)), r"grad_output"),
        "grad-float64": (lambda w: grouped_apply_gradients(w.gctxs, np.ones((2, DIM + 3))), r"grad_output"),
        "grad-nan": (lambda w: grouped_apply_gradients(w.gctxs, np.full((2, DIM + 3), np.nan, F32)),
                     r"grad_output"),
        "lr-list-short": (lambda w: grouped_apply_gradients(w.gctxs, w.gg, lr=[0.1]), r"\blr\b"),
        "lr-list-long": (lambda w: grouped_apply_gradients(w.gctxs, w.gg, lr=[0.1, 0.1, 0.1]), r"\blr\b"),
        "lr[1]-nan": (lambda w: grouped_apply_gradients(w.gctxs, w.gg, lr=[0.1, float("nan")]), r"\blr\b"),
        "lr[1]-negative": (lambda w: grouped_apply_gradients(w.gctxs, w.gg, lr=[0.1, -0.1]), r"\blr\b"),
        "lr[1]-True": (lambda w: grouped_apply_gradients(w.gctxs, w.gg, lr=[0.1, True]), r"\blr\b"),
        "lr-1e39": (lambda w: grouped_apply_gradients(w.gctxs, w.gg, lr=1e39), r"\blr\b"),
        "stores=[]": (lambda w: grouped_apply_gradients(w.gctxs, w.gg, stores=[]), r"\bstores\b"),
        "stores-swapped": (lambda w: grouped_apply_gradients(w.gctxs, w.gg, stores=[w.other, w.s]),
                           r"\bstores\b|ctx|context"),
    }
    for name, (call, match) in gcases.items():
        refuse(f"grouped_apply_gradients/{name}", call, match)


def _build_config_cases():
    cfg_fields = {
        "dim": {"0": 0, "-1": -1, "1.5": 1.5, "True": True, "str": "4", "65537": 65537, "2**63": 2**63,
                "None": None, "float-4.0": 4.0},
        "dtype": {"float64": "float64", "int8": "int8", "None": None, "np.float64": np.float64, "FLOAT32": "FLOAT32"},
        "initializer": {"None": None, "str": "uniform", "class": Uniform, "optimizer": SGD()},
        "seed": {"-1": -1, "2**64": 2**64, "1.5": 1.5, "True": True, "str": "1", "None": None},
        "capacity": {"-1": -1, "1.5": 1.5, "True": True, "str": "10", "None": None, "2**63": 2**63,
                     "2**64": 2**64},
        "max_load_factor": {"0": 0, "0.05": 0.05, "0.95": 0.95, "1": 1, "nan": float("nan"), "inf": float("inf"),
                            "True": True, "str": "0.5", "None": None},
        "optimizer": {"str": "sgd", "class": SGD, "initializer": Uniform(), "dict": {"lr": 0.1}},
    }
    for field, values in cfg_fields.items():
        for name, value in values.items():
            refuse(f"StoreConfig/{field}={name}", lambda w, f=field, v=value: StoreConfig(**{"dim": DIM, f: v}),
                   rf"\b{field}\b")
            if field != "dim":
                refuse(f"EmbeddingStore/{field}={name}",
                       lambda w, f=field, v=value: EmbeddingStore(**{"dim": DIM, f: v}), rf"\b{field}\b")
    for name, value in {"2**62": 2**62, "2**50": 2**50, "int(0.7*2**60)": int(0.7 * 2**60)}.items():
        refuse(f"EmbeddingStore/capacity={name}", lambda w, v=value: EmbeddingStore(dim=DIM, capacity=v),
               r"\bcapacity\b", HUGE)
    refuse("EmbeddingStore/dim=65536-capacity=2**40", lambda w: EmbeddingStore(dim=65536, capacity=2**40),
           r"\bcapacity\b|\bdim\b", HUGE)
    refuse("EmbeddingStore/config-and-fields", lambda w: EmbeddingStore(w.s.config, dim=DIM), r"config|fields")
    refuse("EmbeddingStore/config=str", lambda w: EmbeddingStore("cfg"), r"\bconfig\b")
    refuse("EmbeddingStore/config=dict", lambda w: EmbeddingStore({"dim": DIM}), r"\bconfig\b")
    refuse("EmbeddingStore/no-dim", lambda w: EmbeddingStore(), r"\bdim\b")
    refuse("EmbeddingStore/unknown-field", lambda w: EmbeddingStore(dim=DIM, bogus=1), r"bogus")

    for name, value in {"np.int64(4)": np.int64(4), "np.int32(4)": np.int32(4)}.items():
        def dim_np(w, v=value):
            s = EmbeddingStore(dim=v)
            _expect(s.lookup(np.array([1]), insert_missing=True).shape == (1, 4), "dim")
        either(f"EmbeddingStore/dim={name}", dim_np, r"\bdim\b")

    def mlf_np(w):
        s = EmbeddingStore(dim=DIM, max_load_factor=np.float32(0.5))
        s.find_or_insert(np.arange(100))
        _expect(len(s) == 100, "rows")
    accept("EmbeddingStore/max_load_factor=np.float32(0.5)", mlf_np)

    def seed_np(w):
        a = EmbeddingStore(dim=DIM, seed=np.uint64(3)).lookup(np.array([5]), insert_missing=True)
        b = EmbeddingStore(dim=DIM, seed=3).lookup(np.array([5]), insert_missing=True)
        _expect(a.tobytes() == b.tobytes(), "seed=np.uint64(3) gives other rows than seed=3")
    either("EmbeddingStore/seed=np.uint64(3)", seed_np, r"\bseed\b")

    nan, inf = float("nan"), float("inf")
    bad_numbers = {"nan": nan, "inf": inf, "-inf": -inf, "1e39": 1e39, "-1e39": -1e39, "True": True, "str": "0.1",
                   "None": None, "complex": 1j, "np.float64-nan": np.float64(nan), "np.float64-1e39": np.float64(1e39),
                   "list": [0.1]}
    init_fields = {
        Uniform: {"low": {"high": 1.0}, "high": {"low": -1.0}},
        Normal: {"mean": {}, "std": {}},
        TruncatedNormal: {"mean": {}, "std": {}, "low": {}, "high": {}},
        Constant: {"value": {}},
    }
    for cls, fields in init_fields.items():
        for field, base in fields.items():
            for name, value in bad_numbers.items():
                refuse(f"{cls.__name__}/{field}={name}",
                       lambda w, cls=cls, field=field, base=base, v=value: cls(**{**base, field: v}),
                       rf"{cls.__name__}\.{field}|\b{field}\b")
    refuse("Uniform/low>high", lambda w: Uniform(low=1.0, high=0.0), r"\blow\b.*\bhigh\b|\bhigh\b.*\blow\b")
    refuse("Uniform/low==high", lambda w: Uniform(low=0.5, high=0.5), r"\blow\b.*\bhigh\b|\bhigh\b.*\blow\b")
    refuse("Uniform/span-overflows-float32", lambda w: Uniform(low=-3e38, high=3e38), r"\blow\b|\bhigh\b")
    for name, std in {"0": 0.0, "-1": -1.0, "1e-46-underflows-float32": 1e-46}.items():
        refuse(f"Normal/std={name}", lambda w, s=std: Normal(std=s), r"\bstd\b")
        refuse(f"TruncatedNormal/std={name}", lambda w, s=std: TruncatedNormal(std=s), r"\bstd\b")
    refuse("TruncatedNormal/low>high", lambda w: TruncatedNormal(low=1.0, high=-1.0), r"\blow\b|\bhigh\b")
    refuse("TruncatedNormal/interval-without-mass", lambda w: TruncatedNormal(low=100.0, high=101.0),
           r"\blow\b|\bhigh\b")

    opt_fields = {SGD: ("lr",), Adagrad: ("lr", "eps", "initial_accumulator_value"),
                  RowWiseAdagrad: ("lr", "eps", "initial_accumulator_value"), Adam: ("lr", "eps")}
    for cls, fields in opt_fields.items():
        for field in fields:
            for name, value in {**bad_numbers, "-1": -1.0, "-1e-9": -1e-9, "False": False}.items():
                refuse(f"{cls.__name__}/{field}={name}", lambda w, cls=cls, field=field, v=value: cls(**{field: v}),
                       rf"{cls.__name__}\.{field}|\b{field}\b")
    for name, betas in {"(1.0,0.999)": (1.0, 0.999), "(-0.1,0.999)": (-0.1, 0.999), "(0.9,)": (0.9,),
                        "(0.9,0.99,0.9)": (0.9, 0.99, 0.9), "None": None, "str": "ab", "(nan,0.9)": (nan, 0.9),
                        "(True,0.9)": (True, 0.9), "float": 0.9, "(0.9,'x')": (0.9, "x")}.items():
        refuse(f"Adam/betas={name}", lambda w, b=betas: Adam(betas=b), r"\bbetas\b")

    # numpy scalars are numbers: accepted, and the store behaves as with the Python float
    np_ok = {
        "Uniform": (lambda: Uniform(np.float32(-0.1), np.float32(0.1)), lambda: Uniform(float(np.float32(-0.1)),
                                                                                      float(np.float32(0.1)))),
        "Normal": (lambda: Normal(np.float32(0.0), np.float32(0.5)), lambda: Normal(0.0, 0.5)),
        "TruncatedNormal": (lambda: TruncatedNormal(np.float32(0), np.float32(1), np.float32(-1), np.float32(1)),
                            lambda: TruncatedNormal(0.0, 1.0, -1.0, 1.0)),
        "Constant": (lambda: Constant(np.float32(0.5)), lambda: Constant(0.5)),
        "Constant-np.int64": (lambda: Constant(np.int64(2)), lambda: Constant(2.0)),
    }
    for name, (make, ref) in np_ok.items():
        def init_ok(w, make=make, ref=ref):
            a = EmbeddingStore(dim=DIM, initializer=make()).lookup(np.array([1, 2]), insert_missing=True)
            b = EmbeddingStore(dim=DIM, initializer=ref()).lookup(np.array([1, 2]), insert_missing=True)
            _expect(a.tobytes() == b.tobytes(), "numpy-scalar initializer gives other rows")
        accept(f"{name}/numpy-scalars", init_ok)
    opt_ok = {
        "SGD": (lambda: SGD(lr=np.float32(0.1)), lambda: SGD(lr=float(np.float32(0.1)))),
        "Adagrad": (lambda: Adagrad(lr=np.float32(0.1), eps=np.float32(1e-8),
                                    initial_accumulator_value=np.float32(0.1)),
                    lambda: Adagrad(lr=float(np.float32(0.1)), eps=float(np.float32(1e-8)),
                                    initial_accumulator_value=float(np.float32(0.1)))),
        "RowWiseAdagrad": (lambda: RowWiseAdagrad(lr=np.float64(0.1), eps=np.float32(1e-8)),
                           lambda: RowWiseAdagrad(lr=0.1, eps=float(np.float32(1e-8)))),
        "Adam": (lambda: Adam(lr=np.float32(0.01), betas=(np.float32(0.9), np.float64(0.99)), eps=np.float32(1e-8)),
                 lambda: Adam(lr=float(np.float32(0.01)), betas=(float(np.float32(0.9)), 0.99),
                              eps=float(np.float32(1e-8)))),
        "SGD-np.int64": (lambda: SGD(lr=np.int64(1)), lambda: SGD(lr=1.0)),
    }
    for name, (make, ref) in opt_ok.items():
        def optim_ok(w, make=make, ref=ref):
            got = []
            for opt in (make(), ref()):
                s = EmbeddingStore(dim=DIM, initializer=Constant(1.0), optimizer=opt)
                _, c = s.pooled_lookup(np.array([1, 2, 1]), lengths=np.array([2, 1]))
                s.apply_gradients(c, np.arange(2 * DIM, dtype=F32).reshape(2, DIM))
                got.append(snapshot(s))
            _expect(got[0] == got[1], "numpy-scalar optimizer fields give other rows")
        accept(f"{name}/numpy-scalars", optim_ok)


# --- the caller mutates its arrays between lookup and backward ---------------------------------

def _build_mutation_cases():
    """After ``out, ctx = store.pooled_lookup(keys, offsets, per_sample_weights=w)`` the caller
    overwrites keys / offsets / weights in place; the backward must give exactly what it gives
    without the mutation (a twin world where nothing was mutated)."""
    mutations = {
        "offsets-zeroed": lambda k, o, w, ln: o.__setitem__(slice(None), 0),
        "offsets-last-huge": lambda k, o, w, ln: o.__setitem__(-1, 10**9),
        "offsets-shuffled": lambda k, o, w, ln: o.__setitem__(slice(None), [0, 1, 4]),
        "offsets-negative": lambda k, o, w, ln: o.__setitem__(1, -7),
        "keys": lambda k, o, w, ln: k.__setitem__(slice(None), [7, 8, 9, 10]),
        "keys-int32": lambda k, o, w, ln: k.__setitem__(slice(None), [7, 8, 9, 10]),
        "weights": lambda k, o, w, ln: w.__setitem__(slice(None), 100.0),
        "weights-nan": lambda k, o, w, ln: w.__setitem__(slice(None), np.nan),
        "lengths": lambda k, o, w, ln: ln.__setitem__(slice(None), [4, 0]),
        "everything": lambda k, o, w, ln: (k.__setitem__(slice(None), 5), o.__setitem__(slice(None), [0, 0, 4]),
                                           w.__setitem__(slice(None), -3.0)),
    }

    def run(world, mutate, verb, use_lengths, kdtype):
        keys = np.array([1, 2, 2, 100], dtype=kdtype)
        offsets = np.array([0, 2, 4], dtype=np.int64)
        lengths = np.array([2, 2], dtype=np.int64)
        weights = np.array([0.5, 1.0, 2.0, -1.0], dtype=F32)
        grad = np.arange(2 * DIM, dtype=F32).reshape(2, DIM) / 4
        if use_lengths:
            _, ctx = world.s.pooled_lookup(keys, lengths=lengths, per_sample_weights=weights)
        else:
            _, ctx = world.s.pooled_lookup(keys, offsets, per_sample_weights=weights)
        if mutate is not None:
            mutate(keys, offsets, weights, lengths)
        if verb == "apply":
            world.s.apply_gradients(ctx, grad)
            return None
        if verb == "grouped":
            grouped_apply_gradients([ctx], grad)
            return None
        k, g = world.s.accumulate_gradients(ctx, grad)
        return k.tolist(), g.tobytes()

    for name, mutate in mutations.items():
        for verb in ("apply", "accumulate", "grouped"):
            use_lengths = name == "lengths"
            kdtype = np.int32 if name == "keys-int32" else np.int64

            def call(w, mutate=mutate, verb=verb, use_lengths=use_lengths, kdtype=kdtype):
                twin = World()
                got = run(w, mutate, verb, use_lengths, kdtype)
                want = run(twin, None, verb, use_lengths, kdtype)
                _expect(got == want, f"accumulate_gradients gave keys {got[0]} and "
                        f"{'the same' if got[1] == want[1] else 'other'} gradients; without the mutation keys {want[0]}"
                        if got and want else "the results differ")
                for a, b in zip(w.stores(), twin.stores()):
                    _expect(snapshot(a) == snapshot(b), "the rows differ from those of the unmutated twin")
            accept(f"mutated-after-lookup/{name}/{verb}", call)


def _build_selftest_cases():
    """Cases that prove the runner reports a crash or a hang as one failed case (only built
    when CN_BAD_INPUTS_SELFTEST is set: they are not part of the catalogue)."""
    import ctypes
    import time
    refuse("selftest/refused-1", lambda w: w.s.find(np.array([1.0])), r"\bkeys\b")
    accept("selftest/segfault", lambda w: ctypes.string_at(0))
    refuse("selftest/refused-2", lambda w: w.s.find(np.array([1.0])), r"\bkeys\b")
    accept("selftest/hang", lambda w: time.sleep(3600))
    refuse("selftest/refused-3", lambda w: w.s.find(np.array([1.0])), r"\bkeys\b")
    refuse("selftest/erases-then-raises", lambda w: (w.s.erase(np.array([1])), w.s.find(np.array([1.0]))),
           r"\bkeys\b")


def build() -> dict[str, Case]:
    if not CASES and os.environ.get("CN_BAD_INPUTS_SELFTEST"):
        _build_selftest_cases()
        return CASES
    if not CASES:
        _build_key_cases()
        _build_row_cases()
        _build_store_verb_cases()
        _build_export_cases()
        _build_pooled_cases()
        _build_backward_cases()
        _build_grouped_cases()
        _build_config_cases()
        _build_mutation_cases()
    return CASES


# --- the runner (in a child process) ------------------------------------------------------------

def _resnapshot(world):
    world.snaps = [snapshot(st) for st in world.stores()]


World.resnapshot = _resnapshot


def run_case(case: Case) -> dict:
    rec = {"id": case.id, "exc": None, "mro": [], "msg": "", "unchanged": True, "detail": ""}
    try:
        world = World()
        world.resnapshot()
    except BaseException as exc:  # the world itself cannot be built: the core is broken
        rec.update(exc="WorldError", msg=f"{type(exc).__name__}: {exc}")
        return rec
    try:
        case.call(world)
    except BaseException as exc:
        rec.update(exc=type(exc).__name__, mro=[c.__name__ for c in type(exc).__mro__], msg=str(exc)[:2000],
                   in_cncore=_raised_in_cncore(exc))
    finally:
        try:
            set_num_threads(None)
        except BaseException:
            pass
    fields = ("keys", "rows", "optimizer_state", "counts", "last_steps", "len", "step", "capacity")
    try:
        now = [snapshot(st) for st in world.stores()]
        names = ["s", "sgd", "plain", "other"] + [f"store {i}" for i in range(4, len(now))]
        changed = [f"{name} ({', '.join(f for f, x, y in zip(fields, a, b) if x != y)})"
                   for name, a, b in zip(names, world.snaps, now) if a != b]
        if changed or len(now) != len(world.snaps):
            rec.update(unchanged=False, detail="changed: " + ", ".join(changed))
    except BaseException as exc:
        rec.update(unchanged=False, detail=f"the store cannot be exported afterwards: {type(exc).__name__}: {exc}")
    return rec


def main(ids: list[str]) -> None:
    import resource
    faulthandler.enable()
    # absurd sizes must fail fast with MemoryError, not swap the machine
    limit = 8 << 30
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    cases = build()
    for cid in ids:
        rec = run_case(cases[cid])
        sys.stdout.write("CASE " + json.dumps(rec) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1:] if len(sys.argv) > 1 else json.load(sys.stdin))

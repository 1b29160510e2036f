"""Bad input to every public entry point of the torch modules and collections: an error of
the documented type whose message names the argument, and every table byte-identical
afterwards (issue 9, the torch front end's harness).

Entry points: the constructors of CNEmbeddingBag, CNEmbedding, CNEmbeddingBagCollection and
CNEmbeddingCollection (and from_pretrained); forward with wrong dtypes, shapes, values, devices
and meta tensors, bad offsets and per_sample_weights, bad KeyedJaggedTensors; the table
methods (insert, assign, reserve, move_to, hooks, the fused optimizer's load_state_dict); and
load_state_dict with a catalogue of broken state_dicts (torch's own RuntimeError, "Error(s) in
loading state_dict ..."). Each case asserts the exception type, `match` on its message, and
that the tables are as before: every state_dict entry (keys, rows, optimizer_state, counts,
last_steps, sorted by key), len and step, and an evaluation forward giving the same bytes
(the module's handle and autograd bridge still work). A state_dict is always loaded from a
*different* table, so a table swapped before the refusal would show.

Hypothesis adds random offsets, KJT lengths and state_dict corruptions, each checked against
a model of what is valid: valid input gives the reference result, invalid input is refused
naming the argument and changes nothing.

Every case runs in a child process (all in one, as importing torch costs seconds; after a
crash the rest run in a new one), which prints one JSON line per case: a segfault fails its
case instead of killing the run. Run the worker by hand to see the records:

    echo '["bag.input.float"]' | python tests/test_torch_bad_inputs.py

and count them with `python -c "import sys; sys.path[:0] = ['tests']; import test_torch_bad_inputs as t;
print(t.N_CASES)"` (437 when written; MIN_CASES keeps it from shrinking).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("torchrec")
import itertools

from torchrec import EmbeddingBagConfig, EmbeddingConfig, KeyedJaggedTensor, PoolingType

import cncore
from cncore_torch import CNEmbedding, CNEmbeddingBag
from cncore_torch.collection import CNEmbeddingBagCollection, CNEmbeddingCollection

DIM = 4
STATE_ERROR = r"Error\(s\) in loading state_dict for {}:\n\t"


@dataclass(frozen=True)
class Case:
    target: str | None           # a name in TARGETS (None: a constructor call)
    call: Callable                  # call(target object, other object of the same kind)
    exc: type | None             # None: must succeed (a strict=False load reporting missing keys)
    match: str                      # re.search on the message (exc None: on the returned value's repr)


# --- the objects the cases are played on -----------------------------------------------------------

def _cfgs(bag=True, dim_u=DIM):
    kind = EmbeddingBagConfig if bag else EmbeddingConfig
    extra = dict(pooling=PoolingType.MEAN) if bag else {}
    return [kind(name="t", embedding_dim=DIM, num_embeddings=50, feature_names=["f"]),
            kind(name="u", embedding_dim=dim_u, num_embeddings=50, feature_names=["g"], **extra)]


def _kjt(values, lengths, weights=None, keys=("f", "g")):
    return KeyedJaggedTensor(keys=list(keys), values=torch.as_tensor(values), lengths=torch.as_tensor(lengths),
                             weights=weights)


def _train(obj, seed: int):
    """Some fused steps on IDs that depend on seed, so that two objects differ."""
    ids = torch.arange(seed * 100, seed * 100 + 12)
    for _ in range(2):
        if isinstance(obj, CNEmbeddingBag):
            out = obj(ids.reshape(3, 4))
        elif isinstance(obj, CNEmbedding):
            out = obj(ids)
        elif isinstance(obj, CNEmbeddingBagCollection):
            w = torch.rand(12) if obj.is_weighted() else None
            out = obj(_kjt(ids, [3, 3, 3, 3], w)).values()
        else:
            out = torch.cat([jt.values() for jt in obj(_kjt(ids, [3, 3, 3, 3])).values()])
        out.sum().backward()
    return obj


def _bag(**kw):
    def make(seed):
        return _train(CNEmbeddingBag(50, DIM, **{"mode": "sum", "optimizer": cncore.Adam(lr=0.1), **kw}), seed)
    return make


def _cncard_bag(seed):
    os.environ["CNCORE_CNCARD"] = "cpu"  # the accelerator code path, on the CPU
    return _train(CNEmbeddingBag(50, DIM, mode="mean", device="cncard", optimizer=cncore.Adagrad(lr=0.1)), seed)


TARGETS = {
    "bag": _bag(),                                                     # sum, Adam
    "bag_sgd": _bag(optimizer=cncore.SGD(lr=0.1)),
    "bag_max": _bag(mode="max", optimizer=cncore.RowWiseAdagrad(lr=0.1)),
    "bag_last": _bag(include_last_offset=True),
    "bag_pad": _bag(padding_idx=7, mode="mean"),
    "bag_cncard": _cncard_bag,
    "bag_hooks": lambda seed: CNEmbeddingBag(50, DIM, mode="sum"),
    "emb": lambda seed: _train(CNEmbedding(50, DIM, optimizer=cncore.RowWiseAdagrad(lr=0.1)), seed),
    "meta": lambda seed: CNEmbeddingBag(50, DIM, device="meta"),
    "ebc": lambda seed: _train(CNEmbeddingBagCollection(_cfgs(), optimizer=cncore.Adam(lr=0.1)), seed),
    "ebc_sgd": lambda seed: _train(CNEmbeddingBagCollection(_cfgs(), optimizer=cncore.SGD(lr=0.1)), seed),
    "ebc_w": lambda seed: _train(CNEmbeddingBagCollection(_cfgs(), is_weighted=True, optimizer=cncore.SGD(lr=0.1)),
                                 seed),
    "ec": lambda seed: _train(CNEmbeddingCollection(_cfgs(bag=False), optimizer=cncore.Adagrad(lr=0.1)), seed),
}


def snapshot(obj) -> dict:
    """Everything a table holds, as bytes: state_dict entries sorted by key, len, step, the fused
    optimizer's lr, and what an evaluation forward returns."""
    if obj is None:
        return {}
    state = obj.state_dict()
    snap = {}
    for name in [k for k in state if k.endswith("keys")]:
        prefix = name[:-len("keys")]
        order = torch.argsort(state[name])
        for field in ("keys", "rows", "optimizer_state", "counts", "last_steps"):
            snap[prefix + field] = state[prefix + field][order].numpy().tobytes()
        snap[prefix + "step"] = int(state[prefix + "step"])
    if isinstance(obj, (CNEmbeddingBag, CNEmbedding)):
        if obj.placement.kind != "meta":
            snap["len"] = obj.num_rows
        ids = torch.tensor([[0, 1, 5, 101], [7, 7, 3, 999]])
    else:
        snap["len"] = {name: len(store) for name, store in obj.stores.items()}
        ids = _kjt([0, 1, 101, 5, 7, 999], [2, 1, 2, 1], torch.ones(6) if isinstance(obj, CNEmbeddingBagCollection)
                   and obj.is_weighted() else None)
    if obj.fused_optimizer is not None:
        snap["lr"] = obj.fused_optimizer.lr
        snap["optimizer"] = str(obj.fused_optimizer.state_dict())
    training = obj.training
    obj.eval()
    with torch.no_grad():
        out = obj(ids)
    obj.train(training)
    if isinstance(out, dict):
        out = torch.cat([jt.values() for jt in out.values()])
    elif not isinstance(out, torch.Tensor):
        out = out.values()
    snap["forward"] = out.numpy().tobytes() if out.device.type != "meta" else tuple(out.shape)
    return snap


# --- the catalogue ---------------------------------------------------------------------------------

def _ctor(cls, *args, **kw):
    return lambda obj, other: cls(*args, **kw)


def _with_entry(key, value=None, transform=None, drop=False, strict=True):
    """load_state_dict of `other`'s state_dict with one entry replaced, transformed or dropped."""
    def call(obj, other):
        state = other.state_dict()
        if drop:
            del state[key]
        else:
            state[key] = transform(state[key]) if transform else value
        return obj.load_state_dict(state, strict=strict)
    return call


def _state_from(kind):
    """load_state_dict of a state_dict written by another kind of table (say, another optimizer)."""
    return lambda obj, other: obj.load_state_dict(TARGETS[kind](3).state_dict())


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor{list(value.shape)}-{str(value.dtype)[6:]}-{value.device.type}"
    return str(value).replace(" ", "")


def _dup_first(t):
    return torch.cat([t, t[:1]])


def build() -> dict:
    cases = {}

    def add(cid, target, call, exc, match):
        assert cid not in cases, cid
        cases[cid] = Case(target, call, exc, match)

    # constructors: CNEmbeddingBag and CNEmbedding
    for cls, short in ((CNEmbeddingBag, "bag"), (CNEmbedding, "emb")):
        for arg, value, exc in (
                ("num_embeddings", -1, ValueError), ("num_embeddings", 10.0, ValueError),
                ("num_embeddings", True, ValueError), ("embedding_dim", 0, ValueError),
                ("embedding_dim", "4", ValueError), ("embedding_dim", 70000, ValueError),
                ("max_norm", 1.0, ValueError), ("scale_grad_by_freq", True, ValueError), ("sparse", True, ValueError),
                ("dtype", torch.float64, TypeError), ("device", "nowhere", ValueError),
                ("optimizer", "sgd", TypeError), ("initializer", "normal", TypeError), ("seed", -1, ValueError),
                ("seed", 2**64, ValueError), ("max_load_factor", 2.0, ValueError), ("padding_idx", "0", TypeError),
                ("padding_idx", 1.5, TypeError), ("_weight", [[1.0] * DIM], TypeError),
                ("_weight", torch.ones(DIM), ValueError), ("_weight", torch.ones(3, DIM + 1), ValueError),
                ("_weight", torch.ones(3, DIM, dtype=torch.int64), TypeError),
                ("_weight", torch.ones(3, DIM, device="meta"), ValueError)):
            kw = {"num_embeddings": 10, "embedding_dim": DIM, arg: value}
            add(f"{short}.ctor.{arg}={_describe(value)}", None, _ctor(cls, **kw), exc, "^" + re.escape(arg))
        add(f"{short}.from_pretrained.list", None, lambda o, x, cls=cls: cls.from_pretrained([[1.0] * DIM]),
            TypeError, "^embeddings must be a floating point")
        add(f"{short}.from_pretrained.1d", None, lambda o, x, cls=cls: cls.from_pretrained(torch.ones(DIM)),
            ValueError, "^embeddings must be 2-D")
    add("bag.ctor.mode", None, _ctor(CNEmbeddingBag, 10, DIM, mode="avg"), ValueError, "^mode must be")
    add("bag.ctor.include_last_offset", None, _ctor(CNEmbeddingBag, 10, DIM, include_last_offset="yes"), TypeError,
        "^include_last_offset must be True or False")

    def no_cncard(obj, other):
        os.environ.pop("CNCORE_CNCARD", None)
        return CNEmbeddingBag(10, DIM, device="cncard")
    add("bag.ctor.cncard_without_accelerator", None, no_cncard, RuntimeError, "device 'cncard' needs an accelerator")

    # constructors: the collections
    for cls, short, cfg in ((CNEmbeddingBagCollection, "ebc", EmbeddingBagConfig),
                            (CNEmbeddingCollection, "ec", EmbeddingConfig)):
        def one(**kw):
            return [cfg(**{"name": "t", "embedding_dim": DIM, "num_embeddings": 50, "feature_names": ["f"], **kw})]

        def zero_rows():
            tables = one()
            tables[0].num_embeddings = 0  # TorchRec's config refuses it at construction, not after
            return tables
        other = EmbeddingConfig if cfg is EmbeddingBagConfig else EmbeddingBagConfig
        for what, kwargs, exc, match in (
                ("tables_none", dict(tables=None), TypeError, "^tables must be a list"),
                ("tables_one_config", dict(tables=one()[0]), TypeError, "^tables must be a list"),
                ("tables_empty", dict(tables=[]), ValueError, "^tables: at least one"),
                ("tables_other_kind", dict(tables=[other(name="t", embedding_dim=DIM, num_embeddings=5)]), TypeError,
                 f"^tables: expected {cfg.__name__}"),
                ("duplicate_name", dict(tables=one() + one()), ValueError, "^tables: duplicate table name 't'"),
                ("embedding_dim", dict(tables=one(embedding_dim=0)), ValueError, "^table 't': embedding_dim must"),
                ("num_embeddings", dict(tables=zero_rows()), ValueError, "^table 't': num_embeddings must"),
                ("optimizer", dict(tables=one(), optimizer="sgd"), TypeError, "^table 't': optimizer must"),
                ("initializers_unknown", dict(tables=one(), initializers={"x": cncore.Constant(0.0)}), ValueError,
                 r"^initializers: no table named \['x'\]"),
                ("initializers_bad", dict(tables=one(), initializers={"t": "x"}), TypeError,
                 "^table 't': initializer must"),
                ("capacities_bad", dict(tables=one(), capacities={"t": -1}), ValueError, "^table 't': capacity must"),
                ("capacities_unknown", dict(tables=one(), capacities={"x": 1}), ValueError,
                 r"^capacities: no table named \['x'\]"),
                ("seed", dict(tables=one(), seed=-1), ValueError, "^seed must be"),
                ("device", dict(tables=one(), device="cuda"), ValueError, "^device='cuda'"),
                ("init_fn", dict(tables=one(init_fn=lambda w: w)), ValueError, "^table 't': init_fn")):
            add(f"{short}.ctor.{what}", None, _ctor(cls, **kwargs), exc, match)
    add("ebc.ctor.pooling", None, _ctor(CNEmbeddingBagCollection, [EmbeddingBagConfig(
        name="t", embedding_dim=DIM, num_embeddings=5, feature_names=["f"], pooling=PoolingType.NONE)]),
        ValueError, "^table 't': pooling")
    add("ebc.ctor.is_weighted", None, _ctor(CNEmbeddingBagCollection, _cfgs(), is_weighted="yes"), TypeError,
        "^is_weighted must be True or False")
    add("ec.ctor.dims", None, _ctor(CNEmbeddingCollection, _cfgs(bag=False, dim_u=8)), ValueError,
        "^tables: an EmbeddingCollection needs one embedding_dim")
    add("ec.ctor.need_indices", None, _ctor(CNEmbeddingCollection, _cfgs(bag=False), need_indices="x"), TypeError,
        "^need_indices must be True or False")

    # CNEmbeddingBag forward
    ids, offs = torch.tensor([1, 7, 3]), torch.tensor([0, 2])  # 7: bag_pad's padding_idx
    ones = torch.ones(3)
    for target in ("bag", "bag_cncard", "bag_pad"):
        for what, args, exc, match in (
                ("input.list", ([1, 2, 3], offs), TypeError, "^input must be a torch.Tensor"),
                ("input.float", (ids.float(), offs), TypeError, "^input must hold int64 or int32"),
                ("input.bool", (ids.bool(), offs), TypeError, "^input must hold int64 or int32"),
                ("input.int16", (ids.short(), offs), TypeError, "^input must hold int64 or int32"),
                ("input.uint8", (ids.to(torch.uint8), offs), TypeError, "^input must hold int64 or int32"),
                ("input.0d", (torch.tensor(1), offs), ValueError, "^input must be 1-D"),
                ("input.3d", (ids.reshape(1, 1, 3),), ValueError, "^input must be 1-D"),
                ("input.meta", (ids.to("meta"), offs), ValueError, "^input is a meta tensor.*expected input on the"),
                ("input.meta_2d", (ids.reshape(1, 3).to("meta"),), ValueError, "^input is a meta tensor"),
                ("offsets.missing", (ids,), ValueError, "^offsets is required"),
                ("offsets.with_2d", (ids.reshape(1, 3), offs), ValueError, "^offsets must be None"),
                ("offsets.list", (ids, [0, 2]), TypeError, "^offsets must be a torch.Tensor"),
                ("offsets.float", (ids, offs.float()), TypeError, "^offsets must hold int64 or int32"),
                ("offsets.2d", (ids, offs.reshape(1, 2)), ValueError, "^offsets must be 1-D"),
                ("offsets.meta", (ids, offs.to("meta")), ValueError, "^offsets is a meta tensor.*expected offsets"),
                ("offsets.decreasing", (ids, torch.tensor([0, 2, 1])), ValueError, "^offsets"),
                ("offsets.first_not_0", (ids, torch.tensor([1, 2])), ValueError, "^offsets"),
                ("offsets.past_end", (ids, torch.tensor([0, 5])), ValueError, "^offsets"),
                ("offsets.negative", (ids, torch.tensor([0, -1])), ValueError, "^offsets"),
                ("offsets.huge", (ids, torch.tensor([0, 2**62])), ValueError, "^offsets"),
                ("offsets.min_int", (ids, torch.tensor([0, -2**63])), ValueError, "^offsets"),
                ("offsets.empty", (ids, torch.tensor([], dtype=torch.int64)), ValueError, "^offsets"),
                ("psw.list", (ids, offs, [1.0] * 3), TypeError, "^per_sample_weights must be a floating point"),
                ("psw.int", (ids, offs, torch.ones(3, dtype=torch.int64)), TypeError, "^per_sample_weights must be"),
                ("psw.bool", (ids, offs, ones.bool()), TypeError, "^per_sample_weights must be a floating point"),
                ("psw.short", (ids, offs, torch.ones(2)), ValueError, "^per_sample_weights must have the shape"),
                ("psw.2d", (ids, offs, ones.reshape(3, 1)), ValueError, "^per_sample_weights must have the shape"),
                ("psw.2d_input", (ids.reshape(1, 3), None, torch.ones(3)), ValueError,
                 "^per_sample_weights must have the shape"),
                ("psw.meta", (ids, offs, ones.to("meta")), ValueError,
                 "^per_sample_weights is a meta tensor.*expected per_sample_weights")):
            add(f"{target}.{what}", target, lambda obj, other, args=args: obj(*args), exc, match)
    for what, offsets in (("empty", []), ("last_short", [0, 2]), ("last_past", [0, 4]), ("only_last", [3])):
        add(f"bag_last.offsets.{what}", "bag_last",
            lambda obj, other, o=offsets: obj(ids, torch.tensor(o, dtype=torch.int64)), ValueError, "^offsets")
    add("bag_max.psw", "bag_max", lambda obj, other: obj(ids, offs, ones), ValueError,
        "^per_sample_weights work with mode='sum' or 'mean'")

    # CNEmbedding forward
    for what, arg, exc, match in (
            ("list", [1, 2], TypeError, "^input must be a torch.Tensor"),
            ("float", torch.tensor([1.0]), TypeError, "^input must hold int64 or int32"),
            ("bool", torch.tensor([True]), TypeError, "^input must hold int64 or int32"),
            ("int8", torch.tensor([1], dtype=torch.int8), TypeError, "^input must hold int64 or int32"),
            ("meta", torch.tensor([1], device="meta"), ValueError, "^input is a meta tensor.*expected input on the")):
        add(f"emb.input.{what}", "emb", lambda obj, other, a=arg: obj(a), exc, match)

    # table methods
    for what, call, exc, match in (
            ("insert.float_ids", lambda o, x: o.insert(torch.tensor([1.0]), torch.ones(1, DIM)), TypeError, "^keys"),
            ("insert.rows_shape", lambda o, x: o.insert(torch.tensor([1]), torch.ones(2, DIM)), ValueError, "^rows"),
            ("insert.rows_width", lambda o, x: o.insert(torch.tensor([1]), torch.ones(1, DIM + 1)), ValueError,
             "^rows"),
            ("assign.rows_shape", lambda o, x: o.assign(torch.tensor([0, 1]), torch.ones(1, DIM)), ValueError,
             "^rows"),
            ("insert.int_rows", lambda o, x: o.insert(torch.tensor([1]), torch.ones(1, DIM, dtype=torch.int64)),
             TypeError, "^rows: expected float32"),
            ("insert.float64_rows", lambda o, x: o.insert(torch.tensor([1]), torch.ones(1, DIM).double()),
             TypeError, "^rows: expected float32"),
            ("insert.float_id_list", lambda o, x: o.insert([1.5], torch.ones(1, DIM)), TypeError, "^keys"),
            ("reserve.negative", lambda o, x: o.reserve(-1), ValueError, "^n_rows"),
            ("move_to.nowhere", lambda o, x: o.move_to("nowhere"), ValueError, "^device must be"),
            ("move_to.meta", lambda o, x: o.move_to("meta"), ValueError, "^moving this table to meta would drop"),
            ("to.meta", lambda o, x: o.to("meta"), ValueError, "^moving this table to meta would drop"),
            ("hook.fused", lambda o, x: o.register_gradient_hook(print), RuntimeError, "fused optimizer"),
            ("fused_optimizer.other_optimizer", lambda o, x: o.fused_optimizer.load_state_dict(
                {"optimizer": "SGD", "lr": 0.1, "step": 0}), ValueError, "^state_dict is for 'SGD'")):
        for target in ("bag", "bag_cncard"):
            if not (target == "bag_cncard" and what.startswith(("hook", "fused"))):
                add(f"{target}.{what}", target, call, exc, match)
    for what, call in (("num_rows", lambda o, x: o.num_rows), ("export", lambda o, x: o.export()),
                       ("insert", lambda o, x: o.insert(torch.tensor([1]), torch.ones(1, DIM))),
                       ("reserve", lambda o, x: o.reserve(10))):
        add(f"meta.{what}", "meta", call, RuntimeError, "^this table is on the meta device and holds no rows")
    for what, state, exc, match in (
            ("list", [], TypeError, "^state_dict must be a dict"),
            ("lr_str", {"optimizer": "Adam", "lr": "x", "step": 5}, ValueError, r"^state_dict\['lr'\]"),
            ("lr_nan", {"optimizer": "Adam", "lr": float("nan"), "step": 5}, ValueError, r"^state_dict\['lr'\]"),
            ("lr_negative", {"optimizer": "Adam", "lr": -1.0, "step": 5}, ValueError, r"^state_dict\['lr'\]"),
            ("step_missing", {"optimizer": "Adam", "lr": 0.1}, ValueError, r"^state_dict\['step'\]"),
            ("step_negative", {"optimizer": "Adam", "lr": 0.1, "step": -1}, ValueError, r"^state_dict\['step'\]"),
            ("step_float", {"optimizer": "Adam", "lr": 0.1, "step": 1.5}, ValueError, r"^state_dict\['step'\]")):
        add(f"bag.fused_optimizer.load_state_dict.{what}", "bag",
            lambda o, x, state=state: o.fused_optimizer.load_state_dict(state), exc, match)
    step_entry = r"^state_dict\['state'\]\['embedding_bags.fused'\]\['step'\] must be an int tensor"

    def keyed(step=None, drop=False):
        state = {"state": {"embedding_bags.fused": {} if drop else {"step": step}}}
        return lambda o, x: o.fused_optimizer.load_state_dict(state)
    for what, call, exc, match in (
            ("list", lambda o, x: o.fused_optimizer.load_state_dict([]), TypeError, "^state_dict must be a dict"),
            ("empty", lambda o, x: o.fused_optimizer.load_state_dict({}), ValueError, step_entry),
            ("step_missing", keyed(drop=True), ValueError, step_entry),
            ("step_negative", keyed(torch.tensor(-1)), ValueError, step_entry),
            ("step_float", keyed(torch.tensor(1.5)), ValueError, step_entry),
            ("step_str", keyed("x"), ValueError, step_entry),
            ("step_meta", keyed(torch.tensor(1, device="meta")), ValueError, step_entry)):
        add(f"ebc.fused_optimizer.load_state_dict.{what}", "ebc", call, exc, match)
    add("bag_hooks.register_gradient_hook.not_callable", "bag_hooks", lambda o, x: o.register_gradient_hook(5),
        TypeError, "^hook must be callable")

    # the collections' forward
    for target in ("ebc", "ec"):
        for what, call, exc, match in (
                ("dict", lambda o, x: o({"f": torch.tensor([1])}), TypeError, "^features must be a KeyedJaggedTensor"),
                ("none", lambda o, x: o(None), TypeError, "^features must be a KeyedJaggedTensor"),
                ("missing_key", lambda o, x: o(_kjt([1], [1], keys=("f",))), ValueError, "^features: no key 'g'"),
                ("float_values", lambda o, x: o(_kjt([1.0, 2.0], [1, 1])), TypeError, "^features: values must be"),
                ("bool_values", lambda o, x: o(_kjt([True, False], [1, 1])), TypeError, "^features: values must be"),
                ("2d_values", lambda o, x: o(_kjt([[1, 2]], [1, 1])), ValueError, "^features: values"),
                ("lengths_over", lambda o, x: o(_kjt([1, 2], [1, 5])), ValueError, "^features: lengths add up to 6"),
                ("lengths_under", lambda o, x: o(_kjt([1, 2, 3], [1, 1])), ValueError, "^features: lengths add up"),
                ("lengths_negative", lambda o, x: o(_kjt([1, 2, 3], [2, -1, 1, 1])), ValueError,
                 "^features: lengths must be >= 0"),
                ("offsets_decreasing", lambda o, x: o(KeyedJaggedTensor(
                    keys=["f", "g"], values=torch.tensor([1, 2, 3]), offsets=torch.tensor([0, 2, 1, 3, 3]))),
                 ValueError, "^features: lengths must be >= 0"),
                ("offsets_huge", lambda o, x: o(KeyedJaggedTensor(
                    keys=["f", "g"], values=torch.tensor([1, 2, 3]), offsets=torch.tensor([0, 2, 2**40, 3, 3]))),
                 ValueError, "^features: lengths must be >= 0"),
                ("offsets_not_from_0", lambda o, x: o(KeyedJaggedTensor(
                    keys=["f", "g"], values=torch.tensor([1, 2, 3]), offsets=torch.tensor([1, 2, 2, 3, 3]))),
                 ValueError, "^features: lengths add up"),
                ("uneven_stride", lambda o, x: o(_kjt([1, 2, 3], [1, 1, 1])), ValueError, "^features: 3 lengths"),
                ("meta_values", lambda o, x: o(_kjt(torch.tensor([1, 2], device="meta"), [1, 1])), ValueError,
                 "^features: values is a meta tensor"),
                ("meta_all", lambda o, x: o(KeyedJaggedTensor(keys=["f", "g"], values=torch.tensor(
                    [1, 2], device="meta"), lengths=torch.tensor([1, 1], device="meta"))), ValueError,
                 "^features: (values|lengths) is a meta tensor")):
            add(f"{target}.forward.{what}", target, call, exc, match)
    for what, call, exc, match in (
            ("no_weights", lambda o, x: o(_kjt([1, 2], [1, 1])), ValueError, "^features: is_weighted=True"),
            ("weights_short", lambda o, x: o(_kjt([1, 2], [1, 1], torch.ones(3))), ValueError,
             "^features: values \\(and weights\\)"),
            ("int_weights", lambda o, x: o(_kjt([1, 2], [1, 1], torch.ones(2, dtype=torch.int64))), TypeError,
             "^features: weights must be floating point"),
            ("meta_weights", lambda o, x: o(_kjt([1, 2], [1, 1], torch.ones(2, device="meta"))), ValueError,
             "^features: weights is a meta tensor")):
        add(f"ebc_w.forward.{what}", "ebc_w", call, exc, match)

    # load_state_dict: a catalogue of broken state_dicts, for a module and for a collection (where
    # the first table is valid and the second broken: neither may change)
    for target, cls, p in (("bag", "CNEmbeddingBag", ""), ("emb", "CNEmbedding", ""),
                           ("bag_cncard", "CNEmbeddingBag", ""), ("ebc", "CNEmbeddingBagCollection", "tables.u."),
                           ("ec", "CNEmbeddingCollection", "tables.u.")):
        head = STATE_ERROR.format(cls)
        for what, call, match in (
                ("keys.float", _with_entry(p + "keys", transform=lambda t: t.float()),
                 f"{p}keys: expected dtype torch.int64, got torch.float32"),
                ("keys.int32", _with_entry(p + "keys", transform=lambda t: t.int()), f"{p}keys: expected dtype"),
                ("keys.2d", _with_entry(p + "keys", transform=lambda t: t[None]), f"{p}keys: expected shape"),
                ("keys.duplicate", _with_entry(p + "keys", transform=lambda t: torch.cat([t[:1], t[:-1]])),
                 f"{p}keys: each key must appear once, 1 appear more than once"),
                ("keys.list", _with_entry(p + "keys", transform=lambda t: t.tolist()),
                 f"{p}keys: expected a tensor, got list"),
                ("keys.numpy", _with_entry(p + "keys", transform=lambda t: t.numpy()),
                 f"{p}keys: expected a tensor, got ndarray"),
                ("keys.meta", _with_entry(p + "keys", transform=lambda t: t.to("meta")), f"{p}keys: is a meta tensor"),
                ("keys.longer", _with_entry(p + "keys", transform=lambda t: torch.cat([t, t.max()[None] + 1])),
                 rf"{p}rows: expected shape \(\d+, 4\)"),
                ("rows.float64", _with_entry(p + "rows", transform=lambda t: t.double()), f"{p}rows: expected dtype"),
                ("rows.int", _with_entry(p + "rows", transform=lambda t: t.long()), f"{p}rows: expected dtype"),
                ("rows.width", _with_entry(p + "rows", transform=lambda t: t[:, :-1]), rf"{p}rows: expected shape"),
                ("rows.fewer", _with_entry(p + "rows", transform=lambda t: t[:-1]), rf"{p}rows: expected shape"),
                ("rows.1d", _with_entry(p + "rows", transform=lambda t: t.reshape(-1)), rf"{p}rows: expected shape"),
                ("rows.meta", _with_entry(p + "rows", transform=lambda t: t.to("meta")), f"{p}rows: is a meta tensor"),
                ("optimizer_state.fewer", _with_entry(p + "optimizer_state", transform=lambda t: t[:-1]),
                 f"{p}optimizer_state: expected shape"),
                ("optimizer_state.float64", _with_entry(p + "optimizer_state", transform=lambda t: t.double()),
                 f"{p}optimizer_state: expected dtype"),
                ("optimizer_state.wider", _with_entry(p + "optimizer_state", transform=lambda t: torch.cat([t, t], 1)),
                 f"{p}optimizer_state: holds \\d+ floats a row.*reset_optimizer_state"),
                ("counts.float", _with_entry(p + "counts", transform=lambda t: t.float()),
                 f"{p}counts: expected dtype"),
                ("counts.negative", _with_entry(p + "counts", transform=lambda t: t - 100),
                 rf"{p}counts: values must be in \[0, 2\*\*32\)"),
                ("counts.2**32", _with_entry(p + "counts", transform=lambda t: t + 2**32), f"{p}counts: values must"),
                ("counts.fewer", _with_entry(p + "counts", transform=lambda t: t[1:]), f"{p}counts: expected shape"),
                ("counts.bool", _with_entry(p + "counts", transform=lambda t: t > 0), f"{p}counts: expected dtype"),
                ("last_steps.negative", _with_entry(p + "last_steps", transform=lambda t: t - 2**40),
                 f"{p}last_steps: values must"),
                ("last_steps.huge", _with_entry(p + "last_steps", transform=lambda t: t + 2**62),
                 f"{p}last_steps: values must"),
                ("last_steps.more", _with_entry(p + "last_steps", transform=_dup_first),
                 f"{p}last_steps: expected shape"),
                ("step.negative", _with_entry(p + "step", value=torch.tensor(-1)), f"{p}step: must be >= 0, got -1"),
                ("step.float", _with_entry(p + "step", value=torch.tensor(1.5)), f"{p}step: expected dtype"),
                ("step.vector", _with_entry(p + "step", value=torch.tensor([1, 2])), rf"{p}step: expected shape \(\)"),
                ("step.int", _with_entry(p + "step", value=3), f"{p}step: expected a tensor, got int"),
                ("missing.keys", _with_entry(p + "keys", drop=True), f'Missing key\\(s\\) in state_dict: "{p}keys"'),
                ("missing.optimizer_state", _with_entry(p + "optimizer_state", drop=True),
                 f'Missing key\\(s\\) in state_dict: "{p}optimizer_state"'),
                ("unexpected_and_bad", lambda o, x, p=p: o.load_state_dict(
                    {**x.state_dict(), p + "keys": x.state_dict()[p + "keys"].float(), "nonsense": torch.ones(1)}),
                 f"Unexpected key\\(s\\) in state_dict: \"nonsense\".*\n\t{p}keys: expected dtype")):
            add(f"{target}.load_state_dict.{what}", target, call, RuntimeError, head + match)
        if not p:  # strict=False: a table with an entry missing is left as it is, and the entry reported
            add(f"{target}.load_state_dict.non_strict_missing_rows", target,
                _with_entry("rows", drop=True, strict=False), None, "missing_keys=\\['rows'\\]")
    for target, cls, source, p, match in (
            ("bag", "CNEmbeddingBag", "bag_sgd", "", "holds 0 floats a row, as SGD .or no optimizer. writes; this "
             "table's optimizer keeps 8 .Adam."),
            ("bag_sgd", "CNEmbeddingBag", "bag", "", "holds 8 floats a row, as Adam writes; this table's optimizer "
             "keeps 0"),
            ("bag", "CNEmbeddingBag", "bag_max", "", "holds 1 floats a row, as RowWiseAdagrad writes"),
            ("ebc", "CNEmbeddingBagCollection", "ebc_sgd", "tables.t.", "holds 0 floats a row, as SGD"),
            ("ebc_sgd", "CNEmbeddingBagCollection", "ebc", "tables.t.", "holds 8 floats a row, as Adam")):
        add(f"{target}.load_state_dict.from_{source}", target, _state_from(source), RuntimeError,
            STATE_ERROR.format(cls) + re.escape(p) + "optimizer_state: " + match)
    add("bag.load_state_dict.nn_embedding_bag", "bag", lambda o, x: o.load_state_dict(
        torch.nn.EmbeddingBag(10, DIM).state_dict()), RuntimeError,
        'Missing key\\(s\\).*Unexpected key\\(s\\).*"weight"')
    add("bag.load_state_dict.other_dim", "bag", lambda o, x: o.load_state_dict(
        _train(CNEmbeddingBag(50, DIM + 1, optimizer=cncore.Adam(lr=0.1)), 2).state_dict()), RuntimeError,
        STATE_ERROR.format("CNEmbeddingBag") + r"rows: expected shape \(\d+, 4\), got \(\d+, 5\)")
    add("meta.load_state_dict.rows", "meta", lambda o, x: o.load_state_dict(TARGETS["bag"](2).state_dict()),
        RuntimeError, "this table is on the meta device and holds no rows")
    add("bag.load_state_dict.not_a_mapping", "bag", lambda o, x: o.load_state_dict([1, 2]), TypeError,
        "Expected state_dict to be dict-like")
    # the first table valid, the second broken, in one collection: neither table may change
    add("ebc.load_state_dict.first_table_valid_second_broken", "ebc",
        _with_entry("tables.u.counts", transform=lambda t: t - 1000), RuntimeError,
        STATE_ERROR.format("CNEmbeddingBagCollection") + r"tables\.u\.counts: values must")

    # hypothesis: random offsets, KJT lengths, state_dict corruptions (one case each, many examples)
    for name in ("offsets", "kjt_lengths", "state_dict"):
        add(f"hypothesis.{name}", None, HYPOTHESIS[name], None, "")
    return cases


# --- hypothesis: random input against a model of what is valid -----------------------------------------

def _hyp_offsets(obj, other):
    from hypothesis import given, settings
    from hypothesis import strategies as st

    os.environ["CNCORE_CNCARD"] = "cpu"
    bags = {(last, device): CNEmbeddingBag(50, DIM, mode="sum", include_last_offset=last, device=device,
                                           optimizer=cncore.Adam(lr=0.1))
            for last in (False, True) for device in (None, "cncard")}  # the core checks offsets; PyTorch does not

    @settings(max_examples=200, derandomize=True, deadline=None, database=None)
    @given(n=st.integers(0, 6), last=st.booleans(), device=st.sampled_from([None, "cncard"]),
           offsets=st.lists(st.one_of(st.integers(-3, 8), st.sampled_from([2**62, -2**63, 2**63 - 1])), max_size=6),
           weighted=st.booleans())
    def check(n, last, device, offsets, weighted):
        bag = bags[last, device]
        ids = torch.arange(n) * 7 + 3
        off = torch.tensor(offsets, dtype=torch.int64)
        full = offsets + ([] if last else [n])
        valid = bool(full) and full[0] == 0 and full[-1] == n and all(a <= b for a, b in itertools.pairwise(full))
        w = torch.rand(n) if weighted else None
        before = snapshot(bag)
        try:
            out = bag(ids, off, w)
        except ValueError as exc:
            assert not valid, f"valid offsets {full} refused: {exc}"
            assert re.match("^offsets", str(exc)), str(exc)
            assert snapshot(bag) == before, "a refused forward changed the table"
            return
        assert valid, f"invalid offsets {full} accepted"
        table = bag.export()
        rows = table["rows"][[table["keys"].tolist().index(i) for i in ids.tolist()]]
        if w is not None:
            rows = rows * w[:, None]
        want = torch.stack([rows[a:b].sum(0) for a, b in itertools.pairwise(full)]) if len(full) > 1 else out
        torch.testing.assert_close(out, want.reshape(out.shape))
    check()


def _hyp_kjt_lengths(obj, other):
    from hypothesis import given, settings
    from hypothesis import strategies as st

    ebc = TARGETS["ebc"](1)

    @settings(max_examples=120, derandomize=True, deadline=None, database=None)
    @given(lengths=st.lists(st.integers(-2, 3), min_size=0, max_size=6), n_values=st.integers(0, 8))
    def check(lengths, n_values):
        valid = (len(lengths) % 2 == 0 and all(x >= 0 for x in lengths) and sum(lengths) == n_values)
        before = snapshot(ebc)
        try:
            kjt = _kjt(torch.arange(n_values), torch.tensor(lengths, dtype=torch.int64))
            out = ebc(kjt)
        except ValueError as exc:
            assert not valid, f"valid lengths {lengths} / {n_values} values refused: {exc}"
            assert re.match("^features: ", str(exc)), str(exc)
            assert snapshot(ebc) == before, "a refused forward changed the tables"
            return
        except Exception as exc:  # TorchRec's own KJT constructor: not ours to judge, but never ours to crash
            assert "features" not in str(exc) and not valid, repr(exc)
            return
        assert valid, f"invalid lengths {lengths} / {n_values} values accepted"
        assert out.values().shape == (len(lengths) // 2, 2 * DIM)
    check()


def _hyp_state_dict(obj, other):
    from hypothesis import given, settings
    from hypothesis import strategies as st

    target, source = TARGETS["bag"](1), TARGETS["bag"](2)
    good, start = source.state_dict(), target.state_dict()
    mutations = {
        "dtype": lambda t, v: t.to([torch.float64, torch.int32, torch.int64, torch.float32, torch.uint8][v % 5]),
        "drop_row": lambda t, v: t[1:] if t.dim() else t,
        "add_row": lambda t, v: torch.cat([t, t[:1]]) if t.dim() else t,
        "poke": lambda t, v: _poke(t, v),
        "transpose": lambda t, v: t.T if t.dim() == 2 else t[None],
    }

    @settings(max_examples=150, derandomize=True, deadline=None, database=None)
    @given(entry=st.sampled_from(["keys", "rows", "optimizer_state", "counts", "last_steps", "step"]),
           how=st.sampled_from(sorted(mutations)), value=st.integers(-2**63, 2**63 - 1))
    def check(entry, how, value):
        state = dict(good)
        state[entry] = mutations[how](good[entry].clone(), value)
        before = snapshot(target)
        try:
            target.load_state_dict(state)
        except RuntimeError as exc:
            # a changed length of keys is reported by the entries that no longer match it
            assert re.match(STATE_ERROR.format("CNEmbeddingBag") + "(keys|rows|optimizer_state|counts|last_steps"
                            "|step): ", str(exc)) and (entry in str(exc) or entry == "keys"), str(exc)
            assert snapshot(target) == before, "a refused load_state_dict changed the table"
            return
        fresh = CNEmbeddingBag(50, DIM, mode="sum", optimizer=cncore.Adam(lr=0.1))
        fresh.load_state_dict(state)
        assert snapshot(target) == snapshot(fresh), "the table is not what the state_dict holds"
        target.load_state_dict(start)  # back to the start for the next example
    check()


def _poke(t: torch.Tensor, v: int) -> torch.Tensor:
    """One value of t replaced by v (as t's dtype holds it: floats take v / 7)."""
    if t.numel() == 0:
        return t
    flat = t.reshape(-1).clone()
    flat[abs(v) % flat.numel()] = v / 7 if t.is_floating_point() else v
    return flat.reshape(t.shape)


HYPOTHESIS = {"offsets": _hyp_offsets, "kjt_lengths": _hyp_kjt_lengths, "state_dict": _hyp_state_dict}

CASES = build()
N_CASES = len(CASES)
# The catalogue as built for issue 9; raise it when cases are added, never lower it.
MIN_CASES = 437


# --- the worker: plays cases, one JSON line each ----------------------------------------------------

def play(cid: str) -> dict:
    case = CASES[cid]
    obj = TARGETS[case.target](1) if case.target else None
    other = TARGETS[case.target](2) if case.target and case.target != "meta" else None
    before = snapshot(obj)
    why = []
    try:
        result = case.call(obj, other)
    except Exception as exc:  # judged below: the type, the message, the tables
        if case.exc is None or not isinstance(exc, case.exc) or not re.search(case.match, str(exc), re.S):
            why.append(f"raised {type(exc).__name__}: {str(exc)[:600]}")
    else:
        if case.exc is not None:
            why.append(f"no {case.exc.__name__} raised (returned {result!r:.200})")
        elif not re.search(case.match, repr(result)):
            why.append(f"returned {result!r:.300}, expected /{case.match}/")
    after = snapshot(obj)
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    if changed:
        why.append(f"the tables changed: {changed}")
    return {"id": cid, "ok": not why, "why": "; ".join(why)}


def _worker() -> None:
    for cid in json.loads(sys.stdin.read()):
        try:
            record = play(cid)
        except AssertionError as exc:
            record = {"id": cid, "ok": False, "why": f"assertion: {str(exc)[:1500]}"}
        except Exception as exc:  # the harness itself must go on to the next case
            record = {"id": cid, "ok": False, "why": f"{type(exc).__name__} outside the call: {str(exc)[:600]}"}
        print("CASE " + json.dumps(record), flush=True)


# --- the tests ----------------------------------------------------------------------------------------

def _run(ids, timeout=240):
    """({id: record}, None or how the child died)."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    try:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__)], input=json.dumps(ids), text=True,
                              capture_output=True, timeout=timeout, env=env)
        out, death = proc.stdout, (None if proc.returncode == 0 else f"exit status {proc.returncode}; stderr: "
                                   f"{proc.stderr[-1500:]}")
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        death = f"hung (no result within {timeout} s)"
    records = {}
    for line in out.splitlines():
        if line.startswith("CASE "):
            record = json.loads(line[5:])
            records[record["id"]] = record
    return records, death


@pytest.fixture(scope="module")
def records():
    """Every case's record; a case that kills its process is recorded as such and the rest
    are played in a new one."""
    todo, done = list(CASES), {}
    while todo:
        got, death = _run(todo)
        done.update(got)
        todo = [cid for cid in todo if cid not in done]
        if todo:
            done[todo[0]] = {"id": todo[0], "ok": False, "why": f"the process died in this case: {death}"}
            todo = todo[1:]
    return done


def test_the_catalogue_is_as_large_as_built():
    assert N_CASES >= MIN_CASES, f"{N_CASES} cases, the harness had {MIN_CASES}"


@pytest.mark.parametrize("cid", list(CASES))
def test_bad_input_is_refused_naming_the_argument_and_changes_nothing(records, cid):
    record = records[cid]
    assert record["ok"], f"{cid}: {record['why']}"


if __name__ == "__main__":
    _worker()

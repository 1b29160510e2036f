"""A store inside a torch `state_dict`: keys, rows, optimizer state, counts, last steps, step.

Shared by the modules and the TorchRec collections, so every checkpoint carries a table the
same way. Loading is all or nothing: every table of a module is checked (and the module's other
entries loaded) before any table changes, so a refused `load_state_dict` leaves each table
exactly as it was. Under strict=False a table with an entry missing is left as it is (the
entry reported in `missing_keys`) and the complete ones load. Errors come out as torch
reports them:

>>> import torch, cncore
>>> from cncore_torch import CNEmbeddingBag
>>> sgd = CNEmbeddingBag(10, 4, optimizer=cncore.SGD(lr=0.1))
>>> sgd(torch.tensor([[1, 2]])).sum().backward()
>>> adam = CNEmbeddingBag(10, 4, optimizer=cncore.Adam(lr=0.1))
>>> try:
...     adam.load_state_dict(sgd.state_dict())
... except RuntimeError as e:
...     print(str(e).splitlines()[1].strip().split(";")[0])
optimizer_state: holds 0 floats a row, as SGD (or no optimizer) writes
>>> adam.num_rows                                    # refused: the table is as it was
0

To move rows to another optimizer, convert the checkpoint with `reset_optimizer_state`: rows,
counts, last steps and step are kept, the optimizer state starts afresh.

>>> adam.load_state_dict(reset_optimizer_state(sgd.state_dict(), adam))
<All keys matched successfully>
>>> adam.num_rows
2
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType

import numpy as np
import torch

import cncore
from cncore.tier import TieredStore
from cncore_torch.dcp import (
    FALLBACK_ENTRIES,
    ShardLayout,
    TableEntry,
    fallback_in_place,
    fallback_moved_error,
    ungather,
)

FIELDS = ("keys", "rows", "optimizer_state", "counts", "last_steps")
ENTRIES = FIELDS + ("step",)
# A table's fallback entries: the rows and their optimizer state, and a shard's count of them.
FALLBACK_WITH_COUNT = FALLBACK_ENTRIES + ("fallback_count",)


def export_tensors(store) -> dict:
    """keys, rows, optimizer_state, counts, last_steps of any row storage (cncore.storage) as
    CPU tensors."""
    batch = store.export()
    return {name: torch.from_numpy(np.asarray(getattr(batch, name), dtype=np.int64)
                                   if name in ("counts", "last_steps") else getattr(batch, name))
            for name in FIELDS}


def save_store(store: cncore.EmbeddingStore | TieredStore, destination: dict, prefix: str,
               shard: tuple[int, int, int] | None = None, group=None, fallback_entries: bool = False) -> None:
    """The store's entries under `prefix`; `shard` (rank, world size, run id): the place of a
    sharded table's shard, written as the entry `shard` (see `read_table`), among the ranks of
    process group `group`. The entries are `cncore_torch.dcp.TableEntry` tensors, which DCP
    writes as this rank's part of each table rather than as replicas.

    `fallback_entries` (a shard of a table whose shards may hold fallback rows: a fixed count
    or ``"auto"``): every rank writes fallback_rows and fallback_optimizer_state (0 rows where
    it holds none: an undecided or unsplit ``"auto"`` shard) as its part of one tensor of every
    rank's fallback rows, and fallback_count, its number of them, so that the ranks' entries
    match (DCP gathers each entry's row counts from every rank) and a load cuts the rows back
    per rank (`cncore_torch.dcp.ungather`)."""
    tensors = export_tensors(store)
    rank, world_size = (shard[0], shard[1]) if shard is not None else (0, 1)
    n_fallback = getattr(store, "fallback_rows", 0)  # (an undecided "auto" table: 0)
    shard_fallback = shard is not None and (fallback_entries or n_fallback > 0)
    layout = ShardLayout(len(tensors["keys"]), rank, world_size, group)
    for name, value in tensors.items():
        destination[prefix + name] = TableEntry(value, layout)
    per_rank: dict = {"step": torch.tensor(store.step, dtype=torch.int64)}
    save_evicted_count(store, per_rank, "")
    if shard is not None:
        per_rank["shard"] = torch.tensor(list(shard), dtype=torch.int64)
    if shard_fallback:
        per_rank["fallback_count"] = torch.tensor(n_fallback, dtype=torch.int64)
    for name, value in per_rank.items():  # one value a rank: stacked by DCP when sharded
        destination[prefix + name] = value if shard is None else TableEntry(value, layout, per_rank=True)
    if shard_fallback:
        save_shard_fallback(store, destination, prefix, ShardLayout(n_fallback, rank, world_size, group))
    else:
        save_fallback(store, destination, prefix)


def save_fallback(store, destination: dict, prefix: str) -> None:
    """A table's fallback rows (``StoreConfig.fallback_rows``) and their optimizer state, as the
    entries fallback_rows and fallback_optimizer_state (nothing without them)."""
    if not getattr(store, "fallback_rows", 0):
        return
    rows, state = store.export_fallback()
    destination[prefix + "fallback_rows"] = torch.from_numpy(rows)
    destination[prefix + "fallback_optimizer_state"] = torch.from_numpy(state)


def save_shard_fallback(store, destination: dict, prefix: str, layout: ShardLayout) -> None:
    """A shard's fallback rows and their optimizer state as `TableEntry` tensors at `layout`
    (this rank's part of every rank's fallback rows; (0, width) without them)."""
    if getattr(store, "fallback_rows", 0):
        rows, state = store.export_fallback()
    else:
        rows = np.zeros((0, store.config.dim), np.float32)
        state = np.zeros((0, store.config.state_floats), np.float32)
    destination[prefix + "fallback_rows"] = TableEntry(torch.from_numpy(rows), layout)
    destination[prefix + "fallback_optimizer_state"] = TableEntry(torch.from_numpy(state), layout)


# evicted_count: written for tables that evicted rows or have an eviction policy. shard: written
# by sharded modules, (rank, world size, run id) of the shard the entries hold: rank R of W holds
# only the keys R owns, and the run id (agreed by the ranks when the module is built) tells the
# ranks of one run from another's; with the step, it identifies a save. Both read when present.
# fallback_rows, fallback_optimizer_state: written for tables with fallback rows, required by them
# (a shard's may hold 0 rows: none). fallback_count: written by the shards of a table that may
# hold fallback rows, each rank's count (what a DCP load cuts the gathered rows by).
OPTIONAL_ENTRIES = ("evicted_count", "shard", "fallback_rows", "fallback_optimizer_state", "fallback_count")


def save_evicted_count(store: cncore.EmbeddingStore | TieredStore, destination: dict, prefix: str) -> None:
    if store.config.eviction is not None or store.evicted_count:
        destination[prefix + "evicted_count"] = torch.tensor(store.evicted_count, dtype=torch.int64)


def is_store_entry(key: str, prefix: str) -> bool:
    return key.startswith(prefix) and key[len(prefix):] in ENTRIES + OPTIONAL_ENTRIES


@dataclass(frozen=True)
class TableState:
    """One table's entries, checked: what `load` of a store (or device rows) takes."""
    keys: np.ndarray                        # (N,) int64, unique
    rows: np.ndarray                        # (N, dim) float32
    optimizer_state: np.ndarray             # (N, state_floats) float32
    counts: np.ndarray                      # (N,) int64 in [0, 2^32)
    last_steps: np.ndarray                  # (N,) int64 in [0, 2^32)
    step: int
    evicted_count: int | None = None     # a bounded table's count of evicted rows, when saved
    shard: tuple[int, int, int] | None = None  # (rank, world size, run id) of a shard, when saved
    fallback: tuple[np.ndarray, np.ndarray] | None = None  # fallback rows and their state, when the table has them

    @classmethod
    def from_export(cls, tensors: dict, step: int) -> TableState:
        """What `export()` returned (a table moving between placements)."""
        keys, rows, optimizer_state, counts, last_steps = (tensors[name].detach().cpu().contiguous().numpy()
                                                           for name in FIELDS)
        return cls(keys, rows, optimizer_state, counts, last_steps, step=step)

    def load_into(self, target) -> None:
        """Replace every row of `target` (an EmbeddingStore or DeviceRows) and its step; an
        undecided ``fallback_rows="auto"`` table takes the split of a checkpoint with fallback rows."""
        target.clear()
        if self.fallback is not None and getattr(target, "_split_pending", False):
            target.choose_split(len(self.fallback[0]))
        target.reserve(len(self.keys))
        state = self.optimizer_state if self.optimizer_state.shape[1] else None
        target.load(self.keys, self.rows, state, self.counts, self.last_steps)
        target.step = self.step
        if self.evicted_count is not None and hasattr(target, "evicted_count"):
            target.evicted_count = self.evicted_count
        if self.fallback is not None:
            target.load_fallback(*self.fallback)


def _optimizers_writing(width: int, dim: int) -> str:
    """Which optimizers leave `width` state floats a row on a table of width `dim`."""
    names = [cls.__name__ for cls in (cncore.SGD, cncore.Adagrad, cncore.RowWiseAdagrad, cncore.Adam)
             if cncore.StoreConfig(dim=dim, optimizer=cls(lr=0.1)).state_floats == width]
    names = [n + " (or no optimizer)" if n == "SGD" else n for n in names]
    return " or ".join(names) if names else "no cncore optimizer"


def read_table(state_dict, prefix: str, dim: int, state_floats: int, missing_keys: list[str],
               error_msgs: list[str], fallback_rows: int | str = 0) -> TableState | None:
    """The checked entries of the table under `prefix`, or None with the reasons appended to
    `missing_keys` / `error_msgs`. Checks everything the store's `load` would, and more
    (unique keys, the optimizer), so that loading a TableState cannot fail half way."""
    if fallback_rows == "auto":  # a table choosing its split: a checkpoint of one that chose fallback rows has them
        fallback_rows = held_fallback_rows(state_dict, prefix)
    missing = [prefix + name for name in ENTRIES + (FALLBACK_ENTRIES if fallback_rows else ())
               if prefix + name not in state_dict]
    if missing:
        missing_keys.extend(missing)
        return None
    errors: list[str] = []

    def tensor(name: str, dtypes: tuple[torch.dtype, ...], shape: tuple) -> torch.Tensor | None:
        key = prefix + name
        value = state_dict[key]
        if not isinstance(value, torch.Tensor):
            errors.append(f"{key}: expected a tensor, got {type(value).__name__}")
        elif value.is_meta:
            errors.append(f"{key}: is a meta tensor, which holds no values (load a checkpoint of a materialised "
                          "table)")
        elif value.dtype not in dtypes:
            errors.append(f"{key}: expected dtype {' or '.join(map(str, dtypes))}, got {value.dtype}")
        elif value.dim() != len(shape) or any(w is not None and g != w for g, w in zip(value.shape, shape)):
            errors.append(f"{key}: expected shape {_shape(shape)}, got {tuple(value.shape)}")
        else:
            return value.detach().cpu().contiguous()
        return None

    integers = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
    keys = tensor("keys", (torch.int64,), (None,))
    n = None if keys is None else keys.shape[0]
    rows = tensor("rows", (torch.float32,), (n, dim))
    counts = tensor("counts", integers, (n,))
    last_steps = tensor("last_steps", integers, (n,))
    step = tensor("step", integers, ())
    raw = state_dict[prefix + "optimizer_state"]
    if isinstance(raw, torch.Tensor) and raw.dim() == 2 and raw.shape[1] != state_floats:
        errors.append(f"{prefix}optimizer_state: holds {raw.shape[1]} floats a row, as "
                      f"{_optimizers_writing(raw.shape[1], dim)} writes; this table's optimizer keeps "
                      f"{state_floats} ({_optimizers_writing(state_floats, dim)}). To change the optimizer, "
                      "convert the state_dict with cncore_torch.state.reset_optimizer_state(state_dict, model): "
                      "rows are kept, the optimizer state starts afresh")
        state = None
    else:
        state = tensor("optimizer_state", (torch.float32,), (n, state_floats))
    if keys is not None and torch.unique(keys).numel() != n:
        values, seen = torch.unique(keys, return_counts=True)
        errors.append(f"{prefix}keys: each key must appear once, {int((seen > 1).sum())} appear more than once "
                      f"(e.g. {int(values[seen > 1][0])})")
    for name, value in (("counts", counts), ("last_steps", last_steps)):
        if value is not None and value.numel() and (int(value.min()) < 0 or int(value.max()) >= 2**32):
            errors.append(f"{prefix}{name}: values must be in [0, 2**32), got [{int(value.min())}, "
                          f"{int(value.max())}]")
    if step is not None and int(step) < 0:
        errors.append(f"{prefix}step: must be >= 0, got {int(step)}")
    evicted = None
    if prefix + "evicted_count" in state_dict:
        value = tensor("evicted_count", integers, ())
        if value is not None and int(value) < 0:
            errors.append(f"{prefix}evicted_count: must be >= 0, got {int(value)}")
        evicted = None if value is None else int(value)
    shard = None
    if prefix + "shard" in state_dict:
        value = tensor("shard", integers, (3,))
        if value is not None:
            rank, world_size, run = (int(v) for v in value)
            if not 0 <= rank < world_size:
                errors.append(f"{prefix}shard: (rank, world size, run id) must have 0 <= rank < world size, got "
                              f"{[rank, world_size, run]}")
            shard = (rank, world_size, run)
    fallback = None
    if fallback_rows:
        fb_rows = tensor("fallback_rows", (torch.float32,), (fallback_rows, dim))
        fb_state = tensor("fallback_optimizer_state", (torch.float32,), (fallback_rows, state_floats))
        if fb_rows is not None and fb_state is not None:
            fallback = (fb_rows.numpy(), fb_state.numpy())
    elif held_fallback_rows(state_dict, prefix):  # (a shard's 0-row entry: it holds none)
        errors.append(f"{prefix}fallback_rows: the checkpoint holds fallback rows and this table has none; build it "
                      f"with fallback_rows={len(state_dict[prefix + 'fallback_rows'])} to load them")
    if (errors or keys is None or rows is None or state is None or counts is None or last_steps is None
            or step is None or (fallback_rows and fallback is None)):  # (a tensor that is None has left its error)
        error_msgs.extend(errors)
        return None
    return TableState(keys.numpy(), rows.numpy(), state.numpy(),
                      counts.to(torch.int64).numpy(), last_steps.to(torch.int64).numpy(), int(step), evicted, shard,
                      fallback)


def held_fallback_rows(state_dict, prefix: str) -> int:
    """The fallback rows the state_dict holds of the table under `prefix` (0 without a 2-D
    fallback_rows entry: none, or a shard's empty one)."""
    entry = state_dict.get(prefix + "fallback_rows")
    return int(entry.shape[0]) if isinstance(entry, torch.Tensor) and entry.dim() == 2 else 0


def _shape(shape) -> str:
    return "(" + ", ".join("N" if s is None else str(s) for s in shape) + (",)" if len(shape) == 1 else ")")


# What a module says about each of its tables, by state_dict prefix: its config, and the
# function that replaces its rows (in place, so that operator handles, pending lookups and the
# user's references to the store stay valid).
TableSpec = tuple[cncore.StoreConfig, Callable[[TableState], None]]


def load_tables(tables: dict[str, TableSpec], load_rest: Callable, state_dict, missing_keys: list,
                unexpected_keys: list, error_msgs: list) -> None:
    """A module's `_load_from_state_dict`: the entries that are not tables go to `load_rest`
    (torch's own loading of the module's parameters), every table is read and checked, and the
    tables are replaced only when torch will not refuse the load for what is known by now: no
    error, and under strict=True nothing missing or unexpected (torch raises for those only
    after every module has loaded). A table with an entry missing is never loaded."""
    errors: list[str] = []
    rest = {k: v for k, v in state_dict.items() if not any(is_store_entry(k, p) for p in tables)}
    load_rest(rest, missing_keys, unexpected_keys, errors)
    refused = set()
    for prefix, (_, write) in tables.items():  # a DCP load's whole tables: this rank's view of them
        entries, problems = ungather(state_dict, prefix, getattr(write, "place", (0, 1)))
        if entries:
            state_dict = {**state_dict, **entries}
        if problems:
            errors.extend(problems)
            refused.add(prefix)
    states = {prefix: None if prefix in refused else
              read_table(state_dict, prefix, config.dim, config.state_floats, missing_keys, errors,
                         config.fallback_rows or 0)  # (None, the default unresolved: no fallback rows)
              for prefix, (config, _) in tables.items()}
    for prefix, (config, write) in tables.items():
        state = states[prefix]
        # Entries of one rank's shard (of W > 1) hold only the keys that rank owns: they are
        # the whole table only for that rank of W (merge_shards joins every rank's into one).
        place = getattr(write, "place", (0, 1))
        if state is not None and state.shard is not None and state.shard[1] > 1 and state.shard[:2] != place:
            r, w = state.shard[:2]
            errors.append(f"{prefix}shard: these entries are rank {r}'s shard of a table split over {w} ranks (the "
                          f"keys rank {r} owns); this table is rank {place[0]} of {place[1]}, so loading them would "
                          f"leave out the other ranks' rows. Merge every rank's state_dict with "
                          f"cncore_torch.distributed.merge_shards first (or load each rank its own state_dict on "
                          f"{w} ranks)")
            states[prefix] = state = None
        if state is not None and state.fallback is not None and len(state.fallback[0]) \
                and not fallback_in_place(state.shard, place):
            errors.append(fallback_moved_error(prefix, len(state.fallback[0]), state.shard, place))
            states[prefix] = state = None
        # A writer may keep only some of the rows (a shard keeps the keys its rank owns).
        kept = getattr(write, "rows_kept", len)(state.keys) if state is not None else 0
        max_rows = config.max_rows
        if config.fallback_rows == "auto" and state is not None and state.fallback is not None:
            # the split the checkpoint's table chose (load_into restores it)
            max_rows = (config.max_rows or 0) - len(state.fallback[0])
            if max_rows < 1:
                errors.append(f"{prefix}fallback_rows: holds {len(state.fallback[0])} fallback rows, this table's "
                              f"max_rows is {config.max_rows}: a split leaves at least one keyed row")
                states[prefix] = None
                continue
        if max_rows is not None and kept > max_rows:
            errors.append(f"{prefix}keys: holds {kept} rows for this table, more than its max_rows "
                          f"({max_rows}); loading them would evict some at once. Build the module with a "
                          "max_rows of at least that, or prune the checkpoint first")
            states[prefix] = None
    error_msgs.extend(errors)
    if error_msgs or (_strict_load() and (missing_keys or unexpected_keys)):
        return
    for prefix, state in states.items():
        if state is not None:
            tables[prefix][1](state)


def drop_fallback_rows(state_dict) -> dict:
    """A copy of `state_dict` without fallback rows: every table's fallback_rows,
    fallback_optimizer_state and fallback_count entries left out. What loads a checkpoint of
    tables with fallback rows at another world size, or merges its shards (`merge_shards`),
    where the trained fallback rows cannot be placed exactly: the keyed rows load as they were;
    a ``fallback_rows="auto"`` table (the default) chooses its split again when it fills. A
    table built with a fixed ``fallback_rows=N`` needs the entries: it reports them missing
    and is left as it is.

    >>> import torch, cncore
    >>> from cncore_torch import CNEmbeddingBag
    >>> bag = CNEmbeddingBag(10, 2, optimizer=cncore.SGD(lr=0.1), max_rows=4, fallback_rows=2)
    >>> [k for k in bag.state_dict() if k.startswith("fallback")], [k for k in drop_fallback_rows(bag.state_dict())
    ...                                                               if k.startswith("fallback")]
    (['fallback_rows', 'fallback_optimizer_state'], [])
    """
    tables = {k[:-len("keys")] for k in state_dict if k.endswith("keys")}
    return {k: v for k, v in state_dict.items()
            if not any(k.startswith(p) and k[len(p):] in FALLBACK_WITH_COUNT for p in tables)}


def _strict_load() -> bool:
    """The `strict` of the running `Module.load_state_dict`. torch hands every
    `_load_from_state_dict` strict=True and applies the caller's `strict` only after all modules
    have loaded, so a table that must stay as it was when the load is then refused for a
    missing or unexpected key reads it from that call's frame. Outside such a call: True."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is torch.nn.Module.load_state_dict.__code__:
            return bool(frame.f_locals.get("strict", True))
        frame = frame.f_back
    return True


def reset_optimizer_state(state_dict, model: torch.nn.Module) -> dict:
    """A copy of `state_dict` whose tables' optimizer state is the initial state of `model`'s
    optimizers: how to load rows trained with one optimizer into tables with another (rows,
    counts, last steps and step are kept; Adam, say, starts from zero moments at the saved step).

    >>> import torch, cncore
    >>> from cncore_torch import CNEmbedding
    >>> old = CNEmbedding(10, 2, optimizer=cncore.Adam(lr=0.1)); _ = old(torch.tensor([3]))
    >>> new = CNEmbedding(10, 2, optimizer=cncore.RowWiseAdagrad(lr=0.1, initial_accumulator_value=0.5))
    >>> _ = new.load_state_dict(reset_optimizer_state(old.state_dict(), new))
    >>> new.export()["optimizer_state"].tolist()
    [[0.5]]
    """
    out = dict(state_dict)
    for name, module in model.named_modules():
        tables = getattr(module, "_tables", None)
        for prefix, (config, _) in (tables(name + "." if name else "") if tables else {}).items():
            keys = out.get(prefix + "keys")
            if isinstance(keys, torch.Tensor) and prefix + "optimizer_state" in out:
                opt = config.optimizer
                out[prefix + "optimizer_state"] = torch.full((keys.shape[0], config.state_floats),
                                                             float(opt.initial_state) if opt else 0.0)
    return out

"""Dynamic tables in `torch.distributed.checkpoint` (DCP).

Layout
------
A rank's state_dict holds its shard of each table as plain tensors (``tables.<name>.keys``,
``rows``, ...), the layout `torch.save`, `merge_shards` and `load_state_dict` read. DCP, given
the same plain tensors under the same names on every rank, takes them for replicas and writes
one rank's. So the table entries are `TableEntry` tensors: plain tensors in every operation
(each op returns a plain `torch.Tensor`; `torch.save` and pickling write a plain tensor) that
tell DCP where they sit in one global tensor (DCP's `__create_write_items__` protocol, which
DTensor implements too):

- the row fields (keys, rows, optimizer_state, counts, last_steps) are rank r's rows of one
  global tensor of every rank's rows, at row offset ``sum of the row counts of ranks < r``;
- the per-rank fields of a sharded table (step, evicted_count, shard, fallback_count) are row r
  of a global tensor of one row per rank;
- a shard's fallback rows and their optimizer state (fallback_rows, fallback_optimizer_state) are
  rank r's rows of one global tensor of every rank's fallback rows, as the row fields are (every
  rank of a table that may hold them writes them, 0 rows where it holds none, so that each rank
  gathers the same counts); fallback_count says how many are rank r's.

The row counts come from one all-gather per table while DCP plans the save (`dcp.save` is a
collective; `state_dict()` itself stays local), or, under `dcp.async_save`, while its stager
copies the state_dict (on the thread that stages, so the thread that writes sends nothing of
ours beside the training's collectives). DCP's own checks then see the shards cover each
global tensor, and its metadata records every rank's chunk. An unsharded table (world size 1)
in a save of several ranks is refused: DCP would keep one rank's rows. `dcp.async_save` copies
the state_dict first (its stager); the copies are entries in the same place (`TableEntry`),
with the default stager, a `DefaultStager` of any options, a `FileSystemWriter` staging itself,
and in the checkpoint process (`AsyncCheckpointerType.PROCESS`, which gets the counts pickled).

Loading
-------
A fresh model does not know how many rows a checkpoint holds, and DCP loads into tensors of
the saved size. `CNLoadPlanner` (pass it to `dcp.load`; DCP's default planner is refused, naming
it, before anything is read) reads the sizes from the checkpoint's metadata, refuses a
checkpoint whose chunks leave rows out, and loads each table whole (every saved rank's rows,
and the per-rank fields stacked). `load_state_dict` then keeps the rows each
rank owns at its world size (`ungather`), as it does for `merge_shards`' whole tables, so a
checkpoint written by N ranks loads into M. Shards' fallback rows are the exception: a key reads
the fallback row of the shard that owns it, so at the saved world size each rank takes its own
back (cut by fallback_count), and at another a checkpoint whose shards hold some is refused by
name before anything changes (`fallback_in_place`).

torch's state_dict helpers work as with any module: `get_state_dict` / `get_model_state_dict`
return the model's state_dict (they walk every key as module attributes; a table's entries are
not attributes, and `EntryPaths`, through torch's `_fqn_modifiers` hook, tells them where the
entries sit), and `set_state_dict` loads it with an optimizer's. Their
`StateDictOptions(full_state_dict=True)` gathers DTensors only: on a table sharded over several
ranks it would return each rank's shard as if it were the whole table, so it is refused by name
there (each rank's shard saves with DCP as above; `merge_shards` makes whole tables).

>>> import tempfile, torch, cncore
>>> import torch.distributed.checkpoint as dcp
>>> from torchrec import EmbeddingBagConfig
>>> from cncore_torch import CNEmbeddingBagCollection
>>> def make():
...     tables = [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=100, feature_names=["f"])]
...     return CNEmbeddingBagCollection(tables, optimizer=cncore.Adagrad(lr=0.1))
>>> ebc = make()
>>> _ = ebc.stores["t"].find_or_insert(torch.tensor([3, 7, 11]).numpy())
>>> path = tempfile.mkdtemp()
>>> _ = dcp.save({"model": ebc.state_dict()}, checkpoint_id=path, no_dist=True)
>>> fresh = make()
>>> state = {"model": fresh.state_dict()}
>>> dcp.load(state, checkpoint_id=path, planner=CNLoadPlanner(), no_dist=True)
>>> fresh.load_state_dict(state["model"])
<All keys matched successfully>
>>> sorted(fresh.stores["t"].export().keys.tolist())
[3, 7, 11]
"""
from __future__ import annotations

import copy
import sys
import warnings
from multiprocessing.reduction import ForkingPickler
from types import CodeType, FrameType
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, create_default_local_load_plan
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import _get_model_state_dict
from torch.distributed.checkpoint.state_dict_saver import _save_state_dict

from cncore.store_fallback import unplaceable_fallback_error

__all__ = ["CNLoadPlanner", "CNStager", "EntryPaths", "TableEntry", "ShardLayout", "ungather"]

# The entries of a table that hold one value per rank (stacked in a DCP checkpoint).
PER_RANK = ("step", "evicted_count", "shard", "fallback_count")
FALLBACK_ENTRIES = ("fallback_rows", "fallback_optimizer_state")


def _refuse_full_state_dict_of_shards(world_size: int) -> None:
    """torch's `get_state_dict` / `get_model_state_dict` with `full_state_dict=True` gather
    DTensors and ShardedTensors; a sharded table's entries are this rank's rows in plain tensors,
    which they would hand back as the whole table: refused by name from the `state_dict()` call
    they make (a layout is made once per table), for a table over several ranks only."""
    if world_size <= 1:
        return
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        if frame.f_code is _GET_MODEL_STATE_DICT:
            if getattr(frame.f_locals.get("info"), "full_state_dict", False):
                raise ValueError(
                    f"get_state_dict / get_model_state_dict(options=StateDictOptions(full_state_dict=True)) on a "
                    f"dynamic table sharded over {world_size} ranks would return this rank's shard as the whole "
                    f"table: take the sharded state_dict (full_state_dict=False, the default) and save it with "
                    f"torch.distributed.checkpoint.save, or make whole tables with cncore_torch.merge_shards")
            return
        frame = frame.f_back


class _EntryPath:
    """What a table entry's key resolves to, past its module, when torch's state_dict helpers
    walk the key as attributes (`EntryPaths`): itself, for any name."""

    def __getattr__(self, name: str) -> _EntryPath:
        if name.startswith("__"):
            raise AttributeError(name)
        return self

    def _fqn_modifiers(self) -> dict[str, str]:
        return {}


class EntryPaths:
    """A module whose state_dict holds table entries under the names `_entry_roots` (the key's
    first part after the module's prefix: ``tables`` for ``tables.<name>.keys``).

    torch's `get_state_dict` / `get_model_state_dict` map each state_dict key to its module
    path by `getattr` on every part (`torch.distributed.checkpoint.state_dict._get_fqns`), and a
    table's entries are not attributes. Their `_fqn_modifiers` hook lets a module redirect a
    name to an attribute of its own; ours redirect the entry roots to an object that answers any
    name, so the key maps to itself. The module's own attributes are untouched (no `keys`,
    `rows` or `step` attribute appears on a module).

    >>> import torch
    >>> from torch.distributed.checkpoint.state_dict import get_model_state_dict
    >>> from cncore_torch import CNEmbeddingBag
    >>> bag = CNEmbeddingBag(10, 4)
    >>> _ = bag(torch.tensor([3, 7]), torch.tensor([0]))
    >>> sorted(get_model_state_dict(torch.nn.Sequential(bag))["0.keys"].tolist())
    [3, 7]
    """

    _entry_roots: tuple[str, ...] = ("tables",)
    _dcp_entry_path = _EntryPath()

    def _fqn_modifiers(self) -> dict[str, str]:
        return dict.fromkeys(self._entry_roots, "_dcp_entry_path")


class ShardLayout:
    """Where one rank's shard of one table sits among the ranks: its row count, rank, world
    size and process group; `row_counts` gathers every rank's count once, when DCP asks.

    Args:
        rows (int): this rank's row count.
        rank (int): this rank, in [0, world_size).
        world_size (int): how many ranks share the table.
        group: the process group of the ranks (None: the default group).
    """

    def __init__(self, rows: int, rank: int = 0, world_size: int = 1, group: Any = None) -> None:
        _refuse_full_state_dict_of_shards(world_size)
        self.rows, self.rank, self.world_size, self.group = rows, rank, world_size, group
        self._counts: list[int] | None = None

    def row_counts(self) -> list[int]:
        """Every rank's row count (an all-gather over the group when world_size > 1)."""
        if self._counts is None:
            if self.world_size == 1:
                self._counts = [self.rows]
            else:
                gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
                dist.all_gather(gathered, torch.tensor([self.rows], dtype=torch.int64), group=self.group)
                self._counts = [int(c) for c in gathered]
        return self._counts

    def __deepcopy__(self, memo) -> ShardLayout:
        # Only a stager copies a layout (an entry's copy shares it): the counts are gathered now,
        # on the thread that stages, not later on the thread that writes beside the training's.
        self.row_counts()
        return self  # holds a process group, which is not copied; the counts are the same

    def __reduce__(self):
        # Pickled for the process `async_save(async_checkpointer_type=PROCESS)` saves from, with
        # the counts the stager gathered; without them it gathers over its only group, the default one.
        if self._counts is None and self.world_size > 1 and self.group is not None \
                and self.group is not dist.group.WORLD:
            raise ValueError(f"a table sharded over a process group of its own ({self.world_size} ranks, not the "
                             f"default group) cannot be saved from async_save's checkpoint process, which only has "
                             f"the default group; use async_save(..., async_checkpointer_type="
                             f"AsyncCheckpointerType.THREAD) (the default) or dcp.save")
        return _layout_in_process, (self.rows, self.rank, self.world_size, self._counts)


def _layout_in_process(rows: int, rank: int, world_size: int, counts: list[int] | None) -> ShardLayout:
    layout = ShardLayout(rows, rank, world_size)
    layout._counts = counts
    return layout


class TableEntry(torch.Tensor):
    """A plain tensor (operations return a `torch.Tensor`, pickling writes one) that DCP writes
    as rank `layout.rank`'s part of a global tensor (see the module docstring). The copies a
    checkpoint stager makes stay entries: `new_empty`, `empty_like`, `zeros_like`, `clone`,
    `detach`, `to`, `cpu`, `contiguous`, `pin_memory` return one with the same place, and
    `dest.copy_(entry)` makes `dest` one (so `async_save`'s stagers, which copy the state_dict
    into CPU buffers, keep every rank's rows).

    Args:
        data (Tensor): this rank's entry; shared, not copied.
        layout (ShardLayout): where the rank's rows sit.
        per_rank (bool): one value per rank (step, evicted_count, shard) rather than rows.

    Example::

        entry = TableEntry(torch.zeros(3, 4), ShardLayout(3))
        assert type(entry * 2) is torch.Tensor and isinstance(entry.clone(), TableEntry)
    """

    cn_layout: ShardLayout
    cn_per_rank: bool

    @staticmethod
    def __new__(cls, data: torch.Tensor, layout: ShardLayout, per_rank: bool = False) -> TableEntry:
        entry = torch.Tensor._make_subclass(cls, data, False)
        entry.cn_layout, entry.cn_per_rank = layout, per_rank
        return entry

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SIZE:
            caller = sys._getframe(1)
            if caller.f_code is _DEFAULT_LOAD_PLAN:
                # DCP's default load planner sizes the load by the fresh table's entries, before it reads
                raise ValueError(f"{caller.f_locals.get('fqn')}: {_NEEDS_PLANNER}")
        if func is _COPY and len(args) > 1 and isinstance(args[1], TableEntry) \
                and type(args[0]) in (torch.Tensor, TableEntry):
            return _copy_into(args[0], args[1], kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if func in _COPIES and isinstance(out, torch.Tensor) and isinstance(args[0], TableEntry):
            return TableEntry(out, args[0].cn_layout, args[0].cn_per_rank)
        return out

    def __reduce_ex__(self, protocol):
        return torch.Tensor(self.as_subclass(torch.Tensor)).__reduce_ex__(protocol)

    def __deepcopy__(self, memo) -> TableEntry:
        return TableEntry(copy.deepcopy(self.as_subclass(torch.Tensor), memo), self.cn_layout, self.cn_per_rank)

    def _place(self) -> tuple[torch.Size, torch.Size, torch.Tensor] | None:
        """(global size, this chunk's offsets, this chunk) or None when this rank writes nothing."""
        local = self.as_subclass(torch.Tensor)
        layout = self.cn_layout
        if self.cn_per_rank:
            chunk = local.reshape(1, *local.shape)
            return (torch.Size([layout.world_size, *local.shape]),
                    torch.Size([layout.rank] + [0] * local.dim()), chunk)
        counts = layout.row_counts()
        total, offset = sum(counts), sum(counts[:layout.rank])
        # An empty chunk would share its offset with the next rank's and be taken for a replica;
        # only rank 0 writes one, when every rank is empty (so the entry is in the checkpoint).
        if local.shape[0] == 0 and (total or layout.rank):
            return None
        return torch.Size([total, *local.shape[1:]]), torch.Size([offset] + [0] * (local.dim() - 1)), local

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        if self.cn_layout.world_size == 1:
            _refuse_unsharded_in_ranks(fqn)
        place = self._place()
        if place is None:
            return []
        size, offsets, chunk = place
        return [WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=offsets, sizes=chunk.shape),
                              properties=TensorProperties.create_from_tensor(chunk), size=size))]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        # TypeError: DCP turns a ValueError from here into its own message, which loses the fix
        raise TypeError(_NEEDS_PLANNER)

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        place = self._place()
        if place is None or index.offset != place[1]:
            raise ValueError(f"{index.fqn}: this rank holds no chunk at {index.offset}")
        return place[2]


_SIZE = torch.Tensor.size
_GET_MODEL_STATE_DICT = getattr(_get_model_state_dict, "__wrapped__", _get_model_state_dict).__code__  # (no_grad)
_COPY = torch.Tensor.copy_
_DEFAULT_LOAD_PLAN = create_default_local_load_plan.__code__
_SAVE_LOCAL_STEP = next((c for c in _save_state_dict.__code__.co_consts
                         if isinstance(c, CodeType) and c.co_name == "local_step"), None)
# The operations a stager copies an entry with: their result is the entry's copy, in the same place.
_COPIES = frozenset({torch.Tensor.new_empty, torch.empty_like, torch.zeros_like, torch.Tensor.clone, torch.clone,
                     torch.Tensor.detach, torch.detach, torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.contiguous,
                     torch.Tensor.pin_memory})
_NEEDS_PLANNER = ("a dynamic table's entries load with torch.distributed.checkpoint.load(..., "
                  "planner=cncore_torch.dcp.CNLoadPlanner()): a fresh table does not know the checkpoint's row "
                  "count; nothing was loaded")


def _copy_into(dest: torch.Tensor, entry: TableEntry, kwargs: dict) -> TableEntry:
    """`dest.copy_(entry)`, and `dest` becomes an entry in the same place: a stager's CPU buffer
    then saves as this rank's part of the table, not as a replica."""
    if dest.shape != entry.shape:
        raise ValueError(f"copying a dynamic table's entry of shape {tuple(entry.shape)} into a buffer of shape "
                         f"{tuple(dest.shape)}: the table's row count is not the buffer's (a stager that caches its "
                         f"buffers, e.g. BlockingAsyncStager(cache_staged_state_dict=True), holds an earlier save's "
                         f"row count); stage without a cache, e.g. with async_save's default stager")
    entry.cn_layout.row_counts()  # gathered while staging (see ShardLayout.__deepcopy__)
    with torch._C.DisableTorchFunctionSubclass():
        dest.copy_(entry, **kwargs)
    dest.__class__ = TableEntry
    dest.cn_layout, dest.cn_per_rank = entry.cn_layout, entry.cn_per_rank  # type: ignore[attr-defined]
    return dest  # type: ignore[return-value]


def _rebuild_entry(data: torch.Tensor, layout: ShardLayout, per_rank: bool) -> TableEntry:
    return TableEntry(data, layout, per_rank)


def _reduce_for_process(entry: TableEntry):
    return _rebuild_entry, (entry.as_subclass(torch.Tensor), entry.cn_layout, entry.cn_per_rank)


# Sent to async_save's checkpoint process (AsyncCheckpointerType.PROCESS) as an entry, where
# torch.save and pickle write a plain tensor.
ForkingPickler.register(TableEntry, _reduce_for_process)


def _refuse_unsharded_in_ranks(fqn: str) -> None:
    """An unsharded table (each rank's its own, `per_rank_tables=True`) in a DCP save of several
    ranks: DCP takes the ranks' entries for replicas and keeps one rank's rows, so it is refused
    while DCP plans the save (its `local_step` holds the save's `_DistWrapper`)."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None and frame.f_code is not _SAVE_LOCAL_STEP:
        frame = frame.f_back
    wrapper = frame.f_locals.get("distW") if frame is not None else None
    if wrapper is None or not wrapper.use_dist:
        return
    ranks = dist.get_world_size(wrapper.group)
    if ranks > 1:
        raise ValueError(f"{fqn}: an unsharded table saved by {ranks} ranks into one checkpoint, where DCP would keep "
                         f"one rank's rows: shard it (CNEmbeddingBagCollectionSharder / "
                         f"CNEmbeddingCollectionSharder), or save each rank's tables to a checkpoint of its own with "
                         f"dcp.save(..., checkpoint_id=<one per rank>, no_dist=True); nothing was written")


def check_chunks(fqn: str, md: TensorStorageMetadata) -> None:
    """The chunks a checkpoint holds of a table entry cover it whole: row ranges, each the full
    width, that tile [0, rows) with no gap (ValueError naming the rows missing otherwise)."""
    size = list(md.size)
    if not size:
        return
    spans = []
    for chunk in md.chunks:
        if list(chunk.offsets[1:]) != [0] * (len(size) - 1) or list(chunk.sizes[1:]) != size[1:]:
            raise ValueError(f"{fqn}: the checkpoint holds a chunk at {list(chunk.offsets)} of size "
                             f"{list(chunk.sizes)}, not whole rows of a table entry of size {size}; it was not "
                             f"written by a dynamic table; nothing was loaded")
        spans.append((chunk.offsets[0], chunk.offsets[0] + chunk.sizes[0]))
    at = 0
    for start, end in sorted(spans):
        if start > at:
            break
        at = max(at, end)
    if at < size[0] or (all(size) and not spans):
        gap = next((f"[{at}, {s})" for s, _ in sorted(spans) if s > at), f"[{at}, {size[0]})")
        raise ValueError(f"{fqn}: the checkpoint holds {size[0]} rows but no chunk covers rows {gap}: a rank's "
                         f"shard is missing from it; load a complete checkpoint; nothing was loaded")


class CNLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, which also loads dynamic tables whole: each `TableEntry` of
    the state_dict is replaced by a tensor of the checkpoint's size (every saved rank's rows)
    after checking that the checkpoint holds all of it. Pass it to `dcp.load`, then hand the
    state_dict to `load_state_dict`, which keeps the rows each rank owns.

    Args:
        **kwargs: DefaultLoadPlanner's (flatten_state_dict, allow_partial_load, ...).

    Example::

        state = {"model": model.state_dict()}
        dcp.load(state, checkpoint_id=path, planner=CNLoadPlanner())
        model.load_state_dict(state["model"])
    """

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        if metadata is None:
            return
        for fqn, value in list(self.state_dict.items()):
            md = metadata.state_dict_metadata.get(fqn)
            if md is None and isinstance(value, TableEntry) and fqn.rsplit(".", 1)[-1] in FALLBACK_ENTRIES:
                self._drop(fqn)  # a shard's fallback rows the checkpoint lacks (it was saved without them)
                continue
            if md is None:
                continue  # an entry the checkpoint lacks: DCP's own check names it
            if fqn.rsplit(".", 1)[-1] in FALLBACK_ENTRIES and isinstance(md, TensorStorageMetadata) \
                    and not isinstance(value, TableEntry):
                # a whole table's fallback rows: loaded whole, whatever this table holds (a shard's
                # are every rank's, cut by ungather; a count that differs is refused by name
                # when the table loads, not read in part)
                self._replace(fqn, torch.empty(md.size, dtype=md.properties.dtype))
                continue
            if isinstance(value, torch.Tensor) and isinstance(md, TensorStorageMetadata) and not value.numel() \
                    and not all(md.size) and value.shape != md.size:
                # An empty tensor of another shape (a collection's (0, 1) anchor, a sharded one's
                # (0,)) holds no values to load; the module's own load takes either shape.
                self._replace(fqn, torch.empty(md.size, dtype=value.dtype))
                continue
            if not isinstance(value, TableEntry):
                continue
            if not isinstance(md, TensorStorageMetadata):
                raise ValueError(f"{fqn}: the checkpoint holds a {type(md).__name__} here, not a table entry; "
                                 f"nothing was loaded")
            check_chunks(fqn, md)
            self._replace(fqn, torch.empty(md.size, dtype=md.properties.dtype))
            if fqn.endswith(".keys"):
                self._per_rank_entries(fqn[:-len("keys")], metadata)

    def _per_rank_entries(self, prefix: str, metadata: Metadata) -> None:
        """A table's step, evicted_count and shard as the checkpoint holds them, whichever module
        saved it and whichever loads it: stacked per saved rank (a sharded save) or one value (a
        plain collection's); entries the checkpoint lacks are left out, entries only it holds
        are added, so `load_state_dict` sees the saved table."""
        keys_path = self.mappings.get(prefix + "keys") if self.flatten_state_dict else None
        for name in PER_RANK:
            fqn, md = prefix + name, metadata.state_dict_metadata.get(prefix + name)
            if isinstance(md, TensorStorageMetadata):
                self._replace(fqn, torch.empty(md.size, dtype=md.properties.dtype), keys_path, name)
            elif fqn in self.state_dict:
                self._drop(fqn)
        # A table with fallback_rows="auto" that had not chosen its split when the model was
        # built has no fallback entries; a checkpoint of one that had holds them: added.
        for name in FALLBACK_ENTRIES:
            fqn, md = prefix + name, metadata.state_dict_metadata.get(prefix + name)
            if isinstance(md, TensorStorageMetadata) and fqn not in self.state_dict:
                self._replace(fqn, torch.empty(md.size, dtype=md.properties.dtype), keys_path, name)

    def _drop(self, fqn: str) -> None:
        del self.state_dict[fqn]
        if self.flatten_state_dict:
            *parents, last = self.mappings.pop(fqn)
            node: Any = self.original_state_dict
            for step in parents:
                node = node[step]
            del node[last]

    def _replace(self, fqn: str, value: torch.Tensor, sibling_path: Any = None, name: str = "") -> None:
        """Put `value` at `fqn` in the planner's state_dict and the caller's (nested) one; an
        entry the caller's lacks goes beside its table's keys (`sibling_path`), named `name`."""
        self.state_dict[fqn] = value
        if self.flatten_state_dict:
            if fqn not in self.mappings:
                *parents, last = sibling_path
                self.mappings[fqn] = (*parents, last[:-len("keys")] + name)
            set_element(self.original_state_dict, self.mappings[fqn], value)


class CNStager(DefaultStager):
    """Deprecated: `dcp.async_save`'s own stagers keep the table entries now (see `TableEntry`),
    so pass no `async_stager`. This is DCP's `DefaultStager` with the options `async_save` gives
    its own, and warns (FutureWarning) when made.

    Args:
        config (StagingOptions | None): as DefaultStager's; None: what `async_save` gives its own
            stager (synchronous staging to plain CPU memory).

    Example::

        dcp.async_save({"model": model.state_dict()}, checkpoint_id=path).result()  # instead
    """

    def __init__(self, config: StagingOptions | None = None) -> None:
        warnings.warn("cncore_torch.dcp.CNStager is deprecated: torch.distributed.checkpoint.async_save's own "
                      "stager keeps every rank's rows of a dynamic table; pass no async_stager",
                      FutureWarning, stacklevel=2)
        super().__init__(config if config is not None else StagingOptions(False, False, False, False))


def fallback_in_place(saved: tuple[int, ...] | None, place: tuple[int, int]) -> bool:
    """Whether fallback rows saved at `saved` ((rank, world size, run id) of a shard; None: a
    whole table) are this table's at `place` (rank, world size): a key reads fallback row
    ``mix64(key) % N`` of the shard that owns it, so a shard's fallback rows are its own only
    on the same rank of the same world size, and a whole table's only for a whole table."""
    return (saved[0], saved[1]) == place if saved is not None else place[1] == 1


def fallback_moved_error(prefix: str, rows: int, saved: tuple[int | None, int] | tuple[int, ...] | None,
                         place: tuple[int, int]) -> str:
    """The refusal of fallback rows saved at `saved` ((rank, world size, ...) of a shard, rank
    None for every rank's; None: a whole table) that cannot be placed at `place`."""
    if saved is None or saved[1] == 1:
        what = "a whole table"
    elif saved[0] is None:
        what = f"the shards of a table split over {saved[1]} ranks"
    else:
        what = f"rank {saved[0]}'s shard of {saved[1]} ranks"
    here = "a whole table" if place[1] == 1 else f"rank {place[0]}'s shard of {place[1]} ranks"
    fix = (f"load the checkpoint on {saved[1]} ranks (the world size it was saved at), each rank its own shard"
           if saved is not None and saved[1] > 1 else "load it into an unsharded table (or one rank)")
    return unplaceable_fallback_error(
        f"{prefix}fallback_rows", f"the checkpoint holds {rows} trained fallback rows of {what}",
        f"this table is {here}",
        [fix, "remove them with cncore_torch.state.drop_fallback_rows(state_dict) to load the keyed rows alone (the "
              "fallback rows then start afresh)"], "loaded")


def ungather(state_dict, prefix: str, place: tuple[int, int]) -> tuple[dict, list[str]]:
    """The entries of the table under `prefix` as one rank's load reads them, from a DCP load's
    whole table (`CNLoadPlanner`: the ``shard`` entry holds one (rank, world size, run id) row
    per saved rank). Returns (replacement entries, errors); ({}, []) when the entries are not
    that form. Every saved rank must be there once, of one run; their steps must agree. At the
    saved world size each rank takes its own evicted count back; at another one rank 0 takes
    their sum (the total over ranks stays what it was)."""
    shards = state_dict.get(prefix + "shard")
    if not isinstance(shards, torch.Tensor) or shards.dim() != 2:
        return {}, []
    rank, world_size = place
    rows = [tuple(int(v) for v in row) for row in shards]
    saved = len(rows)
    if shards.shape[1] != 3 or [r[:2] for r in rows] != [(r, saved) for r in range(saved)] \
            or len({r[2] for r in rows}) != 1:
        return {}, [f"{prefix}shard: expected (rank, {saved}, run id) for ranks 0..{saved - 1} of one save, got "
                    f"{rows}: not every rank's shard of one checkpoint; nothing was loaded"]
    out: dict[str, torch.Tensor] = {}
    step = state_dict.get(prefix + "step")
    if isinstance(step, torch.Tensor) and step.dim() == 1:
        if len(set(step.tolist())) > 1:
            return {}, [f"{prefix}step: the saved shards disagree ({step.tolist()}); were they saved at one step? "
                        f"nothing was loaded"]
        out[prefix + "step"] = step[0].clone()
    evicted = state_dict.get(prefix + "evicted_count")
    if isinstance(evicted, torch.Tensor) and evicted.dim() == 1:
        if saved == world_size:
            out[prefix + "evicted_count"] = evicted[rank].clone()
        else:
            out[prefix + "evicted_count"] = evicted.sum() if rank == 0 else torch.zeros((), dtype=evicted.dtype)
    out[prefix + "shard"] = torch.tensor([rank, world_size, rows[0][2]], dtype=torch.int64)
    fallback, problems = _ungather_fallback(state_dict, prefix, place, saved)
    if problems:
        return {}, problems
    out.update(fallback)
    return out, []


def _ungather_fallback(state_dict, prefix: str, place: tuple[int, int], saved: int) -> tuple[dict, list[str]]:
    """A DCP load's fallback rows of a table saved by `saved` ranks (the ranks' rows one after
    another, ``fallback_count`` their number per rank) as rank `place[0]` of `place[1]` reads
    them: its own rows at the saved world size; at another, none when the ranks held none, and
    refused when they held some (a key's fallback row is its shard's: `fallback_in_place`)."""
    counts = state_dict.get(prefix + "fallback_count")
    if not isinstance(counts, torch.Tensor) or counts.dim() != 1:
        return {}, []
    rank, world_size = place
    per_rank = [int(c) for c in counts]
    entries = {name: state_dict.get(prefix + name) for name in FALLBACK_ENTRIES}
    for name, value in entries.items():
        if not isinstance(value, torch.Tensor) or value.dim() != 2 or value.shape[0] != sum(per_rank):
            held = tuple(value.shape) if isinstance(value, torch.Tensor) else "nothing"
            return {}, [f"{prefix}{name}: the saved ranks' fallback_count {per_rank} add up to {sum(per_rank)} "
                        f"rows, the checkpoint holds {held}: not one save's fallback rows; nothing was loaded"]
    if saved == world_size:
        start = sum(per_rank[:rank])
        out = {prefix + name: value[start:start + per_rank[rank]].clone() for name, value in entries.items()}
        out[prefix + "fallback_count"] = counts[rank].clone()
        return out, []
    if sum(per_rank):
        return {}, [fallback_moved_error(prefix, sum(per_rank), (None, saved), place)]
    out = {prefix + name: value[:0].clone() for name, value in entries.items()}  # (none: 0 rows)
    out[prefix + "fallback_count"] = torch.zeros((), dtype=counts.dtype)
    return out, []

"""Fresh serving: training's incremental saves applied to a frozen model while it serves.

A `TableDelta` is what changed in one table: rows to write (changed IDs and new ones), IDs
to drop (evicted or erased), and the table's fallback rows where it has them (every version
of a table file holds them all, so a delta carries them whole). `TableDelta.from_chain` reads
it from a table file chain (the deltas `save_table(since=...)` and cn-dlrm's
`--incremental-checkpoint-every` write), netting every version after the one the frozen model
holds. `apply_delta` lands deltas of any number of tables as one version:

1. Prepared aside, while requests run: the delta's IDs looked up in the live hash (which of
   its evicted IDs the table holds, which written IDs are new), the weight rows the new IDs
   take (an evicted ID's row first, then new rows at the end; growth copies the table into a
   larger tensor, 1.25x or what the delta needs), and the hash entries the new and evicted
   IDs write (`IdRemap.planned`).
2. Swapped under the model's `ServingLock` (no request is reading): the delta's rows are
   written in place (or were, into the grown copy) and the new and evicted IDs inserted into
   the live FBGEMM hash in place (`hashmap.insert`: one call over the delta's IDs; a delta of
   changed rows only writes no entry).
3. After the lock: the table's sorted ID arrays (which requests do not read) note the new and
   evicted IDs as pending, merged when read or once they pass a quarter of the table
   (`table.TableSlots.record`).

So a delta's work is proportional to the delta, not the table, but for the amortized merge
and the hash rebuilt whole (aside, then swapped in under the lock) when a region's entries in
use (IDs and the tombstones of evicted ones) would pass `hashmap._FULL`, when an added ID needs
another key mask, or when asked (`rebuild=True`, which also drops the tombstones). Measured at
5 GiB in docs/serving.md ("Delta").

Nothing is recompiled and no request waits for more than the swap. An exported `.pt2` is a
snapshot: its shapes and rows are fixed in the file; export a new one from the updated model.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingCollection

from cncore_torch.serving.collection import FrozenEmbeddingBagCollection, FrozenEmbeddingCollection
from cncore_torch.serving.freeze import serving_lock
from cncore_torch.serving.modules import TABLE, FrozenEmbedding, FrozenEmbeddingBag
from cncore_torch.serving.table import TableSlots, id_tensor

__all__ = ["TableDelta", "DeltaReport", "apply_delta", "frozen_tables"]


@dataclass(frozen=True, eq=False)
class TableDelta:
    """What changed in one table.

    Args:
        keys: int64 (M,) IDs whose rows are written (changed or new), each once.
        rows: float32 (M, dim), row i for keys[i].
        removed: int64 IDs dropped from the table (IDs it does not hold are ignored).
        fallback: float32 (N, dim), the table's fallback rows, all of them (None: unchanged).
    """
    keys: np.ndarray
    rows: np.ndarray
    removed: np.ndarray
    fallback: np.ndarray | None = None

    def __post_init__(self) -> None:
        keys, rows = np.asarray(self.keys), np.asarray(self.rows)
        if keys.dtype.kind not in "iu" or keys.ndim != 1:
            raise TypeError(f"keys: expected 1-D int64 IDs, got {keys.dtype} of shape {keys.shape}")
        if rows.ndim != 2 or len(rows) != len(keys):
            raise ValueError(f"rows: expected ({len(keys)}, dim) rows for {len(keys)} keys, got shape {rows.shape}")
        if len(np.unique(keys)) != len(keys):
            raise ValueError("keys: an ID appears twice; a delta writes each ID once")
        object.__setattr__(self, "keys", keys.astype(np.int64))
        object.__setattr__(self, "rows", rows.astype(np.float32, copy=False))
        object.__setattr__(self, "removed", np.unique(np.asarray(self.removed, dtype=np.int64)))
        if self.fallback is not None:
            shared = np.asarray(self.fallback, dtype=np.float32)
            if shared.ndim != 2 or shared.shape[1] != rows.shape[1]:
                raise ValueError(f"fallback: expected (N, {rows.shape[1]}) rows, got shape {shared.shape}")
            object.__setattr__(self, "fallback", shared)

    @property
    def nbytes(self) -> int:
        return (self.keys.nbytes + self.rows.nbytes + self.removed.nbytes
                + (0 if self.fallback is None else self.fallback.nbytes))

    @classmethod
    def from_chain(cls, path: str | os.PathLike, since: str | None, until: str | None = None) -> TableDelta:
        """The net change of the table file chain at `path` from version `since` (the state the
        frozen model holds; None: from nothing, so every row of `until`) to `until` (default:
        the live version): later versions win, an ID removed and then written again is written;
        the fallback rows (of a table that has them) are `until`'s.

        Args:
            path: the table directory (`save_table`'s path).
            since: the version the frozen model holds (`Checkpoint.version`), or None.
            until: the last version to take (None: the live one).

        Returns:
            TableDelta: the net change.

        >>> import numpy as np, tempfile, os, cncore
        >>> from cncore.tablefile import save_table
        >>> s = cncore.EmbeddingStore(dim=2, optimizer=cncore.SGD(), initializer=cncore.Constant(1.0))
        >>> _ = s.find_or_insert(np.array([1, 2, 3]))
        >>> path = os.path.join(tempfile.mkdtemp(), "t.cnt"); base = save_table(s, path)
        >>> _ = s.erase(np.array([2])); _ = s.find_or_insert(np.array([4]))
        >>> d = TableDelta.from_chain(path, base.version, save_table(s, path, since=base).version)
        >>> d.keys.tolist(), d.removed.tolist()      # (rows never trained travel in every delta)
        ([1, 3, 4], [2])
        """
        from cncore.tablefile.reader import _open_chain

        links = _open_chain(os.fspath(path), verify=True, head=until)
        versions = [link.version for link in links]
        if since is not None and since not in versions:
            raise ValueError(f"since: {since!r} is not a version of the chain at {path} (it holds {versions}); "
                             f"pass the version the frozen model was built from or last updated to")
        dim = links[-1].config.dim
        keys, rows = np.empty(0, np.int64), np.empty((0, dim), np.float32)
        removed = np.empty(0, np.int64)
        for link in links[0 if since is None else versions.index(since) + 1:]:
            gone = np.asarray(link.delta["removed"] if link.delta else np.empty(0, np.int64), dtype=np.int64)
            keep = ~np.isin(keys, gone)
            keys, rows, removed = keys[keep], rows[keep], np.union1d(removed, gone)
            new_keys, new_rows = link.read("keys", 0, len(link)), link.read("rows", 0, len(link))
            if link.delta is None:  # a full version: everything it does not hold is gone
                removed = np.union1d(removed, np.setdiff1d(keys, new_keys))
                keys, rows = np.empty(0, np.int64), np.empty((0, dim), np.float32)
            keep = ~np.isin(keys, new_keys)
            keys, rows = np.concatenate([keys[keep], new_keys]), np.concatenate([rows[keep], new_rows])
            removed = np.setdiff1d(removed, new_keys)
        shared = links[-1].fallback
        return cls(keys, rows, removed, None if shared is None else np.asarray(shared[0], dtype=np.float32))


@dataclass
class DeltaReport:
    """What `apply_delta` did.

    Args:
        rows_written: rows of the deltas written into the tables.
        ids_added: IDs the tables did not hold before.
        ids_removed: IDs dropped.
        bytes_written: bytes written into the model (rows, hash entries; a rebuilt hash whole, and
            the ID arrays of its tables whose IDs changed).
        tables_grown: tables whose weight moved to a larger tensor.
        locked_seconds: how long the swap kept requests out.
        hashes_rebuilt: ID hashes rebuilt whole (the others were updated in place).
    """
    rows_written: int = 0
    ids_added: int = 0
    ids_removed: int = 0
    bytes_written: int = 0
    tables_grown: int = 0
    locked_seconds: float = 0.0
    hashes_rebuilt: int = 0


@dataclass
class _Table:
    """Where one frozen table lives: its ID map, and how to read and replace its weight."""
    module: Any        # the frozen collection or module
    slots: TableSlots
    owner: Any         # the module holding `weight` (an nn.EmbeddingBag / nn.Embedding, or the frozen module)
    config_index: int | None = None  # its config in TorchRec's collection (num_embeddings follows growth)
    remap_name: str = TABLE          # its name in module.remap (a frozen module's one table: TABLE)

    @property
    def weight(self) -> torch.Tensor:
        return cast(torch.Tensor, self.owner.weight)

    def set_weight(self, weight: torch.Tensor) -> None:
        if isinstance(self.owner, (FrozenEmbeddingBag, FrozenEmbedding)):
            self.owner.weight = weight
            return
        self.owner.weight = nn.Parameter(weight, requires_grad=False)
        self.owner.num_embeddings = weight.shape[0]
        if self.config_index is not None:
            inner = getattr(self.module, "embedding_bag_collection", None) or self.module.embedding_collection
            configs = (inner.embedding_bag_configs() if hasattr(inner, "embedding_bag_configs")
                       else inner.embedding_configs())
            configs[self.config_index] = dataclasses.replace(configs[self.config_index],
                                                             num_embeddings=weight.shape[0])


def frozen_tables(model: nn.Module) -> dict[str, _Table]:
    """{name: table} of every frozen table in `model`: "<module path>.<table>" for a
    collection's tables (just "<table>" for a collection at the top), the module path for a
    frozen module ("weight" for one at the top).

    Args:
        model (nn.Module): a frozen model.

    Returns:
        dict: {name: the table's ID map (`.slots`, a `TableSlots`) and rows (`.weight`)}.
    """
    out: dict[str, _Table] = {}
    for path, module in model.named_modules():
        if isinstance(module, (FrozenEmbeddingBagCollection, FrozenEmbeddingCollection)):
            bag = isinstance(module, FrozenEmbeddingBagCollection)
            inner = module.embedding_bag_collection if bag else module.embedding_collection
            tables = getattr(inner, "embedding_bags" if bag else "embeddings", None)
            quantized = type(inner) not in (EmbeddingBagCollection, EmbeddingCollection)
            if quantized or not isinstance(tables, nn.ModuleDict):
                raise TypeError(f"model: the tables of {path or 'the model'} are quantized ({type(inner).__module__}."
                                f"{type(inner).__name__}); apply the delta to the float frozen model, then quantize "
                                f"it again")
            configs = (module.embedding_bag_configs() if isinstance(module, FrozenEmbeddingBagCollection)
                       else module.embedding_configs())
            names = [c.name for c in configs]
            for i, name in enumerate(names):
                slots = cast(TableSlots, module.remap.tables[name])
                out[f"{path}.{name}" if path else name] = _Table(module, slots, tables[name], i, name)
        elif isinstance(module, (FrozenEmbeddingBag, FrozenEmbedding)):
            out[path or "weight"] = _Table(module, module.table, module)
    return out


def _resolve(tables: dict[str, _Table], name: str) -> _Table:
    if name in tables:
        return tables[name]
    short = [full for full in tables if full.rsplit(".", 1)[-1] == name]
    if len(short) == 1:
        return tables[short[0]]
    held = ", ".join(sorted(tables)) or "none"
    why = "the name is ambiguous, use the full one" if short else "no such table"
    raise KeyError(f"deltas: {name!r}: {why} (the model's frozen tables: {held})")


@dataclass
class _Prepared:
    """One table's delta, ready to swap in (see the module docstring)."""
    table: _Table
    free: torch.Tensor
    write_at: torch.Tensor   # weight rows the delta's rows go to
    rows: torch.Tensor       # in the weight's dtype, in write_at's (ascending) order
    weight: torch.Tensor | None  # a grown copy holding the rows already (None: write in place)
    added: int
    removed: int
    added_ids: np.ndarray    # IDs new to the table, and their weight rows
    added_slots: np.ndarray
    removed_ids: np.ndarray  # IDs the table held and drops


def _held_rows(table: _Table, ids: np.ndarray) -> np.ndarray:
    """The weight row of each of `ids` (-1: not held): from the hash, O(len(ids)), or from the
    sorted arrays (merged first) for a table no feature reads."""
    got = table.module.remap.held_rows(table.remap_name, ids)
    if got is not None:
        return cast(np.ndarray, got)
    held, slots = table.slots.ids.numpy(), table.slots.slots.numpy()
    if not len(held):
        return np.full(len(ids), -1, np.int64)
    pos = np.searchsorted(held, ids).clip(max=len(held) - 1)
    return np.where(held[pos] == ids, slots[pos], -1)


def _prepare(table: _Table, name: str, delta: TableDelta) -> _Prepared:
    weight = table.weight
    if delta.rows.shape[1] != weight.shape[1]:
        raise ValueError(f"deltas[{name!r}]: rows of dim {delta.rows.shape[1]}, but the table's dim is "
                         f"{weight.shape[1]}")
    # the delta's IDs looked up in the hash (not the O(N) sorted arrays): what goes, what stays
    was = _held_rows(table, delta.removed)
    removed_ids = delta.removed[was >= 0]
    pool = np.concatenate([table.slots.free.numpy(), was[was >= 0]])
    now = _held_rows(table, delta.keys)
    found = (now >= 0) & ~np.isin(delta.keys, removed_ids)   # (evicted and written again: a new ID)
    write_at = np.empty(len(delta.keys), np.int64)
    write_at[found] = now[found]
    n_new = int((~found).sum())
    capacity = weight.shape[0]
    extra = max(n_new - len(pool), 0)
    fresh = np.concatenate([pool[:n_new], np.arange(capacity, capacity + extra, dtype=np.int64)])
    write_at[~found] = fresh
    new_keys = delta.keys[~found]
    rows = torch.from_numpy(delta.rows)
    if delta.fallback is not None:
        held = table.slots.fallback_rows
        if len(delta.fallback) != held:
            raise ValueError(f"deltas[{name!r}]: {len(delta.fallback)} fallback rows, but the frozen table holds "
                             f"{held}; freeze the model again from the table's checkpoint")
        write_at = np.concatenate([write_at, np.arange(table.slots.first_fallback,
                                                       table.slots.first_fallback + held, dtype=np.int64)])
        rows = torch.cat([rows, torch.from_numpy(delta.fallback)])
    # in the weight's dtype and in row order, aside: the write under the lock then runs through the
    # weight forward (1% of a 5 GiB table, 210k rows at random: 104-144 ms unsorted, 59-84 ms sorted
    # on the shared 2-core machine)
    order = np.argsort(write_at, kind="stable")
    write_at, rows = write_at[order], rows[torch.from_numpy(order)].to(weight.dtype)
    grown = None
    if extra:
        grown = torch.zeros((max(capacity + extra, capacity * 5 // 4), weight.shape[1]), dtype=weight.dtype)
        grown[:capacity] = weight
        grown[torch.from_numpy(write_at)] = rows
    return _Prepared(table, id_tensor(pool[n_new:].copy()), torch.from_numpy(write_at), rows, grown, n_new,
                     len(removed_ids), new_keys, fresh, removed_ids)


def apply_delta(model: nn.Module, deltas: Mapping[str, TableDelta], rebuild: bool = False) -> DeltaReport:
    """Apply `deltas` ({table name: TableDelta}) to the frozen `model` in place, as one
    version: a request running on another thread sees all of them or none (see the module
    docstring). Table names as `frozen_tables` gives them, or a collection's table name
    alone where it is unique in the model.

    Args:
        model (nn.Module): the model `cncore_torch.serving.freeze` returned.
        deltas (Mapping[str, TableDelta]): what changed, per table.
        rebuild (bool): rebuild the ID hashes of the changed tables whole (aside) instead of
            inserting into them in place; drops the evicted IDs' tombstones. A delta does it by
            itself when a hash fills up.

    Returns:
        DeltaReport: rows written, IDs added and removed, bytes, tables grown, time locked.

    >>> import numpy as np, torch
    >>> bag = FrozenEmbeddingBag(np.array([1, 2]), np.ones((2, 2)), mode="sum")
    >>> from cncore_torch.serving.freeze import freeze
    >>> frozen = freeze(torch.nn.Sequential(bag))
    >>> report = apply_delta(frozen, {"0": TableDelta(np.array([2, 5]), np.full((2, 2), 3.0), np.array([1]))})
    >>> frozen(torch.tensor([[1, 2, 5]])).tolist(), report.ids_added, report.ids_removed
    ([[6.0, 6.0]], 1, 1)
    """
    import time

    lock = serving_lock(model)
    if not isinstance(rebuild, bool):
        raise TypeError(f"rebuild must be a bool, got {rebuild!r}")
    if not isinstance(deltas, Mapping):
        raise TypeError(f"deltas must be a mapping {{table name: TableDelta}}, got {type(deltas).__name__}")
    tables = frozen_tables(model)
    chosen = {}
    for name, delta in deltas.items():
        if not isinstance(delta, TableDelta):
            raise TypeError(f"deltas[{name!r}]: expected a TableDelta, got {type(delta).__name__}")
        chosen[name] = (_resolve(tables, name), delta)
    report = DeltaReport()
    with lock.applying():
        prepared = [_prepare(table, name, delta) for name, (table, delta) in chosen.items()]
        # each changed remap: its hash updated in place under the lock (planned here), or rebuilt
        # aside whole where it fills up (or `rebuild`)
        remaps: dict[int, tuple[Any, list[_Prepared]]] = {}
        for p in prepared:
            remap = getattr(p.table.module, "remap", None)
            if remap is not None:
                remaps.setdefault(id(remap), (remap, []))[1].append(p)
        updates, rebuilt = [], []
        for remap, parts in remaps.values():
            named = [(p.table.remap_name, p) for p in parts]
            plan = None if rebuild else remap.planned(
                {n: (p.added_ids, p.added_slots, p.removed_ids) for n, p in named})
            if plan is None:
                merged = {n: tuple(map(id_tensor, p.table.slots.merged(p.removed_ids, p.added_ids, p.added_slots)))
                          for n, p in named}
                rebuilt.append((remap, remap.rebuilt(merged), merged, named))
            else:
                updates.append((remap, plan, {n: p.added for n, p in named}))
        start = time.perf_counter()
        entries = 0
        with lock.writing():
            for p in prepared:
                if p.weight is None:
                    p.table.weight.index_put_((p.write_at,), p.rows)
                else:
                    p.table.set_weight(p.weight)
                p.table.slots.free = p.free
            for remap, plan, added in updates:
                entries += remap.insert(plan, added)
            for remap, built, _, _ in rebuilt:
                remap.swap(built)
        report.locked_seconds = time.perf_counter() - start
        # the sorted ID arrays (requests do not read them): merged for a rebuilt hash, else the
        # delta's IDs noted as pending (table.py)
        swapped = set()
        for _, _, merged, named in rebuilt:
            for n, p in named:
                p.table.slots.set_arrays(merged[n][0].numpy(), merged[n][1].numpy())
                swapped.add(id(p))
        for p in prepared:
            if id(p) not in swapped:
                p.table.slots.record(p.removed_ids, p.added_ids, p.added_slots)
    for p in prepared:
        report.rows_written += len(p.write_at)
        report.ids_added += p.added
        report.ids_removed += p.removed
        report.bytes_written += p.rows.nbytes
        report.tables_grown += p.weight is not None
    # the hash: the entries written in place (key and row, 16 bytes each), or every rebuilt one
    # with its tables' ID arrays
    report.bytes_written += entries * 16 + sum(
        built.table.nbytes + built.offsets.nbytes
        + sum(merged[n][0].nbytes + merged[n][1].nbytes for n, p in named if p.added or p.removed)
        for _, built, merged, named in rebuilt)
    report.hashes_rebuilt = len(rebuilt)
    return report

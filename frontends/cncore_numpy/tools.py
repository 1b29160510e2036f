"""The offline table tools behind `cn-table`, as functions over `TableFile`s.

Every tool reads the table in batches of rows with plain file reads (see `TableFile.batches`)
and writes through `TableWriter` or a streamed .npz, so tables larger than memory work. What
they do keep in memory is per-row bookkeeping: the sorted key index of `offline.key_index`
(16 bytes a row) for merge, diff and to-fixed, which must match keys across tables, and a
keep mask (1 byte a row) for prune.

>>> import numpy as np, tempfile, os, cncore
>>> from cncore_numpy import Table, open_table
>>> d = tempfile.mkdtemp()
>>> a = Table(dim=1, initializer=cncore.Constant(1.0)); _ = a.find_or_insert([1, 2])
>>> b = Table(dim=1, initializer=cncore.Constant(3.0)); _ = b.find_or_insert([2, 3])
>>> a.save(os.path.join(d, "a")); b.save(os.path.join(d, "b"))
>>> merge(open_table(os.path.join(d, "a")), open_table(os.path.join(d, "b")), os.path.join(d, "m"), "average")
{'left_only': 1, 'right_only': 1, 'both': 1, 'rows': 3}
>>> m = open_table(os.path.join(d, "m")); m.lookup([1, 2, 3]).ravel().tolist()
[1.0, 2.0, 3.0]
>>> diff(open_table(os.path.join(d, "a")), m)["changed"].tolist()
[2]
"""
from __future__ import annotations

import dataclasses
import os
import secrets
import shutil
from collections.abc import Callable

import numpy as np

from cncore.routing import owner_of, parse_shard_name, shard_name
from cncore.store_fallback import unplaceable_fallback_error
from cncore.tablefile import TableFile, TableWriter, check_shard, config_to_dict
from cncore.tablefile_lookup import find_rows, key_index
from cncore_numpy.exchange import BATCH, NpzStreamWriter

__all__ = ["inspect", "prune_mask", "prune", "merge", "diff", "to_fixed", "check_shards", "reshard", "POLICIES",
           "POLICY_FIELDS"]

POLICIES = ("left", "right", "newer", "average")
_U32_MAX = 2**32 - 1
# A bounded table's policy, as its config holds it (None where not set).
POLICY_FIELDS = ("max_rows", "eviction", "headroom", "admission")


def _norms(rows: np.ndarray) -> np.ndarray:
    return np.sqrt(np.einsum("ij,ij->i", rows, rows, dtype=np.float64))


def _hist(values: np.ndarray, bins) -> dict:
    counts, edges = np.histogram(values, bins=bins)
    return {"edges": edges.tolist(), "counts": counts.tolist()}


def inspect(table: TableFile, progress: Callable = iter) -> dict:
    """Rows, dim, dtype, bytes, key range, and histograms of row norms (10 bins), access
    counts and age (table step - last step). Keeps one float32 norm per row in memory.

    A bounded table's policy is in ``max_rows``, ``eviction``, ``headroom`` and ``admission``,
    as the file's manifest spells them (``{"type": "TTL", "steps": 5}``); None where not set.
    ``evicted_count`` is the table's count of evicted rows when it was saved (0 in files
    before format version 3). ``shard`` is [R, N] for a shard table (a directory named
    ``shard-R-of-N``: the keys `owner_of(key, N) == R` of a table sharded over N ranks), else None.

    NaN and infinite values are data: rows holding a NaN are counted in ``nan_rows``, rows
    holding an infinity (and no NaN) in ``inf_rows``; the norm histogram covers the rest.

    >>> import numpy as np, tempfile, os
    >>> from cncore_numpy import Table, open_table
    >>> path = os.path.join(tempfile.mkdtemp(), "t"); t = Table(dim=2)
    >>> t[[1, 2, 3]] = np.array([[np.nan, 0], [3, 4], [np.inf, 0]], np.float32); t.save(path)
    >>> s = inspect(open_table(path)); s["nan_rows"], s["inf_rows"], sum(s["row_norm"]["counts"])
    (1, 1, 1)
    """
    n = len(table)
    lo, hi = None, None
    norms = np.empty(n, np.float32)
    nan_rows = inf_rows = 0
    counts = np.zeros(8, np.int64)
    ages = np.zeros(8, np.int64)
    count_bins = [0, 1, 2, 5, 10, 100, 1000, 10**4, 2**32]
    age_bins = [0, 1, 10, 100, 1000, 10**4, 10**5, 10**6, 2**32]
    for start, b in progress(table.batches(BATCH, ("keys", "rows", "counts", "last_steps"))):
        keys = b["keys"]
        if len(keys):
            lo = keys.min() if lo is None else min(lo, keys.min())
            hi = keys.max() if hi is None else max(hi, keys.max())
        norms[start:start + len(keys)] = _norms(b["rows"])
        has_nan = np.isnan(b["rows"]).any(axis=1)
        nan_rows += int(has_nan.sum())
        inf_rows += int((np.isinf(b["rows"]).any(axis=1) & ~has_nan).sum())
        counts += np.histogram(b["counts"], count_bins)[0]
        ages += np.histogram(table.step - b["last_steps"].astype(np.int64), age_bins)[0]
    return {"rows": n, "dim": table.dim, "dtype": table.config.dtype,
            "optimizer": type(table.config.optimizer).__name__ if table.config.optimizer else None,
            "bytes": table.nbytes, "step": table.step, "evicted_count": table.evicted_count,
            "shard": list(parse_shard_name(os.path.basename(os.path.normpath(table.path))) or ()) or None,
            **{name: config_to_dict(table.config).get(name) for name in POLICY_FIELDS},
            "key_min": None if lo is None else int(lo), "key_max": None if hi is None else int(hi),
            "nan_rows": nan_rows, "inf_rows": inf_rows,
            "row_norm": _hist(norms[np.isfinite(norms)], 10),
            "access_count": {"edges": count_bins, "counts": counts.tolist()},
            "age": {"edges": age_bins, "counts": ages.tolist()}}


def prune_mask(table: TableFile, min_count: int | None = None, min_step: int | None = None,
               min_norm: float | None = None, top_k: int | None = None, progress: Callable = iter):
    """(keep mask, {criterion: rows failing it}). A row is kept when every given criterion
    holds (count >= min_count, last step >= min_step, row norm >= min_norm); then at most
    `top_k` of the kept rows by access count stay (ties: the smaller key)."""
    n = len(table)
    keep = np.ones(n, dtype=bool)
    failing: dict[str, int] = {}
    names = ("keys", "counts", "last_steps") + (("rows",) if min_norm is not None else ())
    for start, b in progress(table.batches(BATCH, names)):
        tests = {}
        if min_count is not None:
            tests[f"count < {min_count}"] = b["counts"] >= min_count
        if min_step is not None:
            tests[f"last step < {min_step}"] = b["last_steps"] >= min_step
        if min_norm is not None:
            tests[f"norm < {min_norm:g}"] = _norms(b["rows"]) >= min_norm
        k = keep[start:start + len(b["keys"])]
        for label, ok in tests.items():
            failing[label] = failing.get(label, 0) + int((~ok).sum())
            k &= ok
    if top_k is not None and keep.sum() > top_k:
        idx = np.flatnonzero(keep)
        keys = table.read("keys", 0, n)[idx]
        counts = table.read("counts", 0, n)[idx]
        order = np.lexsort((keys, -counts.astype(np.int64)))
        keep[idx[order[top_k:]]] = False
        failing[f"beyond the top {top_k} by count"] = len(idx) - top_k
    return keep, failing


def prune(table: TableFile, out: str, keep: np.ndarray, progress: Callable = iter) -> int:
    """Write the kept rows (state and metadata too) as the table `out`; returns rows removed."""
    with TableWriter(out, table.config, int(keep.sum()), table.step) as writer:
        for start, b in progress(table.batches(BATCH)):
            k = keep[start:start + len(b["keys"])]
            writer.write(*(b[name][k] for name in ("keys", "rows", "optimizer_state", "counts", "last_steps")))
    return int(len(table) - keep.sum())


def _gather(table: TableFile, rows: np.ndarray) -> dict[str, np.ndarray]:
    """Every array's entries at row numbers `rows`."""
    return {name: table.take(name, rows) for name in ("keys", "rows", "optimizer_state", "counts", "last_steps")}


def _check_compatible(left: TableFile, right: TableFile) -> None:
    if left.dim != right.dim:
        raise ValueError(f"right: dim {right.dim} differs from left's {left.dim}; merge needs one dim")
    lo, ro = left.config.optimizer, right.config.optimizer
    if type(lo) is not type(ro):
        raise ValueError(f"right: optimizer {type(ro).__name__} differs from left's {type(lo).__name__}; "
                         f"their per-row states do not mix")


def merge(left: TableFile, right: TableFile, out: str, policy: str, progress: Callable = iter) -> dict:
    """Write the union of two tables of one dim (and one optimizer kind) to `out`.

    Keys in one table keep their row, state and metadata. Keys in both follow `policy`:
    "left" / "right": that table's row, state and metadata; "newer": the one with the larger
    last step (left on ties); "average": the mean of both rows and both optimizer states,
    counts added (capped at 2^32 - 1), the larger last step. The result has left's config and
    the larger step. Returns how many keys were in each part.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy: expected one of {POLICIES}, got {policy!r}")
    _check_compatible(left, right)
    in_left = np.zeros(len(right), bool)
    for _, b in left.batches(BATCH, ("keys",)):
        in_left[find_rows(right, b["keys"])[1]] = True
    both = int(in_left.sum())
    n_out = len(left) + len(right) - both
    with TableWriter(out, left.config, n_out, max(left.step, right.step)) as writer:
        for _, b in progress(left.batches(BATCH)):
            hit, at_right = find_rows(right, b["keys"])
            if hit.any() and policy != "left":
                r = _gather(right, at_right)
                _resolve(b, r, hit, policy)
            writer.write(b["keys"], b["rows"], b["optimizer_state"], b["counts"], b["last_steps"])
        for start, b in progress(right.batches(BATCH)):
            only = ~in_left[start:start + len(b["keys"])]
            writer.write(*(b[name][only] for name in ("keys", "rows", "optimizer_state", "counts", "last_steps")))
    return {"left_only": len(left) - both, "right_only": len(right) - both, "both": both, "rows": n_out}


def _resolve(b: dict[str, np.ndarray], r: dict[str, np.ndarray], hit: np.ndarray, policy: str) -> None:
    """Overwrite left's entries `b` at `hit` with the policy's result given right's `r`."""
    if policy == "right":
        take = np.ones(len(r["keys"]), bool)
    elif policy == "newer":
        take = r["last_steps"] > b["last_steps"][hit]
    else:  # average
        for name in ("rows", "optimizer_state"):
            b[name][hit] = (b[name][hit] + r[name]) * np.float32(0.5)
        b["counts"][hit] = np.minimum(b["counts"][hit].astype(np.uint64) + r["counts"], _U32_MAX)
        b["last_steps"][hit] = np.maximum(b["last_steps"][hit], r["last_steps"])
        return
    where = np.flatnonzero(hit)[take]
    for name in ("rows", "optimizer_state", "counts", "last_steps"):
        b[name][where] = r[name][take]


def diff(old: TableFile, new: TableFile, tolerance: float = 0.0, progress: Callable = iter) -> dict:
    """Keys added (in `new` only), removed (in `old` only) and changed (in both, with some
    row entry differing by more than `tolerance`), each sorted; for the changed keys, the L2
    norm and the largest absolute entry of the row's change (new - old).

    NaN is a value like any other: an entry that became NaN or stopped being NaN is a change
    (of size NaN), an entry NaN in both tables is not; so is an infinity in both.

    >>> import numpy as np, tempfile, os
    >>> from cncore_numpy import Table, open_table
    >>> d = tempfile.mkdtemp(); t = Table(dim=1)
    >>> t[[1, 2, 3]] = np.array([[1], [np.nan], [np.nan]], np.float32); t.save(os.path.join(d, "old"))
    >>> t[[1, 2]] = np.array([[np.nan], [5]], np.float32); t.save(os.path.join(d, "new"))
    >>> diff(open_table(os.path.join(d, "old")), open_table(os.path.join(d, "new")))["changed"].tolist()
    [1, 2]
    """
    if old.dim != new.dim:
        raise ValueError(f"new: dim {new.dim} differs from old's {old.dim}")
    in_old = np.zeros(len(new), bool)
    removed, changed, l2, max_abs = [], [], [], []
    for _, b in progress(old.batches(BATCH, ("keys", "rows"))):
        hit, at_new = find_rows(new, b["keys"])
        removed.append(b["keys"][~hit])
        in_old[at_new] = True
        before, after = b["rows"][hit], new.take("rows", at_new)
        # A NaN difference: a NaN on either side (a change unless on both), or inf - inf (none).
        with np.errstate(invalid="ignore"):
            delta = after.astype(np.float64) - before
            entry_moved = np.where(np.isnan(delta), np.isnan(before) != np.isnan(after), np.abs(delta) > tolerance)
        moved = entry_moved.any(axis=1)
        biggest = np.abs(delta).max(axis=1) if delta.size else np.zeros(len(delta))
        changed.append(b["keys"][hit][moved])
        l2.append(np.linalg.norm(delta[moved], axis=1))
        max_abs.append(biggest[moved])
    added = [b["keys"][~in_old[start:start + len(b["keys"])]] for start, b in new.batches(BATCH, ("keys",))]
    cat = lambda parts, dtype: np.concatenate(parts) if parts else np.zeros(0, dtype)  # noqa: E731
    changed_keys = cat(changed, np.int64)
    order = np.argsort(changed_keys, kind="stable")
    return {"added": np.sort(cat(added, np.int64)), "removed": np.sort(cat(removed, np.int64)),
            "changed": changed_keys[order], "change_l2": cat(l2, np.float64)[order],
            "change_max_abs": cat(max_abs, np.float64)[order]}


def to_fixed(table: TableFile, out: str, progress: Callable = iter) -> None:
    """Write `out` (.npz) for serving with a fixed table: ``ids`` (N,) int64, sorted, and
    ``weight`` (N + 1, dim) float32 whose row i is the row of ids[i]; the last row is zeros,
    where IDs the table never saw go (``np.searchsorted`` finds a row: see
    `cncore_torch.convert.to_fixed`, which makes the same pair as a TorchRec collection).

    >>> import numpy as np, tempfile, os
    >>> from cncore_numpy import Table, open_table
    >>> d = tempfile.mkdtemp(); t = Table(dim=1); t[[5, -5]] = np.array([[5.0], [-5.0]], np.float32)
    >>> t.save(os.path.join(d, "t")); to_fixed(open_table(os.path.join(d, "t")), os.path.join(d, "f.npz"))
    >>> f = np.load(os.path.join(d, "f.npz")); f["ids"].tolist(), f["weight"].ravel().tolist()
    ([-5, 5], [-5.0, 5.0, 0.0])
    """
    sorted_keys, order = key_index(table)
    n = len(sorted_keys)

    def weight():
        for start in progress(range(0, n, BATCH)):
            yield table.take("rows", order[start:start + BATCH])
        yield np.zeros((1, table.dim), np.float32)

    with NpzStreamWriter(out) as npz:
        npz.write("ids", np.int64, (n,), [sorted_keys])
        npz.write("weight", np.float32, (n + 1, table.dim), weight())


# --- shards: one table file per rank (`cncore.routing`), re-split by the owner hash ------------

_SHARD_FIELDS = ("keys", "rows", "optimizer_state", "counts", "last_steps")


def check_shards(paths: list[str], tables: list[TableFile], progress: Callable = iter) -> dict:
    """Check that `tables` (opened from `paths`) are every shard of one split of one table, and
    count their rows. Names: each path's last component is ``shard-R-of-N`` (`shard_name`),
    one N, every R in 0..N-1 once. Contents: one dim, optimizer kind, row dtype, step and save
    id (files that record one); each file's recorded place R of N, and every key of shard R
    owned by R (`cncore.tablefile.check_shard`), so no key is in two shards.
    Raises ValueError naming the first path and what is wrong; reads keys only (in batches).
    Returns {"world_size": N, "rows": total rows, "evicted": summed eviction counts}."""
    if len(paths) != len(tables) or not paths:
        raise ValueError("give the shard tables of one table (at least one)")
    places = []
    for path in paths:
        place = parse_shard_name(os.path.basename(os.path.normpath(path)))
        if place is None:
            raise ValueError(f"{path}: not a shard table (its directory name must be shard-R-of-N, as a sharded "
                             f"collection saves its ranks' shards); nothing was written")
        places.append(place)
    n = places[0][1]
    for path, (_, w) in zip(paths, places):
        if w != n:
            raise ValueError(f"{path}: a shard of a {w}-way split, {paths[0]} of a {n}-way one; give the shards "
                             f"of one save; nothing was written")
    seen: dict[int, str] = {}
    for path, (r, _) in zip(paths, places):
        if r in seen:
            raise ValueError(f"{path}: shard {r} of {n} given twice (also as {seen[r]}); nothing was written")
        seen[r] = path
    missing = [r for r in range(n) if r not in seen]
    if missing:
        raise ValueError(f"shard{'s' * (len(missing) > 1)} {', '.join(map(str, missing))} of {n} missing: a "
                         f"{n}-way split needs all {n} shard tables (shard-0-of-{n} .. shard-{n - 1}-of-{n}); "
                         f"nothing was written")
    first, first_path = tables[0], paths[0]
    for path, t in zip(paths[1:], tables[1:]):
        if t.dim != first.dim:
            raise ValueError(f"{path}: dim {t.dim} differs from {first_path}'s {first.dim}; nothing was written")
        if type(t.config.optimizer) is not type(first.config.optimizer):
            raise ValueError(f"{path}: optimizer {type(t.config.optimizer).__name__} differs from {first_path}'s "
                             f"{type(first.config.optimizer).__name__}; nothing was written")
        if t.config.dtype != first.config.dtype:
            raise ValueError(f"{path}: row dtype {t.config.dtype} differs from {first_path}'s {first.config.dtype}; "
                             f"nothing was written")
        if t.step != first.step:
            raise ValueError(f"{path}: step {t.step} differs from {first_path}'s {first.step} (shards of one save "
                             f"share a step); nothing was written")
    for path, t, (r, _) in zip(paths, tables, places):
        check_shard(t, path, r, n, BATCH, progress)
    first_save = (first.shard or {}).get("save")
    for path, t in zip(paths[1:], tables[1:]):
        save = (t.shard or {}).get("save")
        if save != first_save:
            raise ValueError(f"{path}: written by save {save or '(not recorded)'}, {first_path} by "
                             f"{first_save or '(not recorded)'}: shards of two saves; give the shards of one save; "
                             f"nothing was written")
    return {"world_size": n, "rows": sum(len(t) for t in tables), "evicted": sum(t.evicted_count for t in tables)}


def _split_config(tables: list[TableFile], world_size: int, max_rows: int | None):
    """The config of each of `world_size` shards cut from `tables`: the first's, with the row
    budget (and its headroom) the inputs' sum split ceil(sum / world_size) ways, as a sharded
    collection splits a table's budget; `max_rows` overrides the budget. The capacity hint is
    the inputs' largest, at most the budget."""
    config = tables[0].config
    capacity = max(t.config.capacity for t in tables)

    def split(name: str) -> int | None:
        values = [getattr(t.config, name) for t in tables]
        return None if any(v is None for v in values) else -(-sum(values) // world_size)

    budget = max_rows if max_rows is not None else split("max_rows")
    if budget is None:
        return dataclasses.replace(config, capacity=capacity)
    headroom = split("headroom")
    return dataclasses.replace(config, max_rows=budget, capacity=min(capacity, budget),
                               headroom=None if headroom is None else min(headroom, budget - 1))


def reshard(paths: list[str], tables: list[TableFile], out: str, world_size: int, *, single: bool = False,
            max_rows: int | None = None, progress: Callable = iter) -> dict:
    """Re-split the shard tables of one table (`check_shards`: every shard of an N-way split)
    into `world_size` shards by the owner hash: ``out/shard-R-of-M`` holds every key with
    `owner_of(key, M) == R`, its row, optimizer state, count and last step unchanged (rows of
    16-bit tables too: decoded and encoded exactly). With `single`, `out` is one table holding
    every row (the shards merged; what one process loads).

    The outputs keep the inputs' config and step, with the row budget split as described in
    `_split_config` (a shard past its new budget is refused: pass `max_rows`, per output
    shard). The eviction counts, which cannot be attributed to keys, are summed onto shard 0
    (the total over shards stays what it was).

    Everything is checked before anything is written; the shards are written to a temporary
    directory beside `out` and renamed into place, so a refusal or a crash leaves `out` as it
    was (it must be new or an empty directory, its parents are made as needed; with `single`, new,
    empty or a table). Reads
    each input twice in batches (keys, then everything); holds no table in memory.
    Returns {"world_size_in", "world_size", "rows", "rows_per_shard"}."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world size must be an int >= 1, got {world_size!r}")
    if single:
        world_size = 1
    found = check_shards(paths, tables, progress)
    held = sum(len(t.fallback[0]) for t in tables if t.fallback is not None)
    if held:  # a key reads the fallback row of the shard that owns it: no split of them is exact
        raise ValueError(unplaceable_fallback_error(
            "fallback_rows", f"the shard tables hold {held} trained fallback rows (StoreConfig.fallback_rows)",
            f"they are to be {'merged' if world_size == 1 else f'split over {world_size} shards'}",
            [f"load the shards on {found['world_size']} ranks (the world size they were saved at)",
             "train the tables with fallback_rows=0 to reshard them"], "written"))
    order = sorted(range(len(paths)), key=lambda i: parse_shard_name(os.path.basename(os.path.normpath(paths[i])))[0])
    tables = [tables[i] for i in order]
    per_shard = np.zeros(world_size, np.int64)
    for t in tables:
        for _, b in t.batches(BATCH, ("keys",)):
            per_shard += np.bincount(owner_of(b["keys"], world_size), minlength=world_size)
    config = _split_config(tables, world_size, max_rows)
    if config.max_rows is not None and per_shard.max() > config.max_rows:
        j = int(per_shard.argmax())
        raise ValueError(f"shard {j} of {world_size} would hold {int(per_shard[j]):,} rows, past its budget of "
                         f"{config.max_rows:,} (the inputs' budgets split {world_size} ways); pass a larger "
                         f"--max-rows (rows per output shard); nothing was written")
    if single:
        targets, final = [out], None
    else:
        if os.path.lexists(out) and not (os.path.isdir(out) and not os.listdir(out)):
            raise ValueError(f"{out}: exists and is not an empty directory; the shards go to a new one; nothing "
                             f"was written")
        parent = os.path.dirname(os.path.abspath(out))
        os.makedirs(parent, exist_ok=True)
        final = os.path.join(parent, f".{os.path.basename(os.path.abspath(out))}.tmp-{os.getpid()}")
        shutil.rmtree(final, ignore_errors=True)
        os.makedirs(final)
        targets = [os.path.join(final, shard_name(j, world_size)) for j in range(world_size)]
    writers = []
    save = f"reshard-{secrets.token_hex(8)}"  # one id for the outputs: shards of one save
    try:
        for j, target in enumerate(targets):
            writers.append(TableWriter(target, config, int(per_shard[j]), tables[0].step,
                                       evicted_count=found["evicted"] if j == 0 else 0,
                                       shard=None if single else {"rank": j, "world_size": world_size, "save": save}))
        for t in tables:
            for _, b in progress(t.batches(BATCH, _SHARD_FIELDS)):
                owners = owner_of(b["keys"], world_size)
                for j, writer in enumerate(writers):
                    mine = owners == j
                    writer.write(*(b[name][mine] for name in _SHARD_FIELDS))
        for writer in writers:
            writer.commit()
    except BaseException:
        for writer in writers:
            writer.abort()
        if final is not None:
            shutil.rmtree(final, ignore_errors=True)
        raise
    if final is not None:
        if os.path.isdir(out):
            os.rmdir(out)  # new or empty (checked above)
        os.rename(final, out)
    return {"world_size_in": found["world_size"], "world_size": world_size, "rows": found["rows"],
            "rows_per_shard": per_shard.tolist()}

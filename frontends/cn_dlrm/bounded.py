"""Bounded tables for the DLRM job: each table's row budget, the policy objects of the
`--max-rows / --evict / --ttl-steps / --admit-min-count` options, and what a run reports
about them (rows per table, evictions).

A budget given as a percentage is P% of the distinct IDs the training range brings to each
table, counted in one pass over the synthetic stream, but never below the most distinct IDs
one training batch brings to that table, so that every ID of a batch gets a row (a lookup
whose own distinct keys exceed the budget trains, but the keys past it overflow: no row, no
update; the core never evicts rows the lookup uses). On W processes each table is sharded
and each shard bounds itself at ceil(budget / W) rows, so the floor is W times the most IDs one
batch brings to a single shard (the keys' owners by `owner_of`, as the sharded lookup routes them).

>>> from cncore.synthetic import SyntheticCriteo
>>> counts = stream_counts(SyntheticCriteo(seed=0, batch_size=64), steps=4)
>>> counts.distinct[0] >= counts.peak_batch[0] >= 1
True
>>> budgets = percent_budgets(counts, 50.0)
>>> all(p <= b <= d for b, p, d in zip(budgets, counts.peak_batch, counts.distinct))
True
>>> policy("lfu", None), policy("ttl", 10), policy(None, None)
(LFU(), TTL(steps=10), None)
"""
from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

import cncore
from cn_dlrm.options import InputError, row_budget
from cncore.synthetic import N_SPARSE, SyntheticCriteo
from cncore.tier import TieredStore

__all__ = ["StreamCounts", "stream_counts", "percent_budgets", "policy", "table_budgets", "collection_options",
           "sweep_expired", "eviction_summary", "tier_summary"]


@dataclass
class StreamCounts:
    """Per feature (table): distinct IDs over a range of batches, and the most in one batch."""
    distinct: list[int]
    peak_batch: list[int]


def stream_counts(gen: SyntheticCriteo, steps: int, start: int = 0, world_size: int = 1) -> StreamCounts:
    """Count the distinct IDs of each feature in batches start .. steps-1 of `gen`; peak_batch is
    the most distinct IDs of one batch (with world_size > 1: world_size times the most that one
    batch routes to one shard, the budget a shard of ceil(budget / world_size) rows needs)."""
    seen: list[np.ndarray] = [np.empty(0, np.int64) for _ in range(N_SPARSE)]
    pending: list[list[np.ndarray]] = [[] for _ in range(N_SPARSE)]
    peak = [0] * N_SPARSE
    for i in range(start, steps):
        a = gen.arrays(i)
        for f, values in enumerate(a.values):
            u = np.unique(values)
            peak[f] = max(peak[f], len(u) if world_size == 1 else world_size * _largest_shard(u, world_size))
            pending[f].append(u)
        if (i - start) % 64 == 63 or i == steps - 1:  # merge now and then: memory stays ~ the distinct IDs
            for f in range(N_SPARSE):
                seen[f] = np.unique(np.concatenate([seen[f], *pending[f]]))
                pending[f] = []
    return StreamCounts([len(s) for s in seen], peak)


def _largest_shard(keys: np.ndarray, world_size: int) -> int:
    import torch

    from cncore_torch.distributed.routing import owner_of
    return int(np.bincount(owner_of(torch.from_numpy(keys), world_size).numpy(), minlength=world_size).max())


def percent_budgets(counts: StreamCounts, percent: float) -> list[int]:
    """P% of each table's distinct IDs (rounded up), at least its peak batch, at most all of them."""
    return [min(d, max(math.ceil(d * percent / 100), p, 1)) for d, p in zip(counts.distinct, counts.peak_batch)]


def policy(evict: str | None, ttl_steps: int | None, lfu_halve_every: int | None = None):
    """The cncore eviction object of --evict (None: no policy)."""
    if evict is None:
        return None
    if evict == "lfu":
        return cncore.LFU(halve_every=lfu_halve_every)
    if evict == "lru":
        return cncore.LRU()
    if ttl_steps is None:
        raise ValueError("--evict ttl needs --ttl-steps S (rows unused for more than S steps expire)")
    return cncore.TTL(ttl_steps)


def table_budgets(args, names: list[str], synthetic: SyntheticCriteo | None,
                  world_size: int = 1) -> dict[str, int] | None:
    """{table name: row budget} of --max-rows (None without it); world_size: the processes the
    tables are sharded over (see the module docstring)."""
    rows, percent = row_budget(args.max_rows)
    if rows is not None:
        return dict.fromkeys(names, rows)
    if percent is None:
        return None
    if synthetic is None:
        raise ValueError(f"--max-rows {args.max_rows} counts distinct IDs in the synthetic stream; with "
                         "--criteo-tsv give rows per table (--max-rows N)")
    return dict(zip(names, percent_budgets(stream_counts(synthetic, args.steps, world_size=world_size), percent)))


def collection_options(args, names: list[str], synthetic: SyntheticCriteo | None, world_size: int = 1,
                       rank: int = 0, sizes: list[int] | None = None) -> dict:
    """The keyword arguments of the bounded-table options for CNEmbeddingBagCollection (only
    those set: the collection's defaults stay its own); with --ssd-path, the tier (each rank its
    own directory)."""
    options: dict = {}
    if getattr(args, "ssd_path", None):
        options["storage"] = tier_storage(args, names, sizes or [1] * len(names), world_size, rank)
    budgets = table_budgets(args, names, synthetic, world_size)
    if budgets is not None:
        options["max_rows"] = budgets
        # A row per ID unless --auto-split: the job's runs on N processes (which cannot split), its
        # resumes across process counts and options, and its published AUCs are of that table.
        options["fallback_rows"] = "auto" if getattr(args, "auto_split", False) else 0
    if args.evict is not None:
        options["eviction"] = policy(args.evict, args.ttl_steps, getattr(args, "lfu_halve_every", None))
    if args.admit_min_count is not None:
        options["admission"] = cncore.MinCount(args.admit_min_count)
    if getattr(args, "admit_probability", None) is not None:
        options["admission"] = cncore.Probability(args.admit_probability)
    if getattr(args, "row_dtype", "float32") != "float32":
        options["row_dtype"] = args.row_dtype
    return options


def tier_storage(args, names: list[str], sizes: list[int], world_size: int, rank: int) -> dict[str, cncore.Tiered]:
    """--ssd-path / --cache-mb: each table its directory and a share of the cache by its size,
    never less than 4 batches of distinct IDs (a lookup's keys must fit the cache at once)."""
    root = args.ssd_path if world_size == 1 else os.path.join(args.ssd_path, f"rank{rank}")
    try:
        os.makedirs(root, exist_ok=True)  # the tables' directories go in it (a tier makes only its own)
    except OSError as e:
        raise InputError(f"--ssd-path {args.ssd_path}: cannot make the directory {root} ({e.strerror or e})") from None
    row = args.embedding_dim * 4 + 4 + 47  # a cached row: values, row-wise Adagrad state, metadata, index
    floor = 4 * args.batch_size * row
    total = sum(max(1, n) for n in sizes)
    return {name: cncore.Tiered(os.path.join(root, name), max(floor, (args.cache_mb << 20) * max(1, n) // total))
            for name, n in zip(names, sizes)}


def sweep_expired(stores: dict[str, cncore.EmbeddingStore]) -> int:
    """TTL tables: evict the rows expired at this step, also below the budget; returns how many."""
    return sum(store.evict_expired() for store in stores.values()
               if isinstance(store.config.eviction, cncore.TTL))


def tier_summary(stores: Mapping[str, cncore.EmbeddingStore | TieredStore]) -> dict:
    """The SSD tier's totals over the tables on it (for the job's report): the rows their memory
    caches hold at most, IDs found in memory (hits) and read from disk (misses) over every
    lookup of the run (prefill, training, evaluation), rows read and written; {} when no table
    is on the tier."""
    tiered = [store for store in stores.values() if isinstance(store, TieredStore)]
    if not tiered:
        return {}
    totals = {key: sum(int(store.stats[key]) for store in tiered)
              for key in ("hits", "misses", "rows_read", "rows_written")}
    return {"tier_cache_rows": float(sum(store.cache_rows for store in tiered)),
            **{f"tier_{key}": float(value) for key, value in totals.items()}}


def eviction_summary(stores: dict[str, cncore.EmbeddingStore]) -> dict:
    """Rows and evictions per table, and their totals (for the job's report)."""
    rows = {name: len(store) for name, store in stores.items()}
    evicted = {name: int(store.evicted_count) for name, store in stores.items()}
    # a table that split its budget (fallback_rows="auto") holds max_rows keyed + fallback rows
    budgets = {name: None if store.config.max_rows is None else
               store.config.max_rows + getattr(store, "fallback_rows", 0) for name, store in stores.items()}
    return {"rows_per_table": rows, "evicted_per_table": evicted, "max_rows_per_table": budgets,
            "evicted": float(sum(evicted.values()))}



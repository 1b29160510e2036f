"""The accelerator placement against `nn.EmbeddingBag` on the same accelerator, per training step.

    python asv_bench/scripts/accelerator_step.py [--rows 1000000] [--dim 64] [--batch 4096] [--pooling 20]
        [--compile]

Needs an accelerator (CUDA, or MLU through torch_mlu): `device="cncard"`. Three ways to hold
the same table of `--rows` rows, trained with plain SGD (sum pooling) on the same batches:

- `nn.EmbeddingBag(sparse=True)` on the accelerator with `torch.optim.SGD`: IDs already lie in
  [0, rows) (a fixed table cannot take raw 64-bit IDs; hashing them would be the user's work);
- `CNEmbeddingBag(device="cncard")`: rows, optimizer state and metadata on the accelerator, the
  key index on the host (the core), fused SGD in the backward;
- `CNEmbeddingBag(device="cncard")` with the key index on the accelerator too
  (`CNCORE_DEVICE_INDEX=device`: `cncore_torch.device_index`), the initialiser Uniform (drawn
  on the device; the normal laws are drawn by the core on the host);
- the same, with `--compile`: under `torch.compile(fullgraph=True)` (the lookup one `cncore::`
  operator each way; Inductor compiles the rest of the step);
- FBGEMM's training TBE (`SplitTableBatchedEmbeddingBagsCodegen`, EXACT_SGD, rows on the
  device) with the same IDs, when `fbgemm_gpu` is installed (its CPU build on the CPU device);
- `CNEmbeddingBag()` in the core (host memory), for reference on the same machine.

Then the device index alone (`DeviceKeyIndex`): keys per second of `find`, of `find_or_insert`
on keys present (a training step's case) and of filling it with new keys, in batches of
`--index-batch` keys, beside the core's index (`EmbeddingStore.find_or_insert`) on the host.

Without an accelerator, `CNCORE_CNCARD=cpu` runs every "device" column on the CPU (the code
path, not an accelerator's speed).

IDs come from the data loader on the host, so every step starts from host IDs (the fixed table
pays their copy to the device too). Each round draws fresh IDs (uniform, or Zipf(1.05) with
the hot rows scattered), the table is filled first (every row exists), and each cell is the
median of `--steps` timed steps after `--warmup`, the device synchronised around each step.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch
from torch import nn

import cncore
from cncore_torch import CNEmbeddingBag
from cncore_torch.device_index import DeviceKeyIndex
from cncore_torch.devices import resolve_device


def batches(dist: str, rows: int, batch: int, pooling: int, n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    scatter = rng.permutation(rows)  # the hot rows are not the first ones
    out = []
    for _ in range(n):
        if dist == "uniform":
            ids = rng.integers(0, rows, (batch, pooling))
        else:
            ids = scatter[np.minimum(rng.zipf(1.05, (batch, pooling)) - 1, rows - 1)]
        out.append(torch.from_numpy(ids.astype(np.int64)))
    return out


def timed(step, inputs, warmup: int, sync) -> float:
    for ids in inputs[:warmup]:
        step(ids)
    sync()
    times = []
    for ids in inputs[warmup:]:
        start = time.perf_counter()
        step(ids)
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def tbe(rows: int, dim: int, device: torch.device, lr: float):
    """FBGEMM's training TBE with the table on `device` (CUDA, or its CPU build on the CPU), plain
    SGD, sum pooling; None when fbgemm_gpu is missing or has no kernels for the device."""
    try:
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            SplitTableBatchedEmbeddingBagsCodegen,
        )
    except ImportError:
        return None
    where = ((EmbeddingLocation.DEVICE, ComputeDevice.CUDA) if device.type == "cuda"
             else (EmbeddingLocation.HOST, ComputeDevice.CPU))
    try:
        return SplitTableBatchedEmbeddingBagsCodegen([(rows, dim, *where)], optimizer=EmbOptimType.EXACT_SGD,
                                                     learning_rate=lr, pooling_mode=PoolingMode.SUM)
    except (RuntimeError, AssertionError) as error:  # (a build without this device's kernels)
        print(f"FBGEMM's TBE is not timed: {error}")
        return None


def index_rates(device, sync, n_keys: int, batch: int, repeats: int) -> list[tuple[str, float, float]]:
    """(operation, device index M keys/s, core index M keys/s): the best of `repeats` passes."""
    rng = np.random.default_rng(3)
    keys = rng.integers(-2**63, 2**63 - 1, n_keys, dtype=np.int64)
    chunks = [keys[i:i + batch] for i in range(0, n_keys, batch)]
    dev_chunks = [torch.from_numpy(c).to(device) for c in chunks]

    def best(run) -> float:
        times = []
        for _ in range(repeats):
            sync()
            start = time.perf_counter()
            run()
            sync()
            times.append(time.perf_counter() - start)
        return n_keys / min(times) / 1e6

    def fresh():
        return DeviceKeyIndex(cncore.StoreConfig(dim=1), device), cncore.EmbeddingStore(dim=1)

    def fill_device():
        idx = DeviceKeyIndex(cncore.StoreConfig(dim=1), device)
        for c in dev_chunks:
            idx.find_or_insert(c)

    def fill_core():
        store = cncore.EmbeddingStore(dim=1)
        for c in chunks:
            store.find_or_insert(c)

    rows = [("fill (new keys)", best(fill_device), best(fill_core))]
    idx, store = fresh()
    for c, d in zip(chunks, dev_chunks):
        idx.find_or_insert(d)
        store.find_or_insert(c)
    rows.append(("find_or_insert (keys present)", best(lambda: [idx.find_or_insert(d) for d in dev_chunks]),
                 best(lambda: [store.find_or_insert(c) for c in chunks])))
    rows.append(("find", best(lambda: [idx.find(d) for d in dev_chunks]),
                 best(lambda: [store.find(c) for c in chunks])))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=10**6)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--pooling", type=int, nargs="+", default=[1, 20])
    ap.add_argument("--dists", nargs="+", default=["uniform", "zipf1.05"])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--index-keys", type=int, default=2**22, help="keys of the index rate runs")
    ap.add_argument("--index-batch", type=int, default=2**16, help="keys a call in the index rate runs")
    ap.add_argument("--compile", action="store_true",
                    help="also time the device-index table under torch.compile(fullgraph=True)")
    ap.add_argument("--torch-threads", type=int, default=None,
                    help="torch's intra-op threads (default: torch's own); the CPU device's kernels use them")
    args = ap.parse_args(argv)
    if args.torch_threads is not None:
        torch.set_num_threads(args.torch_threads)
    device = resolve_device("cncard").device
    sync = (torch.cuda.synchronize if device.type == "cuda" else lambda: None)
    print(f"device {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else device.type}), "
          f"{args.rows:,} rows x dim {args.dim}, batch {args.batch}, torch {torch.__version__}, "
          f"{cncore.get_num_threads()} core threads, {torch.get_num_threads()} torch threads")
    fill = torch.arange(args.rows).reshape(-1, 1000)

    fixed = nn.EmbeddingBag(args.rows, args.dim, mode="sum", sparse=True).to(device)
    fixed_opt = torch.optim.SGD(fixed.parameters(), lr=0.01)
    card = CNEmbeddingBag(args.rows, args.dim, mode="sum", optimizer=cncore.SGD(lr=0.01), device="cncard")
    previous = os.environ.get("CNCORE_DEVICE_INDEX")
    os.environ["CNCORE_DEVICE_INDEX"] = "device"
    try:
        indexed = CNEmbeddingBag(args.rows, args.dim, mode="sum", optimizer=cncore.SGD(lr=0.01), device="cncard",
                                 initializer=cncore.Uniform())
    finally:
        if previous is None:
            del os.environ["CNCORE_DEVICE_INDEX"]
        else:
            os.environ["CNCORE_DEVICE_INDEX"] = previous
    core = CNEmbeddingBag(args.rows, args.dim, mode="sum", optimizer=cncore.SGD(lr=0.01))
    for module in (card, indexed, core):
        for chunk in fill:
            module(chunk.reshape(1, -1))  # every row exists before timing
    grad = torch.full((args.batch, args.dim), 1e-3)
    grads = {"dev": grad.to(device), "cpu": grad}

    def fixed_step(ids):
        fixed_opt.zero_grad()
        fixed(ids.to(device, non_blocking=True)).backward(grads["dev"])
        fixed_opt.step()

    def card_step(ids):
        card(ids).backward(grads["dev"])

    def indexed_step(ids):
        indexed(ids.to(device, non_blocking=True)).backward(grads["dev"])

    compiled = torch.compile(indexed, fullgraph=True) if args.compile else None

    def compiled_step(ids):
        compiled(ids.to(device, non_blocking=True)).backward(grads["dev"])

    fbgemm = tbe(args.rows, args.dim, device, 0.01)

    def tbe_step(ids):
        ids = ids.to(device, non_blocking=True)
        offsets = torch.arange(0, ids.numel() + 1, ids.shape[1], device=device)
        fbgemm(ids.reshape(-1), offsets).backward(grads["dev"])

    def core_step(ids):
        core(ids).backward(grads["cpu"])

    print("| IDs | pooling | nn.EmbeddingBag on the device, ms | CNEmbeddingBag on the device (host index), ms | "
          "/ EmbeddingBag | CNEmbeddingBag, index on the device, ms | / EmbeddingBag | compiled, ms | / EmbeddingBag | "
          "FBGEMM TBE, ms | index on the device / TBE | CNEmbeddingBag in host memory, ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for dist in args.dists:
        for pooling in args.pooling:
            inputs = batches(dist, args.rows, args.batch, pooling, args.warmup + args.steps)
            t_fixed = timed(fixed_step, inputs, args.warmup, sync)
            t_card = timed(card_step, inputs, args.warmup, sync)
            t_indexed = timed(indexed_step, inputs, args.warmup, sync)
            t_core = timed(core_step, inputs, args.warmup, sync)
            compiled_cells = "n/a | n/a"
            if compiled is not None:
                t_compiled = timed(compiled_step, inputs, args.warmup, sync)
                compiled_cells = f"{t_compiled:.2f} | {t_compiled / t_fixed:.2f}x"
            tbe_cells = "n/a | n/a"
            if fbgemm is not None:
                t_tbe = timed(tbe_step, inputs, args.warmup, sync)
                tbe_cells = f"{t_tbe:.2f} | {t_indexed / t_tbe:.2f}x"
            print(f"| {dist} | {pooling} | {t_fixed:.2f} | {t_card:.2f} | {t_card / t_fixed:.2f}x | {t_indexed:.2f} | "
                  f"{t_indexed / t_fixed:.2f}x | {compiled_cells} | {tbe_cells} | {t_core:.2f} |")
    print(f"\nThe key index alone: {args.index_keys:,} random int64 keys, {args.index_batch:,} a call, best of 3")
    print(f"| operation | DeviceKeyIndex on {device}, M keys/s | core index (host), M keys/s | device / core |")
    print("|---|---|---|---|")
    for name, dev_rate, core_rate in index_rates(device, sync, args.index_keys, args.index_batch, 3):
        print(f"| {name} | {dev_rate:.2f} | {core_rate:.2f} | {dev_rate / core_rate:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

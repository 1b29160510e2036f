"""Checkpoints across world sizes: 3 ranks train and save one state_dict each; 2 ranks (and one
process) load `merge_shards` of the 3, find exactly the saved rows, optimizer state, counts,
last steps and step for the keys they own, and train on; after that, every rank's rows equal a
single process that trained on the same global batches throughout (to fp32 reassociation of
bags split across ranks: assert_close at 1e-6)."""
import numpy as np
import pytest
import torch

pytest.importorskip("torchrec")

from test_distributed_sharding import _concat, _configs, _kjts

TIMEOUT = 80.0
KIND = "mean"
SIZES = {3: [3, 4, 2], 2: [5, 4], 1: [9]}


def _model(device):
    import cncore
    from cncore_torch import CNEmbeddingBagCollection
    # on the CPU: a one-process model, also each rank's own reference (per_rank_tables)
    return CNEmbeddingBagCollection(_configs(KIND), device=device, optimizer=cncore.Adam(lr=0.05), seed=11,
                                    per_rank_tables=device == "cpu")


class Net(torch.nn.Module):
    def __init__(self, device):
        super().__init__()
        self.sparse = _model(device)

    def forward(self, kjt):
        return self.sparse(kjt)


def _step(model, kjt, targets):
    out = model(kjt)
    (out.values() * targets).sum().backward()


def _targets(step, n):
    return torch.from_numpy(np.random.default_rng(step).standard_normal((n, 27)).astype(np.float32))


def _reference(steps):
    """One process trained on the global batches of steps 0..steps-1 (3 ranks' then 2 ranks')."""
    ref = Net("cpu")
    for step in range(steps):
        sizes = SIZES[3] if step < 2 else SIZES[2]
        _step(ref, _concat(_kjts(step, sizes, False, 50)), _targets(step, sum(sizes)))
    return ref


def _ranks(rank, world_size, directory, phase):
    from torchrec.distributed.model_parallel import DistributedModelParallel

    from cncore_torch.distributed import CNEmbeddingBagCollectionSharder, merge_shards, owner_of

    dmp = DistributedModelParallel(Net("meta"), device=torch.device("cpu"),
                                   sharders=[CNEmbeddingBagCollectionSharder()])
    sizes, start = SIZES[world_size], sum(SIZES[world_size][:rank])
    steps = range(2) if phase == "save" else range(2, 4)
    if phase == "resume":
        merged = merge_shards([torch.load(f"{directory}/rank{r}.pt") for r in range(3)])
        dmp.load_state_dict(merged)
        for name, store in dmp.module.sparse.stores.items():
            p = f"sparse.tables.{name}."
            mine = (owner_of(merged[p + "keys"], world_size) == rank).numpy()
            batch = store.export()
            order = np.argsort(batch.keys)
            want = np.argsort(merged[p + "keys"].numpy()[mine])
            for field in ("keys", "rows", "optimizer_state", "counts", "last_steps"):
                np.testing.assert_array_equal(np.asarray(getattr(batch, field))[order],
                                              merged[p + field].numpy()[mine][want], err_msg=f"{name}.{field}")
            assert store.step == int(merged[p + "step"])
    for step in steps:
        kjt = _kjts(step, sizes, False, 50)[rank]
        _step(dmp, kjt, _targets(step, sum(sizes))[start:start + sizes[rank]])
    if phase == "save":
        torch.save(dmp.state_dict(), f"{directory}/rank{rank}.pt")
        return
    ref = _reference(4)
    for name, store in dmp.module.sparse.stores.items():
        batch = store.export()
        torch.testing.assert_close(torch.from_numpy(batch.rows),
                                   torch.from_numpy(ref.sparse.stores[name].lookup(batch.keys)),
                                   rtol=1e-6, atol=1e-6)
        assert store.step == ref.sparse.stores[name].step == 4


@pytest.mark.slow
def test_three_ranks_save_two_ranks_and_one_process_resume(tmp_path):
    from cncore_torch.distributed import merge_shards
    from cncore_torch.distributed.launch import spawn

    spawn(_ranks, 3, str(tmp_path), "save", timeout=TIMEOUT)
    spawn(_ranks, 2, str(tmp_path), "resume", timeout=TIMEOUT)
    # one process: the merged checkpoint into a plain collection, then the same two steps
    merged = merge_shards([torch.load(tmp_path / f"rank{r}.pt") for r in range(3)])
    single = Net("cpu")
    single.load_state_dict(merged)
    for step in range(2, 4):
        _step(single, _concat(_kjts(step, SIZES[2], False, 50)), _targets(step, sum(SIZES[2])))
    ref = _reference(4)
    for name, store in ref.sparse.stores.items():
        keys = np.sort(store.export().keys)
        np.testing.assert_array_equal(np.sort(single.sparse.stores[name].export().keys), keys)
        torch.testing.assert_close(torch.from_numpy(single.sparse.stores[name].lookup(keys)),
                                   torch.from_numpy(store.lookup(keys)), rtol=1e-6, atol=1e-6)


def test_merge_refuses_overlapping_or_disagreeing_shards():
    from cncore_torch.distributed import merge_shards
    m = _model("cpu")
    m(_kjts(0, [3], False, 50)[0]).values().sum().backward()
    sd = m.state_dict()
    with pytest.raises(ValueError, match="a key appears in two shards"):
        merge_shards([sd, sd])
    other = dict(sd)
    other["tables.t_wide.step"] = sd["tables.t_wide.step"] + 1
    with pytest.raises(ValueError, match="the shards disagree"):
        merge_shards([sd, {k: (v[:0] if k.endswith(("keys", "rows", "optimizer_state", "counts", "last_steps"))
                                   else v) for k, v in other.items()}])

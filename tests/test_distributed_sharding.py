"""CNEmbeddingBagCollection sharded row-wise by DMP over 2 and 3 gloo processes on this machine,
against one process holding every row.

Each rank builds the same W random KJTs (rank r's batch size differs per rank, one rank may have
an empty batch), feeds its own to the DMP model, and runs a single-process collection with the
same configs and seed on their concatenation (rank order). Checked in every rank:
- forward: rank r's KeyedTensor equals the single-process rows of its samples, to fp32
  reassociation (a bag split across ranks is summed from partial sums: assert_close at 1e-6);
- training: after k fused steps (loss = sum(out * fixed targets), so the gradient of every
  pooled row is the same in both), the rows of the keys a rank owns equal the single-process
  rows (assert_close at 1e-6, the same reassociation in the forward of the next steps) and its
  optimizer state too; every key lives on exactly one rank, the one `owner_of` names, and the
  ranks together hold exactly the single-process keys;
- eval mode: nothing is inserted, unseen keys read as zero rows on both;
- the output dist sent exactly the partial pools it should (counted from the batches): every
  sample's by default, with pack_pools=True only those of bags holding a key on the sender (the
  analytic minimum), and their gradients.
"""
import numpy as np
import pytest
import torch

pytest.importorskip("torchrec")

TIMEOUT = 80.0


def _configs(kind):
    from torchrec import EmbeddingBagConfig, PoolingType
    mean = PoolingType.SUM if kind == "weighted_sum" else PoolingType.MEAN
    return [EmbeddingBagConfig(name="t_shared", embedding_dim=4, num_embeddings=64, feature_names=["f1", "f2"]),
            EmbeddingBagConfig(name="t_mean", embedding_dim=3, num_embeddings=64, feature_names=["f3"], pooling=mean),
            EmbeddingBagConfig(name="t_wide", embedding_dim=16, num_embeddings=8, feature_names=["f4"])]


def _kjts(seed, batch_sizes, weighted, high):
    """One KJT per rank (keys f1..f4, batch sizes as given, bags of 0..4 keys), from `seed`."""
    from torchrec import KeyedJaggedTensor
    rng = np.random.default_rng(seed)
    out = []
    for b in batch_sizes:
        lengths = rng.integers(0, 5, 4 * b)
        values = rng.integers(-high, high, int(lengths.sum()))
        weights = torch.from_numpy(rng.random(len(values)).astype(np.float32)) if weighted else None
        out.append(KeyedJaggedTensor.from_lengths_sync(keys=["f1", "f2", "f3", "f4"], values=torch.from_numpy(values),
                                                       lengths=torch.from_numpy(lengths), weights=weights))
    return out


def _concat(kjts):
    from torchrec import KeyedJaggedTensor
    keys = kjts[0].keys()
    values, lengths, weights = [], [], []
    for key in keys:  # feature-major: each feature's bags of every rank, in rank order
        for k in kjts:
            jt = k[key]
            values.append(jt.values()), lengths.append(jt.lengths())
            if k.weights_or_none() is not None:
                weights.append(jt.weights())
    return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths),
                                               weights=torch.cat(weights) if weights else None)


DIMS = [4, 4, 3, 16]  # f1, f2 (t_shared), f3 (t_mean), f4 (t_wide)


def _pool_bytes(kjts, rank, world_size, backward):
    """Bytes of partial pools `rank` sends in one step, counted from the batches: forward, the
    pool of every other rank's bag holding a key owned here; backward, the gradient of each of
    its own bags to every other rank holding a key of it."""
    from cncore_torch.distributed import owner_of
    sent = 0
    for sender_of, kjt in enumerate(kjts):
        lengths = kjt.lengths()
        n_bags = lengths.numel()
        bag = torch.repeat_interleave(torch.arange(n_bags), lengths)
        dim_of_bag = torch.tensor(DIMS).repeat_interleave(n_bags // 4)
        owner = owner_of(kjt.values(), world_size)
        holders = [r for r in range(world_size) if r != rank] if sender_of == rank else [rank]
        if sender_of == rank and not backward:
            continue
        for r in holders:
            sent += 4 * int(dim_of_bag[torch.unique(bag[owner == r])].sum())
    return sent


def _dense_pool_bytes(batch_sizes, rank, backward):
    """Bytes of unpacked partial pools `rank` sends in one step: every sample of every other rank
    forward, every own sample to every other rank backward (27 floats a sample)."""
    others = sum(batch_sizes) - batch_sizes[rank]
    return 4 * sum(DIMS) * (others + (len(batch_sizes) - 1) * batch_sizes[rank] * backward)


def _train_and_compare(rank, world_size, kind, batch_sizes, steps, use_plan, optimizer_name, pack=False):
    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel

    import cncore
    from cncore_torch import CNEmbeddingBagCollection
    from cncore_torch.distributed import CNEmbeddingBagCollectionSharder, owner_of, plan_for

    weighted = kind.startswith("weighted")
    optimizer = getattr(cncore, optimizer_name)(lr=0.05)
    make = lambda device, **kw: CNEmbeddingBagCollection(_configs(kind), is_weighted=weighted,  # noqa: E731
                                                        device=device, optimizer=optimizer, seed=7, **kw)
    model = make("meta")
    kw = dict(plan=plan_for(model, world_size)) if use_plan else {}
    dmp = DistributedModelParallel(model, device=torch.device("cpu"),
                                   sharders=[CNEmbeddingBagCollectionSharder(pack_pools=pack)], **kw)
    ref = make("cpu", per_rank_tables=True)  # each rank's own one-process reference
    sharded = dmp.module
    start = sum(batch_sizes[:rank])
    pool_bytes = 0
    for step in range(steps):
        kjts = _kjts(100 * step + 1, batch_sizes, weighted, high=40 if step % 2 else 2**62)
        pool_bytes += (_pool_bytes(kjts, rank, world_size, backward=True) if pack else
                       _dense_pool_bytes(batch_sizes, rank, backward=True))
        full = _concat(kjts)
        targets = torch.from_numpy(np.random.default_rng(step).standard_normal(
            (sum(batch_sizes), 4 + 4 + 3 + 16)).astype(np.float32))
        out, expected = dmp(kjts[rank]), ref(full)
        assert out.keys() == expected.keys() and out.length_per_key() == expected.length_per_key()
        mine = expected.values()[start:start + batch_sizes[rank]]
        torch.testing.assert_close(out.values(), mine, rtol=1e-6, atol=1e-6)
        (out.values() * targets[start:start + batch_sizes[rank]]).sum().backward()
        (expected.values() * targets).sum().backward()
    # eval: nothing inserted anywhere, unseen keys read as zero rows on both
    dmp.eval(), ref.eval()
    kjts = _kjts(999, batch_sizes, weighted, high=2**62)
    pool_bytes += (_pool_bytes(kjts, rank, world_size, backward=False) if pack else
                   _dense_pool_bytes(batch_sizes, rank, backward=False))
    rows_before = {name: len(s) for name, s in sharded.stores.items()}
    out, expected = dmp(kjts[rank]), ref(_concat(kjts))
    torch.testing.assert_close(out.values(), expected.values()[start:start + batch_sizes[rank]], rtol=1e-6, atol=1e-6)
    assert {name: len(s) for name, s in sharded.stores.items()} == rows_before
    # Packed: only pools of bags with a key on the sender travel (and their gradients back), the
    # minimum; unpacked: every sample's partial pool.
    assert sharded._output_dists[0].bytes_sent == (pool_bytes if world_size > 1 else 0)
    everyone = [None] * world_size
    owned = {name: store.export().keys for name, store in sharded.stores.items()}
    dist.all_gather_object(everyone, owned)
    for name, store in ref.stores.items():
        batch = sharded.stores[name].export()
        assert (owner_of(torch.from_numpy(batch.keys), world_size) == rank).all(), f"{name}: a key not owned here"
        order = np.argsort(batch.keys)
        keys = batch.keys[order]
        torch.testing.assert_close(torch.from_numpy(batch.rows[order]), torch.from_numpy(store.lookup(keys)),
                                   rtol=1e-6, atol=1e-6)
        ref_state = store.read(keys).optimizer_state
        torch.testing.assert_close(torch.from_numpy(batch.optimizer_state[order]), torch.from_numpy(ref_state),
                                   rtol=1e-6, atol=1e-6)
        all_keys = np.concatenate([e[name] for e in everyone])
        assert len(np.unique(all_keys)) == len(all_keys), f"{name}: a key lives on two ranks"
        np.testing.assert_array_equal(np.sort(all_keys), np.sort(store.export().keys))
        assert sharded.stores[name].step == store.step == steps


def _run(world_size, *args):
    from cncore_torch.distributed.launch import spawn
    spawn(_train_and_compare, world_size, *args, timeout=TIMEOUT)


@pytest.mark.slow
@pytest.mark.parametrize("kind, pack", [("mean", False), ("weighted_sum", True), ("weighted_mean", False)])
def test_two_ranks_unequal_batches_equal_one_process(kind, pack):
    _run(2, kind, [5, 3], 3, False, "Adagrad", pack)


@pytest.mark.slow
@pytest.mark.parametrize("pack", [False, True], ids=["every_pool", "packed_pools"])
def test_three_ranks_with_an_empty_batch_and_a_hand_plan(pack):
    _run(3, "mean", [4, 0, 6], 3, True, "RowWiseAdagrad", pack)

"""CNEmbeddingCollection (unpooled) sharded row-wise over 2 and 3 gloo processes, against one
process holding every row: each rank gets exactly the rows of its own IDs (exact: no pooling,
no reassociation), and after k fused steps the rows a rank owns equal the single-process rows
(to 1e-6: a row's gradient sums its IDs' gradients from every rank, in another order); every
key lives on one rank, the ranks together hold exactly the single-process keys."""
import numpy as np
import pytest
import torch

pytest.importorskip("torchrec")

from test_distributed_sharding import _concat, _kjts

TIMEOUT = 80.0


def _configs():
    from torchrec import EmbeddingConfig
    return [EmbeddingConfig(name="t_shared", embedding_dim=4, num_embeddings=64, feature_names=["f1", "f2"]),
            EmbeddingConfig(name="t_other", embedding_dim=4, num_embeddings=64, feature_names=["f3", "f4"])]


def _ranks(rank, world_size, batch_sizes, steps):
    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel

    import cncore
    from cncore_torch.collection import CNEmbeddingCollection
    from cncore_torch.distributed import CNEmbeddingCollectionSharder, owner_of

    make = lambda device, **kw: CNEmbeddingCollection(_configs(), device=device,  # noqa: E731
                                                      optimizer=cncore.Adagrad(lr=0.1), seed=5, **kw)
    dmp = DistributedModelParallel(make("meta"), device=torch.device("cpu"), sharders=[CNEmbeddingCollectionSharder()])
    ref = make("cpu", per_rank_tables=True)  # each rank's own one-process reference
    sharded = dmp.module
    for step in range(steps):
        kjts = _kjts(step, batch_sizes, False, high=30 if step % 2 else 2**62)
        out, expected = dmp(kjts[rank]).wait(), ref(_concat(kjts))  # a LazyAwaitable, as TorchRec's
        assert sorted(out) == sorted(expected)
        loss, ref_loss = 0.0, 0.0
        for name in expected:
            mine = kjts[rank][name]
            before = sum(int(k[name].lengths().sum()) for k in kjts[:rank])
            rows = expected[name].values()[before:before + mine.values().numel()]
            torch.testing.assert_close(out[name].values(), rows, rtol=0, atol=0)
            assert out[name].lengths().tolist() == mine.lengths().tolist()
            g = torch.Generator().manual_seed(step * 10 + len(name))
            target = torch.randn(expected[name].values().shape, generator=g)
            loss = loss + (out[name].values() * target[before:before + len(rows)]).sum()
            ref_loss = ref_loss + (expected[name].values() * target).sum()
        loss.backward()
        ref_loss.backward()
    everyone = [None] * world_size
    dist.all_gather_object(everyone, {n: s.export().keys for n, s in sharded.stores.items()})
    for name, store in ref.stores.items():
        batch = sharded.stores[name].export()
        assert (owner_of(torch.from_numpy(batch.keys), world_size) == rank).all()
        torch.testing.assert_close(torch.from_numpy(batch.rows), torch.from_numpy(store.lookup(batch.keys)),
                                   rtol=1e-6, atol=1e-6)
        all_keys = np.concatenate([e[name] for e in everyone])
        assert len(np.unique(all_keys)) == len(all_keys)
        np.testing.assert_array_equal(np.sort(all_keys), np.sort(store.export().keys))


@pytest.mark.slow
@pytest.mark.parametrize("world_size,batch_sizes", [(2, [5, 2]), (3, [3, 0, 4])])
def test_unpooled_ranks_equal_one_process(world_size, batch_sizes):
    from cncore_torch.distributed.launch import spawn
    spawn(_ranks, world_size, batch_sizes, 3, timeout=TIMEOUT)

"""Sharded tables on the SSD tier: under DMP each rank's shard of a tiered table lives in its own
directory (`<path>/shard-R-of-N`, never two ranks in one), and the sharded forward and training
equal one process holding every row in memory."""
import os

import numpy as np
import pytest
import torch

pytest.importorskip("torchrec")

TIMEOUT = 120.0


def _configs():
    from torchrec import EmbeddingBagConfig
    return [EmbeddingBagConfig(name="t_a", embedding_dim=4, num_embeddings=64, feature_names=["f1", "f2"]),
            EmbeddingBagConfig(name="t_b", embedding_dim=8, num_embeddings=64, feature_names=["f3"])]


def _kjt(seed, batch):
    from torchrec import KeyedJaggedTensor
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 4, 3 * batch)
    values = rng.integers(0, 500, int(lengths.sum()))
    return KeyedJaggedTensor.from_lengths_sync(keys=["f1", "f2", "f3"], values=torch.from_numpy(values),
                                               lengths=torch.from_numpy(lengths))


def _ranks(rank, world_size, root):
    from torchrec import KeyedJaggedTensor
    from torchrec.distributed.model_parallel import DistributedModelParallel

    import cncore
    from cncore.tier import TieredStore
    from cncore_torch import CNEmbeddingBagCollection
    from cncore_torch.distributed import CNEmbeddingBagCollectionSharder

    optimizer = cncore.RowWiseAdagrad(lr=0.1)
    model = CNEmbeddingBagCollection(_configs(), device="meta", optimizer=optimizer, seed=3,
                                     storage=cncore.Tiered(root, cache_bytes=1 << 16))
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), sharders=[CNEmbeddingBagCollectionSharder()])
    ref = CNEmbeddingBagCollection(_configs(), optimizer=optimizer, seed=3, per_rank_tables=True)  # each rank's own
    for name, store in dmp.module.stores.items():
        assert isinstance(store, TieredStore)
        assert store.config.storage.path == os.path.join(root, name, f"shard-{rank}-of-{world_size}")
    for step in range(3):
        kjts = [_kjt(10 * step + r, 4) for r in range(world_size)]
        values = torch.cat([k[f].values() for f in ("f1", "f2", "f3") for k in kjts])
        lengths = torch.cat([k[f].lengths() for f in ("f1", "f2", "f3") for k in kjts])
        full = KeyedJaggedTensor.from_lengths_sync(keys=["f1", "f2", "f3"], values=values, lengths=lengths)
        out, expected = dmp(kjts[rank]), ref(full)
        torch.testing.assert_close(out.values(), expected.values()[4 * rank:4 * rank + 4], rtol=1e-6, atol=1e-6)
        out.values().sum().backward()
        expected.values().sum().backward()
    for name, store in dmp.module.stores.items():
        batch = store.export()
        order = np.argsort(batch.keys)
        torch.testing.assert_close(torch.from_numpy(batch.rows[order]),
                                   torch.from_numpy(ref.stores[name].lookup(batch.keys[order])), rtol=1e-6, atol=1e-6)
        store.flush()


@pytest.mark.slow
def test_each_rank_keeps_its_tiered_shard_in_its_own_directory(tmp_path):
    from cncore_torch.distributed.launch import spawn
    root = str(tmp_path / "tier")
    spawn(_ranks, 2, root, timeout=TIMEOUT)
    for table in ("t_a", "t_b"):
        assert sorted(os.listdir(os.path.join(root, table))) == ["shard-0-of-2", "shard-1-of-2"]

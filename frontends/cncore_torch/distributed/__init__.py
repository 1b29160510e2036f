"""cncore_torch.distributed: dynamic tables sharded row-wise under TorchRec's DistributedModelParallel.

The same roles and names as `torchrec.distributed`:

- `embeddingbag.py`: the sharder (`CNEmbeddingBagCollectionSharder`), the sharded module
  (`ShardedCNEmbeddingBagCollection`) and `plan_for` (a plan without TorchRec's planner);
- `embedding.py`: the same for the unpooled `CNEmbeddingCollection` (one row per ID back);
- `rw_sharding.py`: the sharding (`CNRwPooledEmbeddingSharding`): input dist by key hash over
  TorchRec's KJT all-to-all, output dist as an all-to-all of partial pools (any batch sizes);
- `embedding_lookup.py`, `embedding_kernel.py`: the lookup and the kernel over the rank's stores;
- `routing.py`: which rank owns a key; `checkpoint.py`: `merge_shards` (N ranks' state_dicts ->
  M ranks), `save_shard_tables` / `load_shard_tables` (a table file per rank and table);
- `launch.py`: `spawn` N local gloo processes (tests, `cn-dlrm --nproc`).
"""
from cncore_torch.distributed.embeddingbag import (CNEmbeddingBagCollectionSharder, ShardedCNEmbeddingBagCollection,
                                                   plan_for)
from cncore_torch.distributed.checkpoint import load_shard_tables, merge_shards, save_shard_tables
from cncore_torch.distributed.embedding import CNEmbeddingCollectionSharder, ShardedCNEmbeddingCollection
from cncore_torch.distributed.routing import owner_of

__all__ = ["CNEmbeddingBagCollectionSharder", "ShardedCNEmbeddingBagCollection", "CNEmbeddingCollectionSharder",
           "ShardedCNEmbeddingCollection", "plan_for", "owner_of", "merge_shards", "save_shard_tables",
           "load_shard_tables"]

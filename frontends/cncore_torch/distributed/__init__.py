"""cncore_torch.distributed: dynamic tables sharded row-wise under TorchRec's DistributedModelParallel.

The same roles and names as `torchrec.distributed`:

- `embeddingbag.py`: the sharder (`CNEmbeddingBagCollectionSharder`) and the sharded module
  (`ShardedCNEmbeddingBagCollection`);
- `embedding.py`: the same for the unpooled `CNEmbeddingCollection` (one row per ID back);
- `embedding_sharding.py`: the code both sharded modules share (feature checks, the fused
  optimizer, each rank's store configs, loading the rows a rank owns);
- `planner.py`: what a plan says for dynamic tables (`check_plan`) and what TorchRec's planner
  learns of our kernel; `sharding_plan.py`: `plan_for` (a plan without TorchRec's planner);
- `rw_sharding.py`: the sharding (`CNRwPooledEmbeddingSharding`): input dist by key hash over
  TorchRec's KJT all-to-all, output dist as an all-to-all of partial pools (any batch sizes);
- `embedding_lookup.py`, `embedding_kernel.py`: the lookup and the kernel over the rank's stores;
- `routing.py`: which rank owns a key; `checkpoint.py`: `merge_shards` (N ranks' state_dicts ->
  M ranks), `save_shard_tables` / `load_shard_tables` (a table file per rank and table);
- `launch.py`: `spawn` N local gloo processes (tests, `cn-dlrm --nproc`).
"""
from cncore_torch.distributed.checkpoint import load_shard_tables, merge_shards, save_shard_tables
from cncore_torch.distributed.embedding import CNEmbeddingCollectionSharder, ShardedCNEmbeddingCollection
from cncore_torch.distributed.embeddingbag import CNEmbeddingBagCollectionSharder, ShardedCNEmbeddingBagCollection
from cncore_torch.distributed.routing import owner_of
from cncore_torch.distributed.sharding_plan import plan_for

__all__ = ["CNEmbeddingBagCollectionSharder", "ShardedCNEmbeddingBagCollection", "CNEmbeddingCollectionSharder",
           "ShardedCNEmbeddingCollection", "plan_for", "owner_of", "merge_shards", "save_shard_tables",
           "load_shard_tables"]

"""cncore_torch: the PyTorch front end of cncore (modules, autograd, fused optimizers).

Laid out as TorchRec's modules: `modules` (`CNEmbeddingBag`, `CNEmbedding`) and `collection`
(the TorchRec collections) share one base (`base.TableModule`); `functional` holds the lookups'
functional forms; `bridge` is the one autograd bridge to the tables and `ops` the `cncore::`
operators for `torch.compile` (registered when the first module is built, not at import);
`embedding_configs` turns TorchRec table configs into store configs; `distributed` shards the
collections under DMP.

>>> import torch, cncore, cncore_torch
>>> emb = cncore_torch.CNEmbedding(100, 8, optimizer=cncore.RowWiseAdagrad(lr=0.1))
>>> emb(torch.tensor([[1, 2**50]])).shape
torch.Size([1, 2, 8])
"""
from cncore_torch._openmp_env import bound_openmp_spin

bound_openmp_spin()  # before torch loads libgomp: see _openmp_env

from cncore_torch.modules import CNEmbedding, CNEmbeddingBag  # noqa: E402
from cncore_torch.optim import FusedOptimizer  # noqa: E402

__all__ = ["CNEmbeddingBag", "CNEmbedding", "FusedOptimizer", "CNEmbeddingBagCollection", "CNEmbeddingCollection"]


def __getattr__(name):
    # TorchRec is an optional dependency: imported only when its module is asked for.
    if name in ("CNEmbeddingBagCollection", "CNEmbeddingCollection"):
        from cncore_torch import collection
        return getattr(collection, name)
    raise AttributeError(name)

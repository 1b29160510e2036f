"""`CNGroupedPooledEmbeddingsLookup`: builds and calls the rank's kernel (TorchRec's lookup role,
as `GroupedPooledEmbeddingsLookup` builds FBGEMM's batched kernels). One kernel serves every
table of the collection: the core looks all of them up in one grouped call."""
from __future__ import annotations

from typing import cast

import torch
from torchrec.distributed.embedding_types import BaseEmbeddingLookup
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from cncore_torch.distributed.embedding_kernel import CNEmbeddingBagKernel

__all__ = ["CNGroupedPooledEmbeddingsLookup"]


class CNGroupedPooledEmbeddingsLookup(BaseEmbeddingLookup[KeyedJaggedTensor, torch.Tensor]):
    def __init__(self, kernel: CNEmbeddingBagKernel):
        super().__init__()
        self._emb_modules = torch.nn.ModuleList([kernel])

    @property
    def kernel(self) -> CNEmbeddingBagKernel:
        return cast(CNEmbeddingBagKernel, self._emb_modules[0])  # the one module the list holds

    def forward(self, sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        return self.kernel(sparse_features)

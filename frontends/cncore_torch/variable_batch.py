"""Variable batch per feature (TorchRec's "VBE" KJTs) in the collections' pooled lookup.

A KJT built with `stride_per_key_per_rank` holds a batch size per key: feature f has B_f bags.
The pooled collection looks each feature's B_f bags up as usual, then, as TorchRec's
`EmbeddingBagCollection` does (`torchrec.modules.utils`' `reorder_inverse_indices` and
`process_pooled_embeddings`), gives every sample b of the batch the pooled row of its bag
`inverse_indices[f, b]`: the output is (B, sum of dims), B being the width of the KJT's
`inverse_indices`. The unpooled collection needs none of this (each feature's JaggedTensor
keeps its own B_f bags, as TorchRec's `EmbeddingCollection` returns them).

The backward of the expansion sums the gradients of the samples that share a bag
(`gather_gradients`); eager mode leaves that to autograd (`index_select`), the collection's
operator does it itself.

>>> import torch
>>> from torchrec import KeyedJaggedTensor
>>> kjt = KeyedJaggedTensor(keys=["a", "b"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 1, 1]),
...                         stride_per_key_per_rank=[[1], [2]],
...                         inverse_indices=(["a", "b"], torch.tensor([[0, 0, 0], [1, 0, 1]])))
>>> strides_of(kjt), inverse_rows(kjt, ["b"], "ebc").tolist()
([1, 2], [[1, 0, 1]])
>>> expand([torch.tensor([[5.0]]), torch.tensor([[1.0], [2.0]])], torch.tensor([[0, 0, 0], [1, 0, 1]])).tolist()
[[5.0, 2.0], [5.0, 1.0], [5.0, 2.0]]
"""
from __future__ import annotations

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

__all__ = ["strides_of", "inverse_rows", "expand", "gather_gradients", "weight_spans"]


def strides_of(features: KeyedJaggedTensor) -> list[int] | None:
    """Each key's batch size for a KJT with a batch size per key (None when all keys share one).

    Args:
        features (KeyedJaggedTensor): the collection's input.

    Returns:
        list[int] | None: B_f per key, in the KJT's key order.
    """
    if not features.variable_stride_per_key():
        return None
    return [int(s) for s in features.stride_per_key()]


def inverse_rows(features: KeyedJaggedTensor, feature_names: list[str], owner: str) -> torch.Tensor:
    """The KJT's `inverse_indices` rows of the features a pooled collection reads, in its order.

    Args:
        features (KeyedJaggedTensor): a KJT with a batch size per key.
        feature_names (list[str]): the collection's features, flattened in its order.
        owner (str): the collection, named in errors.

    Returns:
        torch.Tensor: (len(feature_names), B) int64; row f maps each sample to its bag of feature f.
    """
    inverse = features.inverse_indices_or_none()
    if inverse is None:
        raise ValueError(f"features: the KJT has a batch size per key (stride_per_key_per_rank="
                         f"{features.stride_per_key_per_rank()}) but no inverse_indices; {owner} pools every "
                         "feature into rows of one batch, as TorchRec's EmbeddingBagCollection does, and needs "
                         "them: build the KJT with inverse_indices=(keys, (len(keys), batch size) int tensor)")
    names, index = inverse
    if not isinstance(index, torch.Tensor) or index.dim() != 2 or index.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"features: inverse_indices must be (keys, a 2-D int64 or int32 tensor), got a "
                         f"{getattr(index, 'dtype', type(index).__name__)} of shape "
                         f"{tuple(getattr(index, 'shape', ()))}")
    row_of = {name: i for i, name in enumerate(names)}
    missing = [f for f in feature_names if f.split("@")[0] not in row_of]
    if missing:
        raise ValueError(f"features: inverse_indices has no row for feature {missing[0]!r} (its keys are "
                         f"{list(names)})")
    if len(names) != index.shape[0]:
        raise ValueError(f"features: inverse_indices names {len(names)} keys but holds {index.shape[0]} rows")
    return index[[row_of[f.split("@")[0]] for f in feature_names]].to(torch.int64)


def expand(pooled: list[torch.Tensor], inverse: torch.Tensor, names: list[str] | None = None) -> torch.Tensor:
    """(B, sum of dims): sample b of feature f gets `pooled[f][inverse[f, b]]`.

    Args:
        pooled (list[torch.Tensor]): per feature, its (B_f, dim_f) pooled rows.
        inverse (torch.Tensor): (F, B) int64 bag of each sample (`inverse_rows`).
        names (list[str] | None): the features, named in errors.

    Returns:
        torch.Tensor: the rows of every sample, feature f in its own columns.
    """
    for f, (rows, index) in enumerate(zip(pooled, inverse)):
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= rows.shape[0]):
            name = repr(names[f]) if names else f"number {f}"
            raise ValueError(f"features: inverse_indices of feature {name} hold {int(index.min())}.."
                             f"{int(index.max())}, but it has {rows.shape[0]} bags (expected 0..{rows.shape[0] - 1})")
    return torch.cat([rows.index_select(0, index.to(rows.device)) for rows, index in zip(pooled, inverse)], dim=1)


def gather_gradients(grad: torch.Tensor, inverse: torch.Tensor, bags: list[int], dims: list[int]
                     ) -> list[torch.Tensor]:
    """The backward of `expand`: per feature, the (B_f, dim_f) sum of its samples' gradients.

    Args:
        grad (torch.Tensor): (B, sum of dims) gradient of `expand`'s output.
        inverse (torch.Tensor): (F, B) the indices `expand` read.
        bags (list[int]): B_f per feature.
        dims (list[int]): dim_f per feature.

    Returns:
        list[torch.Tensor]: one block per feature.
    """
    blocks, at = [], 0
    for index, n, d in zip(inverse, bags, dims):
        block = grad[:, at:at + d]
        blocks.append(torch.zeros((n, d), dtype=grad.dtype, device=grad.device).index_add_(
            0, index.to(grad.device), block))
        at += d
    return blocks


def weight_spans(features: KeyedJaggedTensor, positions: list[int]) -> list[tuple[int, int]]:
    """Where each feature's values (and weights) sit in the KJT's flat values.

    Args:
        features (KeyedJaggedTensor): the KJT.
        positions (list[int]): each feature's position among its keys.

    Returns:
        list[tuple[int, int]]: (start, stop) per feature.
    """
    starts = [0]
    for n in features.length_per_key():
        starts.append(starts[-1] + int(n))
    return [(starts[p], starts[p + 1]) for p in positions]

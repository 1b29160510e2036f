"""A KJT with a batch size per key (TorchRec's "VBE") in the sharded collections.

Sample b of feature f is pooled from its bag `inverse_indices[f, b]` (as TorchRec's
`EmbeddingBagCollection` expands them, see `cncore_torch.variable_batch`). The sharded module
expands the KJT before routing: bag (f, b) of a one-batch KJT holds the IDs (and weights) of
bag `inverse_indices[f, b]`, so the routing, the lookup, the output dist and MEAN's bag lengths
are those of an ordinary batch of B samples. The pools of samples sharing a bag are the same
pool; their gradients reach the bag's rows (the core adds a key's gradients within a step) and
its weights (each expanded weight's gradient is added at its original position). The sharded
unpooled collection expands the same way: each feature's JaggedTensor has B bags, bag b holding
the rows of bag `inverse_indices[f, b]`, as TorchRec's `ShardedEmbeddingCollection` reindexes
them (`torchrec.modules.utils._vbe_reindex`).
"""
from __future__ import annotations

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from cncore_torch.variable_batch import inverse_rows

__all__ = ["expand_variable_batch"]


def expand_variable_batch(features: KeyedJaggedTensor, feature_names: list[str],
                          owner: str) -> tuple[KeyedJaggedTensor, torch.Tensor]:
    """The one-batch KJT of `feature_names` (in that order) a VBE KJT stands for, and the position
    in `features.values()` of each of its values.

    Args:
        features (KeyedJaggedTensor): a KJT with `stride_per_key_per_rank` and `inverse_indices`.
        feature_names (list[str]): the features the tables read, in the tables' order.
        owner (str): the module, named in errors.

    Returns:
        tuple[KeyedJaggedTensor, torch.Tensor]: keys `feature_names`, stride B (the width of
        `inverse_indices`), values, lengths and weights of each sample's bag; the int64 positions.

    >>> kjt = KeyedJaggedTensor(keys=["a", "b"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 1, 1]),
    ...                         stride_per_key_per_rank=[[1], [2]],
    ...                         inverse_indices=(["a", "b"], torch.tensor([[0, 0, 0], [1, 0, 1]])))
    >>> out, positions = expand_variable_batch(kjt, ["b", "a"], "module")
    >>> out.values().tolist(), out.lengths().tolist(), positions.tolist()
    ([3, 2, 3, 1, 1, 1], [1, 1, 1, 1, 1, 1], [2, 1, 2, 0, 0, 0])
    """
    inverse = inverse_rows(features, feature_names, owner)                       # (F, B)
    keys = features.keys()
    strides = [int(s) for s in features.stride_per_key()]
    lengths = features.lengths().to(torch.int64)
    bag_start = [0]
    for s in strides:
        bag_start.append(bag_start[-1] + s)
    value_start = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=value_start[1:])
    bags = []
    for f, name in enumerate(feature_names):
        k = keys.index(name)
        index = inverse[f]
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= strides[k]):
            raise ValueError(f"features: inverse_indices of feature {name!r} hold {int(index.min())}.."
                             f"{int(index.max())}, but it has {strides[k]} bags (expected 0..{strides[k] - 1})")
        bags.append(index + bag_start[k])
    bag = torch.cat(bags) if bags else torch.zeros(0, dtype=torch.int64)       # global bag of each (f, b)
    new_lengths = lengths[bag]
    total = int(new_lengths.sum())
    first = torch.cumsum(new_lengths, 0) - new_lengths                             # where each new bag starts
    positions = (torch.repeat_interleave(value_start[bag] - first, new_lengths, output_size=total)
                 + torch.arange(total))
    weights = features.weights_or_none()
    out = KeyedJaggedTensor(keys=list(feature_names), values=features.values()[positions],
                            lengths=new_lengths.to(features.lengths().dtype),
                            weights=None if weights is None else weights[positions], stride=inverse.shape[1])
    return out, positions

"""A `KeyedJaggedTensor`'s features as the TorchRec collections read them
(`cncore_torch.collection`): checked and split per key, grouped into the bridge's per-feature
arrays (`cncore_torch.bridge`), and rebuilt from the parts the collections' operators take
(`cncore_torch.ops`).

>>> import torch
>>> from torchrec import KeyedJaggedTensor
>>> from cncore_torch.kjt_features import features_by_key
>>> kjt = KeyedJaggedTensor.from_lengths_sync(keys=["user", "item"], values=torch.tensor([3, 5, 6]),
...                                          lengths=torch.tensor([1, 2]))
>>> features_by_key(kjt, [["user"], ["item"]])["item"].values()
tensor([5, 6])
>>> features_by_key(kjt, [["query"]])
Traceback (most recent call last):
ValueError: features: no key 'query' (it has ['user', 'item'])
"""
from __future__ import annotations

from typing import Protocol

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

__all__ = ["FeatureReader", "feature_positions", "features_by_key", "grouped_arrays", "kjt_of_parts", "plain_arrays"]


class FeatureReader(Protocol):
    """What these helpers read from a collection: the features of each table, in order, and
    whether the bags are weighted."""

    @property
    def _feature_names(self) -> list[list[str]]: ...

    @property
    def _is_weighted(self) -> bool: ...


def features_by_key(features: object, feature_names: list[list[str]],
                    rows_device: torch.device | None = None) -> dict[str, JaggedTensor]:
    """The KJT's JaggedTensor per key, every feature the tables read being present. The KJT is
    checked first (TorchRec's constructor checks little): CPU tensors (or on `rows_device`, where
    the tables' rows are on an accelerator) with values, int IDs,
    floating weights, lengths >= 0 adding up to the number of values. A collection on meta
    (`rows_device` meta: shape inference) also takes a KJT on meta, whose values go unchecked."""
    if not isinstance(features, KeyedJaggedTensor):
        raise TypeError(f"features must be a KeyedJaggedTensor, got {type(features).__name__}")
    values, lengths, weights = features.values(), features.lengths(), features.weights_or_none()
    if values.is_meta and rows_device is not None and rows_device.type == "meta":
        by_key = features.to_dict()
        missing = [n for names in feature_names for n in names if n not in by_key]
        if missing:
            raise ValueError(f"features: no key {missing[0]!r} (it has {features.keys()})")
        return by_key
    for name, t in (("values", values), ("lengths", lengths), ("weights", weights)):
        if t is not None and t.is_meta:
            raise ValueError(f"features: {name} is a meta tensor, which holds no values; expected a CPU tensor")
        if t is not None and t.device.type != "cpu" and t.device != rows_device:
            raise ValueError(f"features: {name} is on {t.device}; the tables are in the core, expected the CPU"
                             if rows_device is None else
                             f"features: {name} is on {t.device}; expected the CPU or the tables' {rows_device}")
    if values.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"features: values must be int64 or int32 IDs, got {values.dtype}")
    if weights is not None and not weights.is_floating_point():
        raise TypeError(f"features: weights must be floating point, got {weights.dtype}")
    if values.dim() != 1 or (weights is not None and weights.shape != values.shape):
        raise ValueError(f"features: values (and weights) must be 1-D and of one length, got shapes "
                         f"{tuple(values.shape)} and {None if weights is None else tuple(weights.shape)}")
    if lengths.numel() and int(lengths.min()) < 0:
        raise ValueError(f"features: lengths must be >= 0, got {int(lengths.min())} (offsets must never decrease)")
    if int(lengths.sum()) != values.numel():
        raise ValueError(f"features: lengths add up to {int(lengths.sum())}, but values holds {values.numel()} IDs")
    if not features.variable_stride_per_key() and lengths.numel() != len(features.keys()) * features.stride():
        raise ValueError(f"features: {lengths.numel()} lengths for {len(features.keys())} keys of batch size "
                         f"{features.stride()}")
    if lengths.numel() == 0:  # an empty batch, which TorchRec's to_dict cannot split
        empty = JaggedTensor(values=values, lengths=lengths, weights=weights)
        by_key = dict.fromkeys(features.keys(), empty)
    else:
        by_key = features.to_dict()
    for names in feature_names:
        for name in names:
            if name not in by_key:
                raise ValueError(f"features: no key {name!r} (it has {features.keys()})")
    return by_key


def grouped_arrays(collection: FeatureReader, by_key: dict[str, JaggedTensor]
                   ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor | None]]:
    """(keys, offsets, weights): one tensor per feature of `collection`, in its order (int64
    keys and offsets, float32 weights or None), as the bridge takes them. The weights keep
    their autograd history: a weight that requires grad gets its gradient (TorchRec's
    `PositionWeightedModule` learns so)."""
    keys: list[torch.Tensor] = []
    offsets: list[torch.Tensor] = []
    weights: list[torch.Tensor | None] = []
    is_weighted = collection._is_weighted
    for names in collection._feature_names:
        for name in names:
            jt = by_key[name]
            keys.append(jt.values().detach().to(torch.int64).contiguous())
            offsets.append(jt.offsets().detach().to(torch.int64).contiguous())
            w = jt.weights_or_none() if is_weighted else None
            if is_weighted and w is None:
                raise ValueError(f"features: is_weighted=True but key {name!r} has no weights")
            weights.append(None if w is None else w.to(torch.float32).contiguous())
    return keys, offsets, weights


def plain_arrays(collection: FeatureReader, features: object) -> tuple[list[np.ndarray], list[np.ndarray]] | None:
    """(keys, offsets) of the common KJT as NumPy arrays, one per feature of `collection` in
    its order, straight from the KJT's values and lengths: an unweighted collection, a KJT
    without weights or a batch size per key, int64 values and lengths of the CPU, every key
    the collection reads present and the lengths valid. Keys are views of the KJT's values
    (the caller checks they are not changed in place before the backward: `bridge.lookup`'s
    `inputs`); offsets are new, (B + 1,) each. None for anything else (`features_by_key` and
    `grouped_arrays` then take the KJT, and raise where it is bad).

    Why: `features_by_key` splits the KJT into a JaggedTensor per key (TorchRec's `to_dict`:
    26 JaggedTensors, a cumsum and a cat of lengths) and checks it with torch reductions, each
    a parallel region of torch's OpenMP pool; here one cumsum over the (keys, B) lengths
    gives every feature's offsets. `cn-dlrm`'s forward (26 features, B = 2048, one thread):
    0.83 ms of CPU time for features_by_key + grouped_arrays, about 0.1 ms for this.

    Args:
        collection (FeatureReader): the collection (its features and whether it is weighted).
        features (object): the forward's input.

    Returns:
        tuple[list[np.ndarray], list[np.ndarray]] | None: int64 keys and offsets per feature,
        or None.

    >>> import torch
    >>> from torchrec import KeyedJaggedTensor
    >>> class Reader:
    ...     _feature_names, _is_weighted = [["item"], ["user"]], False
    >>> kjt = KeyedJaggedTensor.from_lengths_sync(keys=["user", "item"], values=torch.tensor([3, 5, 6]),
    ...                                          lengths=torch.tensor([1, 0, 2, 0]))
    >>> keys, offsets = plain_arrays(Reader(), kjt)
    >>> [k.tolist() for k in keys], [o.tolist() for o in offsets]
    ([[5, 6], [3]], [[0, 2, 2], [0, 1, 1]])
    """
    if not isinstance(features, KeyedJaggedTensor) or collection._is_weighted:
        return None
    values, lengths = features.values(), features.lengths()
    if (features.weights_or_none() is not None or features.variable_stride_per_key()
            or values.dtype != torch.int64 or lengths.dtype != torch.int64
            or values.device.type != "cpu" or lengths.device.type != "cpu"
            or values.dim() != 1 or lengths.dim() != 1 or not values.is_contiguous() or not lengths.is_contiguous()):
        return None
    names = features.keys()
    n_keys, batch = len(names), features.stride()
    if batch == 0 or lengths.numel() != n_keys * batch:
        return None
    # Every key's offsets, (keys, B + 1), in one call: FBGEMM's complete cumsum (TorchRec's own
    # for KJT offsets; loaded with TorchRec) took 25 us for 26 x 2048 lengths, torch.cumsum into
    # a table's columns 30-250 us, NumPy's cumsum 110 us; NumPy's min 17 us, torch's 23.
    offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(lengths.view(n_keys, batch)).numpy()
    per_key = offsets[:, -1]
    # (negative lengths can still add up right: the minimum is checked too)
    if int(per_key.sum()) != values.numel() or int(lengths.numpy().min()) < 0:
        return None
    starts = [0]
    for n in per_key.tolist():
        starts.append(starts[-1] + n)
    at = {name: i for i, name in enumerate(names)}
    ids = values.numpy()
    keys, feature_offsets = [], []
    for group in collection._feature_names:
        for name in group:
            i = at.get(name)
            if i is None:
                return None
            keys.append(ids[starts[i]:starts[i + 1]])
            feature_offsets.append(offsets[i])
    return keys, feature_offsets


# --- the KJT in parts: how the collections' operators take it (cncore_torch.ops) -----------------
#
# The bridge's `cncore::lookup` takes per-feature tensors; splitting a KJT per feature is
# data-dependent, so the collections' operators take the whole KJT (values, lengths, weights)
# and each feature's position among its keys (known when traced), and the collection splits it
# (`_pooled_rows`, `_unpooled_rows`) and calls the same forward_impl.


def kjt_of_parts(collection: FeatureReader, values: torch.Tensor, lengths: torch.Tensor,
                 weights: torch.Tensor | None, n_keys: int, positions: list[int],
                 strides: list[int] | None) -> KeyedJaggedTensor:
    """The KJT an operator got in parts: the collection's features at their positions, the
    keys it does not read named by position; `strides`: each key's batch size (None: one)."""
    names = [f"<key {i}>" for i in range(n_keys)]
    for name, at in zip((n for group in collection._feature_names for n in group), positions):
        names[at] = name
    return KeyedJaggedTensor(keys=names, values=values, lengths=lengths, weights=weights,
                             stride_per_key_per_rank=[[s] for s in strides] if strides else None)


def feature_positions(collection: FeatureReader, features: KeyedJaggedTensor) -> list[int]:
    """Where each feature the collection reads sits among the KJT's keys (known when traced)."""
    keys = features.keys()
    missing = [f for names in collection._feature_names for f in names if f not in keys]
    if missing:
        raise ValueError(f"features: no key {missing[0]!r} (it has {keys})")
    return [keys.index(f) for names in collection._feature_names for f in names]



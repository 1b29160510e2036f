"""How far TorchRec's quantized rows may be from the frozen float32 rows.

TorchRec's `quantize_embeddings` / `quantize_inference_model` work on a frozen model as on
any TorchRec model: they swap the `EmbeddingBagCollection` (`EmbeddingCollection`) inside each
frozen collection for its quantized twin, and the in-graph remap in front stays as it is. A
live model is refused there (`TableModule.qconfig`): freeze it first.

Rounding bound (per element of a row; FBGEMM's row-wise formats, as TorchRec stores them):

- int8 (and int4, int2, with 2^bits - 1 levels): a row keeps its minimum and its scale
  (max - min) / levels, both rounded to float16, and each element as round((x - min') /
  scale'); read back as q * scale' + min'. The error is at most half a (rounded) step, plus
  what rounding the minimum and the scale to float16 moves (one float16 half-ulp each, the
  scale's times the levels): ``range / levels / 2 * (1 + 2^-11) + (|min| + range) * 2^-11``.
  A row of equal values (the zero row of unseen IDs among them) comes back exactly.
- float16: ``|x| * 2^-11`` (round to nearest), plus 2^-25 below float16's normal range.

A pooled output is off by at most the sum over its bag of |weight| times its rows' bound
(`row_error_bound`), times 1/length for mean, plus float32 rounding of the sum.
"""
from __future__ import annotations

import torch

__all__ = ["row_error_bound"]

_LEVELS = {torch.qint8: 255, torch.quint8: 255, torch.int8: 255, torch.quint4x2: 15, torch.quint2x4: 3}


def row_error_bound(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The largest error of any element of each row of `weight` once TorchRec stores it as
    `dtype` (see the module docstring).

    Args:
        weight (Tensor): (N, dim) float32 rows.
        dtype: torch.qint8 (int8 rows), torch.quint4x2 (int4), torch.quint2x4 (int2) or
            torch.float16.

    Returns:
        Tensor: (N,) float32 bounds.

    >>> row_error_bound(torch.tensor([[0.0, 2.55], [1.0, 1.0]]), torch.qint8).tolist()
    [0.006247558631002903, 0.00048828125]
    """
    weight = weight.to(torch.float64)
    if dtype == torch.float16:
        return (weight.abs().amax(dim=1) * 2.0**-11 + 2.0**-25).to(torch.float32)
    if dtype not in _LEVELS:
        raise ValueError(f"dtype: {dtype} is not a row format TorchRec quantizes to; expected torch.qint8, "
                         f"torch.quint4x2, torch.quint2x4 or torch.float16")
    low, high = weight.amin(dim=1), weight.amax(dim=1)
    span = high - low
    bound = span / _LEVELS[dtype] / 2 * (1 + 2.0**-11) + (low.abs() + span) * 2.0**-11
    return bound.to(torch.float32)

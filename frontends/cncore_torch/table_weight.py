"""`TableWeight`: what `.weight` of a dynamic table is (`CNEmbeddingBag`, `CNEmbedding`, and the
per-table modules of the collections' `embedding_bags` / `embeddings`).

TorchRec code reads `embedding_bags[name].weight` for its metadata (its device, dtype, shape,
`is_meta`) and sometimes for its values (an `init_fn(weight)`, a copy for serving). A dynamic
table has no dense matrix: its rows sit in a hash table, in no order, and grow as IDs arrive.
So `.weight` is a tensor that holds no data: its metadata is the table's (device: where the rows
live, 'meta' before materialisation; dtype: the row dtype; shape: (rows held now, embedding_dim))
and every operation on its values raises, naming what reads and writes rows instead. A copy
would make writes into it vanish silently, and an (N, dim) matrix would suggest that row i is
the row of ID i. It is not a parameter: optimizers, `state_dict` and DDP never see it.

>>> import torch
>>> from cncore_torch import CNEmbeddingBag
>>> bag = CNEmbeddingBag(10, 4, mode="sum", row_dtype="float16")
>>> _ = bag(torch.tensor([[1, 2, 3]]))
>>> w = bag.weight
>>> w.device, w.dtype, tuple(w.shape), w.is_meta
(device(type='cpu'), torch.float16, (3, 4), False)
>>> torch.nn.init.normal_(w)
Traceback (most recent call last):
...
RuntimeError: CNEmbeddingBag.weight holds no values (aten.normal_): the rows live in a dynamic hash table (3 rows of 4, float16, on cpu), drawn from the initializer as IDs arrive; read them with .export() (keys and rows) and write them with .insert(ids, rows) / .assign(ids, rows)
"""  # noqa: E501 (a doctest's expected error message is one line)
from __future__ import annotations

import torch

__all__ = ["TableWeight"]


class TableWeight(torch.Tensor):
    """A tensor with a table's metadata and no data (see the module docstring).

    Args:
        rows: the rows the table holds now (shape[0]).
        dim: embedding_dim (shape[1]).
        dtype: the row dtype.
        device: where the rows live ('meta' before materialisation).
        owner: the module's name, for the error.

    Returns:
        A (rows, dim) tensor whose every operation on values raises RuntimeError.
    """

    _owner: str

    @staticmethod
    def __new__(cls, rows: int, dim: int, dtype: torch.dtype, device: torch.device, owner: str) -> TableWeight:
        weight = torch.Tensor._make_wrapper_subclass(cls, (rows, dim), dtype=dtype, device=device,
                                                     requires_grad=False)
        weight._owner = owner
        return weight

    def _refuse(self, what: str) -> RuntimeError:
        return RuntimeError(
            f"{self._owner}.weight holds no values ({what}): the rows live in a dynamic hash table ({self.shape[0]} "
            f"rows of {self.shape[1]}, {str(self.dtype).removeprefix('torch.')}, on {self.device}), drawn from "
            "the initializer as IDs arrive; read them with .export() (keys and rows) and write them with "
            ".insert(ids, rows) / .assign(ids, rows)")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        weight = next(a for a in list(args) + list((kwargs or {}).values()) if isinstance(a, TableWeight))
        raise weight._refuse(str(func).removesuffix(".default"))

    def numpy(self, *args, **kwargs):
        raise self._refuse("numpy()")

    def tolist(self):
        raise self._refuse("tolist()")

    def __repr__(self, *, tensor_contents=None) -> str:  # type: ignore[override]
        return (f"TableWeight(rows={self.shape[0]}, embedding_dim={self.shape[1]}, dtype={self.dtype}, "
                f"device={self.device})")

"""cncore: growable hash embedding tables, framework-neutral.

A store maps any int64 key to a float32 row (plus optimizer state and access metadata) and
grows as new keys arrive. Hot paths run in C without the GIL; arrays come in through DLPack
or the buffer protocol and go out as NumPy arrays (DLPack-exportable, zero-copy).

>>> import numpy as np, cncore
>>> store = cncore.EmbeddingStore(dim=4, optimizer=cncore.SGD(lr=0.1))
>>> out, ctx = store.pooled_lookup(np.array([10, 2**40, -3]), lengths=np.array([2, 1]))
>>> out.shape, len(store)
((2, 4), 3)
"""
from cncore import _core  # noqa: F401  (the compiled core, loaded first: an unbuilt package fails here)
from cncore.config import (
    LFU,
    LRU,
    SGD,
    TTL,
    Adagrad,
    Adam,
    Constant,
    MinCount,
    Normal,
    Probability,
    RowWiseAdagrad,
    StoreConfig,
    Tiered,
    TruncatedNormal,
    Uniform,
)
from cncore.factory import make_store
from cncore.grouped import LookupContext, grouped_apply_gradients, grouped_pooled_lookup
from cncore.kernels import kernel_isa, runnable_isas
from cncore.rows import TableBatch, initial_rows
from cncore.store import EmbeddingStore
from cncore.threads import get_num_threads, set_num_threads, traced_bytes

__version__ = "0.1.0"

__all__ = [
    "EmbeddingStore", "make_store", "StoreConfig", "TableBatch", "LookupContext", "initial_rows",
    "Uniform", "Normal", "TruncatedNormal", "Constant",
    "SGD", "Adagrad", "RowWiseAdagrad", "Adam",
    "LRU", "LFU", "TTL", "MinCount", "Probability", "Tiered",
    "grouped_pooled_lookup", "grouped_apply_gradients",
    "set_num_threads", "get_num_threads", "traced_bytes", "kernel_isa", "runnable_isas",
]

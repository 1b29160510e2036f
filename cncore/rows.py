"""Rows outside a store: `TableBatch` (rows with everything attached to them, as the verbs that
read, export and evict give them) and `initial_rows` (the rows a store gives new keys)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from cncore import _core
from cncore._interchange import as_keys
from cncore.config import StoreConfig

__all__ = ["TableBatch", "initial_rows"]


def initial_rows(config: StoreConfig, keys: ArrayLike) -> np.ndarray:
    """The rows a store with `config` gives `keys` when it inserts them, without a store: for
    front ends that keep rows elsewhere (accelerator memory) and the core's index only.

    Args:
        config (StoreConfig): the table's config (its initializer and seed count).
        keys (ArrayLike): (N,) int64 keys.

    Returns:
        np.ndarray: (N, dim) float32 rows.

    >>> import numpy as np
    >>> from cncore import EmbeddingStore, StoreConfig, initial_rows
    >>> cfg = StoreConfig(dim=3, seed=5)
    >>> bool((initial_rows(cfg, np.array([9])) == EmbeddingStore(cfg).lookup(np.array([9]), insert_missing=True)).all())
    True
    """
    if not isinstance(config, StoreConfig):
        raise TypeError(f"config must be a cncore.StoreConfig, got {type(config).__name__}")
    keys = as_keys(keys)
    out = np.empty((len(keys), config.dim), dtype=np.float32)
    if len(keys):
        _core.init_rows(config.initializer.kind, config.seed, *config.initializer.params(), keys, out)
    return out


@dataclass(frozen=True)
class TableBatch:
    """Rows of a store with everything attached to them.

    Args:
        keys (np.ndarray): (N,) int64.
        rows (np.ndarray): (N, dim) float32.
        optimizer_state (np.ndarray): (N, state_floats) float32.
        counts (np.ndarray): (N,) uint32 access counts.
        last_steps (np.ndarray): (N,) uint32 steps of the last training access.
        found (np.ndarray): (N,) bool (all True in an export).
        next_cursor (tuple | None): where an export continues (None when it is finished).
    """
    keys: np.ndarray
    rows: np.ndarray
    optimizer_state: np.ndarray
    counts: np.ndarray
    last_steps: np.ndarray
    found: np.ndarray
    next_cursor: tuple | None = None

    @classmethod
    def concat(cls, parts: list[TableBatch]) -> TableBatch:
        """One batch of `parts`' rows in order (a finished export: no cursor).

        Args:
            parts (list[TableBatch]): the batches.

        Returns:
            TableBatch: their rows, joined.
        """
        def joined(field: str) -> np.ndarray:
            return np.concatenate([getattr(p, field) for p in parts])
        return cls(joined("keys"), joined("rows"), joined("optimizer_state"), joined("counts"),
                   joined("last_steps"), joined("found"))

"""The fallback-row verbs of `EmbeddingStore` (``StoreConfig(fallback_rows=N)``): the N shared
rows that pooled lookups give keys without a row of their own (cn_table_core.h, Fallback
Rows). Checkpoints carry them beside the keyed rows."""
from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

from cncore import _core
from cncore._interchange import as_floats
from cncore.config import StoreConfig


class FallbackVerbs:
    """`EmbeddingStore`'s verbs over its fallback rows; they act on the store's core table."""

    _table: _core.Table
    _config: StoreConfig

    @property
    def fallback_rows(self) -> int:
        """The number of fallback rows (``StoreConfig.fallback_rows``; 0: none)."""
        return self._table.fallback_rows

    def export_fallback(self) -> tuple[np.ndarray, np.ndarray]:
        """A copy of the fallback rows and their optimizer state, in fallback-row order.

        Returns:
            tuple[np.ndarray, np.ndarray]: rows (N, dim) float32 and optimizer state
            (N, state_floats) float32; (0, dim) and (0, state_floats) without fallback rows.

        >>> import numpy as np, cncore
        >>> s = cncore.EmbeddingStore(dim=2, fallback_rows=3, initializer=cncore.Constant(0.5))
        >>> rows, state = s.export_fallback()
        >>> rows.tolist(), state.shape, len(s)
        ([[0.5, 0.5], [0.5, 0.5], [0.5, 0.5]], (3, 0), 0)
        """
        n = self._table.fallback_rows
        rows = np.empty((n, self._config.dim), np.float32)
        state = np.empty((n, self._config.state_floats), np.float32)
        self._table.read_fallback(rows, state)
        return rows, state

    def load_fallback(self, rows: ArrayLike, optimizer_state: ArrayLike | None = None) -> None:
        """Overwrite every fallback row (and its optimizer state): what a checkpoint restores.

        Args:
            rows (ArrayLike): (fallback_rows, dim) float32 values, in fallback-row order.
            optimizer_state (ArrayLike | None): (fallback_rows, state_floats) float32; None
                leaves the rows' optimizer state as it is.

        >>> import numpy as np, cncore
        >>> s = cncore.EmbeddingStore(dim=1, fallback_rows=2)
        >>> s.load_fallback(np.array([[1.0], [2.0]], np.float32))
        >>> s.export_fallback()[0].tolist()
        [[1.0], [2.0]]
        """
        n, dim, sf = self._table.fallback_rows, self._config.dim, self._config.state_floats
        rows = np.ascontiguousarray(as_floats(rows, "rows", (n, dim)))
        if optimizer_state is None:
            state = self.export_fallback()[1]
        else:
            state = np.ascontiguousarray(as_floats(optimizer_state, "optimizer_state", (n, sf)))
        self._table.write_fallback(rows, state)

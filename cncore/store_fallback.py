"""The fallback-row verbs of `EmbeddingStore` (``StoreConfig(fallback_rows=N)``): the N shared
rows that pooled lookups give keys without a row of their own (cn_table_core.h, Fallback
Rows). Checkpoints carry them beside the keyed rows."""
from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

from cncore import _core
from cncore._interchange import as_floats
from cncore.config import StoreConfig

OWNER_RULE = "a key reads the fallback row of the shard that owns it"
"""Why trained fallback rows belong to their shard: the reason every refusal to move them gives."""


def unplaceable_fallback_error(where: str, held: str, target: str, remedies: list[str], nothing: str) -> str:
    """The one wording of every refusal to move trained fallback rows where they cannot be placed
    exactly (another world size, a merge, a re-split): what holds them, where they were to go,
    why not (`OWNER_RULE`), what works instead, and that nothing changed.

    Args:
        where: what the refusal is about (a state_dict prefix, a path, a table name).
        held: who holds how many, e.g. ``"the shards hold 6 trained fallback rows"``.
        target: where they were to go, e.g. ``"this table is a whole table"``.
        remedies: what works instead, each a clause; joined with ", or ".
        nothing: what was left undone (``"loaded"``, ``"merged"``, ``"written"``).

    >>> unplaceable_fallback_error("t", "the shards hold 6 trained fallback rows", "this table is whole",
    ...                            ["load them on 2 ranks"], "loaded")  # doctest: +NORMALIZE_WHITESPACE
    't: the shards hold 6 trained fallback rows, and this table is whole; a key reads the fallback row
    of the shard that owns it, so they cannot be placed exactly there. Load them on 2 ranks; nothing
    was loaded'
    """
    fix = ", or ".join(remedies)
    return (f"{where}: {held}, and {target}; {OWNER_RULE}, so they cannot be placed exactly there. "
            f"{fix[:1].upper()}{fix[1:]}; nothing was {nothing}")


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

"""`Table`: a dynamic embedding table for NumPy users, and its files.

`Table` is cncore's `EmbeddingStore` (every verb takes and returns NumPy arrays; Python
lists of ints work too, as they do for the store) with what a NumPy user reaches for
added: indexing, saving to and loading from the table file format, and pooled scoring that
never inserts.

>>> import numpy as np, cncore
>>> from cncore_numpy import Table
>>> t = Table(dim=2, initializer=cncore.Constant(0.5), optimizer=cncore.SGD(lr=1.0))
>>> slots, found = t.find_or_insert([7, -1, 7])           # one new row per distinct key
>>> found.tolist(), len(t)
([False, False, False], 2)
>>> t.contains([7, 8]).tolist()
[True, False]
>>> t[[7, 8]].tolist()                                     # lookup: absent keys read as zeros
[[0.5, 0.5], [0.0, 0.0]]
>>> t[[8]] = np.array([[1.0, 2.0]], np.float32)           # insert_or_assign
>>> t.assign([8, 9], np.ones((2, 2), np.float32)).tolist() # only present keys are written
[True, False]
>>> b = t.read([8]); b.rows.tolist(), b.counts.tolist(), b.found.tolist()
([[1.0, 1.0]], [0], [True])
>>> t.erase([-1, 12345]).tolist()
[True, False]
>>> sorted(t.export().keys.tolist())
[7, 8]

Training a step with the fused optimizer (SGD, lr 1): the bag [7, 8] sums two rows;
a gradient of 1 moves each of them by -1 and records the access.

>>> out, ctx = t.pooled_lookup([7, 8], lengths=[2])
>>> out.tolist()
[[1.5, 1.5]]
>>> t.apply_gradients(ctx, np.ones((1, 2), np.float32))
>>> t[[7, 8]].tolist(), t.read([7]).counts.tolist(), t.step
([[-0.5, -0.5], [0.0, 0.0]], [1], 1)
"""
from __future__ import annotations

import abc
from typing import Any, cast

import numpy as np

import cncore
from cncore.tablefile import load_store, save_table
from cncore.tier import TieredStore

__all__ = ["Table", "TieredTable", "load_table"]


class TableVerbs:
    """What a NumPy user reaches for beyond a store's verbs: indexing, offline scoring, saving.
    Mixed into `Table` (rows in memory) and `TieredTable` (rows on disk); `self` is either store
    (typed Any: the verbs are EmbeddingStore's or TieredStore's)."""

    def __getitem__(self: Any, keys) -> np.ndarray:
        """``t[keys]``: rows (N, dim); absent keys read as zeros (nothing is inserted)."""
        return self.lookup(keys)

    def __setitem__(self: Any, keys, rows) -> None:
        """``t[keys] = rows``: insert or overwrite (optimizer state of existing rows is kept)."""
        self.insert_or_assign(keys, rows)

    def __delitem__(self: Any, keys) -> None:
        self.erase(keys)

    def score(self: Any, keys, offsets=None, *, lengths=None, mode: str = "sum", per_sample_weights=None) -> np.ndarray:
        """Offline scoring: pooled rows (B, dim) of bags of keys; unknown keys are zero rows and
        nothing in the table changes (no inserts, no access records).

        >>> import cncore
        >>> t = Table(dim=1, initializer=cncore.Constant(2.0)); _ = t.find_or_insert([1])
        >>> t.score([1, 99, 1], lengths=[2, 1], mode="mean").ravel().tolist()
        [1.0, 2.0]
        """
        return self.pooled_lookup(keys, offsets, lengths=lengths, mode=mode, per_sample_weights=per_sample_weights,
                                  insert_missing=False)[0]

    def save(self: Any, path: str) -> None:
        """Write the table to the file format (atomic; see `cncore.tablefile`)."""
        save_table(self, path)


class Table(TableVerbs, cncore.EmbeddingStore, metaclass=abc.ABCMeta):
    """An `EmbeddingStore` with NumPy indexing, files and scoring (see the module docstring).

    ``Table(..., storage=cncore.Tiered(...))`` builds a `TieredTable` instead (the same verbs, its
    rows on disk under a bounded cache), as `cncore.make_store` builds a TieredStore; a
    `TieredTable` counts as a `Table` (``isinstance``). A subclass of `Table` has no tiered form:
    given ``storage=`` it is refused, as `EmbeddingStore` refuses it.

    Args:
        config (cncore.StoreConfig | None): the table's configuration, or None to build one
            from `config_fields`.
        **config_fields: `cncore.StoreConfig`'s fields (dim, initializer, optimizer, max_rows,
            storage, ...), when `config` is None.

    Example::

        >>> import cncore
        >>> from cncore_numpy import Table
        >>> t = Table(dim=2, initializer=cncore.Constant(1.0))
        >>> t[[7, 8]].tolist(), len(t)   # absent IDs read as zeros; indexing inserts nothing
        ([[0.0, 0.0], [0.0, 0.0]], 0)
    """

    def __new__(cls, config: cncore.StoreConfig | None = None, **config_fields):
        storage = config_fields.get("storage") if config is None else getattr(config, "storage", None)
        if storage is not None and cls is Table:
            return TieredTable(config, **config_fields)
        return super().__new__(cls)

    @classmethod
    def open(cls, path: str, verify: bool = True) -> Table:
        """`load_table` into a `Table`: every row of a table file, read in batches.

        Args:
            path (str): the table file (a directory written by `save`).
            verify (bool): check every array's SHA-256 and the keys' uniqueness.

        Returns:
            Table: a new in-memory table holding the file's rows, optimizer state, metadata,
            step and config.

        Example::

            >>> import os, tempfile
            >>> from cncore_numpy import Table
            >>> t = Table(dim=2); _ = t.find_or_insert([5])
            >>> path = os.path.join(tempfile.mkdtemp(), "t.cnt"); t.save(path)
            >>> Table.open(path).export().keys.tolist()
            [5]
        """
        return load_table(path, verify)


class TieredTable(TableVerbs, TieredStore):
    """A `Table` whose rows live on disk under a bounded memory cache (a `cncore.tier.TieredStore`
    with the NumPy verbs): what ``Table(storage=cncore.Tiered(path, ...))`` builds (see
    `cncore.tier`).

    >>> import os, tempfile, cncore
    >>> path = os.path.join(tempfile.mkdtemp(), "rows")
    >>> t = Table(dim=2, initializer=cncore.Constant(0.5), storage=cncore.Tiered(path, cache_bytes=1 << 20))
    >>> t[[3]].tolist(), type(t).__name__, isinstance(t, Table), os.path.isdir(path)
    ([[0.0, 0.0]], 'TieredTable', True, True)
    >>> t.close()
    """


Table.register(TieredTable)  # a Table by its verbs; its rows are a TieredStore's, not an EmbeddingStore's


def load_table(path: str, verify: bool = True, batch_rows: int = 1 << 18) -> Table:
    """A `Table` holding everything in the table directory (read in batches).

    Args:
        path (str): the table file (a directory written by `save`).
        verify (bool): check every array's SHA-256 and the keys' uniqueness.
        batch_rows (int): rows read per batch (bounds the memory a read takes besides the table).

    Returns:
        Table: a new in-memory table holding the file's rows, optimizer state, metadata, step
        and config.

    Example::

    >>> import os, tempfile
    >>> t = Table(dim=3); _ = t.find_or_insert([-2**63, 2**63 - 1])
    >>> path = os.path.join(tempfile.mkdtemp(), "t.cnt"); t.save(path)
    >>> back = load_table(path)
    >>> sorted(back.export().keys.tolist()) == [-2**63, 2**63 - 1], bool((back[[0, -2**63]] == t[[0, -2**63]]).all())
    (True, True)
    """
    return cast(Table, load_store(path, verify, batch_rows, kind=Table))

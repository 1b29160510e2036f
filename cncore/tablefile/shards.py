"""Shard files: a rank's table checked against its recorded place (`check_shard`)."""
from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np

from cncore.routing import owner_of
from cncore.tablefile.reader import TableFile


def check_shard(table: TableFile, path: str, rank: int, world_size: int, batch_rows: int = 1 << 18,
                progress: Callable[[Iterable[np.ndarray]], Iterable[np.ndarray]] = iter,
                keys_of: Iterable[np.ndarray] | None = None) -> None:
    """Check that `table` is shard `rank` of a `world_size`-way split: its recorded place (a
    shard table written by this version on) must be that, and every key must be owned by
    `rank` (`cncore.routing.owner_of`). ValueError naming the path otherwise.

    Args:
        table (TableFile): the shard's table.
        path (str): where it was opened from (for the errors).
        rank (int): the shard it should be.
        world_size (int): the split's ranks.
        batch_rows (int): keys read at a time.
        progress (Callable): wraps the key batches (a progress bar); `iter` for none.
        keys_of (Iterable[np.ndarray] | None): key batches to check instead of the table's own
            (a chain read whole).
    """
    recorded = table.shard
    if recorded is not None and (recorded["rank"], recorded["world_size"]) != (rank, world_size):
        raise ValueError(f"{path}: was saved as shard {recorded['rank']} of {recorded['world_size']}, not shard "
                         f"{rank} of {world_size}: shard folders were renamed or moved; put each back under its "
                         f"own name (shard-{recorded['rank']}-of-{recorded['world_size']}); nothing was loaded or "
                         f"written")
    batches = keys_of if keys_of is not None else (b["keys"] for _, b in table.batches(batch_rows, ("keys",)))
    for keys in progress(batches):
        owners = owner_of(keys, world_size)
        stray = np.flatnonzero(owners != rank)
        if len(stray):
            k = int(keys[stray[0]])
            raise ValueError(f"{path}: holds key {k}, which shard {int(owners[stray[0]])} of {world_size} owns, "
                             f"not {rank}: not shard {rank} of a {world_size}-way split (shards overlap or were "
                             f"renamed); nothing was loaded or written")

"""The split a ``fallback_rows="auto"`` table chooses (``StoreConfig(max_rows=R, fallback_rows="auto")``).

Choosing the split
------------------
The table starts as R keyed rows and no fallback rows. At the first training lookup whose new
keys do not fit (rows held + the call's new distinct keys > R: the lookup that would have to
evict) it measures, once, how it filled:

    churn  = (rows held + rows evicted so far + the call's new keys) / (step + 1) / R
    repeat = (access counts of the rows held + the call's keys) / (rows held + the call's new keys)

churn is the keys it took per training call, over R (``step`` counts the table's optimizer
steps, one a training call; rows inserted by ``load`` or ``insert_or_assign`` count as taken);
repeat is how many lookups each key had (the rows' access counts, as eviction reads them).
A table with churn >= `AUTO_CHURN` and repeat <= `AUTO_REPEAT` (new keys fill it fast, and
each is looked up about once: a long tail) becomes ``R - N`` keyed rows plus
``N = round(AUTO_SHARE * R)`` fallback rows (at least one of each; a one-row budget stays as it
is). A table that measures churn >= `OVERFLOW_CHURN` (one call's new keys alone overflow its
budget) and has at least `OVERFLOW_MIN_ROWS` rows splits too, whatever its repeat, with
``round(OVERFLOW_SHARE * R)`` fallback rows: a small table (a few values, looked up many times
a call) whose budget cannot hold a call's values. Any other keeps its R keyed rows. Both
measures come from what the table holds (its rows, their counts, its step and eviction count),
so a checkpoint of an undecided table carries them.
The constants were chosen on MovieLens-100K and checked on Instacart and the synthetic stream
(docs/bounded-tables.md has every table's measures and the AUC): churn alone did not separate
the tables that gain from shared rows (MovieLens' people at 0.60) from those that lose
(Instacart's users at 0.53, each looked up 8 times a call). The overflow branch came from a
third dataset (NYC flights) and was measured on all three, so none of them tests it
independently: no fill-time measure put every table on the side where it gains (31 tables
labelled by flipping each one's decision; docs/bounded-tables.md).

The conversion
--------------
- The table evicts by its own policy down to ``R - N`` keyed rows (lowest scores first, as
  ``evict(n)``), handing the victims to the ``on_evict`` callbacks and counting them.
- Fallback row j starts as the mean of the victims with ``mix64(key) % N == j`` (what those
  keys would have read), or as the initializer's row where no victim maps to it; its optimizer
  state starts as the optimizer's initial state.
- A new core table with ``max_rows=R - N, fallback_rows=N`` takes the kept rows with their
  optimizer state, counts and last steps, the step, the eviction count,
  and the on_evict callbacks, and replaces the old one; the store's config then holds the
  split. The new table's erase epoch is a fresh stamp, so the backward of a lookup made before
  the conversion is refused, as after any eviction.

Bytes: a fallback row is a slot of the same arena as a keyed row (its values and optimizer
state), without the key, index bucket and metadata a keyed row also pays, so R - N keyed rows
and N fallback rows take no more memory than R keyed rows.

>>> import numpy as np, cncore
>>> s = cncore.EmbeddingStore(dim=1, max_rows=10, fallback_rows="auto", optimizer=cncore.SGD(lr=1.0))
>>> _, ctx = s.pooled_lookup(np.arange(8), lengths=[8]); s.apply_gradients(ctx, np.ones((1, 1), np.float32))
>>> _ = s.pooled_lookup(np.arange(8, 16), lengths=[8])   # 8 + 8 new keys > 10
>>> s.split_measures   # churn (8 + 8) / 2 / 10, repeat (8 + 8) / 16
SplitMeasures(churn=0.8, repeat=1.0, fallback_rows=9)
>>> s.config.max_rows, s.config.fallback_rows, s.fallback_rows, s.evicted_count  # 7 victims, then a round
(1, 9, 9, 8)
"""
from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from cncore import _core
from cncore.config import StoreConfig
from cncore.routing import mix64

if TYPE_CHECKING:
    from cncore.rows import TableBatch

__all__ = ["AUTO_CHURN", "AUTO_REPEAT", "AUTO_SHARE", "OVERFLOW_CHURN", "OVERFLOW_MIN_ROWS", "OVERFLOW_SHARE",
           "auto_fallback_rows", "split_churn", "split_repeat"]

# Churn from which a table shares rows. On MovieLens-100K the tables of a long tail (people,
# items: repeat 1.1-1.7) that gained from shared rows measured 0.40-1.99 (25% and 10% budgets),
# and the same tables at a 50% budget 0.10-0.15, where sharing changed AUC by less than a
# seed's spread: 0.25 lies between.
AUTO_CHURN = 0.25
# Repeat up to which a table shares rows. MovieLens-100K's long-tail tables measured 1.1-1.7
# when they split; every other table of it 6.7 or more (users, zip codes, years, ages: a row
# looked up many times a call): 3 lies between.
AUTO_REPEAT = 3.0
# The share of max_rows a churning table gives to fallback rows: the split that held the most
# AUC on MovieLens at every budget (90% against 20/50/80/95%).
AUTO_SHARE = 0.9
# Churn from which a table splits whatever its repeat: its budget cannot hold one call's new
# keys. Flights' carrier, destination and hour tables at a 25% budget (4-26 rows) carried the
# whole gain of splitting there (0.602 -> 0.629 AUC, 5 seeds), which the repeat limit kept from
# them (each value is looked up many times a call).
OVERFLOW_CHURN = 1.0
# The share of such a table's rows that become fallback rows: half, not AUTO_SHARE's 90%, which
# leaves a 4-26-row table 1-3 keyed rows (Instacart's small tables at 10%: 0.6882 at 50%
# shared, 0.6839 at 90%, against 0.6877 kept).
OVERFLOW_SHARE = 0.5
# The fewest rows a table needs to split by churn alone: flights' 2-row tables at 10% split
# into 1 + 1 rows lost 0.009 AUC (10 seeds).
OVERFLOW_MIN_ROWS = 3


def auto_fallback_rows(max_rows: int, churn: float, repeat: float) -> int:
    """The fallback rows of a ``fallback_rows="auto"`` table of `max_rows` rows at `churn` and
    `repeat` (the module docstring's measures).

    >>> auto_fallback_rows(100, 0.6, 1.2), auto_fallback_rows(100, 0.1, 1.2), auto_fallback_rows(100, 0.6, 9.0)
    (90, 0, 0)
    >>> auto_fallback_rows(10, 2.0, 9.0), auto_fallback_rows(2, 2.0, 9.0)   # overflowed by one call
    (5, 0)
    """
    if churn >= AUTO_CHURN and repeat <= AUTO_REPEAT and max_rows >= 2:
        return _shared_rows(max_rows, AUTO_SHARE)
    if churn >= OVERFLOW_CHURN and max_rows >= max(2, OVERFLOW_MIN_ROWS):
        return _shared_rows(max_rows, OVERFLOW_SHARE)
    return 0


def _shared_rows(max_rows: int, share: float) -> int:
    """`share` of max_rows as fallback rows, leaving at least one of each kind (max_rows >= 2)."""
    return min(max_rows - 1, max(1, round(max_rows * share)))


def split_churn(held: int, evicted: int, new: int, step: int, max_rows: int) -> float:
    """The churn a table measures (the module docstring's formula)."""
    return (held + evicted + new) / (step + 1) / max_rows


def split_repeat(held_counts: int, occurrences: int, held: int, new: int) -> float:
    """The repeat a table measures (the module docstring's formula)."""
    return (held_counts + occurrences) / max(1, held + new)


def budget_of(config: StoreConfig) -> int:
    """The max_rows of an auto table (StoreConfig refuses ``fallback_rows="auto"`` without one)."""
    return cast(int, config.max_rows)


def split_config(config: StoreConfig, fallback_rows: int) -> StoreConfig:
    """The concrete config of an auto table that chose `fallback_rows` of its max_rows (0: its
    max_rows stay keyed rows; the headroom is the default of the keyed rows' budget)."""
    keyed = budget_of(config) - fallback_rows
    return dataclasses.replace(config, max_rows=keyed, fallback_rows=fallback_rows, headroom=None)  # its default


def fallback_start(victim_keys: np.ndarray, victim_rows: np.ndarray, initial: np.ndarray) -> np.ndarray:
    """Fallback rows after a conversion: row j the mean of the victims whose ``mix64(key) % N``
    is j, `initial`'s row j where none is.

    >>> fallback_start(np.array([1, 2]), np.array([[1.0], [3.0]], np.float32), np.zeros((1, 1), np.float32))
    array([[2.]], dtype=float32)
    """
    n = len(initial)
    rows = initial.copy()
    if len(victim_keys) == 0:
        return rows
    slot = (mix64(victim_keys) % np.uint64(n)).astype(np.int64)
    sums = np.zeros(initial.shape, np.float64)
    np.add.at(sums, slot, victim_rows.astype(np.float64))
    hits = np.bincount(slot, minlength=n)
    has = hits > 0
    rows[has] = (sums[has] / hits[has, None]).astype(np.float32)
    return rows


@dataclasses.dataclass(frozen=True)
class SplitMeasures:
    """What an auto table measured when it chose its split (`EmbeddingStore.split_measures`)."""
    churn: float
    repeat: float
    fallback_rows: int


# Serializes the decisions (rare: once a table); a lookup another thread has in flight on the
# table being replaced has its backward refused, as after an eviction.
_DECIDING = threading.RLock()


class AutoSplitVerbs:
    """`EmbeddingStore`'s side of ``fallback_rows="auto"``: the check before a training lookup
    and the conversion (the module docstring)."""

    _table: _core.Table
    _config: StoreConfig
    _evict_callbacks: list[Callable]
    _split_pending: bool
    # How a conversion starts the fallback rows: "victims" (the mean of the victims of each row,
    # the initializer where none) or "initializer" (every row from the initializer). The
    # benchmark's comparison of the two is in docs/bounded-tables.md.
    fallback_start_from = "victims"
    # The measures of the split this store chose itself (None before, and for a store that
    # was built or loaded with its split).
    split_measures: SplitMeasures | None = None

    def split_before_training(self, keys: np.ndarray) -> None:
        """Before a training lookup with `keys` (every key the call looks this table up with):
        choose the split if the table is ``"auto"``, undecided, and the call's new keys do not
        fit. A decided or fixed table returns at once."""
        if not self._split_pending:
            return
        if self._table.size + len(keys) <= budget_of(self._config):  # fits whatever its new keys
            return
        with _DECIDING:  # one decision, whichever thread's lookup finds the table full first
            if self._split_pending:
                self._split_when_full(keys)

    def _split_when_full(self, keys: np.ndarray) -> None:
        config = self._config
        budget = budget_of(config)
        distinct = np.unique(keys)
        slots = np.empty(len(distinct), dtype=np.int64)
        self._table.find(distinct, slots)
        new = int((slots < 0).sum())
        held = self._table.size
        if held + new <= budget:
            return
        churn = split_churn(held, self._table.evicted_count, new, self._table.step, budget)
        counts = int(self.export(with_rows=False).counts.sum(dtype=np.int64)) if held else 0
        repeat = split_repeat(counts, len(keys), held, new)
        fallback_rows = auto_fallback_rows(budget, churn, repeat)
        self.choose_split(fallback_rows)
        self.split_measures = SplitMeasures(churn, repeat, fallback_rows)

    def choose_split(self, fallback_rows: int) -> None:
        """Turn an undecided ``fallback_rows="auto"`` table into ``max_rows - fallback_rows`` keyed
        rows plus `fallback_rows` fallback rows now (the conversion of the module docstring; 0
        keeps its keyed rows). Training lookups call it when the table fills; a checkpoint of
        a decided table calls it to restore the split.

        Args:
            fallback_rows (int): in [0, max_rows - 1].

        >>> import numpy as np, cncore
        >>> s = cncore.EmbeddingStore(dim=1, max_rows=4, fallback_rows="auto")
        >>> s.choose_split(3); s.config.max_rows, s.fallback_rows
        (1, 3)
        """
        if not self._split_pending:
            raise ValueError(f"choose_split: this table's fallback_rows is {self._config.fallback_rows!r}, not an "
                             "undecided 'auto'; its split is fixed")
        max_rows = budget_of(self._config)
        if isinstance(fallback_rows, bool) or not isinstance(fallback_rows, (int, np.integer)) \
                or not 0 <= fallback_rows < max_rows:
            raise ValueError(f"fallback_rows must be an int in [0, {max_rows - 1}] (max_rows - 1), got "
                             f"{fallback_rows!r}; the table is unchanged")
        config = split_config(self._config, int(fallback_rows))
        if not fallback_rows:
            self._config, self._split_pending = config, False
            self._writes += 1  # the config changed: a delta from an earlier save would not match its base
            return
        victims: list[tuple[np.ndarray, np.ndarray]] = []
        errors: list[BaseException] = []

        def collect(keys, rows, state, counts, last_steps):
            victims.append((np.array(keys), np.array(rows)))
            if self._evict_callbacks:
                try:
                    self._deliver(keys, rows, state, counts, last_steps)
                except BaseException as e:  # the conversion completes; the error is raised after it
                    errors.append(e)

        old = self._table
        if old.size > config.max_rows:
            old.evict_sink = collect
            try:
                old.evict(old.size - config.max_rows)
            finally:
                old.evict_sink = self._deliver if self._evict_callbacks else None
        self._swap_table(config, victims)
        if errors:
            raise errors[0]

    def _swap_table(self, config: StoreConfig, victims: list[tuple[np.ndarray, np.ndarray]]) -> None:
        kept = self.export()
        old = self._table
        # this mixin's one user, EmbeddingStore (not imported: it imports this module), builds the core table
        fresh = cast("Callable[[StoreConfig], Any]", type(self))(config)
        fresh.reserve(len(kept.keys))
        fresh.load(kept.keys, kept.rows, kept.optimizer_state if config.state_floats else None, kept.counts,
                   kept.last_steps)
        initial, state = fresh.export_fallback()
        if self.fallback_start_from == "victims" and victims:
            rows = fallback_start(np.concatenate([k for k, _ in victims]),
                                  np.concatenate([r for _, r in victims]), initial)
            fresh.load_fallback(rows, state)
        fresh._table.step = old.step
        fresh._table.evicted_count = old.evicted_count  # (no admission counters: auto refuses admission)
        self._config, self._table, self._split_pending = config, fresh._table, False
        if self._evict_callbacks:
            self._table.evict_sink = self._deliver
        self._writes += 1

    _writes: int

    if TYPE_CHECKING:  # EvictionVerbs' and EmbeddingStore's
        def _deliver(self, keys, rows, state, counts, last_steps) -> None: ...

        def export(self, cursor=None, max_rows=None, *, with_rows: bool = True) -> TableBatch: ...

"""The bounded tables' policies (cn_evict.h and cn_admit.h state them exactly): which rows an
eviction removes first (`LRU`, `LFU`, `TTL`) and which keys a training lookup gives a row
(`MinCount`, `Probability`). They are parts of a `cncore.StoreConfig` (`eviction=`,
`admission=`), re-exported by `cncore` and `cncore.config`.

>>> from cncore import LFU, MinCount, StoreConfig
>>> cfg = StoreConfig(dim=4, max_rows=1000, eviction=LFU(), admission=MinCount(2))
>>> cfg.eviction, cfg.admission.count
(LFU(), 2)
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

__all__ = ["LRU", "LFU", "TTL", "Eviction", "MinCount", "Probability", "Admission", "AUTO_HALVE_TURNOVERS",
           "auto_halve_shift"]


@dataclass(frozen=True)
class LRU:
    """Evict the least recently used rows first: score = last_step, ties by key (ascending).

    Takes no arguments.

    When to use it: IDs that retire (players, last season's items): on the Baseball Databank
    stream it leads plain LFU by 0.04-0.18 AUC. When not to: where the IDs that matter are the
    ones seen most over the whole stream (a popularity head that comes back: MovieLens-100K,
    Instacart, flight numbers), LRU evicts that head with every burst of new IDs and a returning
    ID starts over; it trails the default, ``LFU(halve_every=128)``, by up to 0.045 there. And
    ``fallback_rows="auto"``'s rule was fitted under LFU: a long-tail table it keeps keyed
    (MovieLens-100K's people and items at a 50% budget: churn 0.10-0.15, repeat 3.1-3.3)
    thrashes under LRU, which loses to hashing into the same memory by 0.020 AUC there (0.674
    against 0.694). Under LRU, split such a table's budget yourself (a tenth as ``max_rows=``,
    the rest as ``fallback_rows=``: 0.697 with both split) or keep the default eviction
    (docs/bounded-tables.md, "Every policy against hashing (2026-12-08)").

    Example::

        >>> from cncore import LRU, StoreConfig
        >>> StoreConfig(dim=4, max_rows=1000, eviction=LRU()).headroom
        31
    """
    kind = 1


@dataclass(frozen=True, repr=False)
class LFU:
    """Evict the least frequently used rows first: score = (count, last_step), ties by key.

    When not to use plain ``LFU()`` (no aging): a stream whose population turns over. On the
    Baseball Databank it keeps long careers of every era (19-20% of the test's known players at
    25% and 10% of the rows) and, tested on 2016-2020, loses to hashing into the same memory by
    0.019-0.045 AUC, where the default ``LFU(halve_every=128)`` leads hashing by 0.045-0.058
    (docs/bounded-tables.md, "Every policy against hashing (2026-12-08)").

    Without aging, rows that were popular once keep their place however long they go unused,
    so LFU alone suits only streams whose popular IDs never change. The stored counts are left
    as they are (export shows the lookups); the decay is in the eviction order alone, so a row
    on a tier's disk ages too.

    Args:
        halve_every (int | str | None): aging, a power of two in [1, 2**31], ``"auto"``, or None
            (no aging). A row's count then counts half for every `halve_every` steps since its
            last use: score = (count >> ((step - last_step) // halve_every), last_step) at the
            eviction's step (no more than 32 halvings). ``"auto"`` (needs ``max_rows``) counts
            in the table's own time: at each eviction, halve_every is
            ``AUTO_HALVE_TURNOVERS`` turnovers, a turnover being the steps the table takes to
            take in its budget's worth of rows at its rate so far, rounded down to a power of
            two (`auto_halve_shift` states it exactly).

    Example::

        >>> from cncore import LFU
        >>> LFU(halve_every=1024).halve_every, LFU(halve_every="auto")
        (1024, LFU(halve_every='auto'))
    """
    halve_every: int | str | None = None
    kind = 2

    def __post_init__(self):
        h = self.halve_every
        if h is None or h == "auto":
            return
        if isinstance(h, bool) or not isinstance(h, numbers.Integral) or not 1 <= h <= 2**31 or h & (h - 1):
            raise ValueError(f"LFU.halve_every must be None or a power of two in [1, 2**31] (the decay is "
                             f"a shift in the eviction's scan), or 'auto', got {h!r}")
        object.__setattr__(self, "halve_every", int(h))

    def __repr__(self) -> str:  # LFU() as before aging existed (reports, cn-table inspect)
        return "LFU()" if self.halve_every is None else f"LFU(halve_every={self.halve_every!r})"

    @property
    def halve_shift(self) -> int:
        """log2(halve_every), -1 without aging, or ``-2 - log2(AUTO_HALVE_TURNOVERS)`` for
        ``"auto"`` (the core's form, cn_evict.h's CN_LFU_AUTO)."""
        if self.halve_every is None:
            return -1
        if self.halve_every == "auto":
            return -2 - (AUTO_HALVE_TURNOVERS.bit_length() - 1)
        return int(self.halve_every).bit_length() - 1


# LFU(halve_every="auto"): the turnovers per halving (a power of two). 1, the one measured on all
# five streams (docs/bounded-tables.md, "Aging in the table's own time, and on a long stream"):
# against LFU(halve_every=128), +0.016 / +0.044 on baseball at 25 / 10%, -0.005..-0.021 on
# Instacart; 16 lost baseball by 0.002-0.031 (its period outlasts a 336-step stream at 50%).
AUTO_HALVE_TURNOVERS = 1


def auto_halve_shift(step: int, max_rows: int, held: int, evicted: int, turnovers: int | None = None) -> int:
    """log2 of the halving period an ``LFU(halve_every="auto")`` table uses at an eviction:
    ``min(31, log2(turnovers) + h)``, h the largest integer in [0, 31] with
    ``(held + evicted) * 2**h <= (step + 1) * max_rows`` (0 if none): the steps a turnover
    takes, ``(step + 1) * max_rows / (held + evicted)``, rounded down to a power of two. 31
    when the table has taken no rows.

    Args:
        step (int): the table's step at the eviction.
        max_rows (int): its budget of keyed rows.
        held (int): the rows it holds before the eviction.
        evicted (int): the rows it has evicted so far (``evicted_count``).
        turnovers (int | None): the turnovers per halving (None: `AUTO_HALVE_TURNOVERS`).

    >>> auto_halve_shift(99, 1000, 1000, 4000, turnovers=1)   # 100 steps took 5 budgets: 20 steps each
    4
    >>> auto_halve_shift(99, 1000, 1000, 4000, turnovers=16)
    8
    """
    scale = (AUTO_HALVE_TURNOVERS if turnovers is None else turnovers).bit_length() - 1
    taken = held + evicted
    if taken <= 0 or max_rows <= 0:
        return 31
    h = 0
    while h < 31 and taken << (h + 1) <= (step + 1) * max_rows:
        h += 1
    return min(31, h + scale)


@dataclass(frozen=True)
class TTL:
    """Rows not used for more than `steps` steps (store.step - last_step > steps) expire:
    `store.evict_expired()` sweeps them, and under pressure rows go by last_step (as LRU), so
    expired rows, the oldest, go first. Between sweeps it evicts exactly as `LRU` (the same
    score), so `LRU`'s "when not to use it" holds for it too.

    Args:
        steps (int): the steps in [0, 2**32) a row may go unused before it expires.

    Example::

        >>> from cncore import TTL
        >>> TTL(100).steps
        100
    """
    steps: int
    kind = 3

    def __post_init__(self):
        if isinstance(self.steps, bool) or not isinstance(self.steps, numbers.Integral) \
                or not 0 <= self.steps < 2**32:
            raise ValueError(f"TTL.steps must be an int in [0, 2**32), got {self.steps!r}")
        object.__setattr__(self, "steps", int(self.steps))


Eviction = LRU | LFU | TTL


@dataclass(frozen=True)
class MinCount:
    """Admission: a key gets a row in a training lookup only once it has been seen `count`
    times (every occurrence counts; weights never do), counted while it has no row in a
    count-min sketch (depth * width * 4 bytes; cn_admit.h states the hashing, so the decisions
    can be replayed). The sketch may admit a key early (colliding keys raise its counters),
    never late; ``store.decay_admission()`` halves its counters. A key not admitted takes no
    update and has slot -1 in its context. find_or_insert, insert_or_assign and load are not
    gated.

    With an admission policy ``fallback_rows="auto"`` cannot run, so ``max_rows=`` with
    ``admission=`` alone gives a row per key and no shared rows: at small budgets on a
    long-tail table that loses to hashing into the same memory (``MinCount(2)``, MovieLens-100K
    at 25% / 10% of the IDs: -0.022 / -0.018 AUC; flights at 25%: -0.009). Give such a table
    its split (``fallback_rows=N``), table by table where you can: the same 90% split on every
    table is level with hashing of its memory (MovieLens, baseball) but trails the default
    without admission by 0.015-0.067 on Instacart, flights and baseball, where some tables do
    better keyed (docs/bounded-tables.md, "Every policy against hashing (2026-12-08)").

    Args:
        count (int): sightings in [1, 2**32) a key needs before it gets a row.
        unadmitted (str): what a key not admitted reads as: "zeros", or "initial" (its
            initial row, also for any absent key in an evaluation lookup).
        width (int): uint32 counters per sketch row, a power of two in [16, 2**30].
        depth (int): sketch rows (hash functions), in [1, 16].

    Example::

        >>> from cncore import MinCount
        >>> MinCount(2).width, MinCount(2, unadmitted="initial").unadmitted
        (262144, 'initial')
    """
    count: int
    unadmitted: str = "zeros"
    width: int = 2**18
    depth: int = 4

    def __post_init__(self):
        if isinstance(self.count, bool) or not isinstance(self.count, numbers.Integral) or not 1 <= self.count < 2**32:
            raise ValueError(f"MinCount.count must be an int in [1, 2**32), got {self.count!r}")
        if self.unadmitted not in ("zeros", "initial"):
            raise ValueError(f"MinCount.unadmitted must be 'zeros' or 'initial', got {self.unadmitted!r}")
        if isinstance(self.width, bool) or not isinstance(self.width, numbers.Integral) \
                or not 16 <= self.width <= 2**30 or self.width & (self.width - 1):
            raise ValueError(f"MinCount.width must be a power of two in [16, 2**30], got {self.width!r}")
        if isinstance(self.depth, bool) or not isinstance(self.depth, numbers.Integral) or not 1 <= self.depth <= 16:
            raise ValueError(f"MinCount.depth must be an int in [1, 16], got {self.depth!r}")
        for name in ("count", "width", "depth"):
            object.__setattr__(self, name, int(getattr(self, name)))


@dataclass(frozen=True)
class Probability:
    """Admission by probability: a key a training lookup sees without a row gets one with
    probability `p`, decided once per (table seed, key): it is admitted when a uniform draw in
    [0, 1) fixed by the seed and the key (53 bits of mix64, cn_admit.h states it) is below p. No
    memory and no counting; the same keys are admitted whatever the order or batching, and a
    key refused once is refused every time (so about a fraction p of the distinct keys ever gets
    a row: TFRA's and DeepRec's probability filters). A key not admitted takes no update;
    find_or_insert, insert_or_assign and load are not gated.

    Args:
        p (float): the probability in (0, 1] that a key gets a row.
        unadmitted (str): what a key not admitted reads as: "zeros", or "initial" (its
            initial row).

    Example::

        >>> from cncore import Probability
        >>> Probability(0.25), Probability(1).p
        (Probability(p=0.25, unadmitted='zeros'), 1.0)
    """
    p: float
    unadmitted: str = "zeros"

    def __post_init__(self):
        if isinstance(self.p, bool) or not isinstance(self.p, numbers.Real) or not 0 < float(self.p) <= 1:
            raise ValueError(f"Probability.p must be a number in (0, 1], got {self.p!r}")
        if self.unadmitted not in ("zeros", "initial"):
            raise ValueError(f"Probability.unadmitted must be 'zeros' or 'initial', got {self.unadmitted!r}")
        object.__setattr__(self, "p", float(self.p))

    @property
    def threshold(self) -> int:
        """ceil(p * 2^53): a key is admitted when its 53-bit draw is below it (exact: p * 2^53
        is a float scaled by a power of two)."""
        return math.ceil(self.p * 2**53)


Admission = MinCount | Probability

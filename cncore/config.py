"""Configuration of a store: frozen dataclasses, validated on construction.

>>> from cncore import StoreConfig, Normal, RowWiseAdagrad
>>> cfg = StoreConfig(dim=8, initializer=Normal(std=0.01), optimizer=RowWiseAdagrad(lr=0.1), seed=7)
>>> cfg.state_floats
1
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, replace

# The bounded tables' eviction and admission policies (cncore/policies.py), part of a config.
from cncore.policies import LFU, LRU, TTL, Admission, Eviction, MinCount, Probability

__all__ = [
    "Uniform", "Normal", "TruncatedNormal", "Constant", "Initializer",
    "SGD", "Adagrad", "RowWiseAdagrad", "Adam", "Optimizer",
    "LRU", "LFU", "TTL", "Eviction", "MinCount", "Probability", "Admission",
    "StoreConfig",
]


# What max_rows= evicts by when no eviction is given: LFU, its counts halving every 128 steps a
# row goes unused. Measured on five streams (docs/bounded-tables.md, "Which eviction policy by
# default"): plain LFU lost to hashing by 0.02-0.05 AUC where IDs retire (baseball, tested on
# later seasons), this one leads there by 0.045-0.058 and is level with plain LFU elsewhere
# (Instacart 50%: -0.0015). LRU lost 0.014-0.044 on three of the five; aging every 8 or 32
# steps cost Instacart up to 0.024. The halving acts on a row's idle steps, not the stream's
# length: IDs seen at least every 128 steps keep plain LFU's order on any stream, and a count C
# gives way after about 128 x log2(C) idle steps. On a 10,000-step synthetic stream the rows a
# full table evicts from have idled far longer than that, so it held LRU's rows (90-99.95%),
# not plain LFU's ("Aging in the table's own time, and on a long stream"). LFU(halve_every=
# "auto"), a period in the table's turnovers, lost on Instacart (1 turnover) or on baseball (16).
DEFAULT_EVICTION = LFU(halve_every=128)

# Rows a store may be asked to hold up front (the core's index bound, cn_index.h); what the
# machine can hold is checked when the store allocates.
MAX_CAPACITY = 2**56

# The largest float32: rows, state and hyperparameters are float32 in the core, so a larger
# value became inf there (and NaN rows after the first update).
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32: a std below it is 0 or denormal


def _finite(name: str, value: float) -> float:
    """A real number (Python's or NumPy's; not a bool) that is finite as a float32."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) \
            or abs(float(value)) > FLOAT32_MAX:
        raise ValueError(f"{name} must be a finite number within float32's range (|x| <= 3.4e38), got {value!r}")
    return float(value)


def _field(obj, name: str) -> float:
    """Check a numeric field of a frozen config dataclass and store it as a Python float, so
    NumPy scalars (`lr=np.float32(0.1)`) are accepted and the config stays JSON-able."""
    value = _finite(f"{type(obj).__name__}.{name}", getattr(obj, name))
    object.__setattr__(obj, name, value)
    return value


def _non_negative(obj, *fields: str) -> None:
    """Each named field of the (optimizer) dataclass must be a finite number >= 0."""
    for name in fields:
        if not _field(obj, name) >= 0:
            raise ValueError(f"{type(obj).__name__}.{name} must be >= 0, got {getattr(obj, name)}")


# --- initialisers: a new row's value is a pure function of (seed, key, column) ---------------

@dataclass(frozen=True)
class Uniform:
    """U(low, high), as torch.nn.init.uniform_: how a new key's row is drawn.

    Args:
        low (float): the lower bound.
        high (float): the upper bound, > low.

    Example::

        >>> from cncore import StoreConfig, Uniform
        >>> StoreConfig(dim=4, initializer=Uniform(-0.1, 0.1)).initializer.params()
        (-0.1, 0.1, 0.0, 0.0)
    """
    low: float = -0.05
    high: float = 0.05
    kind = 0

    def __post_init__(self):
        if not _field(self, "low") < _field(self, "high"):
            raise ValueError(f"Uniform needs low < high, got low={self.low}, high={self.high}")
        _finite("Uniform.high - Uniform.low", float(self.high) - float(self.low))

    def params(self) -> tuple[float, float, float, float]:
        """The initializer's four parameters as the core reads them (cn_init.h).

        Returns:
            tuple[float, float, float, float]: (low, high, 0, 0).
        """
        return (self.low, self.high, 0.0, 0.0)


@dataclass(frozen=True)
class Normal:
    """N(mean, std^2), as torch.nn.init.normal_: how a new key's row is drawn.

    Args:
        mean (float): the mean.
        std (float): the standard deviation, >= 1.2e-38 (a float32 that is not 0).

    Example::

        >>> from cncore import Normal
        >>> Normal(std=0.01).params()
        (0.0, 0.01, 0.0, 0.0)
    """
    mean: float = 0.0
    std: float = 1.0
    kind = 1

    def __post_init__(self):
        _field(self, "mean")
        if not _field(self, "std") >= FLOAT32_TINY:
            raise ValueError(f"Normal.std must be >= 1.2e-38 (a float32 that is not 0), got {self.std}")
        # A draw is at most ~6 std from the mean (24-bit uniforms); it must stay a finite float32.
        _finite("Normal.mean + 8 * Normal.std", abs(float(self.mean)) + 8 * float(self.std))

    def params(self) -> tuple[float, float, float, float]:
        """The initializer's four parameters as the core reads them (cn_init.h).

        Returns:
            tuple[float, float, float, float]: (mean, std, 0, 0).
        """
        return (self.mean, self.std, 0.0, 0.0)


def _normal_mass(a: float, b: float) -> float:
    """P(a <= Z <= b) for a standard normal Z, computed in the tail where it is small, so that
    intervals far from the mean keep their (tiny) mass instead of rounding to 0."""
    if a >= 0:
        return 0.5 * (math.erfc(a / math.sqrt(2)) - math.erfc(b / math.sqrt(2)))
    if b <= 0:
        return 0.5 * (math.erfc(-b / math.sqrt(2)) - math.erfc(-a / math.sqrt(2)))
    return 1.0 - 0.5 * (math.erfc(-a / math.sqrt(2)) + math.erfc(b / math.sqrt(2)))


@dataclass(frozen=True)
class TruncatedNormal:
    """N(mean, std^2) restricted to [low, high] (absolute bounds), as torch.nn.init.trunc_normal_.

    A first normal draw is kept when it falls inside; otherwise the value is drawn by inverse
    CDF from the truncated distribution itself (cn_init.h), so any interval with mass works,
    also one far in a tail (rejection sampling pinned 98.9 % of TruncatedNormal(0, 1, 3.9, 3.96)
    at `low`). Intervals whose mass underflows double precision (about 37 std from the mean)
    are refused.

    Args:
        mean (float): the mean of the normal distribution.
        std (float): its standard deviation, >= 1.2e-38.
        low (float): the lower bound of the values (absolute, not in std).
        high (float): the upper bound, > low.

    Example::

        >>> from cncore import TruncatedNormal
        >>> TruncatedNormal(0.0, 1.0, 3.9, 3.96).high
        3.96
    """
    mean: float = 0.0
    std: float = 1.0
    low: float = -2.0
    high: float = 2.0
    kind = 2

    def __post_init__(self):
        mean = _field(self, "mean")
        if not _field(self, "std") >= FLOAT32_TINY:
            raise ValueError(f"TruncatedNormal.std must be >= 1.2e-38 (a float32 that is not 0), got {self.std}")
        lo, hi = _field(self, "low"), _field(self, "high")
        if not lo < hi:
            raise ValueError(f"TruncatedNormal needs low < high, got low={lo}, high={hi}")
        a, b = (lo - mean) / self.std, (hi - mean) / self.std
        if not _normal_mass(a, b) > 1e-300:
            raise ValueError(f"TruncatedNormal: [low, high] = [{lo}, {hi}] holds no probability mass a double can "
                             f"represent (it lies {min(abs(a), abs(b)):.0f} std from the mean); move it closer")

    def params(self) -> tuple[float, float, float, float]:
        """The initializer's four parameters as the core reads them (cn_init.h).

        Returns:
            tuple[float, float, float, float]: (mean, std, low, high).
        """
        return (self.mean, self.std, self.low, self.high)


@dataclass(frozen=True)
class Constant:
    """Every value of a new row is `value` (torch.nn.init.constant_).

    Args:
        value (float): the value of every entry of a new row.

    Example::

        >>> from cncore import Constant
        >>> Constant(0.5).params()
        (0.5, 0.0, 0.0, 0.0)
    """
    value: float = 0.0
    kind = 3

    def __post_init__(self):
        _field(self, "value")

    def params(self) -> tuple[float, float, float, float]:
        """The initializer's four parameters as the core reads them (cn_init.h).

        Returns:
            tuple[float, float, float, float]: (value, 0, 0, 0).
        """
        return (self.value, 0.0, 0.0, 0.0)


Initializer = Uniform | Normal | TruncatedNormal | Constant


# --- optimizers: the per-row state the rows carry, and the fused update ----------------------

@dataclass(frozen=True)
class SGD:
    """w -= lr * g, the fused update of the rows a backward reaches. No per-row state.

    Args:
        lr (float): the learning rate, >= 0.

    Example::

        >>> from cncore import SGD, StoreConfig
        >>> StoreConfig(dim=4, optimizer=SGD(lr=0.1)).state_floats
        0
    """
    lr: float = 0.01
    kind = 1
    eps = 0.0
    betas = (0.0, 0.0)
    initial_state = 0.0

    def __post_init__(self):
        _non_negative(self, "lr")


class _AdagradFamily:
    """What Adagrad and its row-wise form share: the checks, and the accumulator's start."""
    betas = (0.0, 0.0)

    def __post_init__(self):
        _non_negative(self, "lr", "eps", "initial_accumulator_value")

    @property
    def initial_state(self):
        return self.initial_accumulator_value


@dataclass(frozen=True)
class Adagrad(_AdagradFamily):
    """torch.optim.Adagrad (lr_decay=0, weight_decay=0): one state float per value.

    Args:
        lr (float): the learning rate, >= 0.
        eps (float): added to the accumulator's square root, >= 0.
        initial_accumulator_value (float): a new row's accumulator, >= 0.

    Example::

        >>> from cncore import Adagrad, StoreConfig
        >>> StoreConfig(dim=4, optimizer=Adagrad(lr=0.1)).state_floats
        4
    """
    lr: float = 0.01
    eps: float = 1e-10
    initial_accumulator_value: float = 0.0
    kind = 2


@dataclass(frozen=True)
class RowWiseAdagrad(_AdagradFamily):
    """FBGEMM's EXACT_ROWWISE_ADAGRAD: one state float per row,
    s += mean(g^2); w -= lr / (sqrt(s) + eps) * g.

    Args:
        lr (float): the learning rate, >= 0.
        eps (float): added to the accumulator's square root, >= 0.
        initial_accumulator_value (float): a new row's accumulator, >= 0.

    Example::

        >>> from cncore import RowWiseAdagrad, StoreConfig
        >>> StoreConfig(dim=4, optimizer=RowWiseAdagrad(lr=0.1)).state_floats
        1
    """
    lr: float = 0.01
    eps: float = 1e-8
    initial_accumulator_value: float = 0.0
    kind = 3


@dataclass(frozen=True)
class Adam:
    """torch.optim.Adam's formula applied lazily (only rows with a gradient move; the bias
    correction uses the store's step). Two state vectors per row (m, v).

    Args:
        lr (float): the learning rate, >= 0.
        betas (tuple[float, float]): the decay rates of m and v, each in [0, 1).
        eps (float): added to sqrt(v), >= 0.

    Example::

        >>> from cncore import Adam, StoreConfig
        >>> StoreConfig(dim=4, optimizer=Adam(betas=(0.8, 0.99))).state_floats
        8
    """
    lr: float = 0.001
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    kind = 4
    initial_state = 0.0

    def __post_init__(self):
        _non_negative(self, "lr", "eps")
        if not isinstance(self.betas, (tuple, list)) or len(self.betas) != 2 \
                or not all(0.0 <= _finite("Adam.betas", b) < 1.0 for b in self.betas):
            raise ValueError(f"Adam.betas must be two numbers in [0, 1), got {self.betas!r}")
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))


Optimizer = SGD | Adagrad | RowWiseAdagrad | Adam

_STATE_FLOATS = {None: lambda d: 0, SGD: lambda d: 0, Adagrad: lambda d: d, RowWiseAdagrad: lambda d: 1,
                 Adam: lambda d: 2 * d}



SUPPORTED_DTYPES = ("float32", "float16", "bfloat16")
PLANNED_DTYPES = ()
# What a key reads from its fallback row (StoreConfig.fallback_mode, docs/bounded-tables.md).
FALLBACK_MODES = ("miss", "residual")
# The core's code of each row dtype (cn_dtype.h).
ROW_DTYPES = {"float32": 0, "float16": 1, "bfloat16": 2}


@dataclass(frozen=True)
class Tiered:
    """Storage for a table larger than memory (cncore/tier/): every row lives in a directory on
    disk (a slotted file of page-aligned records plus the key index of the last flush); a
    bounded in-memory cache holds the hot rows with their optimizer state and metadata
    (evicting by the config's eviction policy, LRU by default).

    Rewritten rows go to free space, so the file holds the live rows plus those rewritten
    since the last flushes; a low `compact_ratio` bounds the space but rewrites records more
    often (10 uniform passes over a table 3x its cache, dim 64, a flush after each: write
    amplification 2.43 at ratio 2, a compaction at every flush, and 1.35 at 3, none, the file
    2.1x the live records; 1.08 of it is the record itself, 280 bytes for 260 of row and
    state). The `io_threads` are apart from the core's compute threads: a thread waiting on a
    device uses no core. Reading 1,400 records of a step took 2.0 ms on 1 thread, 1.1 on 2 or
    4, 1.4 on 8 (page cache, 2 cores); a real SSD wants more in flight. The reads of `prefetch`
    and the writes of evicted rows run on the tier's background thread alone (plus the
    training thread reading beside it when it needs the records early): pool workers woken
    there took the cores the training thread computes on (cncore/tier/prefetch.py,
    TieredStore.prefetch).

    Args:
        path (str | os.PathLike): the table's directory (made if absent).
        cache_bytes (int): the memory cache's size in bytes, in [1, 2**56].
        compact_ratio (float): a flush compacts the file when it holds more than this many
            records per row, in [1, 1e6].
        io_threads (int): threads that move a batch's records (each issues blocking preads /
            pwrites, so this many I/Os are in flight), in [1, 256].

    Example::

        >>> from cncore import Tiered
        >>> Tiered(path="/tmp/users.tier", cache_bytes=2**30).cache_bytes
        1073741824
    """
    path: str
    cache_bytes: int
    compact_ratio: float = 3.0
    io_threads: int = 4

    def __post_init__(self):
        import os
        if not isinstance(self.path, (str, os.PathLike)) or not str(self.path):
            raise TypeError(f"Tiered.path must be a directory path (str), got {self.path!r}")
        object.__setattr__(self, "path", os.fspath(self.path))
        if isinstance(self.cache_bytes, bool) or not isinstance(self.cache_bytes, numbers.Integral) \
                or not 1 <= self.cache_bytes <= 2**56:
            raise ValueError(f"Tiered.cache_bytes must be an int in [1, 2**56], got {self.cache_bytes!r}")
        object.__setattr__(self, "cache_bytes", int(self.cache_bytes))
        if isinstance(self.compact_ratio, bool) or not isinstance(self.compact_ratio, numbers.Real) \
                or not 1.0 <= self.compact_ratio <= 1e6:
            raise ValueError(f"Tiered.compact_ratio must be a number in [1, 1e6] (records per row the file may hold "
                             f"before a flush compacts it), got {self.compact_ratio!r}")
        object.__setattr__(self, "compact_ratio", float(self.compact_ratio))
        if isinstance(self.io_threads, bool) or not isinstance(self.io_threads, numbers.Integral) \
                or not 1 <= self.io_threads <= 256:
            raise ValueError(f"Tiered.io_threads must be an int in [1, 256], got {self.io_threads!r}")
        object.__setattr__(self, "io_threads", int(self.io_threads))


@dataclass(frozen=True)
class StoreConfig:
    """Everything that defines a store (`cncore.make_store(config)` builds it).

    Half-precision rows take half the bytes; optimizer state stays float32, every update
    computes in float32 and rounds to nearest even once per row and step, values past
    float16's 65504 saturate; rows cross the API as float32 arrays, exact for these dtypes
    (cython_src/include/cn_dtype.h).

    Bounded tables (cn_evict.h has the exact policy): an insert that would take the table past
    `max_rows` first evicts, by `eviction`, the lowest-scoring rows the call does not use, down
    to ``max_rows - headroom`` rows after the insert. A training lookup whose own distinct keys
    exceed max_rows still trains: one round of eviction frees rows down to
    ``max_rows - headroom`` (at least one; never rows the call uses), its new keys take the
    free rows in order of first occurrence, and the rest overflow (they read as keys admission
    refuses: zeros, or the initial row with ``unadmitted="initial"``, and take no update); an
    explicit insert (``find_or_insert``) that large is refused (ValueError, table unchanged).
    Evicted rows go to the callbacks of ``store.on_evict`` and are counted in
    ``store.evicted_count``. An eviction, like an erase, makes earlier lookups' contexts stale
    (their backward is refused). With an eviction policy the table keeps each row's key next
    to its metadata (8 bytes + 1 bit per row) so eviction scans memory in order. Each round of
    eviction scans the table a few times, so a larger `headroom` pays that scan over more
    inserts, at the price of a table that runs up to `headroom` rows below its budget.

    Fallback rows (``fallback_rows=N``, docs/bounded-tables.md): N shared rows beside the keyed
    ones, outside the budget and the index. In a pooled lookup, a key without a row of its own
    (not admitted, overflowed, evicted and not back; in evaluation, unseen) reads the fallback
    row ``mix64(key) % N``, and in training updates it with its optimizer state, as a table
    hashed into N rows would; a key that gets a row starts from its fallback row's values
    (``fallback_copy=True``) or from the initializer. Fallback row j starts as key j's initial
    row. ``len``, find, read and export see keyed rows only; ``nbytes`` includes them. With
    ``fallback_mode="residual"`` every key of a pooled lookup reads its own row (zeros while
    it has none) plus its fallback row, and the backward trains both (an exact head over a
    shared hashed part, as hybrid/compositional hashing does).

    Args:
        dim (int): row width, in [1, 65536].
        dtype (str): storage dtype of the rows' values: "float32", "float16" or "bfloat16".
        initializer (Initializer): how a new key's row is drawn (`Uniform`, `Normal`,
            `TruncatedNormal` or `Constant`).
        seed (int): the table seed of that draw (a key's initial row depends on it alone).
        capacity (int): rows to allocate up front (a hint: the store grows past it).
        max_load_factor (float): the index grows when size / buckets would exceed it (0.1 .. 0.9).
        optimizer (Optimizer | None): the fused optimizer whose per-row state the rows carry
            (`SGD`, `Adagrad`, `RowWiseAdagrad` or `Adam`), or None.
        max_rows (int | None): the row budget, or None (unbounded).
        eviction (Eviction | None): `LRU()`, `LFU()` or `TTL(steps)`; with max_rows, None means
            ``LFU(halve_every=128)``: frequency, aged so that IDs which stop
            coming (retired players, last season's items) give way (docs/bounded-tables.md,
            "Which eviction policy by default": level with plain LFU on four streams, far ahead
            of it where IDs retire); allowed without max_rows (then only the explicit ``evict``
            / ``evict_expired`` verbs evict).
        headroom (int | None): rows freed beyond the need by one round of eviction (None:
            max(1, max_rows // 32); at most max_rows - 1).
        admission (Admission | None): `MinCount(c)`, `Probability(p)` or None: which keys a
            training lookup gives a row.
        storage (Tiered | None): None (every row in memory) or `Tiered(path, cache_bytes)`: rows
            on disk under a bounded memory cache; `cncore.make_store(config)` then builds a
            `cncore.tier.TieredStore`.
        fallback_rows (int | str | None): shared rows for keys without a row of their own (0:
            none, one row per key: they read as zeros; at small budgets a long-tail table
            loses to hashing that way, MovieLens-100K at 25%: -0.021 AUC, docs/bounded-tables.md
            "Every policy against hashing"); in [0, 2**56]. Not with ``storage=``.
            ``"auto"`` (with max_rows): the table starts as max_rows keyed rows and, at the first
            training lookup that finds it full, splits max_rows into keyed and fallback rows by
            the churn it measured while filling (`cncore.store_split`); its config then holds
            the split. None (the default): ``"auto"`` where it can run (max_rows, rows in memory,
            fallback_mode="miss", no admission; a store in the core, sharded or not), else 0. The
            config keeps None only where the placement decides; ``store.config`` holds what was
            resolved (`with_default_split`).
        fallback_copy (bool): a key's new row starts as a copy of its fallback row (True) or
            from the initializer (False); only with fallback_rows. Not read in residual mode.
        fallback_mode (str): "miss" (a key reads its fallback row only while it has no row of
            its own) or "residual" (every key of a pooled lookup reads its own row, zeros if
            none, plus its fallback row, and both train, each with its optimizer state; a new
            row starts at zero; "sum" and "mean" pooling, "max" refused). Needs fallback_rows.

    Example::

        >>> from cncore import LRU, StoreConfig, make_store
        >>> cfg = StoreConfig(dim=4, max_rows=100, eviction=LRU())
        >>> cfg.headroom, len(make_store(cfg))
        (3, 0)
        >>> cfg.fallback_rows, make_store(cfg).config.fallback_rows, StoreConfig(dim=4).fallback_rows
        (None, 'auto', 0)
    """
    dim: int
    dtype: str = "float32"
    initializer: Initializer = field(default_factory=Uniform)
    seed: int = 0
    capacity: int = 1024
    max_load_factor: float = 0.7
    optimizer: Optimizer | None = None
    max_rows: int | None = None
    eviction: Eviction | None = None
    headroom: int | None = None
    admission: Admission | None = None
    storage: Tiered | None = None
    fallback_rows: int | str | None = None
    fallback_copy: bool = True
    fallback_mode: str = "miss"

    def __post_init__(self):
        if not isinstance(self.dim, int) or isinstance(self.dim, bool) or not 1 <= self.dim <= 65536:
            raise ValueError(f"dim must be an int in [1, 65536], got {self.dim!r}")
        if self.dtype not in SUPPORTED_DTYPES:
            planned = " (planned, not yet supported)" if self.dtype in PLANNED_DTYPES else ""
            raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {self.dtype!r}{planned}")
        if not isinstance(self.initializer, (Uniform, Normal, TruncatedNormal, Constant)):
            raise TypeError("initializer must be Uniform, Normal, TruncatedNormal or Constant, "
                            f"got {type(self.initializer).__name__}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed < 2**64:
            raise ValueError(f"seed must be an int in [0, 2**64), got {self.seed!r}")
        if isinstance(self.capacity, bool) or not isinstance(self.capacity, numbers.Integral) \
                or not 0 <= self.capacity <= MAX_CAPACITY:
            raise ValueError(f"capacity must be an int in [0, 2**56], got {self.capacity!r}")
        object.__setattr__(self, "capacity", int(self.capacity))
        if isinstance(self.max_load_factor, bool) or not isinstance(self.max_load_factor, numbers.Real) \
                or not 0.1 <= self.max_load_factor <= 0.9:
            raise ValueError(f"max_load_factor must be in [0.1, 0.9], got {self.max_load_factor!r}")
        object.__setattr__(self, "max_load_factor", float(self.max_load_factor))
        if self.optimizer is not None and type(self.optimizer) not in _STATE_FLOATS:
            raise TypeError("optimizer must be None, SGD, Adagrad, RowWiseAdagrad or Adam, "
                            f"got {type(self.optimizer).__name__}")
        if self.eviction is not None and not isinstance(self.eviction, (LRU, LFU, TTL)):
            raise TypeError(f"eviction must be None, LRU(), LFU() or TTL(steps), got {type(self.eviction).__name__}")
        if self.admission is not None and not isinstance(self.admission, (MinCount, Probability)):
            raise TypeError(f"admission must be None, MinCount(count) or Probability(p), got "
                            f"{type(self.admission).__name__}")
        if self.max_rows is not None:
            if isinstance(self.max_rows, bool) or not isinstance(self.max_rows, numbers.Integral) \
                    or not 1 <= self.max_rows <= MAX_CAPACITY:
                raise ValueError(f"max_rows must be None or an int in [1, 2**56], got {self.max_rows!r}")
            object.__setattr__(self, "max_rows", int(self.max_rows))
            if self.eviction is None:  # the default policy (docs/bounded-tables.md has the measurements)
                object.__setattr__(self, "eviction", DEFAULT_EVICTION)
            if self.headroom is None:
                object.__setattr__(self, "headroom", min(max(1, self.max_rows // 32), self.max_rows - 1))
        if isinstance(self.eviction, LFU) and self.eviction.halve_every == "auto" and self.max_rows is None:
            raise ValueError("eviction=LFU(halve_every='auto') ages by the table's turnover of its max_rows: "
                             "set max_rows too")
        if self.storage is not None and not isinstance(self.storage, Tiered):
            raise TypeError(f"storage must be None or cncore.Tiered(path, cache_bytes), got "
                            f"{type(self.storage).__name__}")
        if self.headroom is not None:
            if self.max_rows is None:
                raise ValueError("headroom applies to a row budget: set max_rows too")
            if isinstance(self.headroom, bool) or not isinstance(self.headroom, numbers.Integral) \
                    or not 0 <= self.headroom < self.max_rows:
                raise ValueError(f"headroom must be an int in [0, max_rows), got {self.headroom!r}")
            object.__setattr__(self, "headroom", int(self.headroom))
        self._check_fallback()

    def _check_fallback(self) -> None:
        if self.fallback_rows is None and not self._can_split():
            object.__setattr__(self, "fallback_rows", 0)  # the default where "auto" cannot run: one row per key
        if self.fallback_rows is None:
            if not isinstance(self.fallback_copy, bool):
                raise TypeError(f"fallback_copy must be a bool, got {self.fallback_copy!r}")
            return
        if isinstance(self.fallback_rows, str):
            self._check_auto_split()
            return
        if isinstance(self.fallback_rows, bool) or not isinstance(self.fallback_rows, numbers.Integral) \
                or not 0 <= self.fallback_rows <= MAX_CAPACITY:
            raise ValueError(f"fallback_rows must be an int in [0, 2**56], got {self.fallback_rows!r}")
        object.__setattr__(self, "fallback_rows", int(self.fallback_rows))
        if not isinstance(self.fallback_copy, bool):
            raise TypeError(f"fallback_copy must be a bool, got {self.fallback_copy!r}")
        if self.fallback_mode not in FALLBACK_MODES:
            raise ValueError(f"fallback_mode must be one of {FALLBACK_MODES}, got {self.fallback_mode!r}")
        if self.fallback_mode == "residual" and not self.fallback_rows:
            raise ValueError("fallback_mode='residual' adds a shared fallback row to every key's row: set "
                             "fallback_rows > 0 too, or leave fallback_mode='miss'")
        if self.fallback_mode == "residual" and not self.fallback_copy:
            raise ValueError("fallback_copy=False with fallback_mode='residual': a residual table's new row always "
                             "starts at zero (the key keeps reading its fallback row plus its own), never from the "
                             "initializer; leave fallback_copy at its default (True, not read in this mode)")
        if not self.fallback_rows:
            return
        if self.storage is not None:
            raise ValueError(f"fallback_rows={self.fallback_rows}: a tiered table (storage={self.storage!r}) has no "
                             "fallback rows; keep its rows in memory (storage=None) or set fallback_rows=0")
        if self.admission is not None and self.admission.unadmitted != "zeros":
            raise ValueError(f"fallback_rows={self.fallback_rows} with admission={self.admission!r}: keys not "
                             "admitted read their fallback row; leave unadmitted='zeros' (the default)")

    def _can_split(self) -> bool:
        """Whether ``fallback_rows="auto"`` can run on this config (what the placement and the
        sharding decide is left to them: `with_default_split`)."""
        return (self.max_rows is not None and self.storage is None and self.fallback_mode == "miss"
                and self.admission is None)

    def _check_auto_split(self) -> None:
        """``fallback_rows="auto"``: the split of max_rows chosen by the table (cncore/store_split.py)."""
        if self.fallback_rows != "auto":
            raise ValueError(f"fallback_rows must be an int in [0, 2**56] or 'auto', got {self.fallback_rows!r}")
        if not isinstance(self.fallback_copy, bool):
            raise TypeError(f"fallback_copy must be a bool, got {self.fallback_copy!r}")
        refusal = None
        if self.max_rows is None:
            refusal = "it splits a row budget: set max_rows too"
        elif self.storage is not None:
            refusal = f"a tiered table (storage={self.storage!r}) has no fallback rows; keep its rows in memory"
        elif self.fallback_mode != "miss":
            refusal = (f"fallback_mode={self.fallback_mode!r} is not chosen by the split; use fallback_mode='miss' or "
                       "a fixed fallback_rows=N")
        elif self.admission is not None:
            refusal = (f"admission={self.admission!r} refuses keys, which the churn the split is chosen from does "
                       "not count; use admission=None or a fixed fallback_rows=N")
        if refusal is not None:
            raise ValueError(f"fallback_rows='auto': {refusal}")

    @property
    def fixed_fallback_rows(self) -> int:
        """The fallback rows the table holds now: `fallback_rows`, or 0 for ``"auto"`` (a table that
        has not chosen its split yet; once it has, its config holds the number)."""
        return 0 if isinstance(self.fallback_rows, str) or self.fallback_rows is None else self.fallback_rows

    @property
    def state_floats(self) -> int:
        """Optimizer-state floats stored after each row's embedding."""
        return _STATE_FLOATS[type(self.optimizer) if self.optimizer is not None else None](self.dim)


def store_config_of(config: StoreConfig | None, config_fields: dict) -> StoreConfig:
    """The StoreConfig a store constructor or the factory was given: `config`, or one built from
    its fields as keywords (never both).

    >>> store_config_of(None, {"dim": 4}).dim
    4
    """
    if config is None:
        return StoreConfig(**config_fields)
    if config_fields:
        raise TypeError("pass either a StoreConfig or its fields as keywords, not both")
    if not isinstance(config, StoreConfig):
        raise TypeError(f"config must be a cncore.StoreConfig, got {type(config).__name__}")
    return config


def with_default_split(config: StoreConfig, can_split: bool = True) -> StoreConfig:
    """`config` with its default ``fallback_rows=None`` resolved: ``"auto"`` where the table can
    take it (`can_split`: its rows in the core's memory; a DMP shard too) and 0 otherwise; a config
    that names its fallback_rows is returned as it is.

    >>> cfg = StoreConfig(dim=4, max_rows=100)
    >>> cfg.fallback_rows, with_default_split(cfg).fallback_rows, with_default_split(cfg, False).fallback_rows
    (None, 'auto', 0)
    >>> StoreConfig(dim=4).fallback_rows  # no max_rows: nothing to split
    0
    """
    if config.fallback_rows is not None:
        return config
    return replace(config, fallback_rows="auto" if can_split else 0)


def config_with_optimizer(config: StoreConfig, optimizer) -> StoreConfig:
    """`config` with `optimizer`, for a table built without one (`set_optimizer` of every row
    storage); refused when it has one already (its rows' state would be lost) or for None."""
    if config.optimizer is not None:
        raise ValueError(f"optimizer: this table already has {config.optimizer!r}; its rows' optimizer state would "
                         "be lost (build a new table to change it)")
    if optimizer is None:
        raise TypeError("optimizer must be a cncore optimizer (SGD, Adagrad, RowWiseAdagrad, Adam), got None")
    return replace(config, optimizer=optimizer)  # checks the optimizer

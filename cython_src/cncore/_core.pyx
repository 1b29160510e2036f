# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The extension layer: owns the C tables and turns Python calls into single nogil sections.

Arguments arrive already validated and converted by the `cncore` package (dtype, shape,
contiguity, writability); this layer checks what only the C side can check cheaply (offsets),
takes the table's lock, runs one nogil section, and turns return codes into exceptions.
"""
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport malloc, calloc, free
from libc.string cimport memcmp, memcpy, memset
from cncore._typedefs cimport key_t, slot_t, offset_t, weight_t, count_t
from cncore._ctable cimport *
from cncore._grouped cimport LookupFeature, LookupTable, UpdateFeature
cimport numpy as cnp

import os

import numpy as np

cnp.import_array()


def traced_bytes():
    """Bytes currently held by every table of this process (the allocation tracer)."""
    return cn_traced_bytes()


# libgomp exits the process at 32768 threads and crashes at 65536; no CPU needs more than this.
MAX_THREADS = 1024


def set_thread_setting(int n):
    if not 0 <= n <= MAX_THREADS:
        raise ValueError(f"n must be in [1, {MAX_THREADS}] (0: the default), got {n}")
    cn_set_thread_setting(n)


def set_evict_sample_rows(int64_t n):
    """Rows the victim selection samples to guess its threshold (0: the radix select alone);
    returns the previous value. For tests, which run both paths (cn_evict.h)."""
    cdef int64_t before = cn_evict_sample_rows
    global cn_evict_sample_rows
    cn_evict_sample_rows = max(n, 0)
    return before


def machine_bytes():
    """Physical memory of this machine: the core refuses to allocate past it."""
    return cn_machine_bytes()


def max_threads():
    return cn_max_threads()


def has_threads():
    return bool(cn_has_threads())


# The instruction-set level of the hot kernels (cn_isa.h), chosen once, here at import: the best
# this CPU runs, or the one CNCORE_ISA names. A name this CPU or build cannot run is refused
# (ImportError names the variable and what would run), never replaced by another level.
ISA_LEVELS = tuple(cn_isa_level_name(level).decode() for level in range(CN_ISA_LEVELS))  # base, v3, v4
ISA_VARIABLE = "CNCORE_ISA"


def runnable_isas():
    """The instruction-set levels of the kernels that this CPU and build can run, lowest first."""
    return tuple(name for level, name in enumerate(ISA_LEVELS) if cn_isa_runnable(level))


def kernel_isa():
    """The instruction-set level the kernels run: "base", "v3" or "v4"."""
    return cn_isa_active_name().decode()


def build_isa():
    """The level the rest of the core (find, insert, eviction) is compiled for: the build's -march."""
    return cn_isa_build_name().decode()


def isa_refusal(requested, runnable):
    """Why CNCORE_ISA=`requested` cannot be used where the levels `runnable` run; None when it can
    (None or "": the best level)."""
    if requested is None or requested == "":
        return None
    if requested not in ISA_LEVELS:
        return (f"{ISA_VARIABLE}={requested!r} is not a level of the kernels: use one of {', '.join(ISA_LEVELS)} "
                f"(this CPU runs {', '.join(runnable)}), or unset it to choose the best")
    if requested not in runnable:
        return (f"{ISA_VARIABLE}={requested!r}: this CPU (or this build of cncore) cannot run the {requested} "
                f"kernels; it runs {', '.join(runnable)}. Set {ISA_VARIABLE} to one of those, or unset it to "
                f"choose the best")
    return None


def _choose_isa(requested):
    refusal = isa_refusal(requested, runnable_isas())
    if refusal is not None:
        raise ImportError(refusal)
    if cn_isa_use(cn_isa_best() if not requested else ISA_LEVELS.index(requested)) != 0:
        raise ImportError(f"{ISA_VARIABLE}={requested!r}: the {requested} kernels cannot run here")


_choose_isa(os.environ.get(ISA_VARIABLE))


# SlotIndex calls over fewer keys than this keep the GIL: their C part takes microseconds, and a
# call that lets the GIL go waits, to take it back, for whatever Python the tier's background
# thread runs meanwhile. Safe because the index's mutex is only ever held inside C, never while
# waiting for the GIL. SlotIndex.missing of 512 IDs (a cn-dlrm table's step): 4.3 -> 3.5 us alone
# (timeit), 20.5-22 -> 11.4 us a call under line_profiler in a loop of lookups with a prefetch a
# step. cn-dlrm's samples/s did not move beyond its noise (two alternated pairs).
# Table.find too (the table's rwlock is likewise only held inside C: nothing in this module runs
# `with gil`): the tier's cache find of a cn-dlrm table's 512 IDs, twice a table a step (the
# prefetch's and the fault-in's), took 0.51-0.60 ms of wall time a step over 26 tables, 0.36-0.39
# after (three alternated runs of `cn-dlrm --batch-size 512 --zipf-alpha 1.05 --cache-mb 15`
# with the call timed); its CPU time is the same, the difference was the wait for the GIL.
cdef enum: _NOGIL_FROM = 4096


# Steps. A row records the table's step at its last training lookup in 32 bits (cn_meta), so a
# table's step stops at 2^32 - 1: the setter refuses more, a training lookup at it is refused
# (its backward would pass it) and so is a backward that would advance past it, each before
# anything changes. Widening last_step instead would cost every row without a scalar optimizer
# state 8 more bytes (its metadata line is 8 bytes), LFU's (count, last_step) score its 64-bit
# key, and the table file, exchange and tier records their uint32 last_steps; the limit is
# reached after 4.29e9 steps (50 days at 1,000 steps a second), and moving every step back by
# one amount (the remedy below) keeps every policy's order.
cdef int64_t _STEP_MAX = 0xFFFFFFFF
STEP_MAX = _STEP_MAX  # for Python: front ends that keep their own step (cncore_torch's device rows)
STEP_REMEDY = ("To train further, move every step back by one amount d: load each row again with last_steps - d "
               "(at least 0), then set step -= d")


def raise_first(errors):
    """Raise errors[0] (an exception) with the others attached to it as notes (PEP 678)."""
    first = errors[0]
    for other in errors[1:]:
        note = f"also raised: {type(other).__name__}: {other}"
        if hasattr(first, "add_note"):
            first.add_note(note)
        else:  # Python 3.10: the attribute tracebacks show from 3.11 on
            first.__notes__ = getattr(first, "__notes__", []) + [note]
    raise first


# The parts, one job each, in dependency order (each uses only what comes before it):
#   slot_index.pxi  the SSD tier's disk index (SlotIndex)
#   records.pxi     the tier's records: offsets, checks, block I/O, RecordWriter and its jobs
#   arrays.pxi      the checks and addresses of arrays the core reads through raw pointers
#   table.pxi       one C table (Table), its lock, eviction sink and errors
#   forward.pxi     the grouped pooled lookup (grouped_forward)
#   backward.pxi    the backward: grouped_backward, unique_gradients
include "slot_index.pxi"
include "records.pxi"
include "arrays.pxi"
include "table.pxi"
include "forward.pxi"
include "backward.pxi"

"""Data for the DLRM job: the synthetic Criteo-like stream (`cncore.synthetic`, shared with the
JAX job) as torch tensors and a KeyedJaggedTensor, and a reader of the Criteo Kaggle / 1TB text
format. Both yield `Batch`es of 13 dense and 26 categorical features.

>>> gen = SyntheticCriteo(seed=0, batch_size=4)
>>> b = gen.batch(0)
>>> b.dense.shape, len(b.sparse.keys()), b.labels.shape
(torch.Size([4, 13]), 26, torch.Size([4]))
>>> bool((gen.batch(0).sparse.values() == b.sparse.values()).all())   # a pure function of (seed, index)
True
"""
from __future__ import annotations

import gzip
import re
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from cn_dlrm.options import InputError
from cncore import synthetic
from cncore.synthetic import CRITEO_CARDINALITIES, DENSE_KEYS, N_DENSE, N_SPARSE, SPARSE_KEYS  # noqa: F401

M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


@dataclass
class Batch:
    dense: torch.Tensor         # (B, 13) float32, log(1 + count)
    sparse: KeyedJaggedTensor   # 26 keys, raw int64 IDs, one ID per sample and feature (empty allowed)
    labels: torch.Tensor        # (B,) float32
    probabilities: torch.Tensor | None = None  # the hidden model's click probability (synthetic data)


class SyntheticCriteo(synthetic.SyntheticCriteo):
    """`cncore.synthetic.SyntheticCriteo` with batches as torch tensors; `batch(i)` is a pure
    function of (seed, i)."""

    def batch(self, index: int) -> Batch:
        a = self.arrays(index)
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=SPARSE_KEYS, values=torch.from_numpy(np.concatenate(a.values)),
                                                  lengths=torch.from_numpy(a.lengths.reshape(-1)))
        return Batch(torch.from_numpy(a.dense), kjt, torch.from_numpy(a.labels), torch.from_numpy(a.probabilities))

    def batches(self, start: int = 0, stop: int | None = None) -> Iterator[Batch]:
        i = start
        while stop is None or i < stop:
            yield self.batch(i)
            i += 1


def read_criteo_tsv(path: str, batch_size: int, skip_batches: int = 0, rank: int = 0,
                    world_size: int = 1) -> Iterator[Batch]:
    r"""Stream a Criteo Kaggle / 1TB text file (optionally .gz): label (0 or 1), 13 integers, 26
    hex categories per line, tab-separated, empty fields allowed. The reader takes exactly the
    spellings Criteo writes, so that no two spellings name one ID: a label is ``0`` or ``1``; an
    integer is ASCII decimal digits with an optional leading ``-`` (Criteo's second column has
    negative values), in -2^63 .. 2^64-1; a category is lower-case hex digits ``0-9a-f``
    (Criteo writes 8; up to 16, for 64-bit IDs). No sign, ``0x``, ``_``, spaces, upper case or
    non-ASCII digits. Categories become raw IDs (their hex value; values of 2^63 and above wrap
    to negative int64, which are valid keys); an empty category is an empty bag; an empty or
    negative integer reads as 0. A line that breaks these rules raises `InputError` naming the
    file, the line and the field.

    With world_size > 1, process `rank`'s view of every batch: only the lines of its
    contiguous share of the batch (samples rank*n//world_size up to (rank+1)*n//world_size, the
    share `cn_dlrm.distributed.share` takes) are parsed and checked; the other
    samples are left blank (label 0, zero integers, no IDs), so the batch keeps its global size
    and `share` picks this rank's samples out of it exactly as out of the whole batch. Every
    process still reads (but does not parse) every line, to find its own.

    >>> import tempfile
    >>> with tempfile.NamedTemporaryFile("w", suffix=".tsv", delete=False) as fh:
    ...     _ = fh.write("1\t5" + "\t" * 13 + "\t".join(["000000ff"] * 26) + "\n" + "2" + "\t" * 39 + "\n")
    >>> next(read_criteo_tsv(fh.name, batch_size=1)).labels.tolist()
    [1.0]
    >>> list(read_criteo_tsv(fh.name, batch_size=1))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    cn_dlrm.options.InputError: ...tsv, line 2: the label is '2', it must be 0 or 1
    """
    opener = gzip.open if path.endswith(".gz") else open
    line_no = 0
    try:
        with opener(path, "rt", encoding="utf-8") as fh:
            lines: list[str] = []
            n_batches = 0
            for line in fh:
                line_no += 1
                lines.append(line)
                if len(lines) == batch_size:
                    if n_batches >= skip_batches:
                        yield _parse(lines, path, line_no - len(lines) + 1, rank, world_size)
                    n_batches += 1
                    lines = []
            if lines and n_batches >= skip_batches:
                yield _parse(lines, path, line_no - len(lines) + 1, rank, world_size)
    except UnicodeDecodeError as e:
        raise InputError(f"{path}, line {line_no + 1}: not UTF-8 text ({e.reason})") from None
    except (OSError, EOFError) as e:  # gzip.BadGzipFile is an OSError; a cut-off .gz ends in EOFError
        raise InputError(f"{path}: cannot read it after line {line_no}: {e}") from None


N_FIELDS = 1 + N_DENSE + N_SPARSE

# The fields as Criteo writes them (ASCII only: a Python character range, unlike \d, matches no
# other script's digits). A line that matches `LINE` needs no other check but the integers' range.
INTEGER = "(?:-?[0-9]+)?"
CATEGORY = "[0-9a-f]{0,16}"
LINE = re.compile("[01]" + f"\t{INTEGER}" * N_DENSE + f"\t{CATEGORY}" * N_SPARSE)
_INTEGER, _CATEGORY = re.compile(INTEGER), re.compile(CATEGORY)
INTEGER_RANGE = (-(1 << 63), 1 << 64)  # what a 64-bit count (signed or not) holds


def _parse(lines: list[str], path: str, first_line: int, rank: int = 0, world_size: int = 1) -> Batch:
    """The batch of `lines`; with world_size > 1, only rank `rank`'s share parsed (the rest blank)."""
    b = len(lines)
    labels = np.zeros(b, dtype=np.float32)
    dense = np.zeros((b, N_DENSE), dtype=np.float32)
    per_feature: list[list[int]] = [[] for _ in range(N_SPARSE)]
    lengths = np.zeros((N_SPARSE, b), dtype=np.int64)
    lo, hi = rank * b // world_size, (rank + 1) * b // world_size
    for row in range(lo, hi):
        line = lines[row].rstrip("\r\n")
        fields = line.split("\t")

        def bad(what: str, row: int = row) -> InputError:
            return InputError(f"{path}, line {first_line + row}: {what}")

        if len(fields) != N_FIELDS:
            raise bad(f"{len(fields)} tab-separated fields, a Criteo line has {N_FIELDS} "
                      f"(label, {N_DENSE} integers, {N_SPARSE} hex categories)")
        if not LINE.fullmatch(line):
            raise bad(_what_is_wrong(fields))
        labels[row] = float(fields[0])
        for j in range(N_DENSE):
            v = fields[1 + j]
            if v:
                number = int(v)
                if not INTEGER_RANGE[0] <= number < INTEGER_RANGE[1]:
                    raise bad(f"integer feature {j + 1} is {_shown(v)}, outside -2^63 .. 2^64-1 (Criteo's "
                              f"integer features are counts, which fit 32 bits)")
                if number > 0:
                    dense[row, j] = np.log1p(float(number))
        for f in range(N_SPARSE):
            v = fields[1 + N_DENSE + f]
            if v:
                value = int(v, 16)
                per_feature[f].append(value - (1 << 64) if value >= 1 << 63 else value)
                lengths[f, row] = 1
    values = np.array([v for feature in per_feature for v in feature], dtype=np.int64)
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=SPARSE_KEYS, values=torch.from_numpy(values),
                                              lengths=torch.from_numpy(lengths.reshape(-1)))
    return Batch(torch.from_numpy(dense), kjt, torch.from_numpy(labels))


def _shown(text: str) -> str:
    """A field in a message: its repr, cut at 20 characters."""
    return repr(text[:20]) + ("..." if len(text) > 20 else "")


def _what_is_wrong(fields: list[str]) -> str:
    """Why a line of the right field count does not match `LINE`: its first bad field."""
    if fields[0] not in ("0", "1"):
        return f"the label is {_shown(fields[0])}, it must be 0 or 1"
    for j in range(N_DENSE):
        v = fields[1 + j]
        if not _INTEGER.fullmatch(v):
            return (f"integer feature {j + 1} is {_shown(v)}, not a whole number as Criteo writes them (ASCII "
                    f"digits 0-9, '-' before a negative one, or nothing)")
    for f in range(N_SPARSE):
        v = fields[1 + N_DENSE + f]
        if not _CATEGORY.fullmatch(v):
            if re.fullmatch("[0-9a-f]+", v):  # then longer than 16
                return f"category {f + 1} is {_shown(v)}, more than 16 hex digits (IDs are 64-bit)"
            return (f"category {f + 1} is {_shown(v)}, not a hex ID as Criteo writes them (lower-case hex digits "
                    f"0-9 a-f, 8 in Criteo's files, at most 16, or nothing)")
    raise RuntimeError("LINE and the per-field patterns disagree")  # unreachable: LINE is the fields' patterns joined

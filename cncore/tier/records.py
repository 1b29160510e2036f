"""The layout of a tier's records in rows.dat: fields, padding, checksum, offsets, and the bytes a
cached row takes."""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from cncore import _core
from cncore.config import ROW_DTYPES, StoreConfig
from cncore.fileio import TableFormatError
from cncore.row_codec import FILE_DTYPES, decode_rows

_PAGE = 4096
_IO_ROWS = 1024  # records a spill writes, or a fault-in loads, at a time (287 KiB at dim 64, row-wise Adagrad)
_VERSION = 4  # 4: a checksum in every record; 3: 16-bit rows at their size; 2: records packed to 8 bytes


def _row_bytes(config: StoreConfig) -> int:
    """Bytes a cached row takes: the row and its state, metadata and key (24 bytes), and the
    index's share (16-byte buckets at the 0.7 load factor, about 23 bytes)."""
    return config.dim * (4 if config.dtype == "float32" else 2) + 4 * config.state_floats + 24 + 23


def _cache_rows(config: StoreConfig, cache_bytes: int) -> int:
    """Rows that fit cache_bytes."""
    return cache_bytes // _row_bytes(config)



def record_layout(config: StoreConfig, version: int = _VERSION) -> tuple[np.dtype, int]:
    """The layout of a tier's records in rows.dat.

    From version 3 a row is stored at its dtype's size (float16 as <f2, bfloat16 as the <u2 bit
    patterns, as table files store them: cncore.row_codec), so a 16-bit table's records are
    smaller: at dim 64 with row-wise Adagrad, 152 bytes instead of 280 (26 a page, not 14),
    and every spill, read and flush moves 46% fewer bytes.

    From version 4 a record's last 4 bytes ("check") hold the checksum of the bytes before them
    (cn_tier_sum, cn_tier.h), written with the record and checked at every read: where the
    fields leave 4 bytes of padding (dim 64 with row-wise Adagrad: 276 bytes of data in 280) it
    costs no space, else 8 bytes a record.

    Args:
        config (StoreConfig): the tier's config.
        version (int): the directory's format version.

    Returns:
        tuple[np.dtype, int]: the record's dtype, and records per 4 KiB page.
    """
    row = FILE_DTYPES[config.dtype].str if version >= 3 else "<f4"
    fields = [("key", "<i8"), ("count", "<u4"), ("last_step", "<u4"), ("row", row, (config.dim,))]
    if config.state_floats:
        fields.append(("state", "<f4", (config.state_floats,)))
    packed = np.dtype(fields)
    # Records packed to 8 bytes (the key stays aligned), not to 64: at dim 64 with row-wise
    # Adagrad, 276 bytes of data took 320 bytes (12 a page) and now 280 (14 a page), so every
    # spill and flush writes 12% fewer bytes and the file is 12% smaller; a record is read
    # into a buffer, so its alignment in the file buys nothing.
    check = version >= 4
    rec = -(-(packed.itemsize + 4 * check) // 8) * 8
    if rec > _PAGE:
        rec = -(-rec // _PAGE) * _PAGE   # a record of its own pages
    packed_names: tuple[str, ...] = packed.names or ()
    packed_fields: Mapping[str, tuple] = packed.fields or {}
    names = list(packed_names)
    formats = [packed_fields[n][0] for n in packed_names]
    offsets = [packed_fields[n][1] for n in packed_names]
    if check:
        names, formats, offsets = names + ["check"], formats + ["<u4"], offsets + [rec - 4]
    record = np.dtype({"names": names, "formats": formats, "offsets": offsets, "itemsize": rec})
    return record, max(1, _PAGE // rec)


def check_offset(record: np.dtype) -> int:
    """Where a record of this layout holds its checksum (0: none, before version 4)."""
    fields: Mapping[str, tuple] = record.fields or {}
    return fields["check"][1] if "check" in fields else 0


def writer_layout(config: StoreConfig, record: np.dtype, per_page: int) -> tuple:
    """The record layout as the core's RecordWriter takes it (cn_tier_layout): record bytes,
    records a page, dim, state floats, the row's dtype code and the fields' offsets."""
    fields: Mapping[str, tuple] = record.fields or {}
    row_code = 0 if fields["row"][0].base == np.float32 else ROW_DTYPES[config.dtype]
    return (record.itemsize, per_page, config.dim, config.state_floats, row_code, fields["count"][1],
            fields["last_step"][1], fields["row"][1], fields["state"][1] if "state" in fields else 0,
            check_offset(record))


def rows_of(rec: np.ndarray, dtype: str) -> np.ndarray:
    """The rows of records as float32 (a new array), whatever width the records store."""
    if rec.dtype["row"].base == np.float32:
        return np.ascontiguousarray(rec["row"])
    return decode_rows(rec["row"], dtype)


def record_offsets(slots: np.ndarray, rec: int, per_page: int) -> np.ndarray:
    """File offsets of the records at `slots` (a record never straddles a page): the C
    formula the writer uses (cn_tier_offset, through _core.record_offsets), so that reads and
    writes cannot disagree."""
    return _core.record_offsets(slots, rec, per_page)


def records_end(slots: np.ndarray, rec: int, per_page: int) -> int:
    """Bytes rows.dat must have for the records at `slots` (0 for none)."""
    if not len(slots):
        return 0
    return int(record_offsets(np.array([np.max(slots)]), rec, per_page)[0]) + rec


def record_error(directory: str, raw: np.ndarray, key: int, slot: int, what_next: str):
    """The TableFormatError of a record (raw: its bytes) that check_records refused: another key
    in the slot, or a checksum that does not match."""
    held = int(np.ascontiguousarray(raw[:8]).view(np.int64)[0])
    if held != key:
        return TableFormatError(f"{directory}: rows.dat holds key {held} in slot {slot}, the index says {key}: "
                                f"the file is damaged or was written by another process; {what_next}")
    return TableFormatError(f"{directory}: rows.dat: the record of key {key} in slot {slot} fails its checksum "
                            f"(the file is damaged); {what_next}")

"""The table file format: a directory that outlives the code that wrote it.

    TABLE/
      CURRENT            the name of the live version directory (replaced atomically)
      v000003/
        manifest.json    format, version, config, row count, step, and per array: file, dtype,
                         shape, byte size and SHA-256
        manifest.sha256  the SHA-256 of manifest.json (`sha256sum -c manifest.sha256` checks it)
        keys.npy         int64 (N,)
        rows.npy         (N, dim) in the row dtype's size: float32, float16, or bfloat16 as
                         uint16 bit patterns (`cncore.row_codec.decode_rows` widens them)
        optimizer_state.npy  float32 (N, state floats)
        counts.npy       uint32 (N,)    access counts
        last_steps.npy   uint32 (N,)    step of the last training access

Every array is a plain C-ordered `.npy` file: NumPy reads it, memory-mapped, without this
package. A save writes a new version directory (files fsynced), then points CURRENT at it with
an atomic rename, then removes older versions: a crash or kill at any moment leaves CURRENT
naming either the old table or the new one, complete. A table directory holds nothing else:
saving refuses a directory with other files in it, and a save removes only what saves make.

Opening trusts nothing in the directory: the manifest's own checksum, every field's type and
range, each array's .npy header, shape and dtype against the row count and the config, the
file sizes and (by default) the arrays' checksums and the keys' uniqueness. A damaged,
truncated or edited table is refused with `TableFormatError`, naming the file or field.
An opened `TableFile` holds its files open, so saves that replace (and delete) its version
do not disturb it.

Format version 2 added manifest.sha256; version 1 tables (without it) still open. Version 3
stores 16-bit rows at their size (a bfloat16 table file is half its version 2 size) and the
table's eviction counter ("evicted" in the manifest: rows a bounded table evicted so far);
`TableFile.read` / `take` / `batches` hand rows out as float32 whatever the file holds.

Incremental saves (a chain: one full base, then deltas). ``save_table(store, path,
since=checkpoint)`` writes a delta version: the rows trained (last step >= the checkpoint's
step) or inserted since the checkpoint (count and last step 0: never trained), plus
``removed_keys.npy``, the keys of the chain that the store no longer holds (erased or
evicted), found by comparing key sets, so no erase log is kept. Its manifest has a "delta"
field naming its parent version; the commit keeps the chain's versions and removes the rest.
A delta also records its own version name ("name") and the SHA-256 of its parent's
manifest.json ("parent_sha256", what the parent's manifest.sha256 holds). Each manifest holds
its parent's digest, so the head's manifest pins the whole chain: reading a chain checks every
link, and a link replaced by another save's, or versions renamed, are refused with
`TableFormatError` naming the link. Deltas written before these fields existed have neither:
they read as before (there is nothing to check them against).

Shard tables (one file per rank of a sharded table, `cncore.routing.shard_name`) also record
their place: an optional "shard" field {"rank", "world_size", "save"} (the save id every
rank's file of one save shares), which `check_shard` holds against the file's name and keys.
A crash mid-delta leaves CURRENT on the previous head, so the chain opens as the last complete
state. ``load_store`` reads a chain as one table; ``open_table`` (memory maps of one version)
refuses a chain's head and ``compact_table`` rewrites the chain as one full base. A save falls
back to a full one when it cannot prove a delta complete: the checkpoint is of another store
or path, the table was saved since, rows were written by assign / insert_or_assign / load
(those do not record a step), the step went back, or the chain holds MAX_CHAIN deltas.

>>> import numpy as np, tempfile, os, cncore
>>> from cncore.tablefile import save_table, load_store, open_table
>>> store = cncore.EmbeddingStore(dim=2, optimizer=cncore.RowWiseAdagrad())
>>> _ = store.find_or_insert(np.array([-1, 2**63 - 1]))
>>> path = os.path.join(tempfile.mkdtemp(), "users.cnt")
>>> checkpoint = save_table(store, path)
>>> table = open_table(path)                 # memory-mapped, checked
>>> sorted(table.keys.tolist()), table.rows.shape
([-1, 9223372036854775807], (2, 2))
>>> len(load_store(path))
2
"""
from cncore.fileio import TableFormatError, config_from_dict, config_to_dict
from cncore.tablefile.format import (
    ARRAYS,
    FORMAT,
    FORMAT_VERSION,
    MAX_CHAIN,
    array_dtypes,
    as_column,
    check_path_name,
    infer_config,
    npy_header,
)
from cncore.tablefile.reader import (
    TableFile,
    chain_head,
    chain_length,
    chain_versions,
    load_store,
    open_table,
    open_table_rows,
)
from cncore.tablefile.shards import check_shard
from cncore.tablefile.writer import Checkpoint, TableWriter, compact_table, save_table

__all__ = ["save_table", "open_table", "load_store", "TableFile", "TableWriter", "TableFormatError",
           "FORMAT_VERSION", "config_to_dict", "config_from_dict", "infer_config", "Checkpoint", "compact_table",
           "chain_length", "chain_versions", "chain_head", "check_shard", "check_path_name", "ARRAYS", "FORMAT",
           "MAX_CHAIN", "array_dtypes", "as_column", "npy_header", "open_table_rows"]

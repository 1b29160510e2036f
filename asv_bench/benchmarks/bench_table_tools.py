"""cn-table's tools and the table file format on a table of N_ROWS rows (dim 64, row-wise
Adagrad): save, open (with its SHA-256 check), inspect, prune, export, merge, offline scoring.
The files live in a temporary directory made in setup and removed in teardown."""
import os
import shutil
import tempfile

import numpy as np

from cncore_numpy import open_table, save_table
from cncore_numpy.exchange import export_table
from cncore_numpy.tools import inspect, merge, prune, prune_mask

from .common import filled_store, zipf_positions


class TableFile:
    number = 1
    repeat = 3
    warmup_time = 0

    def setup(self):
        self.dir = tempfile.mkdtemp(prefix="cn-asv-")
        self.store, self.keys = filled_store(64, "rowwise_adagrad")
        self.path = os.path.join(self.dir, "t")
        save_table(self.store, self.path)
        self.table = open_table(self.path)
        self.queries = self.keys[zipf_positions(65_536, len(self.keys))]
        self.lengths = np.full(len(self.queries) // 16, 16, np.int64)

    def teardown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def time_save(self):
        save_table(self.store, os.path.join(self.dir, "saved"))

    def time_open_verified(self):
        open_table(self.path, verify=True)

    def time_inspect(self):
        inspect(self.table)

    def time_prune_min_count(self):
        keep, _ = prune_mask(self.table, min_count=0)  # keeps every row: a full rewrite
        prune(self.table, os.path.join(self.dir, "pruned"), keep)

    def time_export_npz(self):
        export_table(self.table, os.path.join(self.dir, "t.npz"))

    def time_merge_average(self):
        merge(self.table, self.table, os.path.join(self.dir, "merged"), "average")

    def time_file_pooled_lookup(self):
        self.table.pooled_lookup(self.queries, lengths=self.lengths)

    def time_store_pooled_lookup(self):
        """The in-memory reference for the file's offline scoring."""
        self.store.pooled_lookup(self.queries, lengths=self.lengths, insert_missing=False)

"""The pooled forward on a table far larger than the last-level cache (LARGE_ROWS rows, dim 64:
1 GiB in float32 for a 32 MiB cache), rows in float32, float16 and bfloat16, uniform and
Zipf(1.05) IDs, cold (fresh IDs and a flushed cache before every call), on an idle machine and
beside one busy process per core (the threading defaults on a shared machine).

The comparison with nn.EmbeddingBag and FBGEMM on the same rows, and the share of the memory
bandwidth, are asv_bench/scripts/forward_large.py's (same run, ratios); this tracks our own
speed over commits.
"""
import numpy as np

import cncore

from . import machine
from .common import LARGE_ROWS, flush, fresh_bags, shared_store

DIM = 64


class LargeTableForward:
    params = [["float32", "float16", "bfloat16"], ["uniform", "zipf1.05"], [1, 20], ["idle", "busy"]]
    param_names = ["dtype", "ids", "pooling", "load"]
    number = 1
    repeat = (3, 15, 20.0)
    timeout = 600

    def setup(self, dtype, ids, pooling, load):
        self.store, keys = shared_store(DIM, LARGE_ROWS, dtype)
        cncore.set_num_threads(None)  # the defaults are what a shared machine tests
        self.keys, self.offsets = fresh_bags(keys, pooling, ids)
        self.out = np.empty((len(self.offsets) - 1, DIM), np.float32)
        self.load = machine.background_load() if load == "busy" else None
        if self.load is not None:
            self.load.__enter__()
        flush()

    def teardown(self, dtype, ids, pooling, load):
        if self.load is not None:
            self.load.__exit__(None, None, None)
            self.load = None

    def time_forward(self, dtype, ids, pooling, load):
        self.store.pooled_lookup(self.keys, self.offsets, insert_missing=False, out=self.out)

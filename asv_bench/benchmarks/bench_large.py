"""The pooled forward and the training step on a table far larger than the last-level cache
(LARGE_ROWS rows: 32x the cache, at most an eighth of the available memory), cold (fresh IDs
and a flushed cache before every call). The forward: rows in float32, float16 and bfloat16,
uniform and Zipf(1.05) IDs, on an idle machine and beside one busy process per core (the
threading defaults on a shared machine). The step: the fused backward with row-wise Adagrad
(and the lookup before it) at dims 16 and 64, pooling 1 and 20.

The comparisons with nn.EmbeddingBag and FBGEMM on the same rows are the scripts'
(asv_bench/scripts/forward_large.py, step_large.py: same run, ratios); this tracks our own
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


class LargeTableStep:
    """The fused backward (row-wise Adagrad) of one cold lookup, and the whole step (lookup then
    backward). The updates move the rows by about lr * 1e-3 a step, which leaves the timing
    alone, so the table is built once per process and not rebuilt per call."""
    params = [[16, 64], ["uniform", "zipf1.05"], [1, 20]]
    param_names = ["dim", "ids", "pooling"]
    number = 1
    repeat = (3, 15, 20.0)
    timeout = 600

    def setup(self, dim, ids, pooling):
        self.store, keys = shared_store(dim, LARGE_ROWS, optimizer="rowwise_adagrad")
        cncore.set_num_threads(None)
        self.keys, self.offsets = fresh_bags(keys, pooling, ids)
        self.grad = np.random.default_rng(3).standard_normal((len(self.offsets) - 1, dim)).astype(np.float32) * 1e-3
        _, self.ctx = self.store.pooled_lookup(self.keys, self.offsets)
        flush()

    def time_backward(self, dim, ids, pooling):
        self.store.apply_gradients(self.ctx, self.grad)

    def time_step(self, dim, ids, pooling):
        _, ctx = self.store.pooled_lookup(self.keys, self.offsets)
        self.store.apply_gradients(ctx, self.grad)

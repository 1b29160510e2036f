"""The hot path: pooled lookup, fused backward + optimizer update, the grouped call."""
import numpy as np

import cncore

from .common import BATCH, N_ROWS, THREADS, bags, filled_store, flush, fresh_bags, rng, shared_store


class PooledLookup:
    """The 1M-row shape (kept for continuity), cold: fresh Zipf IDs and a flushed cache for
    every call."""
    params = [[64, 128], [1, 20], ["sum", "mean", "max"]]
    param_names = ["dim", "pooling", "mode"]
    number = 1

    def setup(self, dim, pooling, mode):
        self.store, keys = shared_store(dim)
        self.keys, self.offsets = fresh_bags(keys, pooling)
        self.out = np.empty((len(self.offsets) - 1, dim), dtype=np.float32)
        flush()

    def time_pooled_lookup_train(self, dim, pooling, mode):
        self.store.pooled_lookup(self.keys, self.offsets, mode=mode, out=self.out)

    def time_pooled_lookup_eval(self, dim, pooling, mode):
        self.store.pooled_lookup(self.keys, self.offsets, mode=mode, insert_missing=False, out=self.out)


class TrainingStep:
    params = [[64, 128], [1, 20], ["sgd", "rowwise_adagrad", "adam"]]
    param_names = ["dim", "pooling", "optimizer"]

    number = 1

    def setup(self, dim, pooling, optimizer):
        self.store, keys = filled_store(dim, optimizer)
        self.keys, self.offsets = fresh_bags(keys, pooling)
        self.grad = rng(3).standard_normal((len(self.offsets) - 1, dim)).astype(np.float32) * 1e-3
        _, self.ctx = self.store.pooled_lookup(self.keys, self.offsets)
        flush()

    def time_fused_backward(self, dim, pooling, optimizer):
        self.store.apply_gradients(self.ctx, self.grad)

    def time_step(self, dim, pooling, optimizer):
        _, ctx = self.store.pooled_lookup(self.keys, self.offsets)
        self.store.apply_gradients(ctx, self.grad)

    def time_accumulate_gradients(self, dim, pooling, optimizer):
        self.store.accumulate_gradients(self.ctx, self.grad)

    def peakmem_step(self, dim, pooling, optimizer):
        _, ctx = self.store.pooled_lookup(self.keys, self.offsets)
        self.store.apply_gradients(ctx, self.grad)


class GroupedDLRM:
    """26 tables of DLRM-like sizes, one grouped lookup and backward per batch."""
    params = [[True, False]]
    param_names = ["grouped"]

    def setup(self, grouped):
        cncore.set_num_threads(THREADS)
        sizes = [max(10, N_ROWS // 4 >> (i % 8)) for i in range(26)]
        self.stores, self.keys = [], []
        for i, n in enumerate(sizes):
            store, keys = filled_store(16, "rowwise_adagrad", n_rows=n, seed=i)
            self.stores.append(store)
            self.keys.append(bags(keys, 1, seed=i)[0])
        self.lengths = [np.ones(BATCH, dtype=np.int64)] * 26
        self.grad = rng(4).standard_normal((BATCH, 16 * 26)).astype(np.float32) * 1e-3

    def time_lookup_and_update(self, grouped):
        if grouped:
            _, ctxs = cncore.grouped_pooled_lookup(self.stores, self.keys, lengths=self.lengths)
            cncore.grouped_apply_gradients(ctxs, self.grad)
        else:
            for f, store in enumerate(self.stores):
                _, ctx = store.pooled_lookup(self.keys[f], lengths=self.lengths[f])
                store.apply_gradients(ctx, self.grad[:, 16 * f:16 * (f + 1)])

"""Store verbs: find, find_or_insert of new keys, export."""

import cncore

from .common import N_ROWS, THREADS, filled_store, raw_keys, zipf_positions


class Find:
    params = [[1, 2]]
    param_names = ["threads"]

    def setup(self, threads):
        self.store, keys = filled_store(64)
        self.queries = keys[zipf_positions(200_000, len(keys))]
        cncore.set_num_threads(threads)

    def teardown(self, threads):
        cncore.set_num_threads(None)

    def time_find(self, threads):
        self.store.find(self.queries)

    def time_contains(self, threads):
        self.store.contains(self.queries)


class FindOrInsertNew:
    """Insertion of keys never seen, with row initialisation; state rebuilt for every sample."""
    params = [[64, 128], ["uniform", "normal"]]
    param_names = ["dim", "initializer"]
    number = 1
    repeat = 5
    warmup_time = 0

    def setup(self, dim, initializer):
        cncore.set_num_threads(THREADS)
        init = cncore.Uniform() if initializer == "uniform" else cncore.Normal(0, 0.01)
        self.store = cncore.EmbeddingStore(dim=dim, initializer=init, optimizer=cncore.SGD())
        self.new_keys = raw_keys(N_ROWS // 4, seed=7)

    def time_find_or_insert_new(self, dim, initializer):
        self.store.find_or_insert(self.new_keys)

    def peakmem_find_or_insert_new(self, dim, initializer):
        self.store.find_or_insert(self.new_keys)


class Export:
    params = [[None, 65536]]
    param_names = ["max_rows"]

    def setup(self, max_rows):
        self.store, _ = filled_store(64, "rowwise_adagrad")

    def time_export(self, max_rows):
        for _ in self.store.iter_export(max_rows or len(self.store)):
            pass

    def peakmem_export(self, max_rows):
        for _ in self.store.iter_export(max_rows or len(self.store)):
            pass


class MemoryPerRow:
    """Bytes the store allocated per row (tracked over commits, like a time)."""
    params = [[64, 128], ["sgd", "rowwise_adagrad", "adam"]]
    param_names = ["dim", "optimizer"]
    unit = "bytes"  # asv reads a track_* benchmark's unit from the function, then from its class

    def track_bytes_per_row(self, dim, optimizer):
        store, _ = filled_store(dim, optimizer)
        return store.nbytes / len(store)

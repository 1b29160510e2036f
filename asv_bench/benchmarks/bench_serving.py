"""Serving (cncore_torch.serving): one request of the cn-dlrm DLRM frozen (its in-graph ID remap
included) beside TorchRec's int8 QuantEBC on IDs remapped before the clock, and one delta
applied to a frozen table. asv_bench/scripts/serving_bench.py gives p50/p99 over many requests;
this suite tracks the mean of the same requests over commits.

Requests are timed warm (a server answers them back to back), with one torch thread."""
import functools

import numpy as np
import torch

from .common import SMOKE, delta_ids, rng

SCALE = 0.0005 if SMOKE else 0.01      # of the Criteo cardinalities: 370,717 rows at 0.01
PREFILL = 2 if SMOKE else 50           # batches of 512 whose IDs the tables hold
DIM = 16
DELTA_ROWS = 20_000 if SMOKE else 200_000


@functools.lru_cache(maxsize=1)
def _models():
    """(generator, {variant: model}, remap) built once for every parameter."""
    from torchrec.inference.modules import quantize_embeddings

    from cn_dlrm.data import SyntheticCriteo
    from cn_dlrm.train import build_dlrm, prefill_tables, table_configs
    from cncore_torch import CNEmbeddingBagCollection
    from cncore_torch.serving import freeze

    torch.set_num_threads(1)
    gen = SyntheticCriteo(seed=0, batch_size=512, scale=SCALE)
    ebc = CNEmbeddingBagCollection(tables=table_configs(DIM, gen.cardinalities))
    prefill_tables(ebc, gen, PREFILL)
    live = build_dlrm(ebc, DIM).eval()
    frozen_int8 = quantize_embeddings(freeze(live), dtype=torch.qint8, inplace=False)
    quant = quantize_embeddings(freeze(live), dtype=torch.qint8, inplace=False)
    sparse_arch = quant.sparse_arch
    remap = sparse_arch.embedding_bag_collection.remap
    sparse_arch.embedding_bag_collection = sparse_arch.embedding_bag_collection.embedding_bag_collection
    return gen, {"frozen_int8": frozen_int8, "quant_ebc": quant}, remap


class FrozenRequest:
    """One forward of a synthetic Criteo batch of `batch` samples through the DLRM:
    "frozen_int8" is `freeze(model)` after TorchRec's `quantize_embeddings(qint8)` (raw IDs in,
    the remap timed); "quant_ebc" is TorchRec's QuantEBC in the same DLRM on IDs remapped in
    setup (the remap not timed). The asv ratio frozen_int8 / quant_ebc is the issue's goal."""
    params = [[1, 32, 512], ["frozen_int8", "quant_ebc"]]
    param_names = ["batch", "variant"]

    def setup(self, batch, variant):
        gen, variants, remap = _models()
        gen.batch_size = batch
        self.requests = [gen.batch(1000 + i) for i in range(8)]
        if variant == "quant_ebc":
            self.sparse = [remap(b.sparse) for b in self.requests]
        else:
            self.sparse = [b.sparse for b in self.requests]
        self.model = variants[variant]
        torch.set_num_threads(1)

    def time_request(self, batch, variant):
        with torch.no_grad():
            for request, sparse in zip(self.requests, self.sparse):
                self.model(request.dense, sparse)


class Remap:
    """The frozen collection's ID remap alone (FBGEMM's pruned-index hash over the DLRM's 26
    features), on `batch` samples' raw IDs: what "frozen_int8" pays beyond "quant_ebc"."""
    params = [[1, 32, 512]]
    param_names = ["batch"]

    def setup(self, batch):
        gen, _, self.remap = _models()
        gen.batch_size = batch
        self.sparse = [gen.batch(2000 + i).sparse for i in range(8)]
        for kjt in self.sparse:
            kjt.offsets()      # the TBE after the remap reads them anyway
        torch.set_num_threads(1)

    def time_remap(self, batch):
        with torch.no_grad():
            for kjt in self.sparse:
                self.remap(kjt)


class DeltaApply:
    """`apply_delta` on a frozen `DELTA_ROWS` x 64 float32 table: 1% of its rows changed
    ("changed"), or 1% split into half changed, a quarter new IDs, a quarter evicted ("mixed":
    the ID map is rebuilt aside and swapped)."""
    params = [["changed", "mixed"]]
    param_names = ["delta"]
    number = 1
    repeat = 5

    def setup(self, delta):
        from cncore_torch.serving import FrozenEmbeddingBag, TableDelta, freeze

        g = rng(3)
        keys = g.choice(2**62, DELTA_ROWS, replace=False).astype(np.int64)
        rows = g.standard_normal((DELTA_ROWS, 64), dtype=np.float32)
        self.model = freeze(torch.nn.Sequential(FrozenEmbeddingBag(keys, rows, mode="sum")))
        m = DELTA_ROWS // 100
        write, removed = delta_ids(g, keys, m, delta)
        self.delta = {"0": TableDelta(write, g.standard_normal((len(write), 64), dtype=np.float32), removed)}

    def time_apply(self, delta):
        from cncore_torch.serving import apply_delta

        apply_delta(self.model, self.delta)

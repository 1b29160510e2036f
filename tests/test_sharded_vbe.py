"""The sharded collections at TorchRec's seams over 2 gloo processes, in one spawned run: KJTs
with a batch size per key (VBE) in the sharded unpooled collection; per-sample weights' gradient
and VBE KJTs under TrainPipelineSparseDist and with the whole model compiled.

Unpooled VBE: each rank feeds its own KJT (batch sizes per key differ between ranks and keys,
keys in another order than the tables', IDs owned by both ranks) to DMP with our sharder, and
the same KJT to TorchRec's own sharded EmbeddingCollection (DMP, row-wise) holding our initial
rows. Each feature's JaggedTensor equals TorchRec's sharded EC's (lengths and rows: sample b of
feature f is bag inverse_indices[f, b]) and TorchRec's unsharded EC's output on the same KJT,
indexed by inverse_indices. After each SGD step (lr 1) the rows each rank owns equal the
unsharded EC's rows moved by the gradient of both ranks' samples (TorchRec's sharded EC is no
reference for the rows on CPU: its VBE reindex, fbgemm's permute_1D_sparse_data, has no CPU
autograd kernel, so no gradient reaches its rows). Without inverse_indices each feature keeps its
own bags, as the unsharded collections return them. Compiled whole, it gives the eager output.

Pipeline and compile: a TorchRec-style model (a PositionWeightedModule over a weighted collection,
a collection reading a VBE KJT, a dense layer, (loss, prediction) out) under DMP with our sharder
is trained for 3 batches (a different batch size per rank) through TrainPipelineSparseDist (which
runs the VBE collection's input dist a batch ahead) and, separately, compiled whole
(torch.compile of the DMP model: the sharded collections run outside the graph); both give the
predictions, the learnt position weights and dense parameters and the rows of a plain eager run
of the same model (whose weights' gradient and VBE rows equal TorchRec's EBC's:
tests/test_sharded_seams.py). TorchRec's own sharded modules are no reference here on CPU: their
VBE backward gets no gradient (see above).
"""
import numpy as np
import pytest
import torch

Pipelineable = pytest.importorskip("torchrec.streamable").Pipelineable

TIMEOUT = 240.0
ROWS = 40
KEYS = ["f3", "f1", "f2"]                 # not the tables' order
KEYS_SORTED = sorted(KEYS)
STRIDES = [[2, 3, 1], [1, 2, 2]]          # each rank's batch size per key (KEYS)
SAMPLES = [4, 3]                          # each rank's inverse_indices width


def _ec_configs():
    from torchrec import EmbeddingConfig
    return [EmbeddingConfig(name="t_shared", embedding_dim=4, num_embeddings=ROWS, feature_names=["f1", "f2"]),
            EmbeddingConfig(name="t_other", embedding_dim=4, num_embeddings=ROWS, feature_names=["f3"])]


def _vbe_kjt(rank, seed, inverse=True):
    """Rank `rank`'s KJT with a batch size per key (bags of 0..3 IDs in [0, ROWS))."""
    from torchrec import KeyedJaggedTensor
    rng = np.random.default_rng(seed + rank)
    strides = STRIDES[rank]
    lengths = torch.from_numpy(rng.integers(0, 4, sum(strides)))
    values = torch.from_numpy(rng.integers(0, ROWS, int(lengths.sum())))
    index = torch.stack([torch.from_numpy(rng.integers(0, s, SAMPLES[rank])) for s in strides])
    return KeyedJaggedTensor(keys=KEYS, values=values, lengths=lengths,
                             stride_per_key_per_rank=[[s] for s in strides],
                             inverse_indices=(KEYS, index) if inverse else None)


def _initial_rows(make):
    """Our initial rows of IDs 0..ROWS-1, per table."""
    return {c.name: torch.from_numpy(make("cpu").stores[c.name].lookup(np.arange(ROWS), insert_missing=True))
            for c in _ec_configs()}


def _torchrec_sharded_ec(rows):
    """TorchRec's EmbeddingCollection under DMP (row-wise) holding `rows`."""
    import torch.distributed as dist
    from torchrec import EmbeddingCollection
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints

    sharder = EmbeddingCollectionSharder()
    ec = EmbeddingCollection(_ec_configs(), device=torch.device("meta"))
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=dist.get_world_size(), compute_device="cpu"),
                                       constraints={c.name: ParameterConstraints(sharding_types=["row_wise"])
                                                    for c in _ec_configs()})
    plan = planner.collective_plan(ec, [sharder], dist.group.WORLD)
    dmp = DistributedModelParallel(ec, device=torch.device("cpu"), sharders=[sharder], plan=plan)
    with torch.no_grad():
        for name, tensor in dmp.state_dict().items():
            table = name.split(".")[-2]
            for shard in tensor.local_shards():
                start, size = shard.metadata.shard_offsets[0], shard.metadata.shard_sizes[0]
                shard.tensor.copy_(rows[table][start:start + size])
    return dmp


def _wait(out):
    return out.wait() if hasattr(out, "wait") else out


def _unpooled_variable_batch(rank, world_size):
    from torchrec import EmbeddingCollection
    from torchrec.distributed.model_parallel import DistributedModelParallel

    import cncore
    from cncore_torch import CNEmbeddingCollection
    from cncore_torch.distributed import CNEmbeddingCollectionSharder, owner_of

    make = lambda device: CNEmbeddingCollection(_ec_configs(), device=device, optimizer=cncore.SGD(lr=1.0),  # noqa: E731
                                                seed=3, per_rank_tables=True)
    rows = _initial_rows(make)
    ours = DistributedModelParallel(make("meta"), device=torch.device("cpu"),
                                    sharders=[CNEmbeddingCollectionSharder()])
    theirs = _torchrec_sharded_ec(rows)
    unsharded = EmbeddingCollection(_ec_configs())
    with torch.no_grad():
        for name, weight in rows.items():
            unsharded.embeddings[name].weight.copy_(weight)
    for step in range(2):
        kjts = [_vbe_kjt(r, 30 + 10 * step) for r in range(world_size)]
        out = _wait(ours(kjts[rank]))
        with torch.no_grad():
            ref = _wait(theirs(kjts[rank]))
        assert sorted(out) == sorted(ref) == ["f1", "f2", "f3"]
        loss, ref_loss = 0, 0
        for r, kjt in enumerate(kjts):
            plain = unsharded(kjt)               # each feature's own bags
            for f, index in zip(KEYS, kjt.inverse_indices()[1]):
                bags = plain[f].to_dense()
                expected = torch.cat([bags[int(b)] for b in index])
                targets = torch.from_numpy(np.random.default_rng(10 * r + step).standard_normal(
                    tuple(expected.shape)).astype(np.float32))
                ref_loss = ref_loss + (expected * targets).sum()
                if r != rank:
                    continue
                assert out[f].lengths().tolist() == ref[f].lengths().tolist()
                assert out[f].lengths().tolist() == [len(bags[int(b)]) for b in index]
                if step == 0:  # TorchRec's sharded EC holds the initial rows (its own do not move)
                    torch.testing.assert_close(out[f].values(), ref[f].values(), rtol=1e-6, atol=1e-7)
                torch.testing.assert_close(out[f].values(), expected, rtol=1e-6, atol=1e-7)
                loss = loss + (out[f].values() * targets).sum()
        loss.backward()
        ref_loss.backward()
        with torch.no_grad():  # SGD, lr 1, on the unsharded EC: the gradient of both ranks' samples
            for embedding in unsharded.embeddings.values():
                embedding.weight -= embedding.weight.grad
                embedding.weight.grad = None
        for name, store in ours.module.stores.items():
            batch = store.export()
            assert len(batch.keys) and (owner_of(torch.from_numpy(batch.keys), world_size) == rank).all()
            weight = unsharded.embeddings[name].weight.detach()
            torch.testing.assert_close(torch.from_numpy(batch.rows), weight[torch.from_numpy(batch.keys)],
                                       rtol=1e-5, atol=1e-6)
    # without inverse_indices: each feature's own bags, as the unsharded collections return them
    kjt = _vbe_kjt(rank, 90, inverse=False)
    out, plain = _wait(ours(kjt)), unsharded(kjt)  # unseen IDs get their initial rows in both
    for f, stride in zip(KEYS, STRIDES[rank]):
        assert out[f].lengths().tolist() == plain[f].lengths().tolist() and len(plain[f].lengths()) == stride
        torch.testing.assert_close(out[f].values(), plain[f].values(), rtol=1e-6, atol=1e-7)
    # compiled whole, the sharded EC runs outside the graph and gives the eager output
    kjt = _vbe_kjt(rank, 30)
    with torch.no_grad():
        eager, compiled = _wait(ours(kjt)), torch.compile(ours)(kjt)
    assert sorted(compiled) == KEYS_SORTED
    for f in KEYS:
        assert compiled[f].lengths().tolist() == eager[f].lengths().tolist()
        assert compiled[f].lengths().numel() == SAMPLES[rank]
        torch.testing.assert_close(compiled[f].values(), eager[f].values(), rtol=0, atol=0)


def _ebc_configs():
    from torchrec import EmbeddingBagConfig
    return [EmbeddingBagConfig(name="t_pos", embedding_dim=4, num_embeddings=ROWS, feature_names=["f1", "f2"]),
            EmbeddingBagConfig(name="t_vbe", embedding_dim=3, num_embeddings=ROWS, feature_names=KEYS)]


class Batch(Pipelineable):
    """What the data loader gives TrainPipelineSparseDist (a Pipelineable): an ordinary KJT for
    the position-weighted collection, a VBE KJT for the other, labels."""

    def __init__(self, sparse, vbe, labels):
        self.sparse, self.vbe, self.labels = sparse, vbe, labels

    def to(self, device, non_blocking=False):
        return Batch(self.sparse.to(device), self.vbe.to(device), self.labels.to(device))

    def record_stream(self, stream):
        pass


class Model(torch.nn.Module):
    """A TorchRec-style model: FeatureProcessedEmbeddingBagCollection (PositionWeightedModule over a
    weighted collection) on `batch.sparse`, a collection on the VBE KJT `batch.vbe`, a dense layer;
    returns (loss, prediction) as TrainPipelineSparseDist expects."""

    def __init__(self, weighted, vbe):
        from torchrec.modules.feature_processor_ import PositionWeightedModule
        from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
        super().__init__()
        self.weighted = FeatureProcessedEmbeddingBagCollection(
            weighted, {f: PositionWeightedModule(4) for f in ("f1", "f2")})
        self.vbe = vbe
        self.dense = torch.nn.Linear(8 + 3 * len(KEYS), 1)
        with torch.no_grad():
            for i, p in enumerate(self.parameters()):
                p.copy_(torch.linspace(-0.5, 1.5, p.numel()).view(p.shape) + 0.1 * i)

    def forward(self, batch):
        pooled = torch.cat([self.weighted(batch.sparse).values(), self.vbe(batch.vbe).values()], dim=1)
        prediction = self.dense(pooled).squeeze(1)
        return ((prediction - batch.labels) ** 2).sum(), prediction.detach()


def _batches(rank, count):
    from torchrec import KeyedJaggedTensor
    out = []
    for step in range(count):
        rng = np.random.default_rng(100 + 10 * step + rank)
        lengths = torch.from_numpy(rng.integers(0, 4, 2 * SAMPLES[rank]))
        sparse = KeyedJaggedTensor.from_lengths_sync(["f2", "f1"], torch.from_numpy(
            rng.integers(0, ROWS, int(lengths.sum()))), lengths)
        out.append(Batch(sparse, _vbe_kjt(rank, 200 + step),
                         torch.from_numpy(rng.standard_normal(SAMPLES[rank]).astype(np.float32))))
    return out


def _trained(mode, batches):
    """Our model under DMP, trained on `batches` (SGD lr 0.05 on the dense part, fused SGD on the
    tables) plainly in eager mode, through TrainPipelineSparseDist, or compiled whole
    (torch.compile of the DMP model): (predictions, dense parameters, each table's rows by key, the dense parameters
    before training)."""
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    import cncore
    from cncore_torch import CNEmbeddingBagCollection
    from cncore_torch.distributed import CNEmbeddingBagCollectionSharder

    configs = _ebc_configs()
    model = Model(CNEmbeddingBagCollection(configs[:1], is_weighted=True, device="meta", seed=5,
                                           optimizer=cncore.SGD(lr=0.05)),
                  CNEmbeddingBagCollection(configs[1:], device="meta", seed=6, optimizer=cncore.SGD(lr=0.05)))
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), sharders=[CNEmbeddingBagCollectionSharder()])
    dense = [p for _, p in in_backward_optimizer_filter(dmp.named_parameters())]
    initial = {n: p.detach().clone() for n, p in dmp.named_parameters() if p.numel()}
    optimizer = torch.optim.SGD(dense, lr=0.05)
    predictions = []
    if mode == "pipeline":
        pipeline = TrainPipelineSparseDist(dmp, optimizer, torch.device("cpu"))
        loader = iter(batches)
        for _ in batches:
            predictions.append(pipeline.progress(loader))
        # the VBE collection reads the batch directly: its input dist runs a batch ahead
        assert [type(m).__name__ for m in pipeline._pipelined_modules] == ["ShardedCNEmbeddingBagCollection"]
    else:
        model = torch.compile(dmp) if mode == "compiled" else dmp  # the sharded modules run outside the graph
        for batch in batches:
            optimizer.zero_grad()
            loss, prediction = model(batch)
            loss.backward()
            optimizer.step()
            predictions.append(prediction)
    rows = {}
    for module in dmp.modules():
        for name, store in getattr(module, "stores", {}).items():
            batch = store.export()
            order = np.argsort(batch.keys)
            rows[name] = (batch.keys[order], batch.rows[order])
    dense = {n: p.detach().clone() for n, p in dmp.named_parameters() if p.numel()}
    return predictions, dense, rows, initial


def _pipeline_and_compile(rank, world_size):
    batches = _batches(rank, 3)
    plain = _trained("plain", batches)
    for mode in ("pipeline", "compiled"):
        predictions, dense, rows, _ = _trained(mode, batches)
        assert len(predictions) == len(plain[0]) == 3, mode
        for got, expected in zip(predictions, plain[0]):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        assert sorted(dense) == sorted(plain[1]) and any("position_weight" in n for n in dense), (mode, dense)
        assert all(not torch.equal(dense[n], plain[3][n]) for n in dense), mode  # every one learnt
        for name, p in dense.items():
            torch.testing.assert_close(p, plain[1][name], rtol=1e-5, atol=1e-6)
        assert sorted(rows) == ["t_pos", "t_vbe"] and all(len(rows[t][0]) for t in rows)
        for name, (keys, values) in rows.items():
            np.testing.assert_array_equal(keys, plain[2][name][0])
            np.testing.assert_allclose(values, plain[2][name][1], rtol=1e-5, atol=1e-6)


def _seams(rank, world_size):
    _unpooled_variable_batch(rank, world_size)
    _pipeline_and_compile(rank, world_size)


@pytest.mark.slow
def test_two_ranks_sharded_seams():
    """One spawned 2-rank run: the sharded unpooled collection on VBE KJTs equals TorchRec's own
    sharded EC (outputs) and its unsharded EC expanded by inverse_indices (outputs, rows after SGD
    steps); a model with position weights and a VBE collection trains through
    TrainPipelineSparseDist and compiled whole exactly as in plain eager mode."""
    from cncore_torch.distributed.launch import spawn
    spawn(_seams, 2, timeout=TIMEOUT)

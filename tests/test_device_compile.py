"""Accelerator tables with the key index on the device under `torch.compile`: each lookup is one
opaque `cncore::` operator each way (no graph break, `fullgraph=True` works), and a compiled
training step gives the rows and outputs of the eager one.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import cncore


@pytest.fixture
def device_index(cncard, monkeypatch):
    monkeypatch.setenv("CNCORE_DEVICE_INDEX", "device")
    torch._dynamo.reset()  # each test's modules are new: no recompilation limit carried over
    yield
    torch._dynamo.reset()


class _Model(torch.nn.Module):
    def __init__(self, mode: str):
        super().__init__()
        from cncore_torch import CNEmbeddingBag
        self.bag = CNEmbeddingBag(100, 4, mode=mode, optimizer=cncore.Adam(lr=0.01), device="cncard",
                                  max_rows=12, eviction=cncore.LRU(), headroom=2, initializer=cncore.Uniform(),
                                  seed=5)
        torch.manual_seed(0)
        self.dense = torch.nn.Linear(4, 1, device=self.bag.device_rows.device)

    def forward(self, ids, weights=None):
        return self.dense(torch.relu(self.bag(ids, per_sample_weights=weights))).sum()


def _train(model, step, batches):
    opt = torch.optim.SGD(model.dense.parameters(), lr=0.1)
    losses = []
    for ids, w in batches:
        loss = step(ids, w)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses)


def _export(module):
    e = module.export()
    order = torch.argsort(e["keys"])
    return {k: v[order] for k, v in e.items()}


def _batches(weighted: bool):
    rng = np.random.default_rng(1)
    out = []
    for _ in range(6):  # new keys, known keys, and evictions past max_rows
        ids = torch.from_numpy(rng.integers(-8, 12, (5, 3)))
        out.append((ids, torch.from_numpy(rng.random((5, 3)).astype(np.float32)) if weighted else None))
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "weighted"), [("sum", True), ("max", False)])
def test_a_fullgraph_compiled_training_step_equals_the_eager_one(device_index, mode, weighted):
    """Default backend (Inductor on the CPU), fullgraph=True: the same losses, rows, optimizer
    state, counts, last steps and evictions as eager."""
    eager, compiled = _Model(mode), _Model(mode)
    batches = _batches(weighted)
    eager_losses = _train(eager, eager, batches)
    compiled_losses = _train(compiled, torch.compile(compiled, fullgraph=True), batches)
    torch.testing.assert_close(compiled_losses, eager_losses, rtol=1e-5, atol=1e-6)
    a, b = _export(eager.bag), _export(compiled.bag)
    assert b["keys"].tolist() == a["keys"].tolist() and len(a["keys"]) <= 12
    for name in ("rows", "optimizer_state"):
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6)
    for name in ("counts", "last_steps"):
        assert torch.equal(b[name], a[name])
    assert compiled.bag.device_rows.evicted_count == eager.bag.device_rows.evicted_count > 0


@pytest.mark.parametrize("key_index", ["device", "host"])
def test_the_device_lookup_is_one_operator_each_way_with_no_graph_break(device_index, monkeypatch, key_index):
    monkeypatch.setenv("CNCORE_DEVICE_INDEX", key_index)
    model = _Model("mean")
    ids = torch.tensor([[1, 2, 3], [3, 4, -(2**63)]])
    explained = torch._dynamo.explain(model)(ids)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    graphs = []

    def backend(gm, example_inputs):
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward
    torch._dynamo.reset()
    torch.compile(model, backend=backend, fullgraph=True)(ids).backward()
    assert sum(t.startswith("cncore.lookup") for t in graphs[0]) == 1
    assert len(model.bag.device_rows) == 5


@pytest.mark.slow
def test_both_collections_compile_fullgraph_on_device_rows_and_train_as_eager(device_index):
    from torchrec import EmbeddingBagConfig, EmbeddingConfig, KeyedJaggedTensor

    from cncore_torch import CNEmbeddingBagCollection, CNEmbeddingCollection
    bags = [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=50, feature_names=["a", "b"])]
    seqs = [EmbeddingConfig(name="t", embedding_dim=4, num_embeddings=50, feature_names=["a", "b"])]
    rng = np.random.default_rng(3)
    kjts = []
    for _ in range(4):
        lengths = torch.from_numpy(rng.integers(0, 3, 6))
        kjts.append(KeyedJaggedTensor.from_lengths_sync(["a", "b"], torch.from_numpy(
            rng.integers(-10, 10, int(lengths.sum()))), lengths))
    for cls, configs in ((CNEmbeddingBagCollection, bags), (CNEmbeddingCollection, seqs)):
        eager, twin = (cls(configs, device="cncard", optimizer=cncore.RowWiseAdagrad(lr=0.1)) for _ in range(2))
        torch._dynamo.reset()
        compiled = torch.compile(twin, backend="aot_eager", fullgraph=True)
        for kjt in kjts:
            for module in (eager, compiled):
                out = module(kjt)
                if cls is CNEmbeddingBagCollection:
                    out.values().pow(2).sum().backward()
                else:
                    sum(out[f].values().pow(2).sum() for f in ("a", "b")).backward()
        ea, eb = eager.stores["t"].export(), twin.stores["t"].export()
        oa, ob = np.argsort(ea.keys), np.argsort(eb.keys)
        assert eb.keys[ob].tolist() == ea.keys[oa].tolist() and len(ea.keys) > 0
        np.testing.assert_array_equal(eb.rows[ob], ea.rows[oa])
        np.testing.assert_array_equal(eb.counts[ob], ea.counts[oa])

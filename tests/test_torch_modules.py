"""cncore_torch modules against torch.nn.EmbeddingBag / torch.nn.Embedding on the same rows."""
import io

import numpy as np
import pytest
import torch

import cncore
from cncore_torch import CNEmbedding, CNEmbeddingBag
from cncore_torch.state import reset_optimizer_state

N, DIM = 30, 8


def pair(mode="mean", optimizer=None, seed=0, **kw):
    torch.manual_seed(seed)
    ref = torch.nn.EmbeddingBag(N, DIM, mode=mode, **kw)
    ours = CNEmbeddingBag(N, DIM, mode=mode, _weight=ref.weight.detach(), optimizer=optimizer, **kw)
    return ours, ref


def rows(module, n=N):
    return torch.from_numpy(module.store.lookup(np.arange(n)))


def random_bags(rng, n_bags=6, max_len=5):
    lengths = rng.integers(0, max_len + 1, n_bags)
    ids = torch.from_numpy(rng.integers(0, N, int(lengths.sum())))
    offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)[:-1]]))
    return ids, offsets


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("include_last_offset", [False, True])
def test_forward_matches_embedding_bag_1d(mode, include_last_offset):
    rng = np.random.default_rng(1)
    ours, ref = pair(mode, include_last_offset=include_last_offset)
    for _ in range(5):
        ids, offsets = random_bags(rng)
        if include_last_offset:
            offsets = torch.cat([offsets, torch.tensor([len(ids)])])
        torch.testing.assert_close(ours(ids, offsets), ref(ids, offsets))


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_forward_matches_embedding_bag_2d_weights_and_padding(mode):
    rng = np.random.default_rng(2)
    ours, ref = pair(mode, padding_idx=3)
    ids = torch.from_numpy(rng.integers(0, N, (7, 4)))
    ids[0, :2] = 3
    ids[1, :] = 3  # a bag of padding only
    torch.testing.assert_close(ours(ids), ref(ids))
    if mode == "sum":
        w = torch.rand(7, 4)
        torch.testing.assert_close(ours(ids, per_sample_weights=w), ref(ids, per_sample_weights=w))


def test_embedding_matches_nn_embedding_any_shape():
    torch.manual_seed(0)
    ref = torch.nn.Embedding(N, DIM, padding_idx=0)
    ours = CNEmbedding(N, DIM, padding_idx=0, _weight=ref.weight.detach(), optimizer=cncore.SGD(lr=0.3))
    opt = torch.optim.SGD(ref.parameters(), lr=0.3)
    ids = torch.tensor([[[1, 0, 5], [5, 5, 2]]])
    for _ in range(3):
        a, b = ours(ids), ref(ids)
        torch.testing.assert_close(a, b)
        assert a.shape == (1, 2, 3, DIM)
        g = torch.randn_like(b)
        opt.zero_grad()
        b.backward(g)
        opt.step()
        a.backward(g)
    torch.testing.assert_close(rows(ours)[1:], ref.weight.detach()[1:])


def dense_optimizer(cfg, params):
    if isinstance(cfg, cncore.SGD):
        return torch.optim.SGD(params, lr=cfg.lr)
    if isinstance(cfg, cncore.Adagrad):
        return torch.optim.Adagrad(params, lr=cfg.lr, eps=cfg.eps)
    return torch.optim.Adam(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("cfg", [cncore.SGD(lr=0.1), cncore.Adagrad(lr=0.1), cncore.Adam(lr=0.01)],
                         ids=["sgd", "adagrad", "adam"])
def test_fused_training_matches_torch_optim(mode, cfg):
    rng = np.random.default_rng(3)
    ours, ref = pair(mode, optimizer=cfg)
    opt = dense_optimizer(cfg, ref.parameters())
    for _ in range(4):
        ids, offsets = random_bags(rng, 8, 6)
        if isinstance(cfg, cncore.Adam):  # dense Adam moves every row: touch every row
            ids = torch.cat([torch.arange(N), ids])
            offsets = torch.cat([torch.tensor([0]), offsets[1:] + N]) if len(offsets) > 1 else torch.tensor([0])
        g = torch.randn(len(offsets), DIM)
        opt.zero_grad()
        ref(ids, offsets).backward(g)
        opt.step()
        ours(ids, offsets).backward(g)
        ours.fused_optimizer.step()  # a no-op, as with TorchRec's fused tables
        ours.fused_optimizer.zero_grad()
    torch.testing.assert_close(rows(ours), ref.weight.detach(), rtol=1e-5, atol=1e-5)


def test_non_fused_hook_receives_torch_gradients():
    rng = np.random.default_rng(4)
    ours, ref = pair("sum")
    got = []
    ours.register_gradient_hook(lambda ids, grads: got.append((ids.clone(), grads.clone())))
    ids, offsets = random_bags(rng, 10, 4)
    w = torch.rand(len(ids), requires_grad=True)
    w_ref = w.detach().clone().requires_grad_()
    g = torch.randn(10, DIM)
    ours(ids, offsets, per_sample_weights=w).backward(g)
    ref(ids, offsets, per_sample_weights=w_ref).backward(g)
    (uids, grads), = got
    torch.testing.assert_close(grads, ref.weight.grad[uids], rtol=1e-5, atol=1e-6)
    assert set(uids.tolist()) == set(ids.tolist())
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=1e-5, atol=1e-6)  # per-sample weight gradient
    torch.testing.assert_close(rows(ours), ref.weight.detach())  # the hook owns the update


def test_small_model_trains_like_embedding_bag():
    """An MLP over two bags: same data, same initial rows, same loss curve."""
    def model(bag_a, bag_b):
        torch.manual_seed(5)
        head = torch.nn.Sequential(torch.nn.Linear(2 * DIM, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        return bag_a, bag_b, head

    losses = []
    for kind in ("torch", "ours"):
        torch.manual_seed(6)
        ref_a, ref_b = torch.nn.EmbeddingBag(N, DIM, mode="mean"), torch.nn.EmbeddingBag(N, DIM, mode="sum")
        if kind == "torch":
            a, b = ref_a, ref_b
        else:
            a = CNEmbeddingBag(N, DIM, mode="mean", _weight=ref_a.weight.detach(), optimizer=cncore.SGD(lr=0.2))
            b = CNEmbeddingBag(N, DIM, mode="sum", _weight=ref_b.weight.detach(), optimizer=cncore.SGD(lr=0.2))
        a, b, head = model(a, b)
        params = list(head.parameters()) + (list(a.parameters()) + list(b.parameters()) if kind == "torch" else [])
        opt = torch.optim.SGD(params, lr=0.2)
        rng = np.random.default_rng(7)
        curve = []
        for _ in range(100):
            ids = torch.from_numpy(rng.integers(0, N, (32, 2)))
            y = (ids[:, :1] < N // 2).float()  # learnable from the rows of the first ID
            x = torch.cat([a(ids), b(ids)], dim=1)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(head(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            curve.append(loss.item())
        losses.append(curve)
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-4, atol=1e-5)
    assert np.mean(losses[0][-10:]) < 0.8 * np.mean(losses[0][:10])


def test_eval_reads_unseen_ids_as_zero_and_inserts_nothing():
    ours, _ = pair("sum")
    ours.eval()
    out = ours(torch.tensor([[2**60, 1]]))
    torch.testing.assert_close(out[0], rows(ours)[1])
    assert ours.num_rows == N
    ours.train()
    ours(torch.tensor([[2**60, 1]]))
    assert ours.num_rows == N + 1


def test_torch_compile_matches_eager_and_fx_keeps_one_node():
    ours, ref = pair("sum", optimizer=cncore.SGD(lr=0.1))
    ids = torch.tensor([[1, 2, 3], [4, 4, 5]])

    class Net(torch.nn.Module):
        def __init__(self, bag):
            super().__init__()
            self.bag = bag

        def forward(self, x):
            return self.bag(x).relu().sum(1)

    net = Net(ours)
    eager = net(ids)
    compiled = torch.compile(net, fullgraph=True)
    torch.testing.assert_close(compiled(ids), eager)
    before = rows(ours).clone()
    compiled(ids).sum().backward()  # the fused update runs inside the compiled backward
    assert not torch.equal(rows(ours), before)
    gm = torch.fx.symbolic_trace(net)
    lookups = [n for n in gm.graph.nodes if n.op == "call_function" and "lookup" in str(n.target)]
    assert len(lookups) == 1, gm.graph


def test_state_dict_round_trip_and_load_into_another_capacity(tmp_path):
    ours, _ = pair("sum", optimizer=cncore.RowWiseAdagrad(lr=0.1))
    ours(torch.tensor([[2**50, 1, 2]])).sum().backward()
    torch.save({"model": ours.state_dict(), "opt": ours.fused_optimizer.state_dict()}, tmp_path / "ck.pt")
    loaded = torch.load(tmp_path / "ck.pt")
    other = CNEmbeddingBag(4, DIM, mode="sum", optimizer=cncore.RowWiseAdagrad(lr=0.1))
    other.load_state_dict(loaded["model"])
    other.fused_optimizer.load_state_dict(loaded["opt"])
    a, b = ours.export(), other.export()
    oa, ob = torch.argsort(a["keys"]), torch.argsort(b["keys"])
    for name in a:
        torch.testing.assert_close(a[name][oa], b[name][ob])
    assert other.store.step == ours.store.step == 1
    buffer = io.BytesIO()
    torch.save(torch.nn.Sequential(ours), buffer)  # a whole model holding the module
    buffer.seek(0)
    again = torch.load(buffer, weights_only=False)[0]
    torch.testing.assert_close(again(torch.tensor([[2**50]])), ours(torch.tensor([[2**50]])))


def test_lr_scheduler_drives_the_fused_optimizer():
    ours = CNEmbeddingBag(10, 2, mode="sum", optimizer=cncore.SGD(lr=1.0), initializer=cncore.Constant(0.0))
    sched = torch.optim.lr_scheduler.StepLR(ours.fused_optimizer, step_size=1, gamma=0.5)
    ours.fused_optimizer.step()
    sched.step()
    ours(torch.tensor([[1]])).sum().backward()
    torch.testing.assert_close(rows(ours, 2)[1], torch.tensor([-0.5, -0.5]))


@pytest.mark.parametrize("kwargs,exc", [
    (dict(max_norm=1.0), ValueError), (dict(scale_grad_by_freq=True), ValueError), (dict(sparse=True), ValueError),
    (dict(device="nowhere"), ValueError), (dict(dtype=torch.float64), TypeError), (dict(mode="avg"), ValueError),
])
def test_unsupported_options_are_refused_at_construction(kwargs, exc):
    with pytest.raises(exc):
        CNEmbeddingBag(10, 4, **kwargs)


@pytest.mark.parametrize("call,exc", [
    (lambda m: m(torch.tensor([1.0, 2.0]), torch.tensor([0])), TypeError),
    (lambda m: m(torch.tensor([1, 2, 3]), torch.tensor([0, 2, 1])), ValueError),
    (lambda m: m(torch.tensor([1, 2, 3]), torch.tensor([0, 5])), ValueError),
    (lambda m: m(torch.tensor([1, 2])), ValueError),
    (lambda m: m(torch.tensor([[1, 2]]), torch.tensor([0])), ValueError),
    (lambda m: m(torch.tensor([[1, 2]]), per_sample_weights=torch.ones(3)), ValueError),
])
def test_bad_input_raises_and_leaves_the_table_unchanged(call, exc):
    ours, _ = pair("sum")
    before = ours.export()
    with pytest.raises(exc):
        call(ours)
    after = ours.export()
    for name in before:
        torch.testing.assert_close(before[name], after[name])


def trained(optimizer, ids, seed=0):
    """A sum bag with fused `optimizer`, after two steps on `ids` (a (B, L) tensor)."""
    bag = CNEmbeddingBag(N, DIM, mode="sum", optimizer=optimizer, seed=seed)
    for _ in range(2):
        bag(ids).sum().backward()
    return bag


def exported(module):
    """Everything the table holds, sorted by key, as bytes; and its step."""
    e = module.export()
    order = torch.argsort(e["keys"])
    return {name: e[name][order].numpy().tobytes() for name in e} | {"step": module.store.step}


@pytest.mark.parametrize("entry,change,message", [
    ("keys", lambda t: t.float(), "keys: expected dtype torch.int64, got torch.float32"),
    ("keys", lambda t: torch.cat([t[:1], t[:-1]]), "keys: each key must appear once"),
    ("rows", lambda t: t[:-1], r"rows: expected shape \(6, 8\), got \(5, 8\)"),
    ("optimizer_state", lambda t: t[:, :0], "optimizer_state: holds 0 floats a row, as SGD"),
    ("counts", lambda t: t - 5, r"counts: values must be in \[0, 2\*\*32\)"),
    ("last_steps", lambda t: t + 2**32, r"last_steps: values must be in \[0, 2\*\*32\)"),
    ("step", lambda t: t.double(), "step: expected dtype"),
])
def test_a_refused_load_state_dict_leaves_the_table_exactly_as_it_was(entry, change, message):
    bag = trained(cncore.Adam(lr=0.1), torch.tensor([[1, 2, 3]]))
    other = trained(cncore.Adam(lr=0.1), torch.tensor([[4, 5, 6], [7, 8, 9]]), seed=1)
    before, store = exported(bag), bag.store
    state = other.state_dict()
    state[entry] = change(state[entry])
    with pytest.raises(RuntimeError, match=r"^Error\(s\) in loading state_dict for CNEmbeddingBag:\n\t" + message):
        bag.load_state_dict(state)
    assert exported(bag) == before
    bag.load_state_dict(other.state_dict())  # the same module still loads, in place
    assert bag.store is store and exported(bag) == exported(other)


def test_an_optimizer_mismatch_is_refused_and_reset_optimizer_state_converts_the_checkpoint():
    sgd = trained(cncore.SGD(lr=0.1), torch.tensor([[1, 2, 3]]))
    adam = CNEmbeddingBag(N, DIM, mode="sum", optimizer=cncore.Adam(lr=0.1))
    with pytest.raises(RuntimeError, match=r"optimizer_state: holds 0 floats a row, as SGD \(or no optimizer\) "
                                           r"writes; this table's optimizer keeps 16 \(Adam\).*reset_optimizer_state"):
        adam.load_state_dict(sgd.state_dict())
    assert adam.num_rows == 0
    adam.load_state_dict(reset_optimizer_state(sgd.state_dict(), adam))
    got, want = adam.export(), sgd.export()
    for name in ("keys", "rows", "counts", "last_steps"):
        assert torch.equal(got[name], want[name]), name
    assert torch.equal(got["optimizer_state"], torch.zeros(3, 2 * DIM)) and adam.store.step == sgd.store.step == 2
    adam(torch.tensor([[1, 4]])).sum().backward()  # and trains on


def test_a_lookup_made_before_a_load_cannot_apply_its_gradient_after_it():
    bag = CNEmbeddingBag(N, DIM, mode="sum", optimizer=cncore.SGD(lr=0.1))
    other = trained(cncore.SGD(lr=0.1), torch.tensor([[5, 6]]))
    out = bag(torch.tensor([[1, 2]]))
    bag.load_state_dict(other.state_dict())
    with pytest.raises(RuntimeError, match="keys were erased .* since this lookup"):
        out.sum().backward()
    assert exported(bag) == exported(other)

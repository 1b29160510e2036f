"""The modules' fast path (`bridge.lookup_table`): every call it takes returns what the general
path (`embedding_bag_lookup` / `embedding_lookup`) returns, applies the same updates and hands
the hooks the same gradients, and equals torch.nn.EmbeddingBag / torch.nn.Embedding on the
same rows; `torch.jit.trace` is refused with the table unchanged."""
import numpy as np
import pytest
import torch

import cncore
from cncore_torch import CNEmbedding, CNEmbeddingBag, functional, modules

N, DIM = 30, 8
NR = N + 10  # nn.EmbeddingBag's rows in the 2-D test: IDs N.. are first inserted by our lookups


def rows(module, n=N):
    return torch.from_numpy(module.store.lookup(np.arange(n)))


class Paths:
    """Records which path each module's forward took: `general` lists the modules that called
    the general lookup ("other" for modules not named by `force_general`); `force_general(m)`
    sends m there even where the fast path applies."""

    def __init__(self, monkeypatch):
        self.general, self.forced, self._anchors = [], set(), {}
        for name in ("embedding_bag_lookup", "embedding_lookup"):
            real = getattr(functional, name)
            monkeypatch.setattr(functional, name, lambda anchor, *a, real=real: self._general(anchor, real, *a))
        fast = modules._fast_ids
        monkeypatch.setattr(modules, "_fast_ids", lambda m, x: id(m) not in self.forced and fast(m, x))

    def force_general(self, module):
        self.forced.add(id(module))
        self._anchors[id(module._anchor)] = module

    def _general(self, anchor, real, *args):
        self.general.append(self._anchors.get(id(anchor), "other"))
        return real(anchor, *args)

    def took(self, fast, general, call):
        """`call(fast)` takes the fast path, `call(general)` the general one: their outputs."""
        out = call(fast)
        assert self.general == []  # the fast path ran
        expected = call(general)
        assert self.general == [general]
        self.general.clear()
        return out, expected


def bags(mode, optimizer, n_ref=N, seed=3, **kw):
    """Two CNEmbeddingBags with the same rows 0..N-1 (for the fast and the general path) and an
    nn.EmbeddingBag of n_ref rows whose first N are those."""
    fast, general = (CNEmbeddingBag(N, DIM, mode=mode, optimizer=optimizer, seed=seed, **kw) for _ in range(2))
    start = torch.from_numpy(np.random.default_rng(seed).standard_normal((N, DIM), dtype=np.float32))
    for m in (fast, general):
        m.insert(torch.arange(N), start)
    ref = torch.nn.EmbeddingBag(n_ref, DIM, mode=mode, **kw)
    with torch.no_grad():
        ref.weight[:N] = start
    return fast, general, ref


def hooks(*modules_):
    got = {id(m): [] for m in modules_}
    for m in modules_:
        m.register_gradient_hook(lambda ids, grads, out=got[id(m)]: out.append((ids.clone(), grads.clone())))
    return got


def dense_gradient(got_module, n=N):
    """The hooks' (unique IDs, gradient rows) of the last backward as a dense (n, DIM) gradient."""
    ids, grads = got_module[-1]
    assert len(set(ids.tolist())) == len(ids)
    dense = torch.zeros(n, DIM)
    dense[ids] = grads
    return dense


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("fused", [True, False])
def test_a_2d_batch_takes_the_fast_path_and_does_what_the_general_path_does(mode, fused, monkeypatch):
    """A (B, L) int64 CPU batch goes straight to the bridge: the same outputs, row updates, hook
    gradients and inserts as the general path (exactly) and nn.EmbeddingBag + torch.optim.SGD,
    for a strided batch, unseen IDs (their new rows copied into nn.EmbeddingBag) and an
    expanded gradient too."""
    paths = Paths(monkeypatch)
    rng = np.random.default_rng(7)
    torch.manual_seed(0)  # (the gradients torch.randn draws)
    fast, general, ref = bags(mode, cncore.SGD(lr=0.1) if fused else None, n_ref=NR)
    paths.force_general(general)
    got = {} if fused else hooks(fast, general)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    seen = set(range(N))
    for step in range(4):
        big = torch.from_numpy(rng.integers(0, NR, (6, 8)))  # IDs N.. are not in the tables yet
        batch = big[:, ::2] if step % 2 else big[:, :4].contiguous()  # strided, then contiguous
        out, expected = paths.took(fast, general, lambda m: m(batch))
        new = sorted(set(batch.flatten().tolist()) - seen)
        seen |= set(new)
        with torch.no_grad():  # the rows our lookups just inserted (deterministic: same seed, same rows)
            ref.weight[new] = torch.from_numpy(fast.store.lookup(np.array(new, dtype=np.int64)))
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        opt.zero_grad()
        ref_out = ref(batch)
        torch.testing.assert_close(out, ref_out)
        if step == 3:  # an expanded (stride 0) gradient
            for o in (out, expected, ref_out):
                o.sum().backward()
        else:
            g = torch.randn(out.shape)
            for o in (out, expected, ref_out):
                o.backward(g)
        assert sorted(fast.keys().tolist()) == sorted(general.keys().tolist()) == sorted(seen)
        torch.testing.assert_close(rows(fast, NR), rows(general, NR), rtol=0, atol=0)
        if fused:
            opt.step()
            present = sorted(seen)  # (nn.EmbeddingBag's other rows: its own initial values)
            torch.testing.assert_close(rows(fast, NR)[present], ref.weight.detach()[present], rtol=1e-4, atol=1e-5)
        else:
            torch.testing.assert_close(dense_gradient(got[id(fast)], NR), dense_gradient(got[id(general)], NR),
                                       rtol=0, atol=0)
            torch.testing.assert_close(dense_gradient(got[id(fast)], NR), ref.weight.grad, rtol=1e-4, atol=1e-5)
    assert len(got.get(id(fast), [])) == (0 if fused else 4)
    assert not modules._fixed_offsets(6, 4).flags.writeable  # shared between calls: nobody writes them


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("include_last_offset", [False, True])
@pytest.mark.parametrize("fused", [True, False])
def test_1d_ids_with_offsets_take_the_fast_path_and_equal_the_general_path_and_embedding_bag(
        mode, include_last_offset, fused, monkeypatch):
    """1-D int64 IDs with int64 offsets (empty bags, a strided input, a strided offsets tensor)
    take the fast path: outputs, fused updates (against nn.EmbeddingBag + torch.optim.SGD) and
    the hooks' gradients (against nn.EmbeddingBag's weight gradient) equal both references."""
    paths = Paths(monkeypatch)
    rng = np.random.default_rng(11)
    torch.manual_seed(0)  # (the gradients torch.randn draws)
    kw = dict(include_last_offset=include_last_offset)
    fast, general, ref = bags(mode, cncore.SGD(lr=0.5) if fused else None, **kw)
    paths.force_general(general)
    got = {} if fused else hooks(fast, general)
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(4):
        lengths = rng.integers(0, 4, 5)
        lengths[1] = 0  # an empty bag
        ids = torch.from_numpy(rng.integers(0, N, 2 * int(lengths.sum())))[::2]  # strided IDs
        offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]))
        offsets = offsets if include_last_offset else offsets[:-1]
        if step == 1:  # a strided offsets tensor
            offsets = torch.stack([offsets, offsets], 1)[:, 0]
        out, expected = paths.took(fast, general, lambda m: m(ids, offsets))
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        torch.testing.assert_close(out, ref(ids, offsets))
        g = torch.randn(out.shape)
        opt.zero_grad()
        ref(ids, offsets).backward(g)
        out.backward(g)
        expected.backward(g)
        if fused:
            opt.step()
            torch.testing.assert_close(rows(fast), ref.weight.detach(), rtol=1e-4, atol=1e-5)
        else:
            torch.testing.assert_close(dense_gradient(got[id(fast)]), ref.weight.grad, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(dense_gradient(got[id(general)]), dense_gradient(got[id(fast)]), rtol=0,
                                       atol=0)
        torch.testing.assert_close(rows(fast), rows(general), rtol=0, atol=0)
    assert len(got.get(id(fast), [])) == (0 if fused else 4)


def test_1d_offsets_the_fast_path_cannot_take_go_the_general_way(monkeypatch):
    """int32 offsets, per-sample weights and include_last_offset=True with no offsets take the
    general path (which converts, weights, or refuses them)."""
    paths = Paths(monkeypatch)
    fast, _, ref = bags("sum", None, include_last_offset=True)
    ids = torch.tensor([1, 2, 3])
    torch.testing.assert_close(fast(ids, torch.tensor([0, 1, 3], dtype=torch.int32)),
                               ref(ids, torch.tensor([0, 1, 3])))
    w = torch.tensor([0.5, 1.0, 2.0])
    torch.testing.assert_close(fast(ids, torch.tensor([0, 1, 3]), per_sample_weights=w),
                               ref(ids, torch.tensor([0, 1, 3]), per_sample_weights=w))
    with pytest.raises(ValueError, match="^offsets must hold B\\+1 entries"):
        fast(ids, torch.tensor([], dtype=torch.int64))
    assert paths.general == ["other"] * 3


@pytest.mark.parametrize("fused", [True, False])
def test_cnembedding_takes_the_fast_path_for_any_shape_and_equals_nn_embedding(fused, monkeypatch):
    """CNEmbedding's int64 CPU input of any shape (1-D, 3-D, 0-d, empty, strided) takes the fast
    path: output (input.shape + (dim,)), fused updates (against nn.Embedding + torch.optim.SGD)
    and the hooks' gradients equal the general path's and nn.Embedding's."""
    paths = Paths(monkeypatch)
    rng = np.random.default_rng(5)
    torch.manual_seed(0)  # (the gradients torch.randn draws)
    opt_config = cncore.SGD(lr=0.5) if fused else None
    fast, general = (CNEmbedding(N, DIM, optimizer=opt_config, seed=2) for _ in range(2))
    start = torch.from_numpy(rng.standard_normal((N, DIM), dtype=np.float32))
    for m in (fast, general):
        m.insert(torch.arange(N), start)
    paths.force_general(general)
    ref = torch.nn.Embedding(N, DIM)
    with torch.no_grad():
        ref.weight.copy_(start)
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    got = {} if fused else hooks(fast, general)
    inputs = [torch.from_numpy(rng.integers(0, N, 7)), torch.from_numpy(rng.integers(0, N, (2, 3, 4))),
              torch.tensor(5), torch.zeros(0, dtype=torch.int64), torch.zeros((3, 0), dtype=torch.int64),
              torch.from_numpy(rng.integers(0, N, (4, 6)))[:, ::3], torch.from_numpy(rng.integers(0, N, 5000))]
    for x in inputs:
        out, expected = paths.took(fast, general, lambda m: m(x))
        assert out.shape == x.shape + (DIM,)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        torch.testing.assert_close(out, ref(x))
        g = torch.randn(out.shape)
        opt.zero_grad()
        ref(x).backward(g)
        out.backward(g)
        expected.backward(g)
        if fused:
            opt.step()
            torch.testing.assert_close(rows(fast), ref.weight.detach(), rtol=1e-4, atol=1e-5)
        else:  # (an empty input: the hooks get no IDs, as nn.Embedding's gradient is zero)
            torch.testing.assert_close(dense_gradient(got[id(fast)]), ref.weight.grad, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(dense_gradient(got[id(general)]), dense_gradient(got[id(fast)]), rtol=0,
                                       atol=0)
        torch.testing.assert_close(rows(fast), rows(general), rtol=0, atol=0)
    offsets = modules._unit_offsets(3)
    assert offsets.tolist() == [0, 1, 2, 3] and not offsets.flags.writeable  # a prefix of the shared range
    assert len(modules._UNIT_OFFSETS[0]) > 5000


def test_no_grad_and_eval_on_the_fast_path():
    """Under no_grad the fast path builds no graph (nothing to backward) and, in training mode
    too, reads as in eval mode: unseen IDs read as zeros and nothing is inserted."""
    bag = CNEmbeddingBag(N, DIM, mode="sum", optimizer=cncore.SGD(lr=0.1))
    with torch.no_grad():
        out = bag(torch.tensor([[1, 2]]))
    assert not out.requires_grad and out.grad_fn is None and bag.num_rows == 0 and out.tolist() == [[0.0] * DIM]
    bag(torch.tensor([[1, 2]]))  # a training lookup with gradients inserts
    assert bag.num_rows == 2
    bag.eval()
    out = bag(torch.tensor([[1, 2**50]]))
    torch.testing.assert_close(out[0], rows(bag)[1])
    assert bag.num_rows == 2 and out.requires_grad


@pytest.mark.parametrize("case", ["bag_2d", "bag_1d", "embedding"])
def test_a_functorch_transform_takes_the_general_path(case, monkeypatch):
    """Under a functorch transform (torch.func.grad) the fast path steps aside (there `.numpy()`
    of any tensor fails): the general path's autograd.Function is refused by functorch, naming
    what it needs (setup_context), and nothing changes."""
    paths = Paths(monkeypatch)
    if case == "embedding":
        module, call = CNEmbedding(N, DIM, optimizer=cncore.SGD(lr=0.1)), lambda: module(torch.tensor([[1, 2]]))
    else:
        module = CNEmbeddingBag(N, DIM, mode="sum", optimizer=cncore.SGD(lr=0.1))
        call = ((lambda: module(torch.tensor([[1, 2]]))) if case == "bag_2d" else
                (lambda: module(torch.tensor([1, 2]), torch.tensor([0, 1]))))
    call()
    assert paths.general == []
    before = rows(module).clone()
    with pytest.raises(RuntimeError, match="functorch transforms .* must override the setup_context"):
        torch.func.grad(lambda x: (call() * x).sum())(torch.ones(DIM))
    assert paths.general == ["other"]
    assert module.keys().tolist() == [1, 2]
    torch.testing.assert_close(rows(module), before, rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")  # (the general path's offsets, before the refusal)
@pytest.mark.parametrize("case", ["bag_2d", "bag_1d", "embedding"])
def test_jit_trace_is_refused_with_the_table_unchanged(case):
    """torch.jit.trace cannot record a lookup that runs in the core (a trace would replay the
    traced IDs): it is refused with a message that says what to use instead, and the table is
    unchanged (no row inserted by the traced call)."""
    if case == "embedding":
        module, args = CNEmbedding(N, DIM, optimizer=cncore.SGD(lr=0.1)), (torch.tensor([[1, 2]]),)
    else:
        module = CNEmbeddingBag(N, DIM, mode="sum", optimizer=cncore.SGD(lr=0.1))
        args = (torch.tensor([[1, 2]]),) if case == "bag_2d" else (torch.tensor([1, 2, 3]), torch.tensor([0, 1]))
    first = {"bag_2d": (torch.tensor([[7]]),), "bag_1d": (torch.tensor([7]), torch.tensor([0])),
             "embedding": (torch.tensor([7]),)}[case]
    module(*first)  # (row 7: the only key, before and after)
    before = rows(module).clone()

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table = module
            self.head = torch.nn.Linear(DIM, 1)

        def forward(self, *x):
            return self.head(self.table(*x))

    with pytest.raises(RuntimeError, match="^torch.jit.trace cannot record the lookup of "
                                           f"{type(module).__name__}.*torch.compile.*the table is unchanged"):
        torch.jit.trace(Model(), args)
    assert module.keys().tolist() == [7]
    torch.testing.assert_close(rows(module), before, rtol=0, atol=0)




@pytest.mark.parametrize("path", ["fast", "general"])
@pytest.mark.parametrize("changed", ["ids", "offsets", "weights"])
@pytest.mark.parametrize("fused", [True, False])
def test_an_input_changed_in_place_before_the_backward_is_refused_as_nn_embedding_bag_does(
        path, changed, fused, monkeypatch):
    """The backward reads the forward's offsets, weights and (for the hooks) IDs again: a caller
    that writes the next batch into the same tensors before this backward gets autograd's error
    for a modified saved tensor, as nn.EmbeddingBag raises it, and nothing is updated or handed
    to the hooks. (The fast path takes no weights: "weights" goes the general way.)"""
    paths = Paths(monkeypatch)
    bag, _, ref = bags("sum", cncore.SGD(lr=0.5) if fused else None, include_last_offset=True)
    if path == "general":
        paths.force_general(bag)
    got = {} if fused else hooks(bag)
    ids = torch.tensor([1, 2, 3, 4, 5, 6], dtype=torch.int64)
    offsets = torch.tensor([0, 2, 2, 6], dtype=torch.int64)
    weights = torch.arange(1.0, 7.0) if changed == "weights" else None
    inputs = dict(ids=ids, offsets=offsets, weights=weights)
    before = rows(bag)
    g = torch.ones(3, DIM)
    out = bag(ids, offsets, per_sample_weights=weights)
    expected_out = ref(ids, offsets, per_sample_weights=weights)
    torch.testing.assert_close(out, expected_out)
    assert paths.general == ([] if path == "fast" and weights is None else [bag if path == "general" else "other"])
    inputs[changed][1] = 0  # the next batch written into the same buffer
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as caught:
        expected_out.backward(g)  # (the reference's own error, for the record)
    with pytest.raises(RuntimeError, match="modified by an inplace operation.*Nothing was updated"):
        out.backward(g)
    assert "is at version 1; expected version 0" in str(caught.value)
    torch.testing.assert_close(rows(bag), before, rtol=0, atol=0)
    assert got.get(id(bag), []) == []

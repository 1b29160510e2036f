"""Placements: meta (no storage, then to_empty), cncard (rows as device tensors; CNCORE_CNCARD=cpu
maps it onto the CPU so CI runs that code path), and moves between them with every row."""
import numpy as np
import pytest
import torch

import cncore
from cncore_torch import CNEmbedding, CNEmbeddingBag

N, DIM = 20, 8


def test_meta_builds_without_storage_then_materialises():
    bag = CNEmbeddingBag(10**9, DIM, mode="sum", device="meta", optimizer=cncore.SGD(lr=0.1))
    out = bag(torch.tensor([[1, 2], [3, 4]]))
    assert out.device.type == "meta" and out.shape == (2, DIM)
    with pytest.raises(RuntimeError, match="to_empty"):
        _ = bag.num_rows
    bag.to_empty(device="cpu")
    assert bag.placement.kind == "core" and bag.num_rows == 0
    bag(torch.tensor([[1, 2]])).sum().backward()
    assert bag.num_rows == 2 and bag.store.step == 1
    assert bag.fused_optimizer.param_groups[0]["params"][0] is bag._anchor


def test_cncard_without_an_accelerator_says_so(monkeypatch):
    monkeypatch.delenv("CNCORE_CNCARD", raising=False)
    if torch.cuda.is_available():
        pytest.skip("an accelerator is present")
    with pytest.raises(RuntimeError, match="CNCORE_CNCARD=cpu"):
        CNEmbeddingBag(10, 4, device="cncard")


def twins(mode, optimizer, **kw):
    torch.manual_seed(0)
    weight = torch.randn(N, DIM)
    core = CNEmbeddingBag(N, DIM, mode=mode, _weight=weight, optimizer=optimizer, **kw)
    card = CNEmbeddingBag(N, DIM, mode=mode, _weight=weight, optimizer=optimizer, device="cncard", **kw)
    return core, card


def sorted_export(module):
    e = module.export()
    order = torch.argsort(e["keys"].cpu())
    return {k: v.cpu()[order] for k, v in e.items()}


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("optimizer", [cncore.SGD(lr=0.1), cncore.Adagrad(lr=0.1), cncore.RowWiseAdagrad(lr=0.1),
                                       cncore.Adam(lr=0.01)], ids=["sgd", "adagrad", "rowwise", "adam"])
def test_cncard_path_trains_like_the_core(cncard, mode, optimizer):
    core, card = twins(mode, optimizer)
    assert card.placement.kind == "device"
    rng = np.random.default_rng(1)
    for _ in range(4):
        ids = torch.from_numpy(rng.integers(0, N + 10, (6, 3)))  # some IDs are new
        w = torch.rand(6, 3) if mode != "max" else None
        g = torch.randn(6, DIM)
        a, b = core(ids, per_sample_weights=w), card(ids, per_sample_weights=w)
        torch.testing.assert_close(b.cpu(), a)
        a.backward(g)
        b.backward(g.to(b.device))
    ea, eb = sorted_export(core), sorted_export(card)
    for name in ea:
        torch.testing.assert_close(eb[name], ea[name], rtol=1e-5, atol=1e-6)


def test_cncard_eval_reads_unseen_as_zero_and_non_fused_hook(cncard):
    core, card = twins("mean", None)
    card.eval()
    out = card(torch.tensor([[1, 10**12]]))
    torch.testing.assert_close(out[0].cpu(), core.export()["rows"][torch.argsort(core.export()["keys"])][1] / 2)
    assert card.num_rows == N
    card.train()
    got = []
    card.register_gradient_hook(lambda ids, grads: got.append((ids, grads)))
    core.register_gradient_hook(lambda ids, grads: got.append((ids, grads)))
    g = torch.randn(1, DIM)
    card(torch.tensor([[3, 3, 5]])).backward(g.to(card.device_rows.device))
    core(torch.tensor([[3, 3, 5]])).backward(g)
    (ids_card, g_card), (ids_core, g_core) = got
    ids_card, g_card = ids_card.cpu(), g_card.cpu()
    torch.testing.assert_close(g_card[torch.argsort(ids_card)], g_core[torch.argsort(ids_core)])


def test_move_between_core_and_cncard_keeps_every_row(cncard):
    bag = CNEmbeddingBag(N, DIM, mode="sum", optimizer=cncore.RowWiseAdagrad(lr=0.1))
    for _ in range(3):
        bag(torch.tensor([[1, 2, 2**40], [5, 5, 7]])).sum().backward()
    before = sorted_export(bag)
    step = bag.store.step
    bag.move_to("cncard")
    assert bag.placement.kind == "device" and bag.store is None
    for name, value in sorted_export(bag).items():
        torch.testing.assert_close(value, before[name])
    assert bag.device_rows.step == step
    bag.move_to("cpu")
    assert bag.placement.kind == "core"
    for name, value in sorted_export(bag).items():
        torch.testing.assert_close(value, before[name])
    assert bag.store.step == step


def test_cncard_state_dict_round_trip(cncard):
    card = CNEmbedding(N, DIM, device="cncard", optimizer=cncore.Adam(lr=0.01))
    card(torch.tensor([3, 4, 2**33])).sum().backward()
    core = CNEmbedding(4, DIM, optimizer=cncore.Adam(lr=0.01))
    core.load_state_dict(card.state_dict())
    for name, value in sorted_export(core).items():
        torch.testing.assert_close(value, sorted_export(card)[name])


@pytest.mark.parametrize("placement", ["cpu", "cncard"])
@pytest.mark.parametrize("argument", ["input", "offsets", "per_sample_weights"])
def test_meta_inputs_are_refused_naming_the_argument(cncard, placement, argument):
    bag = CNEmbeddingBag(10, 4, mode="sum", device="meta")
    bag.to_empty(device="cpu")
    if placement == "cncard":
        bag.move_to("cncard")
    args = {"input": torch.tensor([1, 2]), "offsets": torch.tensor([0]), "per_sample_weights": torch.ones(2)}
    args[argument] = args[argument].to("meta")
    with pytest.raises(ValueError, match=f"^{argument} is a meta tensor, which holds no values: expected "
                                         f"{argument} on the CPU"):
        bag(**args)
    assert bag.num_rows == 0
    emb = CNEmbedding(10, 4)
    with pytest.raises(ValueError, match="^input is a meta tensor"):
        emb(torch.tensor([1], device="meta"))


def test_to_meta_refuses_to_drop_rows_and_to_empty_keeps_the_optimizer_wired():
    bag = CNEmbeddingBag(10, 4, mode="sum", optimizer=cncore.SGD(lr=0.5))
    bag(torch.tensor([[1]])).sum().backward()
    with pytest.raises(ValueError, match="drop its 1 rows"):
        bag.to("meta")
    assert bag.num_rows == 1 and bag.placement.kind == "core"
    empty = CNEmbeddingBag(10, 4, mode="sum", optimizer=cncore.SGD(lr=0.5)).to("meta")
    assert empty.placement.kind == "meta"
    empty.to_empty(device="cpu")
    sched = torch.optim.lr_scheduler.StepLR(empty.fused_optimizer, step_size=1, gamma=0.1)
    empty.fused_optimizer.step()
    sched.step()
    assert empty.fused_optimizer.lr == pytest.approx(0.05)

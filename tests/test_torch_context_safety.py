"""A lookup's backward meets the table it was made on, or is refused (issue 9, item 16): moving
a module between devices between forward and backward built a new store whose erase epoch
equalled the old one, and the backward updated the new store's rows at the old slots."""
import numpy as np
import pytest
import torch

import cncore
from cncore_torch import CNEmbeddingBag


def rows_by_key(bag):
    e = bag.export()
    order = torch.argsort(e["keys"])
    return e["keys"][order].tolist(), e["rows"][order].clone()


@pytest.mark.parametrize("route", [("cncard", "cpu"), ("cncard",)])
def test_moving_between_forward_and_backward_refuses_the_update(monkeypatch, route):
    monkeypatch.setenv("CNCORE_CNCARD", "cpu")
    bag = CNEmbeddingBag(100, 4, mode="sum", optimizer=cncore.SGD(lr=1.0))
    bag(torch.tensor([[5, 6, 7]]))                # rows exist before the step we interrupt
    bag.train()
    out = bag(torch.tensor([[7, 8], [5, 5]]))
    for device in route:
        bag.move_to(device)
    keys_before, rows_before = rows_by_key(bag)
    with pytest.raises(RuntimeError, match="erased|moved off the core"):
        out.sum().backward()
    keys_after, rows_after = rows_by_key(bag)
    assert keys_after == keys_before == [5, 6, 7, 8]
    assert torch.equal(rows_after, rows_before)


def test_erase_between_forward_and_backward_refuses_the_update_through_torch():
    bag = CNEmbeddingBag(100, 4, mode="mean", optimizer=cncore.Adagrad(lr=0.5))
    out = bag(torch.tensor([[1, 2], [3, 4]]))
    bag.store.erase(np.array([2]))
    keys_before, rows_before = rows_by_key(bag)
    with pytest.raises(RuntimeError, match="erased"):
        out.sum().backward()
    keys_after, rows_after = rows_by_key(bag)
    assert keys_after == keys_before == [1, 3, 4] and torch.equal(rows_after, rows_before)
    assert bag.store.step == 0

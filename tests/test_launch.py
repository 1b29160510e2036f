"""cncore_torch.distributed.launch.spawn: a port taken between choosing it and rank 0's bind is
retried on a new one; every other failure is raised as it is, the first time."""
import socket

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("torch.distributed")

TIMEOUT = 90.0


def _sum_ranks(rank, world_size, out_dir):
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    with open(f"{out_dir}/rank{rank}", "w") as f:
        f.write(str(total.item()))


def _fail(rank, world_size):
    raise RuntimeError(f"rank {rank} fails on purpose")


@pytest.mark.slow
def test_a_port_taken_before_rank_0_binds_it_is_retried_on_a_new_one(tmp_path, monkeypatch):
    from cncore_torch.distributed import launch
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = [taken.getsockname()[1]]
    real = launch.free_port

    def first_taken():
        ports.append(real())
        return ports[-2] if len(ports) == 2 else ports[-1]

    monkeypatch.setattr(launch, "free_port", first_taken)
    try:
        launch.spawn(_sum_ranks, 2, str(tmp_path), timeout=TIMEOUT)
    finally:
        taken.close()
    assert len(ports) == 3  # the taken port, then the free one it ran on
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == ["3.0", "3.0"]


@pytest.mark.slow
def test_a_failure_other_than_the_port_is_raised_without_a_retry(monkeypatch):
    from cncore_torch.distributed import launch
    calls = []
    real = launch.free_port
    monkeypatch.setattr(launch, "free_port", lambda: calls.append(1) or real())
    with pytest.raises(torch.multiprocessing.ProcessRaisedException, match="fails on purpose"):
        launch.spawn(_fail, 2, timeout=TIMEOUT)
    assert len(calls) == 1


def test_nprocs_must_be_a_positive_int():
    from cncore_torch.distributed.launch import spawn
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match=rf"nprocs must be an int >= 1, got {bad!r}"):
            spawn(_fail, bad)

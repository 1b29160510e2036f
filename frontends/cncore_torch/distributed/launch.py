"""Run a function in N local processes joined by a gloo process group (tests, `cn-dlrm --nproc`).

`spawn(fn, nprocs, *args, timeout=...)` calls `fn(rank, world_size, *args)` in each process
after `torch.distributed.init_process_group("gloo")` on 127.0.0.1 and a free port; a process
that raises fails the whole run (its traceback in the error), and the run is killed past
`timeout` seconds. Nothing listens beyond localhost.

The port is free when chosen, not when rank 0 binds it a few seconds later (spawned processes
import torch first): another process on the machine (a parallel test worker, its gloo pairs)
may take it in between. Rank 0 then fails with EADDRINUSE before `fn` runs, so `spawn` tries
again on a new port (up to PORT_TRIES times); any other failure is raised as it is.
"""
from __future__ import annotations

import datetime
import os
import socket
import time

import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["spawn", "free_port"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(rank: int, world_size: int, port: int, timeout: float | None, fn, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=max(10.0, timeout) if timeout else 1800.0))
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


PORT_TRIES = 3
"""How many ports `spawn` tries when the one it chose was taken before rank 0 could bind it."""


def spawn(fn, nprocs: int, *args, timeout: float | None = 120.0) -> None:
    """fn(rank, nprocs, *args) in `nprocs` processes; raises if one fails or time runs out
    (timeout=None: no deadline for the run; a collective still gives up after 30 minutes)."""
    if not isinstance(nprocs, int) or isinstance(nprocs, bool) or nprocs < 1:
        raise ValueError(f"nprocs must be an int >= 1, got {nprocs!r}")
    for attempt in range(PORT_TRIES):
        try:
            return _spawn_on(free_port(), fn, nprocs, args, timeout)
        except mp.ProcessRaisedException as e:  # the port was taken between free_port() and the bind
            if "EADDRINUSE" not in str(e) or attempt == PORT_TRIES - 1:
                raise


def _spawn_on(port: int, fn, nprocs: int, args: tuple, timeout: float | None) -> None:
    context = mp.start_processes(_run, args=(nprocs, port, timeout, fn, args), nprocs=nprocs,
                                 join=False, start_method="spawn")
    deadline = time.monotonic() + (timeout if timeout else float("inf"))
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in context.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"{nprocs} processes still running after {timeout} s; killed")

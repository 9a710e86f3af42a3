"""A world of N processes on this machine, for benchmarks and tests: ``run_local_world``.

Each process is a rank as torchrun would start it (its variables set, a free port for
the rendezvous, the default process group on gloo), runs ``fn(rank, world, *args)``
and hands back what it returns; a rank that raises fails the whole call with its
traceback (``torch.multiprocessing``'s ``ProcessRaisedException``). Training jobs are
started by ``fxpipe run`` (``job/launcher.py``) or torchrun, not here.
"""
from __future__ import annotations

import os
import pickle
import socket
import tempfile
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port free on the loopback now (the rendezvous binds it moments later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_local_world(rank: int, world: int, port: int, *, timeout: timedelta = timedelta(seconds=600)) -> None:
    """This process as rank ``rank`` of a local gloo world: torchrun's variables, then the
    default process group."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)


def _entry(rank: int, world: int, port: int, outdir: str, fn: Callable, args: tuple, env: dict[str, str],
           cwd: str, timeout: timedelta, threads: int | None) -> None:
    # A forked worker has its server's environment and directory, not the caller's: take
    # the caller's (as spawn would), so variables set and directories entered reach it.
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    if threads is not None:
        torch.set_num_threads(threads)
    join_local_world(rank, world, port, timeout=timeout)
    try:
        result = fn(rank, world, *args)
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001  (a group a failed collective left broken)
            pass
    with open(os.path.join(outdir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def run_local_world(world: int, fn: Callable, *args: Any, timeout: timedelta = timedelta(seconds=600),
                    threads: int | None = None, start_method: str = "spawn",
                    preload: Sequence[str] = ()) -> list[Any]:
    """``fn(rank, world, *args)`` on each rank of a local gloo world of ``world``
    processes; each rank's return value, in rank order. ``fn`` and ``args`` must be
    picklable (``fn`` a module-level function). ``threads``: torch's threads per rank
    (None: torch's default). ``timeout``: the process group's. ``start_method``
    "forkserver" with ``preload`` (modules the server imports once) starts a world in a
    fraction of spawn's time when many worlds are started."""
    if preload:
        import multiprocessing

        multiprocessing.set_forkserver_preload(list(preload))  # read when the server first starts
    with tempfile.TemporaryDirectory() as outdir:
        mp.start_processes(_entry, args=(world, free_port(), outdir, fn, args, dict(os.environ), os.getcwd(),
                                         timeout, threads),
                           nprocs=world, join=True, start_method=start_method)
        out = []
        for r in range(world):
            with open(os.path.join(outdir, f"{r}.pkl"), "rb") as f:
                out.append(pickle.load(f))
        return out

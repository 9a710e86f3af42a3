"""Run a function on a local gloo world of N processes and collect what each returns."""
from __future__ import annotations

import os
import pickle
import socket
import tempfile
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The workers fork from a server process that imported these once (multiprocessing's
# forkserver): a world starts in ~0.1 s instead of ~4 s of spawning and re-importing
# torch, transformers and fxpipe per process, and the first torch.export's set-up is
# done there too (_warm_worker.py); the suite starts ~15 worlds of 2-8 workers.
PRELOAD = ["tests.runtime._warm_worker"]


def _entry(rank: int, world: int, port: int, outdir: str, fn: Callable, args: tuple,
           env: dict[str, str], cwd: str) -> None:
    # A forked worker has the server's environment and directory, not the test's: take
    # the caller's (as spawn would), so monkeypatched variables and chdir reach it.
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        result = fn(rank, world, *args)
    except BaseException:
        with open(os.path.join(outdir, f"{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        try:
            dist.destroy_process_group()
        except Exception:
            pass
    with open(os.path.join(outdir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def run_world(world: int, fn: Callable, *args: Any) -> list[Any]:
    """``fn(rank, world, *args)`` on every rank; returns the per-rank results."""
    import multiprocessing

    multiprocessing.set_forkserver_preload(PRELOAD)  # read when the server first starts
    with tempfile.TemporaryDirectory() as outdir:
        mp.start_processes(_entry, args=(world, _free_port(), outdir, fn, args, dict(os.environ), os.getcwd()),
                           nprocs=world, join=True, start_method="forkserver")
        out = []
        for r in range(world):
            with open(os.path.join(outdir, f"{r}.pkl"), "rb") as f:
                out.append(pickle.load(f))
        return out

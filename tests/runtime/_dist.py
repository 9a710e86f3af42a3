"""Run a function on a local gloo world of N processes and collect what each returns
(``fxpipe/runtime/local_world.py``, started from a warm forkserver)."""
from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable

from fxpipe.runtime.local_world import free_port as _free_port  # noqa: F401  (tests name it so)
from fxpipe.runtime.local_world import run_local_world

# The workers fork from a server process that imported these once (multiprocessing's
# forkserver): a world starts in ~0.1 s instead of ~4 s of spawning and re-importing
# torch, transformers and fxpipe per process, and the first torch.export's set-up is
# done there too (_warm_worker.py); the suite starts ~15 worlds of 2-8 workers.
PRELOAD = ["tests.runtime._warm_worker"]


def run_world(world: int, fn: Callable, *args: Any) -> list[Any]:
    """``fn(rank, world, *args)`` on every rank, one thread each; returns the per-rank results."""
    return run_local_world(world, fn, *args, timeout=timedelta(seconds=120), threads=1,
                           start_method="forkserver", preload=PRELOAD)

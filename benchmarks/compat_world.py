"""Run many jobs in one spawned gloo world, with a time limit per job.

Starting a world costs each process a torch + transformers import, so one world
runs every family of a world size.
Each rank writes one result file per job; the parent watches them. A job that
does not finish in time, or that ends differently on different ranks (some
failed, others did not: the process groups may hold stale messages), ends the
world; the parent records the job and starts a fresh world for the rest.
"""
from __future__ import annotations

import os
import pickle
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch.multiprocessing as mp

from fxpipe.runtime.local_world import free_port


def _worker(rank: int, world: int, port: int, outdir: str, fn: Callable, jobs: list) -> None:
    import torch
    import torch.distributed as dist

    from fxpipe.runtime.local_world import join_local_world

    torch.set_num_threads(1)
    join_local_world(rank, world, port, timeout=timedelta(seconds=600))
    # Our own group for the after-job handshake: independent of whatever the job's
    # groups are still waiting for.
    control = dist.new_group(backend="gloo")
    for index, job in enumerate(jobs):
        try:
            result: Any = ("ok", fn(*job))
        except BaseException as exc:  # every failure is a result of the job
            result = ("exc", exc, traceback.format_exc())
        path = os.path.join(outdir, f"{index}.{rank}.pkl")
        try:
            blob = pickle.dumps(result)
        except Exception:  # an unpicklable exception: keep its text
            blob = pickle.dumps(("exc", RuntimeError(repr(result[1])[:300]), result[-1]))
        with open(path + ".tmp", "wb") as f:
            f.write(blob)
        os.replace(path + ".tmp", path)
        _release_groups(keep=control)
        kinds: list[Any] = [None] * world
        dist.all_gather_object(kinds, result[0], group=control)
        if len(set(kinds)) > 1:
            os._exit(0)  # ranks disagree: the parent starts a fresh world
    os._exit(0)


def _release_groups(keep) -> None:
    """Destroy every process group a job created, finished or not: each gloo group
    keeps polling threads until destroyed, and hundreds of jobs in one world piled up
    thousands of them (the machine's load reached ~1000). c10d's own map of groups is
    the one place that knows them all, including those of a job that failed half-way."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    for pg in list(c10d._world.pg_map):
        if pg is not c10d.GroupMember.WORLD and pg is not keep:
            dist.destroy_process_group(pg)


def run_jobs(world: int, fn: Callable, jobs: list[tuple], timeout_s: float,
             on_done: Callable[[int, list], None]) -> None:
    """``fn(*job)`` on every rank of a ``world``-process gloo world, for each job in order.

    ``on_done(index, per_rank)`` is called as each job ends; ``per_rank`` holds
    ('ok', value) or ('exc', exception, traceback text) per rank, or is None
    for a job that timed out (or whose world died)."""
    start = 0
    ctx = mp.get_context("spawn")
    while start < len(jobs):
        pending = jobs[start:]
        with tempfile.TemporaryDirectory() as outdir:
            port = free_port()
            procs = [ctx.Process(target=_worker, args=(r, world, port, outdir, fn, pending), daemon=True)
                     for r in range(world)]
            for p in procs:
                p.start()
            done, deadline = 0, time.monotonic() + timeout_s + 60  # + start-up
            while done < len(pending):
                files = [os.path.join(outdir, f"{done}.{r}.pkl") for r in range(world)]
                if all(os.path.exists(f) for f in files):
                    per_rank = []
                    for f in files:
                        with open(f, "rb") as fh:
                            per_rank.append(pickle.load(fh))
                    on_done(start + done, per_rank)
                    done += 1
                    deadline = time.monotonic() + timeout_s
                    kinds = {r[0] for r in per_rank}
                    if len(kinds) > 1:
                        break
                    continue
                if time.monotonic() > deadline or not any(p.is_alive() for p in procs):
                    on_done(start + done, None)
                    done += 1
                    break
                time.sleep(0.2)
            for p in procs:  # only the processes started above
                if p.is_alive():
                    p.kill()
                p.join()
        start += done
        sys.stdout.flush()

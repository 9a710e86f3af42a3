"""The local gloo world benchmarks and tests start (fxpipe/runtime/local_world.py) and the
rank-0 decision every rank receives (fxpipe/runtime/launch.py: rank0_decides)."""
from __future__ import annotations

import gc
import os
import time

import pytest
import torch.multiprocessing as mp

from fxpipe.checkpoint.lock import CheckpointLockError
from fxpipe.runtime.launch import rank0_decides
from fxpipe.runtime.local_world import run_local_world


def _ranks(rank: int, world: int, base: int) -> tuple[int, int, int]:
    import torch
    import torch.distributed as dist

    t = torch.tensor([rank + base])
    dist.all_reduce(t)  # the ranks are one process group
    return rank, world, int(t)


def _fails_on_rank_1(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("rank 1 refuses")
    return rank


def _decisions(rank: int, world: int) -> list:
    out = [rank0_decides(lambda: f"rank {rank} decided")]

    def locked():
        raise CheckpointLockError("held by another job")

    for as_raised in ((CheckpointLockError,), ()):
        try:
            rank0_decides(locked, as_raised=as_raised)
        except Exception as exc:  # noqa: BLE001  (which type each rank raised is the point)
            out.append((type(exc).__name__, str(exc)))
    return out


def _threads_left_by_decisions(rank: int, world: int) -> list[int]:
    """This process's threads after each decision (two refusals, then a plain one),
    less those before them, with the cycle collector off: a decision's gloo group must
    be gone, its threads joined, when the call returns or raises, not when a
    collection (or the interpreter's exit) gets to it."""
    def threads() -> int:
        return len(os.listdir("/proc/self/task"))

    def left_after(base: int) -> int:
        # A thread the group's destructor has joined may still be listed for a moment
        # while the kernel tears it down (seen once in ~30 runs on a loaded 2-core
        # machine); a group kept alive keeps its threads for good, so a short wait for
        # the count to settle still tells the two apart.
        deadline = time.monotonic() + 5.0
        while threads() > base and time.monotonic() < deadline:
            time.sleep(0.05)
        return threads() - base

    def locked():
        raise CheckpointLockError("held by another job")

    gc.disable()
    try:
        rank0_decides(lambda: rank)  # anything started once per process is in the base
        base, left = threads(), []
        for as_raised in ((CheckpointLockError,), ()):
            try:
                rank0_decides(locked, as_raised=as_raised)
            except Exception:  # noqa: BLE001  (the threads, not the error, are tested here)
                pass
            left.append(left_after(base))
        rank0_decides(lambda: rank)
        left.append(left_after(base))
        return left
    finally:
        gc.enable()


@pytest.mark.slow
def test_each_rank_runs_once_in_one_group_and_returns_in_rank_order():
    # sum over ranks of (rank + 10) = 10 + 11 + 12
    assert run_local_world(3, _ranks, 10, threads=1) == [(0, 3, 33), (1, 3, 33), (2, 3, 33)]


@pytest.mark.slow
def test_a_failing_rank_fails_the_call_with_its_message():
    with pytest.raises(mp.ProcessRaisedException, match="rank 1 refuses"):
        run_local_world(2, _fails_on_rank_1, threads=1)


@pytest.mark.slow
def test_rank_0_decides_for_every_rank_and_its_refusal_reaches_them_as_asked():
    ranks = run_local_world(2, _decisions, threads=1)
    assert ranks[0][:2] == ranks[1][:2], ranks
    decided, as_itself, _ = ranks[0]
    assert decided == "rank 0 decided"
    assert as_itself == ("CheckpointLockError", "held by another job")
    # Not passed on as itself: rank 0 re-raises its own, the others hear it in words.
    assert ranks[0][2] == ("CheckpointLockError", "held by another job")
    assert ranks[1][2] == ("RuntimeError", "rank 0 failed: CheckpointLockError: held by another job")


@pytest.mark.slow
def test_a_decision_leaves_no_thread_behind_even_when_refused():
    """A refusal's traceback held the decision's group (and its gloo threads) until the
    interpreter's exit, where a worker still releasing the broadcast's tensors aborted
    the process ("terminate called without an active exception")."""
    assert run_local_world(2, _threads_left_by_decisions, threads=1) == [[0, 0, 0], [0, 0, 0]]


def test_without_a_process_group_rank0_decides_is_the_decision_itself():
    assert rank0_decides(lambda: 42) == 42
    with pytest.raises(KeyError):
        rank0_decides(lambda: {}["missing"])

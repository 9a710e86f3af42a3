"""What posting a point-to-point transfer costs a pipeline rank, inside fxpipe's runtime
and alone.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_transfer_posts.py [--steps 10] [--microbatches 16]

World 2 (gloo, one thread per process). First a pipeline as the layout benchmark runs one
(``gpt-tiny``, global batch 16 × 32, pp=2, 1F1B, ``--microbatches``): every ``isend`` and
``irecv`` the runtime posts (``runtime/transport.py``: activations, gradients, lookups)
is timed where it is called, wall time, over ``--steps`` steps after three of warm-up; per
rank the posts per step, their median, mean and largest, and their total per step beside
the step. Then the same post alone: one 8 KB message per round, each rank computing
before and after it (close to how ``fxpipe calibrate`` measured ``transfer_cpu_s`` before:
one message at a time, there with the ranks asleep, taken by its median; it now takes the
runtime's mean in a tiny pipeline, ``Transport.posted_s``).

The price adds ``transfer_cpu_s`` per transfer end (``planner/transfer_price.py``): where
the posts inside the runtime cost more than that on average, a pipeline is priced low.
Writes benchmarks/results/bench_transfer_posts.txt.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.results_log import recorded  # noqa: E402
from fxpipe.runtime.local_world import run_local_world  # noqa: E402


class _TimedPosts:
    """``torch.distributed`` as the runtime's modules see it, with ``isend`` and ``irecv``
    timed (what each call takes before it returns its work handle)."""

    def __init__(self, dist, record: list) -> None:
        self._dist, self._record = dist, record

    def __getattr__(self, name: str):
        return getattr(self._dist, name)

    def _timed(self, kind: str, fn, *args, **kwargs):
        start = time.perf_counter()
        work = fn(*args, **kwargs)
        self._record.append((kind, time.perf_counter() - start))
        return work

    def isend(self, *args, **kwargs):
        return self._timed("send", self._dist.isend, *args, **kwargs)

    def irecv(self, *args, **kwargs):
        return self._timed("recv", self._dist.irecv, *args, **kwargs)


def _pipeline(rank: int, world: int, microbatches: int, steps: int) -> tuple[float, list]:
    import torch.distributed as dist

    import fxpipe
    import fxpipe.runtime.transport as transport
    from benchmarks.bench_auto_layout import workload

    record: list = []
    transport.dist = _TimedPosts(dist, record)  # every post of the runtime goes through it
    w = workload("gpt-tiny", 16, 32)
    pm = fxpipe.parallelize(w.model, example_inputs=w.example_inputs, loss_fn=w.loss_fn, costs="model",
                            partition="dp", pp=2, microbatches=microbatches, schedule="1f1b")
    for _ in range(3):
        pm.train_step(w.example_inputs)
    record.clear()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        pm.train_step(w.example_inputs)
    step = (time.perf_counter() - start) / steps
    pm.close()
    return step, record


def _spin(seconds: float) -> None:
    a = torch.randn(64, 64)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = (a @ a).tanh_()


def _alone(rank: int, world: int, rounds: int) -> list:
    """Rank 0 computes 1.5 ms, posts a send, computes 1 ms, waits; rank 1 computes 1 ms,
    posts the receive, computes 1.5 ms, waits."""
    import torch.distributed as dist

    buf, record = torch.zeros(2048), []
    for i in range(rounds + 5):
        dist.barrier()
        before, after = (0.0015, 0.001) if rank == 0 else (0.001, 0.0015)
        _spin(before)
        start = time.perf_counter()
        work = dist.isend(buf, 1) if rank == 0 else dist.irecv(buf, 0)
        took = time.perf_counter() - start
        _spin(after)
        work.wait()
        if i >= 5:
            record.append(("send" if rank == 0 else "recv", took))
    return record


def _line(label: str, got: list[float], per: int) -> str:
    return (f"{label}: {len(got) / per:.0f} per step, median {statistics.median(got) * 1e6:.0f} us, "
            f"mean {statistics.mean(got) * 1e6:.0f} us, largest {max(got) * 1e6:.0f} us, "
            f"{sum(got) / per * 1e3:.1f} ms per step")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--microbatches", type=int, default=16)
    p.add_argument("--rounds", type=int, default=80)
    args = p.parse_args()
    with recorded("bench_transfer_posts"):
        print(f"torch {torch.__version__}, world 2 gloo, 1 thread per rank, load average "
              f"{os.getloadavg()[0]:.1f} at start\n")
        print(f"## inside the runtime: gpt-tiny 16x32, pp=2 1F1B, m={args.microbatches}, {args.steps} steps")
        for rank, (step, record) in enumerate(run_local_world(2, _pipeline, args.microbatches, args.steps,
                                                              threads=1)):
            print(f"rank {rank}: step {step * 1e3:.1f} ms")
            for kind in ("send", "recv"):
                got = [t for k, t in record if k == kind]
                if got:
                    print("  " + _line(f"{kind} posts", got, args.steps))
        print(f"\n## alone: one 8 KB message per round, both ranks computing around it, {args.rounds} rounds")
        for rank, record in enumerate(run_local_world(2, _alone, args.rounds, threads=1)):
            got = [t for _, t in record]
            print(f"rank {rank} {record[0][0]} post: median {statistics.median(got) * 1e6:.0f} us, "
                  f"mean {statistics.mean(got) * 1e6:.0f} us, largest {max(got) * 1e6:.0f} us")
        print(f"\nload average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()

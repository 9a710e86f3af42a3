"""What a point-to-point transfer end costs its rank, measured where it happens: in a
running pipeline of the tiny GPT (``tiny_runtime.py``), the posting thread's CPU and the
CPU gloo's transport threads run meanwhile (``Hardware.transfer_cpu_s``; part of
``fxpipe calibrate``, ``machine_speeds.py``)."""
from __future__ import annotations

import os
from typing import Any, Sequence

import torch

from fxpipe.planner.tiny_runtime import tiny_batch, tiny_runtime


def pipeline_posts(steps: int = 10, warmup: int = 3) -> dict[str, Any]:
    """What this rank's sends and receives cost it over ``steps`` steps (after ``warmup``)
    of a tiny GPT (h=16, two layers, tied head) run by the runtime as a 2-stage 1F1B
    pipeline of 8 microbatches, in the world of two the caller joined: ``posts``, the
    wall time in them (``posted_s``, ``Transport.posted_s``), the posting thread's CPU in
    them (``posted_cpu_s``) and the CPU gloo's transport threads ran meanwhile
    (``transport_s``; None where the system does not say, ``transport_threads_s``).

    Their sum per post is each transfer end's own cost (``Hardware.transfer_cpu_s``): a
    post takes the calling thread's time, and gloo's transport thread reads and writes
    the message on a thread of its own, which on a CPU whose cores all compute runs on
    the rank's core (130–225 µs a post in a 2-stage GPipe of gpt-tiny, beside 150–240 µs
    in the posts; the compute thread waited as long for its core). A post alone, both
    ranks idle, takes ~0.1 ms every time; inside a pipeline it blocks now and then for
    milliseconds (``benchmarks/bench_transfer_posts.py``), so it is measured where it
    happens and taken by its mean: the price sums the posts of a step."""
    torch.manual_seed(0)
    batch = tiny_batch()
    _, pm = tiny_runtime(2, batch, pp=2, microbatches=8, schedule="1f1b")
    out: dict[str, Any] = dict(posted_s=0.0, posted_cpu_s=0.0, posts=0, transport_s=None)
    try:
        for _ in range(warmup):
            pm.train_step(batch)
        before = transport_threads_s()
        for _ in range(steps):
            pm.train_step(batch)
            t = pm.executor.transport
            out["posted_s"] += t.posted_s
            out["posted_cpu_s"] += t.posted_cpu_s
            out["posts"] += t.posts
        after = transport_threads_s()
        if before is not None and after is not None:
            out["transport_s"] = after - before
    finally:
        pm.close()
    return out


def transfer_end_s(costs: Sequence[dict[str, Any]]) -> float:
    """One transfer end's own time from ``pipeline_posts`` of every rank: the posting
    thread's CPU and the transport threads' per post where the system says what the
    transport threads ran, else the wall time in the posts."""
    posts = max(1, sum(c["posts"] for c in costs))
    if all(c.get("transport_s") is not None for c in costs):
        return sum(c["posted_cpu_s"] + c["transport_s"] for c in costs) / posts
    return sum(c["posted_s"] for c in costs) / posts


def describe_end(costs: Sequence[dict[str, Any]]) -> str:
    """How a transfer end's own time divides, for the calibration's line."""
    posts = max(1, sum(c["posts"] for c in costs))
    if any(c.get("transport_s") is None for c in costs):
        return " (the wall time in its posts)"
    posting = sum(c["posted_cpu_s"] for c in costs) / posts
    transport = sum(c["transport_s"] for c in costs) / posts
    return f" (posting {posting * 1e6:.0f} us + gloo's transport threads {transport * 1e6:.0f} us)"


def transport_threads_s() -> float | None:
    """CPU seconds gloo's transport threads of this process have run so far (Linux: each
    thread's ``schedstat``; the threads gloo names ``gloo_*``), None where the system does
    not say."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    total, found = 0.0, False
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if not f.read(64).startswith("gloo"):
                    continue
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read(256).split()[0]) / 1e9
            found = True
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile, or no schedstat
    return total if found else None

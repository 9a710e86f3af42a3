"""Point-to-point latency and bandwidth between two pipeline ranks, measured.

A ping-pong between global rank 0 and its next pipeline peer: the round trip of a
4-byte message gives the latency, of an 8 MiB one the bandwidth (Hockney's model,
t = latency + bytes / bandwidth, the one the partition problem prices transfers
with). Everyone else waits for rank 0's broadcast of the two numbers.
"""
from __future__ import annotations

import math
import statistics
import time

import torch
import torch.distributed as dist

from fxpipe.runtime.launch import rank0_decides

SMALL, LARGE = 1, 2 * 2**20  # float32 elements: 4 B and 8 MiB


def _round_trip(peer: int, first: bool, n: int, device: torch.device, repeats: int) -> float:
    x = torch.zeros(n, dtype=torch.float32, device=device)
    times = []
    for i in range(repeats + 1):  # the first trip sets up the connection
        t = time.perf_counter()
        if first:
            dist.send(x, peer)
            dist.recv(x, peer)
        else:
            dist.recv(x, peer)
            dist.send(x, peer)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def probe_link(peer_of_rank0: int | None, device: torch.device, repeats: int = 5) -> tuple[float, float]:
    """(latency s, bandwidth B/s) between rank 0 and ``peer_of_rank0`` (collective over
    the world; (0, inf) when there is no peer)."""
    if peer_of_rank0 is None:
        return 0.0, math.inf
    rank = dist.get_rank()
    measured = None
    if rank in (0, peer_of_rank0):
        first = rank == 0
        other = peer_of_rank0 if first else 0
        small = _round_trip(other, first, SMALL, device, repeats) / 2
        large = _round_trip(other, first, LARGE, device, repeats) / 2
        bandwidth = LARGE * 4 / max(large - small, 1e-9)
        measured = (small, bandwidth)
    return rank0_decides(lambda: measured)  # rank 0's numbers on every rank

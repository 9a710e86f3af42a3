"""How many worker processes this machine may start: ``fxpipe run``'s local ranks and
``prepare-data``'s tokenizing processes share the bound (each a process of its own;
hundreds on a few cores only thrash, and 1,000 forks exhausted the machine)."""
from __future__ import annotations

import os

WORKERS_PER_CORE = 16
"""Local CPU workers beyond this many per core are refused: each is a process of its own
(torch alone is ~0.3 GiB), and hundreds of them on a few cores only thrash."""
GIB_PER_WORKER = 0.4
"""A lower bound on one worker's memory (torch, fxpipe and a tiny model imported)."""


def local_worker_limit() -> tuple[int, int, float]:
    """(the most worker processes this machine may start, its cores, its free GiB):
    ``WORKERS_PER_CORE`` per core, ``GIB_PER_WORKER`` each."""
    cores = os.cpu_count() or 1
    free_gib = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    return min(WORKERS_PER_CORE * cores, max(1, int(free_gib / GIB_PER_WORKER))), cores, free_gib

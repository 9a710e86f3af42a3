"""How long `fxpipe run`'s default job waits for its layout search: cold, then cached.

    .venv/bin/python benchmarks/bench_search_time.py [--world 4] [--model gpt-small]

Runs the search `fxpipe run` runs with no layout flag (``job/layout_choice.py``'s
``_search``: the job's first global batch, the ranks' threads and shared cores) twice
with the layout cache in a fresh directory: the first searches (shapes timed, layouts
priced in order of their lower bound), the second reads the first's result back. Prints
each wall time and this process's CPU seconds (user + system: on a shared machine the
wall time is its neighbours' too, the CPU seconds much less so), the search's own table
and the load average.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fxpipe.job import layout_choice  # noqa: E402
from fxpipe.job.config import TrainConfig  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--model", default=TrainConfig().model)
    args = p.parse_args()
    config = dataclasses.replace(TrainConfig(), model=args.model)
    with tempfile.TemporaryDirectory() as cache:
        os.environ.update(FXPIPE_CACHE_DIR=cache, FXPIPE_LAYOUT_CACHE="1")
        for run in ("cold", "cached"):
            load = os.getloadavg()[0]
            start, cpu = time.perf_counter(), _cpu_s()
            layout_choice._search(config, args.world, {})
            print(f"# {run}: search {time.perf_counter() - start:.1f} s wall, {_cpu_s() - cpu:.1f} s CPU "
                  f"(load {load:.1f} before, {os.getloadavg()[0]:.1f} after)", flush=True)


def _cpu_s() -> float:
    """This process's user + system CPU seconds."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


if __name__ == "__main__":
    main()

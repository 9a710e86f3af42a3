"""Keep what a printing benchmark printed: ``with recorded("bench_x"):`` copies stdout
to ``benchmarks/results/bench_x.txt`` (under a header naming the machine), so every
benchmark's numbers live under results/ beside the tables the others write."""
from __future__ import annotations

import contextlib
import datetime
import os
import platform
import sys

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


class _Tee:
    def __init__(self, *streams) -> None:
        self.streams = streams

    def write(self, text: str) -> int:
        for s in self.streams:
            s.write(text)
        return len(text)

    def flush(self) -> None:
        for s in self.streams:
            s.flush()


@contextlib.contextmanager
def recorded(name: str):
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, f"{name}.txt")
    with open(path, "w") as f:
        f.write(f"# {name} — {datetime.date.today()}, {platform.machine()} "
                f"{platform.processor() or ''} {os.cpu_count()} cpus, Python {platform.python_version()}, "
                f"command: {' '.join(sys.argv)}\n")
        out = sys.stdout
        sys.stdout = _Tee(out, f)
        try:
            yield path
        finally:
            sys.stdout = out
    print(f"results: {os.path.relpath(path)}")

"""``fxpipe calibrate``: measure this machine's matmul, memory and gloo speeds."""
from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    from fxpipe.cli.planner_args import add_calibrate_arguments, run_calibrate

    add_calibrate_arguments(p)
    p.set_defaults(fn=run_calibrate)

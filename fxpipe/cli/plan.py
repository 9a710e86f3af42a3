"""``fxpipe plan``: search tp/pp/dp layouts with the simulator (``fxpipe/cli/planner_args.py``)."""
from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    from fxpipe.cli.planner_args import add_plan_arguments, run_plan

    add_plan_arguments(p)
    p.set_defaults(fn=run_plan)

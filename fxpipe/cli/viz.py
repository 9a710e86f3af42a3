"""``fxpipe viz``: draw a pipeline schedule (``fxpipe/cli/viz_args.py``)."""
from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    from fxpipe.cli.viz_args import add_viz_arguments, run_viz

    add_viz_arguments(p)
    p.set_defaults(fn=run_viz)

"""``fxpipe viz``: generate, lower, validate, simulate and draw a schedule.

``fxpipe/cli/viz.py`` wires these in as a subcommand::

    viz = subparsers.add_parser("viz", help="draw a pipeline schedule")
    add_viz_arguments(viz)
    viz.set_defaults(func=run_viz)

Examples::

    fxpipe viz --schedule interleaved --pp 4 --microbatches 8 --chunks 2
    fxpipe viz --schedule zb-h1 --pp 4 --microbatches 8 --durations 1,2,1 -o zb.png
    fxpipe viz --schedule 1f1b --pp 8 --microbatches 16 --p2p-latency 0.1 -o 1f1b.json
    fxpipe viz --schedule 1f1b --pp 4 --microbatches 8 --vocab-passes 0.6,1.2 -o vocab.png
"""
from __future__ import annotations

import argparse
import os
import sys

from fxpipe.schedules.lowering import lower
from fxpipe.schedules.registry import SCHEDULES, check_size, generate
from fxpipe.schedules.render import render_ascii, render_gantt, render_trace
from fxpipe.schedules.simulate import StageDurations, simulate
from fxpipe.schedules.validate import validate
from fxpipe.schedules.vocab_actions import place_vocab_passes, split_output_layer

"""Stage-microbatch pairs (p·v·m) ``viz`` simulates and prints: ~2.5 GB and a minute at the
limit (measured: p=64, m=1024 takes 0.5 GB and 7 s); beyond it memory runs out."""
"""The same for a PNG/SVG Gantt chart, one rectangle per action (8192 pairs: 0.45 GB, 5 s)."""


def _durations(text: str) -> tuple[float, float, float]:
    try:
        f, b, w = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--durations wants three numbers F,B,W (forward, full backward, its weight part), got {text!r}"
        ) from None
    return f, b, w


def _head(text: str) -> tuple[float, float]:
    try:
        f, b = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--vocab-passes wants two numbers F,B (the output layer's forward and backward), got {text!r}"
        ) from None
    return f, b


def add_viz_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``viz`` flags to ``parser``."""
    parser.add_argument("--schedule", required=True, metavar="NAME",
                        help=f"schedule name: {', '.join(SCHEDULES)}")
    parser.add_argument("--pp", type=int, required=True, metavar="P", help="pipeline-parallel size (ranks)")
    parser.add_argument("--microbatches", type=int, required=True, metavar="M", help="microbatches per step")
    parser.add_argument("--chunks", type=int, default=None, metavar="V",
                        help="stages per rank (default: 2 for interleaved and zb-v, else 1)")
    parser.add_argument("--durations", type=_durations, default=(1.0, 2.0, 1.0), metavar="F,B,W",
                        help="per-stage forward, full backward and weight-gradient times; split "
                             "schedules run I = B - W then W (default 1,2,1)")
    parser.add_argument("--p2p-latency", type=float, default=0.0, metavar="T",
                        help="time for a tensor to reach the next rank (default 0)")
    parser.add_argument("--vocab-passes", type=_head, default=None, metavar="F,B",
                        help="run the output layer (forward F, backward B, both part of the last stage's "
                             "--durations) as vocabulary passes on every rank, 1/p each (Yeung et al. 2025)")
    parser.add_argument("-o", "--output", default=None, metavar="FILE",
                        help="write a Gantt chart (.png, .svg) or a Perfetto trace (.json) "
                             "instead of printing the ASCII grid")


def run_viz(args: argparse.Namespace) -> int:
    """Run ``fxpipe viz``; returns the process exit code."""
    try:
        ext = os.path.splitext(args.output or "")[1].lower()
        if args.pp >= 1 and args.microbatches >= 1 and (args.chunks or 1) >= 1:  # else generate says why
            check_size(args.pp, args.microbatches, args.chunks, image=ext in (".png", ".svg", ".pdf"))
        schedule = generate(args.schedule, args.pp, args.microbatches, args.chunks)
        f, b, w = args.durations
        durations = StageDurations.uniform(schedule.num_stages, forward=f, backward=b, weight=w)
        if args.vocab_passes is not None:
            hf, hb = args.vocab_passes
            durations = split_output_layer(durations, schedule.num_ranks, forward=hf, backward=hb,
                                           weight=min(hb / 2, w))
            schedule = place_vocab_passes(schedule, durations, p2p_latency=args.p2p_latency)
        schedule = lower(schedule)
        validate(schedule)
        result = simulate(schedule, durations, p2p_latency=args.p2p_latency)
    except ValueError as exc:  # bad sizes, names or durations: say why, no traceback
        print(f"fxpipe viz: error: {exc}", file=sys.stderr)
        return 2
    if args.output is None:
        sys.stdout.write(render_ascii(result.timeline))
        return 0
    if ext == ".json":
        render_trace(result.timeline, args.output)
    elif ext in (".png", ".svg", ".pdf"):
        render_gantt(result.timeline, args.output)
    else:
        print(f"fxpipe viz: error: unknown output type {ext!r}; use .png, .svg, .pdf or .json",
              file=sys.stderr)
        return 2
    print(f"wrote {args.output}: {result.timeline.title}, makespan {result.makespan:g}, "
          f"bubble {max(result.bubble_fraction):.1%}, peak in flight {max(result.peak_in_flight)}")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_viz_arguments(p)
    p.set_defaults(fn=run_viz)

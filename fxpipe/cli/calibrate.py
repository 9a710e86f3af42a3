"""``fxpipe calibrate``: measure this machine's matmul, memory and gloo speeds."""
from __future__ import annotations

import argparse


def add_calibrate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output", default="fxpipe-hardware.json",
                   help="profile to write; pass it to --hardware (default: %(default)s)")
    p.add_argument("--name", default="cpu-measured", help="profile name (default: %(default)s)")
    p.add_argument("--threads", type=int, default=1,
                   help="intra-op threads per process while measuring, as the runs will use "
                        "(default: %(default)s)")
    p.add_argument("--no-distributed", action="store_true",
                   help="skip the 2-process gloo measurements (keep the CPU preset's links)")


def run_calibrate(args: argparse.Namespace) -> int:
    # loaded when the command runs, not on import: `fxpipe --help` stays quick
    from fxpipe.planner.machine_speeds import calibrate

    hw, measurements = calibrate(name=args.name, threads=args.threads,
                                 distributed=not args.no_distributed, log=print)
    hw.save(args.output, measurements)
    print(f"profile written to {args.output}; use it with --hardware {args.output}")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_calibrate_arguments(p)
    p.set_defaults(fn=run_calibrate)

"""``fxpipe compile | run | viz | plan`` — the command-line front end.

Each subcommand parses its flags here and hands a config to library code; no
compiler logic lives in this file.
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Sequence


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="gpt-tiny",
                   help="registry name (gpt-tiny, gpt-small, gpt2-small, gpt2-medium, gpt3-175b, "
                        "hf:gpt2, hf:llama, hf:gpt_neox, hf:opt) or package.module:function "
                        "returning (model, batch[, loss_fn]) (default: %(default)s)")
    p.add_argument("--batch", type=int, default=2, help="sequences per batch B (default: %(default)s)")
    p.add_argument("--seq", type=int, default=None,
                   help="sequence length s (default: the model's own maximum)")
    p.add_argument("--layers", type=int, default=None, help="override the number of layers")
    p.add_argument("--device", default=None,
                   help="device to build the model on; 'meta' allocates no weights "
                        "(default: meta for gpt2-medium and larger, else cpu)")


def _cmd_compile(args: argparse.Namespace) -> int:
    from fxpipe.capture import capture
    from fxpipe.models.registry import build_workload
    from fxpipe.passes import run_passes
    from fxpipe.report import compile_summary

    device = args.device or ("meta" if args.model in ("gpt2-medium", "gpt3-175b") else "cpu")
    start = time.perf_counter()
    workload = build_workload(args.model, batch=args.batch, seq=args.seq, device=device,
                              layers=args.layers)
    program = capture(workload.model, workload.example_inputs, workload.loss_fn)
    captured = time.perf_counter() - start
    program, timings = run_passes(program, None, skip=args.skip_pass, debug=args.debug)
    print(compile_summary(program, timings))
    print(f"capture      {captured:.2f} s on {device}")
    if args.graph:
        with open(args.graph, "w") as f:
            f.write(str(program.graph))
        print(f"graph text   written to {args.graph}")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    # Until the pipeline runtime lands, `run` compiles the embedded default and says so.
    print("fxpipe run: the distributed runtime is not built yet; compiling the default model "
          "instead (this is what `run` will train).", file=sys.stderr)
    return _cmd_compile(args)


def _cmd_plan(args: argparse.Namespace) -> int:
    print("fxpipe plan: the planner is not built yet (see the project's planner issue).",
          file=sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fxpipe", description="Compile and run an unmodified PyTorch model with tensor and "
                                   "pipeline parallelism.")
    sub = parser.add_subparsers(dest="command", metavar="{compile,run,viz,plan}")
    sub.required = True

    p = sub.add_parser("compile", help="capture a model, run the passes, print a summary")
    _add_model_args(p)
    p.add_argument("--graph", metavar="FILE", help="write the compiled ATen graph as text")
    p.add_argument("--skip-pass", action="append", default=[], metavar="NAME",
                   help="skip a pass by name (repeatable)")
    p.add_argument("--debug", action="store_true",
                   help="lint the graph and check invariants after every pass")
    p.set_defaults(fn=_cmd_compile)

    p = sub.add_parser("run", help="compile and train (the embedded default: a small GPT on CPU)")
    _add_model_args(p)
    p.set_defaults(fn=_cmd_run, model="gpt-small", graph=None, skip_pass=[], debug=False)

    p = sub.add_parser("viz", help="draw a pipeline schedule (ASCII, PNG/SVG Gantt, Perfetto JSON)")
    try:
        from fxpipe.schedules.cli import add_viz_arguments, run_viz
        add_viz_arguments(p)
        p.set_defaults(fn=run_viz)
    except ImportError:  # schedules package not present in this build
        p.set_defaults(fn=lambda a: _missing("viz"))

    p = sub.add_parser("plan", help="search tp/pp/dp layouts with the simulator")
    p.set_defaults(fn=_cmd_plan)
    return parser


def _missing(cmd: str) -> int:
    print(f"fxpipe {cmd}: not available in this build", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args) or 0)
    except (ValueError, TypeError) as exc:
        # User errors carry their own fix hint; no traceback for them.
        print(f"fxpipe {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

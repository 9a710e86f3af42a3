"""``fxpipe compile | run | viz | plan | calibrate | prepare-data`` — the command-line front end.

One module per subcommand; each parses its flags and hands a config to library
code. ``compile``'s and ``run``'s flags are generated from the config dataclasses
(``flags.py``): one definition, one default and one help text per field.
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from fxpipe.cli import calibrate, compile, plan, prepare_data, run, viz
from fxpipe.job.flags import positive_float, positive_int

__all__ = ["build_parser", "main", "positive_float", "positive_int"]

SUBCOMMANDS = {
    "compile": (compile, "capture a model, run the passes, print a summary", None),
    "run": (run, "compile and train (the embedded default: a small GPT on CPU)",
            "Train a model with tensor × pipeline × data parallelism on your data (--data) or the Python "
            "standard library's source as byte-level text. Without torchrun, starts tp·pp·dp local worker "
            "processes itself."),
    "viz": (viz, "draw a pipeline schedule (ASCII, PNG/SVG Gantt, Perfetto JSON)", None),
    "plan": (plan, "search tp/pp/dp layouts with the simulator", None),
    "calibrate": (calibrate, "measure this machine's matmul, memory and gloo speeds", None),
    "prepare-data": (prepare_data, "tokenize a corpus or dataset once, with every core, for fxpipe run",
                     "Tokenize text (.txt, .jsonl, directories) or a Hugging Face dataset (save_to_disk, "
                     "Parquet, Arrow) into the token cache fxpipe run memory-maps; a run on a prepared corpus "
                     "starts in the same time whatever its size."),
}


def build_parser() -> argparse.ArgumentParser:
    # allow_abbrev=False everywhere: `fxpipe plan --dp 4` must never be read as --dp-overlap
    parser = argparse.ArgumentParser(
        prog="fxpipe", allow_abbrev=False, description="Compile and run an unmodified PyTorch model with tensor and "
                                   "pipeline parallelism.")
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(SUBCOMMANDS) + "}")
    sub.required = True
    for name, (module, help_text, description) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=description, allow_abbrev=False)
        module.add_arguments(p)
        if name not in ("compile", "run"):  # compile and run have their own --debug
            p.add_argument("--debug", action="store_true", help="print the full traceback of an error")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # loaded when the command runs, not on import: `fxpipe --help` stays quick
    from fxpipe.compiler.capture import CaptureError

    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args) or 0)
    except (ValueError, TypeError, CaptureError, OSError) as exc:
        # User errors carry their own fix hint; the traceback only with --debug.
        if args.debug:
            raise
        print(f"fxpipe {args.command}: error: {_message(exc)}", file=sys.stderr)
        return 2


def _message(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.filename is not None:
        return f"{exc.strerror or type(exc).__name__}: {exc.filename}"
    return str(exc)

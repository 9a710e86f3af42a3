"""``fxpipe run``: train a model (every flag is a field of ``TrainConfig`` or its
``ParallelConfig``; ``--config FILE.toml`` holds the same keys)."""
from __future__ import annotations

import argparse
import dataclasses
import enum
import os

from fxpipe.job.config import TrainConfig
from fxpipe.job.flags import LAYOUT_FLAGS, TRAIN_FLAGS, add_flags, given, with_layout

DEFAULT = TrainConfig()
"""The embedded default: gpt-small on the standard library's source, tp=2 × pp=2."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE.toml", default=None,
                   help="read the run's settings from a TOML file whose keys are these flags' names "
                        "(lr-schedule = \"cosine\"); flags given here override it")
    add_flags(p, TRAIN_FLAGS, vars(DEFAULT))
    add_flags(p, LAYOUT_FLAGS, vars(DEFAULT.parallel))
    p.add_argument("--debug", action="store_true",
                   help="on failure, print every failed rank's full traceback (default: one line)")
    p.set_defaults(fn=run)


def resolve(args: argparse.Namespace) -> TrainConfig:
    """Defaults, then the config file, then the flags given."""
    # loaded when the command runs, not on import: `fxpipe --help` stays quick
    from fxpipe.job.config_file import read_config

    fields = read_config(args.config, {**TRAIN_FLAGS, **LAYOUT_FLAGS}) if args.config else {}
    fields.update(given(args, TRAIN_FLAGS))
    fields.update(given(args, LAYOUT_FLAGS))
    layout = {k: fields.pop(k) for k in list(fields) if k in LAYOUT_FLAGS}
    check_flags_by_name({**vars(DEFAULT.parallel), "chunks": None, **vars(DEFAULT), **layout, **fields})
    # val_fraction is derived from eval_interval when not given: resolved again, as chunks is.
    return dataclasses.replace(DEFAULT, parallel=with_layout(DEFAULT.parallel, layout),
                               **{"val_fraction": None, **fields})


def check_flags_by_name(values: dict) -> None:
    """``preflight.check_flags`` reads the flags by their names (messages name the flag)."""
    # loaded when the command runs, not on import: `fxpipe --help` stays quick
    from fxpipe.job.preflight import check_flags

    names = {f.field: f.key.replace("-", "_") for f in {**TRAIN_FLAGS, **LAYOUT_FLAGS}.values()}
    plain = lambda v: v.value if isinstance(v, enum.Enum) else v  # noqa: E731 (flags hold names)
    check_flags(argparse.Namespace(**{names.get(k, k): plain(v) for k, v in values.items()}))


def run(args: argparse.Namespace) -> int:
    # loaded when the command runs, not on import: `fxpipe --help` stays quick
    from fxpipe.job.launcher import launch
    from fxpipe.job.preflight import check_run

    config = resolve(args)
    # Everything checkable is checked here, before a worker starts (fxpipe/job/preflight.py).
    # Under torchrun every rank is a worker already: the model is captured by each anyway.
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    check_run(config, model=not under_torchrun)
    return launch(config, debug=args.debug)

"""``fxpipe run``: train a model (every flag is a field of ``TrainConfig`` or its
``ParallelConfig``; ``--config FILE.toml`` holds the same keys)."""
from __future__ import annotations

import argparse
import dataclasses
import enum

from fxpipe.job.config import TrainConfig
from fxpipe.job.flags import LAYOUT_FLAGS, TRAIN_FLAGS, add_flags, given, with_layout

DEFAULT = TrainConfig()
"""The embedded default: gpt-small on the standard library's source, on the layout the
search chooses for 4 ranks (the GPUs here on a GPU machine): ``fxpipe/job/layout_choice.py``."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE.toml", default=None,
                   help="read the run's settings from a TOML file whose keys are these flags' names "
                        "(lr-schedule = \"cosine\"); flags given here override it")
    add_flags(p, TRAIN_FLAGS, vars(DEFAULT))
    add_flags(p, LAYOUT_FLAGS, vars(DEFAULT.parallel))
    p.add_argument("--debug", action="store_true",
                   help="on failure, print every failed rank's full traceback (default: one line)")
    p.set_defaults(fn=run)


def _given(args: argparse.Namespace) -> dict:
    """The fields the config file and the flags give (the flags win): the file read once."""
    # loaded when the command runs, not on import: `fxpipe --help` stays quick
    from fxpipe.job.config_file import read_config

    fields = read_config(args.config, {**TRAIN_FLAGS, **LAYOUT_FLAGS}) if args.config else {}
    fields.update(given(args, TRAIN_FLAGS))
    fields.update(given(args, LAYOUT_FLAGS))
    return fields


def searched_layout(fields: dict) -> tuple[int, dict] | None:
    """(ranks, pinned fields) when the run's layout is to be searched: ``--world`` given,
    or no layout field given at all (then the default world; a memory saver given, such
    as ``--recompute full``, is kept); None: the layout as given."""
    # loaded when the command runs, not on import: `fxpipe --help` stays quick
    from fxpipe.job.layout_choice import default_world
    from fxpipe.planner.layout_space import LAYOUT_FIELDS, SEARCHED

    pinned = {k: v for k, v in fields.items() if k in SEARCHED}
    if fields.get("world") is not None:
        return fields["world"], pinned
    return (default_world(), pinned) if not set(pinned) & set(LAYOUT_FIELDS) else None


def resolve(args: argparse.Namespace) -> TrainConfig:
    """Defaults, then the config file, then the flags given."""
    return _resolve(args)[0]


def _resolve(args: argparse.Namespace) -> tuple[TrainConfig, tuple[int, dict] | None]:
    """The run's one ``TrainConfig`` and, when its layout is to be searched, (ranks, pins)."""
    fields = _given(args)
    search = searched_layout(fields)
    layout = {k: fields.pop(k) for k in list(fields) if k in LAYOUT_FLAGS}
    if layout.get("ep", 1) > 1 and search is not None:
        # ep is the search's pin (searched_layout); the layout it replaces keeps ep=1, so the
        # defaults (tp=2, dp=1) are no pins to refuse it by, and the global batch stays theirs.
        del layout["ep"]
    if fields.get("global_batch") and "micro_batch_size" not in fields and search is not None:
        # The search splits the global batch into dp·m·b: until it has, one microbatch of all
        # the rows per replica (dp and m as pinned, else 1) stands in for its choice.
        dp, m = layout.setdefault("dp", 1), layout.setdefault("num_microbatches", 1)
        if fields["global_batch"] % (dp * m) == 0:
            fields["micro_batch_size"] = fields["global_batch"] // (dp * m)
    check_flags_by_name({**vars(DEFAULT.parallel), "chunks": None, **vars(DEFAULT), **layout, **fields})
    # val_fraction is derived from eval_interval when not given: resolved again, as chunks is.
    config = dataclasses.replace(DEFAULT, parallel=with_layout(DEFAULT.parallel, layout),
                                 **{"val_fraction": None, **fields})
    return config, search


def check_flags_by_name(values: dict) -> None:
    """``preflight.check_flags`` on the settings by field name, enums by their names
    (as flags give them: messages name the flag)."""
    # loaded when the command runs, not on import: `fxpipe --help` stays quick
    from fxpipe.job.preflight import check_flags

    check_flags({k: v.value if isinstance(v, enum.Enum) else v for k, v in values.items()})


def run(args: argparse.Namespace) -> int:
    # loaded when the command runs, not on import: `fxpipe --help` stays quick
    from fxpipe.job.launcher import launch
    from fxpipe.job.preflight import check_run
    from fxpipe.runtime.launch import under_torchrun

    config, search = _resolve(args)
    # Everything checkable is checked here, before a worker starts (fxpipe/job/preflight.py).
    # Under torchrun every rank is a worker already: the model is captured by each anyway.
    if search is not None:  # files and data first: a bad path before minutes of search
        # loaded when the command runs, not on import: `fxpipe --help` stays quick
        from fxpipe.job.layout_choice import choose_run_layout

        check_run(config, model=False, config_file=args.config)
        config = choose_run_layout(config, *search)
    check_run(config, model=not under_torchrun(), config_file=args.config)
    return launch(config, debug=args.debug)

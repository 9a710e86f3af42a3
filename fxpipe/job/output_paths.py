"""One rule for every path ``fxpipe run`` writes: it never lands on a file the run reads,
nor inside a directory the run reads, nor (for a file) through a symbolic link.

Without it ``--metrics-file`` equal to the ``--data`` file appends JSON to the training
text, ``--export`` equal to it replaces the corpus with a checkpoint, ``--export`` into
the ``--init-from`` directory overwrites the initial weights, and a metrics file that is
a link appends to the link's target. Paths are compared after resolving links and
``..`` (``os.path.realpath``), so two spellings of one file are one file. The writers
themselves open files without following a link (``base/safe_io.open_output``), so a link
made after this check is refused too.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from fxpipe.base.safe_io import UnsafeFileError, check_regular
from fxpipe.job.preflight_files import PreflightError

if TYPE_CHECKING:
    from fxpipe.job.config import TrainConfig


def read_paths(config: "TrainConfig") -> list[tuple[str, str]]:
    """(flag, path) of every file or directory the run reads that exists."""
    named = [("--data", config.data), ("--tokenizer", config.tokenizer), ("--init-from", config.init_from),
             ("--model", config.model), ("--costs", config.parallel.costs), ("--hardware", config.parallel.hardware)]
    return [(flag, str(p)) for flag, p in named if p is not None and os.path.exists(p)]


def written_paths(config: "TrainConfig") -> list[tuple[str, str, bool]]:
    """(flag, path, is a file) of every output the run writes."""
    out: list[tuple[str, str, bool]] = []
    if config.metrics_file is not None:
        out.append(("--metrics-file", config.metrics_file, True))
    if config.timeline is not None:
        out += [("--timeline", config.timeline + ".json", True), ("--timeline", config.timeline + ".png", True)]
    if config.export is not None:
        export = Path(config.export)
        out.append(("--export", config.export, not (export.is_dir() or export.suffix == "")))
    for flag, d in (("--checkpoint-dir", config.checkpoint_dir), ("--tensorboard-dir", config.tensorboard_dir)):
        if d is not None:
            out.append((flag, str(d), False))
    return out


def _within(path: str, directory: str) -> bool:
    return os.path.commonpath([path, directory]) == directory


def check_outputs(config: "TrainConfig") -> None:
    """Refuse (one line, before any worker) an output that is a link, is a file the run
    reads, or lies inside a directory the run reads; and two outputs on one path."""
    reads = [(flag, path, os.path.realpath(path)) for flag, path in read_paths(config)]
    seen: dict[str, str] = {}
    for flag, path, is_file in written_paths(config):
        if is_file and os.path.islink(path):
            raise PreflightError(f"{flag} {path} is a symbolic link (to {os.readlink(path)}); fxpipe writes no output "
                                 f"through a link: give the path of the file itself")
        if is_file and os.path.lexists(path):
            try:  # a FIFO would block the writer, a device swallow the output
                check_regular(path, follow=False)
            except UnsafeFileError as exc:
                raise PreflightError(f"{flag} {exc}; give the path of a regular file (or a new one)") from None
        real = os.path.realpath(path)
        for in_flag, in_path, in_real in reads:
            if real == in_real:
                raise PreflightError(f"{flag} {path} is what {in_flag} reads ({in_path}); writing there would "
                                     f"destroy the run's input: choose another path")
            if os.path.isdir(in_real) and _within(real, in_real):
                raise PreflightError(f"{flag} {path} lies inside {in_path}, the directory {in_flag} reads; writing "
                                     f"there would change the run's input: choose a path outside it")
        if real in seen and seen[real] != flag:
            raise PreflightError(f"{flag} {path} is also where {seen[real]} writes; give each output its own path")
        seen[real] = flag

"""One rule for every path ``fxpipe run`` writes: it never lands on a file the run reads,
nor inside a directory the run reads, nor (for a file) through a symbolic link.

Without it ``--metrics-file`` equal to the ``--data`` file appends JSON to the training
text, ``--export`` equal to it replaces the corpus with a checkpoint, ``--export`` into
the ``--init-from`` directory overwrites the initial weights, and a metrics file that is
a link appends to the link's target. Inputs are registered once and compared by
identity (device and inode after links are resolved: a hard link or another spelling of
a file is that file; ``job/input_registry.py``). The writers themselves open files
without following a link and compare the opened descriptor with the inputs again
(``base/safe_io.open_output``), so a link or name planted after this check is refused too.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from fxpipe.base.safe_io import UnsafeFileError, check_regular
from fxpipe.job.input_registry import InputRegistry
from fxpipe.job.preflight_files import PreflightError

if TYPE_CHECKING:
    from fxpipe.job.config import TrainConfig


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
    for flag, d in (("--checkpoint-dir", config.checkpoint_dir), ("--tensorboard-dir", config.tensorboard_dir),
                    ("--data-cache", config.data_cache)):
        if d is not None:
            out.append((flag, str(d), False))
    return out


def check_outputs(config: "TrainConfig", config_file: str | None = None) -> None:
    """Refuse (one line, before any worker) an output that is a link, is a file the run
    reads, or lies inside a directory the run reads (by identity: ``job/input_registry.py``);
    and two outputs on one path."""
    inputs = InputRegistry.of(config, config_file)
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
        clash = inputs.clash(path, besides=flag)
        if clash is not None and clash[0] == "is":
            same = "" if os.path.realpath(path) == os.path.realpath(clash[1].path) else " (the same file by another name: a hard link)"
            raise PreflightError(f"{flag} {path} is what {clash[1].flag} reads ({clash[1].path}){same}; writing there "
                                 f"would destroy the run's input: choose another path")
        if clash is not None:
            raise PreflightError(f"{flag} {path} lies inside {clash[1].path}, the directory {clash[1].flag} reads; "
                                 f"writing there would change the run's input: choose a path outside it")
        real = os.path.realpath(path)
        if real in seen and seen[real] != flag:
            raise PreflightError(f"{flag} {path} is also where {seen[real]} writes; give each output its own path")
        seen[real] = flag

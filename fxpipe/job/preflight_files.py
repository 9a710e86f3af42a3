"""The file-system half of ``fxpipe run``'s preflight (``fxpipe/job/preflight.py``): every
path the job will write or read, checked in the launcher before a worker starts.

- **Writable, by a real write.** ``os.access`` answers from the permission bits, and
  for root it says yes to a read-only mount or a full disk. So a probe file is created
  (``O_EXCL``), written, fsynced and removed in the directory the job will write into
  (or the nearest one that exists, for a path still to be created); the error names
  the errno (``EROFS``, ``ENOSPC``, ``EACCES`` ...).
- **A checkpoint directory belongs to one run.** Without ``--resume`` a directory that
  already holds checkpoints is refused (a fresh run would replace their steps); with
  ``--overwrite`` the new run replaces them at its first save.
- **Resume from what will load.** The checkpoint a resume takes is chosen here as the
  workers will choose it (every digest verified, damaged ones skipped), and its
  manifest checked against the model and the LR schedule against the flags.
- **Weights.** ``--init-from``'s names, shapes and dtypes, from the files' headers.
"""
from __future__ import annotations

import errno
import math
import os
import tempfile
from pathlib import Path
from typing import Any

from fxpipe.checkpoint.dcp import candidates, local_problems, pick_intact, state_dict_names
from fxpipe.checkpoint.files import committed
from fxpipe.checkpoint.manifest import CorruptCheckpointError, read_manifest
from fxpipe.ir.program import Program
from fxpipe.job.config import TrainConfig
from fxpipe.params.hf_weights import WeightsDir
from fxpipe.params.rank_state import check_weights as check


class PreflightError(ValueError):
    """A problem found before spawning workers; the message is the whole report."""


# ---- writable --------------------------------------------------------------------------------
def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not os.path.lexists(path) and path != path.parent:
        path = path.parent
    return path


def _errno_text(exc: OSError) -> str:
    name = errno.errorcode.get(exc.errno or 0, type(exc).__name__)
    return f"{name}: {exc.strerror or exc}"


def probe_write(directory: Path) -> None:
    """Create, write, fsync and remove a file in ``directory``; raises OSError."""
    fd, name = tempfile.mkstemp(prefix=".fxpipe-probe-", dir=directory)
    try:
        os.write(fd, b"\0" * 4096)
        os.fsync(fd)  # a full disk may only say so when the block is allocated
    finally:
        os.close(fd)
        os.unlink(name)


def _probe(directory: Path, flag: str, path: Path, what: str) -> None:
    try:
        probe_write(directory)
    except OSError as exc:
        where = "" if directory == path.absolute() else f" (tried a file in {directory})"
        raise PreflightError(f"{flag} {path} cannot be written{where}: {_errno_text(exc)}; {what}") from None


def check_writable_dir(path: Path, flag: str, what: str) -> None:
    """``path`` is (or can be created as) a directory this process can write into."""
    base = _nearest_existing(path)
    if base == path.absolute() and not path.is_dir():
        raise PreflightError(f"{flag} {path} is a file, not a directory; {what}")
    if not base.is_dir():
        raise PreflightError(f"{flag} {path} cannot be created: {base} is a file; {what}")
    _probe(base, flag, path, what)


def check_writable_file(path: Path, flag: str) -> None:
    """A file can be created (or replaced) at ``path``; its directory must exist."""
    if path.is_dir():
        raise PreflightError(f"{flag} {path} is a directory; give a file path")
    parent = path.absolute().parent
    if not parent.is_dir():
        raise PreflightError(f"{flag} {path}: directory {parent} does not exist; create it first")
    _probe(parent, flag, path, "choose a path this user can write")


# ---- checkpoints -----------------------------------------------------------------------------
def check_owner(config: "TrainConfig") -> None:
    """Without --resume, the directory must hold no checkpoint (of any run): saving a
    fresh run there would replace their steps. --overwrite means it."""

    if config.resume or config.overwrite or not Path(config.checkpoint_dir).is_dir():
        return
    found = committed(config.checkpoint_dir)
    if not found:
        return
    steps = [s for s, _ in found]
    try:
        source = f"; {read_manifest(found[-1][1])['source']}"
    except CorruptCheckpointError:
        source = ""
    shown = ", ".join(map(str, steps[:6])) + (f" (+{len(steps) - 6} more)" if len(steps) > 6 else "")
    raise PreflightError(f"--checkpoint-dir {config.checkpoint_dir} already holds checkpoints of another run "
                         f"(steps {shown}{source}); add --resume to continue that run, --overwrite to replace "
                         f"its checkpoints, or choose another --checkpoint-dir")


def resume_path(config: "TrainConfig") -> Path:
    """The checkpoint the workers will resume from, chosen as they will choose it
    (``candidates`` / ``pick_intact``: every digest verified, damaged ones skipped)."""

    try:
        paths, notes = candidates(config.checkpoint_dir, config.resume_from)
        path, _ = pick_intact(paths, local_problems, strict=config.resume_from is not None, notes=notes)
    except (FileNotFoundError, CorruptCheckpointError) as exc:  # none at all / none intact
        raise PreflightError(f"--resume: {exc}") from None
    return path


def _show(names: list[str], limit: int = 4) -> str:
    return ", ".join(names[:limit]) + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


def check_resume(program: "Program", path: Path, config: "TrainConfig | None" = None) -> None:
    """The checkpoint to resume from must hold this model's tensors (by ``state_dict``
    name; shapes are checked by the workers against DCP's index when they load), and
    its LR schedule must be one this run's flags continue."""

    try:
        meta: Any = read_manifest(path)  # type-checked
    except CorruptCheckpointError as exc:
        raise PreflightError(f"--resume: {exc}") from None
    saved, source = set(meta["state_dict"]), meta["source"]
    ours = set(state_dict_names(program))
    missing, unexpected = sorted(ours - saved), sorted(saved - ours)
    if missing or unexpected:
        raise PreflightError(
            f"--resume: {path} was saved from another model ({source}, {len(saved)} tensors); "
            f"this model ({program.source}) has {len(ours)}: missing from the checkpoint: "
            f"{_show(missing) or 'none'}; not in this model: {_show(unexpected) or 'none'}. "
            f"Use the --model that saved it, or another --checkpoint-dir")
    if config is not None:
        try:
            check_schedule(meta["extra"], meta["step"], config.lr)
        except ValueError as exc:
            raise PreflightError(f"--resume: {path}: {exc}") from None


def _numbers(v: Any, n: int | None = None) -> bool:
    return isinstance(v, list) and (n is None or len(v) == n) and bool(v) and all(
        type(x) in (int, float) and math.isfinite(x) and x >= 0 for x in v)


def check_schedule(extra: dict, step: int, lr: float, groups: int | None = None) -> None:
    """``fxpipe run``'s LR scheduler state (LambdaLR, in the manifest's ``extra``)
    range-checked against the run: a base rate per parameter group equal to ``--lr``
    (LambdaLR.load_state_dict would silently replace the run's with it), the step
    count equal to the checkpoint's step, the last rate within [0, base]."""
    state = extra.get("lr_scheduler")
    if not isinstance(state, dict):
        raise ValueError("extra holds no 'lr_scheduler' state: it was not saved by fxpipe run")
    base, last = state.get("base_lrs"), state.get("_last_lr")
    if not _numbers(base, groups) or not all(x > 0 for x in base):
        raise ValueError(f"lr_scheduler.base_lrs must be {groups or 'one or more'} finite rates > 0, got "
                         f"{str(base)[:80]}")
    if any(not math.isclose(b, lr, rel_tol=1e-9) for b in base):
        raise ValueError(f"its learning-rate schedule has base rate {base[0]:g}, this run's --lr is {lr:g}; "
                         f"resume with --lr {base[0]:g}")
    if type(state.get("last_epoch")) is not int or state["last_epoch"] != step:
        raise ValueError(f"lr_scheduler.last_epoch is {str(state.get('last_epoch'))[:32]}, the checkpoint's "
                         f"step is {step}")
    if not _numbers(last, len(base)) or any(x > b * (1 + 1e-9) for x, b in zip(last, base)):
        raise ValueError(f"lr_scheduler._last_lr must be {len(base)} rates within [0, base rate], got "
                         f"{str(last)[:80]}")


# ---- weights ---------------------------------------------------------------------------------
def check_weights(program: "Program", directory: str) -> None:
    """--init-from: names, shapes and dtypes against the model, from the headers alone."""

    try:
        check(WeightsDir(directory), program, program.tp_specs)
    except (OSError, ValueError) as exc:
        raise PreflightError(f"--init-from: {exc}") from None

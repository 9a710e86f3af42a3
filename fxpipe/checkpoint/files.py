"""The on-disk side of checkpoints: step directories, the ``latest`` pointer, atomic
commits, and a DCP reader that never unpickles code.

    DIR/.lock                  held (flock) by the job using the directory (lock.py)
    DIR/latest                 "step_0000006": replaced atomically (write beside + os.replace)
    DIR/step_0000006/          a complete checkpoint: renamed from step_0000006.<job>.tmp only
        .metadata              DCP's index, written by DCP's coordinator after every rank's data
        __<rank>_0.distcp      DCP's data, one file per rank
        fxpipe.json            manifest: every file with its size and SHA-256, step, extra,
                               layout, state_dict names (manifest.py)
    DIR/step_0000009.<job>.tmp/           a save in progress, or one killed: ignored
    DIR/step_0000003.<job>.deleting.tmp/  a pruned checkpoint being removed: ignored

A kill -9 at any instant leaves either the old or the new set of complete
directories, because rename(2) of a directory within one filesystem is atomic
(POSIX), nothing is ever written into a directory that does not end in .tmp, and
nothing is deleted from one that does not either (pruning renames first). Only the
job holding the directory's lock removes ``*.tmp`` debris, so it is never another
live job's.

Nothing outside the directory is read or written through a link: ``latest``, the
manifest, DCP's index and data files are opened with ``O_NOFOLLOW`` and must be
regular files (``fxpipe/base/safe_io.py``), a ``step_N`` that is a symbolic link is never
a checkpoint (a resume names it as skipped), and ``.lock`` is refused if it is a link
(``lock.py``). Pruning deletes only this run's own checkpoints (the
manifest's ``run``), so a directory shared by mistake loses nothing to another run.
"""
from __future__ import annotations

import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import StorageMeta

from fxpipe.base.safe_io import UnsafeFileError, read_bounded
from fxpipe.checkpoint.lock import JOB_ID
from fxpipe.checkpoint.manifest import (CorruptCheckpointError, is_complete as _manifest_complete, read_manifest,
                                        why_incomplete as _why_incomplete)
from fxpipe.checkpoint.metadata import read_metadata

POINTER_FILE = "latest"
_STEP_DIR = re.compile(r"^step_(\d{7,})$")


def step_dirname(step: int) -> str:
    return f"step_{step:07d}"


def is_real_dir(path: Path) -> bool:
    """A directory, not a symbolic link to one (which could lead out of the checkpoint directory)."""
    return path.is_dir() and not path.is_symlink()


def is_complete(path: Path) -> bool:
    """A committed (renamed) step directory whose manifest's files are all present."""
    return bool(_STEP_DIR.match(path.name)) and is_real_dir(path) and _manifest_complete(path)


def list_checkpoints(directory: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints in ``directory`` as (step, path), oldest first; ``*.tmp`` are ignored."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and is_complete(p)]
    return sorted(found)


def committed(directory: str | os.PathLike) -> list[tuple[int, Path]]:
    """Every directory named ``step_N`` (renamed, so once complete), oldest first,
    complete or not: a resume reports the ones it skips."""
    root = Path(directory)
    if not root.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name))
                  and (p.is_dir() or p.is_symlink()))  # a link is listed, to be named when skipped


def read_pointer(directory: str | os.PathLike) -> tuple[Path | None, str | None]:
    """The step directory ``latest`` names, and what is wrong with the pointer (None
    if it is missing, which a kill before the first pointer write leaves, or usable).
    The pointer is read from disk: only a bare step directory name is followed (no
    path components, so it cannot point outside ``directory``), from a regular file of
    at most 256 bytes that is not a link (a FIFO or ``/dev/zero`` is refused at once)."""
    root = Path(directory)
    try:
        raw = read_bounded(root / POINTER_FILE, 256, follow=False)
    except (FileNotFoundError, NotADirectoryError):
        return None, None
    except UnsafeFileError as exc:
        return None, f"{exc}; ignored"
    except OSError as exc:
        return None, f"{root / POINTER_FILE} is unreadable ({exc})"
    name = raw.decode("ascii", "replace").strip()
    if not _STEP_DIR.match(name):
        return None, f"{root / POINTER_FILE} does not name a step directory ({name[:64]!r})"
    if (root / name).is_symlink():
        return None, f"{root / POINTER_FILE} names {name}, which is a symbolic link (not followed)"
    if not (root / name).is_dir():
        return None, f"{root / POINTER_FILE} names {name}, which does not exist"
    return root / name, None


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The checkpoint the ``latest`` pointer names, or the newest complete one if the
    pointer is missing or dangling (a kill between the rename and the pointer update)."""
    target, _ = read_pointer(directory)
    if target is not None and is_complete(target):
        return target
    found = list_checkpoints(directory)
    return found[-1][1] if found else None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Write beside, fsync, then os.replace: readers see the old file or the new one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    if tmp.is_symlink():
        tmp.unlink()  # a link planted under our temporary's name: never written through
    # O_NOFOLLOW: the temporary itself is never a link; os.replace then swaps the name
    # ``path`` (a link there is replaced, not followed).
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with open(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


class SafeReader(FileSystemReader):
    """DCP's reader, but ``.metadata`` is read by ``checkpoint_metadata.read_metadata``
    (exact allow-list unpickler + structural validation) instead of plain
    ``pickle.load``: together with DCP loading tensors with ``weights_only=True``, no
    code runs from the files."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("rank") is not None:
            raise ValueError("fxpipe checkpoints have one index (.metadata), not one per rank")
        metadata = read_metadata(self.path)
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def temporary(final: Path) -> Path:
    """This job's temporary directory for the save of ``final``."""
    return final.with_name(f"{final.name}.{JOB_ID}.tmp")


def remove_debris(root: Path) -> None:
    """Remove ``*.tmp`` left by killed saves and prunes. Only call while holding the
    directory's lock: then no other live job owns any of them."""
    for stale in root.glob("step_*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)


def commit(tmp: Path, final: Path) -> None:
    """rename(2) of a directory is atomic; an older save of the same step is moved
    aside first (as ``*.tmp``, so a kill in between leaves only ignored debris)."""
    if final.exists():
        aside = final.with_name(f"{final.name}.{JOB_ID}.replaced.tmp")
        os.rename(final, aside)
        os.rename(tmp, final)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _fsync_dir(final.parent)


_RUNS: dict[str, str] = {}
"""Resolved checkpoint directory -> the run this process saves there (rank 0's decides)."""


def run_id(directory: str | os.PathLike) -> str:
    """The run this process saves into ``directory`` as: the one it resumed from there
    (``adopt_run``), else a fresh random id, kept for the process's life."""
    return _RUNS.setdefault(str(Path(directory).resolve()), uuid.uuid4().hex[:16])


def adopt_run(directory: str | os.PathLike, run: str | None) -> None:
    """A resume continues the run that saved the checkpoint it loaded (older formats
    have none: the resumed job is then a run of its own)."""
    if run is not None:
        _RUNS[str(Path(directory).resolve())] = run


def run_of(path: Path) -> str | None:
    """The run that saved checkpoint ``path`` (None: unreadable manifest, or a format before runs)."""
    try:
        return read_manifest(path).get("run")
    except CorruptCheckpointError:
        return None


def _delete(root: Path, old: Path) -> None:
    """Renamed out of the ``step_N`` namespace (atomic), then deleted: a kill mid-deletion
    leaves ignored debris, never a half-deleted "complete" step."""
    doomed = old.with_name(f"{old.name}.{JOB_ID}.deleting.tmp")
    os.rename(old, doomed)
    _fsync_dir(root)
    shutil.rmtree(doomed, ignore_errors=True)


def prune(root: Path, keep_last: int, keep: Path, run: str) -> None:
    """Remove all but the newest ``keep_last`` complete checkpoints of ``run`` (never
    ``keep``). Another run's checkpoints are never pruned: a second job pointed at this
    directory by mistake must not delete the first one's."""
    own = [p for _, p in list_checkpoints(root) if run_of(p) == run]
    for old in own[:-keep_last]:
        if old != keep:
            _delete(root, old)


def remove_other_runs(root: Path, run: str, keep: Path) -> list[str]:
    """``--overwrite``: every committed step directory that is not ``run``'s (complete
    or not; links are left alone, they were never checkpoints). Returns their names."""
    gone = []
    for _, old in committed(root):
        if old != keep and is_real_dir(old) and run_of(old) != run:
            _delete(root, old)
            gone.append(old.name)
    return gone


def resolve(directory: str | os.PathLike, step: int | None) -> Path:
    root = Path(directory)
    path = latest_checkpoint(root) if step is None else root / step_dirname(step)
    if path is None or not is_complete(path):
        which = "no complete checkpoint" if step is None else f"no complete checkpoint for step {step}"
        if path is not None and path.is_symlink():
            why = f": {path} is a symbolic link; fxpipe does not follow links in a checkpoint directory"
        else:
            why = f": {_why_incomplete(path)}" if path is not None and path.is_dir() else ""
        steps = [s for s, _ in list_checkpoints(root)]
        raise FileNotFoundError(f"{which} in {root}{why} (complete: {steps or 'none'}); "
                                f"check --checkpoint-dir, or start without --resume")
    return path

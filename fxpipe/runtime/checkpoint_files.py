"""The on-disk side of checkpoints: step directories, the ``latest`` pointer, atomic
commits, and a DCP reader that never unpickles code.

    DIR/latest                 "step_0000006": replaced atomically (write beside + os.replace)
    DIR/step_0000006/          a complete checkpoint: renamed from step_0000006.tmp only
        .metadata              DCP's index, written by DCP's coordinator after every rank's data
        __<rank>_0.distcp      DCP's data, one file per rank
        fxpipe.json            step, extra, layout, state_dict names
    DIR/step_0000009.tmp/      a save in progress, or one killed: ignored, removed by the next save

A kill -9 at any instant leaves either the old or the new set of complete
directories, because rename(2) of a directory within one filesystem is atomic
(POSIX) and nothing is ever written into a directory that does not end in .tmp.
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import StorageMeta

from fxpipe.runtime.checkpoint_metadata import read_metadata

FORMAT = 1
META_FILE = "fxpipe.json"
POINTER_FILE = "latest"
_STEP_DIR = re.compile(r"^step_(\d{7,})$")


def step_dirname(step: int) -> str:
    return f"step_{step:07d}"


def is_complete(path: Path) -> bool:
    # Only a renamed (committed) directory counts; both files are written before the rename.
    return bool(_STEP_DIR.match(path.name)) and (path / META_FILE).is_file() and (path / ".metadata").is_file()


def list_checkpoints(directory: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints in ``directory`` as (step, path), oldest first; ``*.tmp`` are ignored."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and is_complete(p)]
    return sorted(found)


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The checkpoint the ``latest`` pointer names, or the newest complete one if the
    pointer is missing or dangling (a kill between the rename and the pointer update)."""
    root = Path(directory)
    try:
        name = (root / POINTER_FILE).read_text().strip()
    except (FileNotFoundError, NotADirectoryError):
        name = ""
    # The pointer is read from disk: only a bare step directory name is followed (no
    # path components, so it cannot point outside ``directory``).
    if _STEP_DIR.match(name) and is_complete(root / name):
        return root / name
    found = list_checkpoints(root)
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
    with open(tmp, "wb") as f:
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


def commit(tmp: Path, final: Path) -> None:
    """rename(2) of a directory is atomic; an older save of the same step is moved
    aside first (as ``*.tmp``, so a kill in between leaves only ignored debris)."""
    if final.exists():
        aside = final.with_name(final.name + ".replaced.tmp")
        os.rename(final, aside)
        os.rename(tmp, final)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _fsync_dir(final.parent)


def resolve(directory: str | os.PathLike, step: int | None) -> Path:
    root = Path(directory)
    path = latest_checkpoint(root) if step is None else root / step_dirname(step)
    if path is None or not is_complete(path):
        which = "no complete checkpoint" if step is None else f"no complete checkpoint for step {step}"
        steps = [s for s, _ in list_checkpoints(root)]
        raise FileNotFoundError(f"{which} in {root} (complete: {steps or 'none'}); "
                                f"check --checkpoint-dir, or start without --resume")
    return path

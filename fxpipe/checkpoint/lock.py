"""One job per checkpoint directory.

Two jobs writing one directory would delete each other's temporaries and race on
``latest``. Global rank 0 holds an exclusive ``flock(2)`` on ``DIR/.lock`` from its
first save or load in that directory until the process exits. The kernel drops the
lock when the process dies, however it dies (kill -9 included), so a lock left by a
dead job is recovered by simply taking it: no stale-pid heuristics. The file's
content (pid, host, start time) only serves the error message.

The lock file is opened with ``O_NOFOLLOW`` and must be a regular file: a ``.lock``
that is a symbolic link would otherwise be followed, and taking the lock truncates
and rewrites the file, whatever it points at. Such a directory is refused, naming
the link.

flock needs a filesystem that implements it across the hosts that share the
directory (local disks do; NFSv4 and Lustre do when mounted with locking).
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
import time
import uuid
from pathlib import Path

LOCK_FILE = ".lock"
JOB_ID = f"{os.getpid()}-{uuid.uuid4().hex[:6]}"
"""This process's job id: names its temporaries (``step_N.<job>.tmp``)."""

_HELD: dict[str, int] = {}  # resolved directory -> open lock file descriptor


class CheckpointLockError(RuntimeError):
    """The checkpoint directory is in use by another job."""


def _holder(fd: int) -> str:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        info = json.loads(os.read(fd, 4096) or b"{}")
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(info.get("started", 0))))
        return f"pid {int(info['pid'])} on {str(info['host'])[:64]}, since {since}"
    except (ValueError, KeyError, TypeError, AttributeError, OSError, RecursionError):
        return "another process"  # the content is only for the message: any junk is tolerated


def _open_lock(path: Path, flags: int) -> int:
    """``DIR/.lock`` opened without following a link, and only if it is a regular file."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CheckpointLockError(f"{path} is a symbolic link; fxpipe never writes through a link "
                                      f"in a checkpoint directory: remove it") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointLockError(f"{path} is not a regular file; remove it")
    return fd


def acquire(directory: str | os.PathLike) -> None:
    """Take the directory's lock for the rest of this process (idempotent)."""
    root = Path(directory)
    key = str(root.resolve())
    if key in _HELD:
        return
    root.mkdir(parents=True, exist_ok=True)
    fd = _open_lock(root / LOCK_FILE, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise CheckpointLockError(
            f"checkpoint directory {root} is in use by another fxpipe job ({holder}); wait for it to "
            f"finish or stop it, or choose another --checkpoint-dir") from None
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps(dict(pid=os.getpid(), host=socket.gethostname(), started=time.time(),
                                 job=JOB_ID)).encode())
    os.fsync(fd)
    _HELD[key] = fd


def check_free(directory: str | os.PathLike) -> None:
    """Raise ``CheckpointLockError`` if another process holds the lock (launcher preflight)."""
    root = Path(directory)
    if str(root.resolve()) in _HELD or not os.path.lexists(root / LOCK_FILE):
        return
    fd = _open_lock(root / LOCK_FILE, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise CheckpointLockError(
            f"checkpoint directory {root} is in use by another fxpipe job ({_holder(fd)}); wait for it "
            f"to finish or stop it, or choose another --checkpoint-dir") from None
    finally:
        os.close(fd)  # closing drops the shared lock just taken


def release(directory: str | os.PathLike) -> None:
    fd = _HELD.pop(str(Path(directory).resolve()), None)
    if fd is not None:
        os.close(fd)

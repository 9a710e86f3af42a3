"""Reading files from disk as hostile input: regular files only, bounded, no links
where the caller says none may be followed.

``Path.stat().st_size`` is 0 for a FIFO or a character device, so a size cap taken
from it lets ``/dev/zero`` through (read until memory runs out) and a FIFO blocks the
reader forever. Here a file is opened with ``O_NONBLOCK`` (opening a FIFO for reading
does not wait for a writer), checked with ``fstat`` on the descriptor that is then
read (no window between the check and the read), refused unless ``S_ISREG``, and read
with a cap that holds whatever ``st_size`` says. ``follow=False`` adds ``O_NOFOLLOW``:
the last path component may not be a symbolic link (ELOOP), for files inside a
directory fxpipe owns (a checkpoint), where a link could only lead outside it.

Every refusal is an ``UnsafeFileError`` (a ``ValueError``: a user error, printed in
one line by the CLI) naming the path and what it is.
"""
from __future__ import annotations

import errno
import os
import stat
from pathlib import Path


class UnsafeFileError(ValueError):
    """A file that is not a regular file, is a refused link, or is over its size cap."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str | os.PathLike, *, follow: bool = True) -> int:
    """A read-only descriptor of ``path``, which must be a regular file (and not a link
    unless ``follow``). FileNotFoundError passes through (callers decide what a
    missing file means)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow:
            raise UnsafeFileError(f"{path} is a symbolic link; fxpipe does not follow links here "
                                  f"(replace it with the file itself)") from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise UnsafeFileError(f"{path} is {_kind(mode)}, not a regular file")
    return fd


def read_bounded(path: str | os.PathLike, limit: int, *, follow: bool = True) -> bytes:
    """The bytes of regular file ``path``, refused if over ``limit`` bytes (the count is
    of what was read, not of ``st_size``, which a file growing meanwhile would outrun)."""
    fd = open_regular(path, follow=follow)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise UnsafeFileError(f"{path} is {size} bytes, over the {limit}-byte limit")
        chunks, total = [], 0
        while chunk := os.read(fd, min(1 << 20, limit + 1 - total)):
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise UnsafeFileError(f"{path} holds more than the {limit}-byte limit")
        return b"".join(chunks)
    finally:
        os.close(fd)


def check_regular(path: str | os.PathLike, *, follow: bool = True) -> os.stat_result:
    """``stat`` of ``path`` if it is a regular file (a link only with ``follow``)."""
    st = os.stat(path) if follow else os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeFileError(f"{path} is {_kind(st.st_mode)}, not a regular file")
    return st


def inside(path: str | os.PathLike, root: str | os.PathLike) -> bool:
    """True if ``path``, with every link resolved, lies inside ``root`` (resolved too)."""
    return Path(os.path.realpath(path)).is_relative_to(os.path.realpath(root))

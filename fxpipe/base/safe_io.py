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
import json
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


def read_json_object(path: str | os.PathLike, limit: int, *, follow: bool = True) -> dict:
    """The JSON object in regular file ``path`` (read under ``limit`` bytes, through a
    link only with ``follow``); a ValueError naming the file when it is not readable JSON
    or not an object."""
    try:
        doc = json.loads(read_bounded(path, limit, follow=follow))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"{path} is not readable JSON ({type(exc).__name__})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return doc


def check_regular(path: str | os.PathLike, *, follow: bool = True) -> os.stat_result:
    """``stat`` of ``path`` if it is a regular file (a link only with ``follow``)."""
    st = os.stat(path) if follow else os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeFileError(f"{path} is {_kind(st.st_mode)}, not a regular file")
    return st


def inside(path: str | os.PathLike, root: str | os.PathLike) -> bool:
    """True if ``path``, with every link resolved, lies inside ``root`` (resolved too)."""
    return Path(os.path.realpath(path)).is_relative_to(os.path.realpath(root))


def code_references(doc: object) -> list[str]:
    """The Python files a Hugging Face config or tokenizer config asks transformers to run:
    its ``auto_map`` (``"AutoConfig": "configuration_x.XConfig"`` → ``configuration_x.py``;
    a ``"repo--module.Class"`` form names the module in another repository)."""
    if not isinstance(doc, dict) or "auto_map" not in doc:
        return []
    entries = doc["auto_map"]
    values = entries.values() if isinstance(entries, dict) else [entries]
    names: list[str] = []
    for value in values:
        for ref in (value if isinstance(value, (list, tuple)) else [value]):
            if isinstance(ref, str) and ref:
                module = ref.split("--")[-1].rsplit(".", 1)[0]
                names.append(module + ".py")
    return sorted(set(names)) or ["(an auto_map entry)"]


def refuse_remote_code(doc: object, path: str | os.PathLike) -> None:
    """fxpipe never runs code from a model or tokenizer directory (``trust_remote_code``
    is always False): a config whose ``auto_map`` asks for some is refused, naming it."""
    files = code_references(doc)
    if files:
        raise UnsafeFileError(f"{path} asks to run custom code ({', '.join(files)}, via 'auto_map'); fxpipe never "
                              f"runs code from a model or tokenizer directory: use a model type transformers "
                              f"builds itself, or remove 'auto_map'")


def open_output(path: str | os.PathLike, *, append: bool = False, line_buffered: bool = True,
                forbidden: frozenset[tuple[int, int]] = frozenset()):
    """A text file opened for writing at ``path`` without following a link there (an
    output never lands on a link's target) and refused unless it is, or becomes, a
    regular file (a FIFO would block the writer, a device swallow or corrupt the output).
    ``forbidden``: (st_dev, st_ino) of the run's inputs (``job/input_registry.py``); the
    opened file is refused, before a byte is truncated or written, when it is one of them
    (a hard link, or a name swapped after the launcher's check)."""
    import fcntl

    flags = (os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
             | (os.O_APPEND if append else 0))
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeFileError(f"{path} is a symbolic link; fxpipe writes no output through a link "
                                  f"(give the path itself)") from None
        if exc.errno == errno.ENXIO:  # a FIFO with no reader
            raise UnsafeFileError(f"{path} is a FIFO, not a regular file") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise UnsafeFileError(f"{path} is {_kind(st.st_mode)}, not a regular file")
    if (st.st_dev, st.st_ino) in forbidden:
        os.close(fd)
        raise UnsafeFileError(f"{path} is a file this run reads (the same file: device {st.st_dev}, inode "
                              f"{st.st_ino}); fxpipe writes no output over an input")
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    if not append:
        os.ftruncate(fd, 0)
    return os.fdopen(fd, "a" if append else "w", buffering=1 if line_buffered else -1)

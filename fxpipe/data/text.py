"""Text data: ``.txt`` files, ``.jsonl`` files with a ``text`` field, or a directory of
them, read as documents (tokenized once into a cache: ``fxpipe/data/corpus.py``)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator

from fxpipe.base.safe_io import check_regular, read_bounded

TEXT_SUFFIXES = (".txt", ".jsonl")
MAX_TEXT_FILE = 4 << 30
"""One text file larger than this is refused (tokenize it into a .bin with your own tool)."""
TEXT_FIELD = "text"
"""The field of a .jsonl line holding the document (Hugging Face datasets' convention)."""
PIECE = 1 << 20
"""A document is encoded in pieces of at most this many characters (bytes for the byte
tokenizer), cut at whitespace: one 100 MB line handed to a tokenizer whole needs many
times its size in memory at once."""


def _walk(path: Path) -> Iterator[Path]:
    """The .txt/.jsonl files under directory ``path`` (hidden ones and hidden directories
    left out), sorted, links included."""
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            if Path(name).suffix in TEXT_SUFFIXES and not name.startswith("."):
                yield Path(dirpath) / name


def skipped_links(path: Path) -> list[Path]:
    """The .txt/.jsonl files under directory ``path`` that ``text_files`` leaves out because
    they are symbolic links (reported, never read)."""
    return [f for f in _walk(path) if f.is_symlink()] if path.is_dir() else []


def text_files(path: Path) -> list[Path]:
    """``path`` itself, or the .txt/.jsonl regular files under directory ``path`` in
    sorted order (links are not followed: a link could lead outside the data)."""
    if not path.is_dir():
        check_regular(path)
        if path.suffix not in TEXT_SUFFIXES:  # a .parquet or .pt read as text trains on its bytes
            raise ValueError(f"{path}: fxpipe reads text from .txt or .jsonl files, tokens from .bin or .npy "
                             f"files and datasets from .parquet or .arrow files (or a save_to_disk directory), "
                             f"not {path.suffix or 'a file without a suffix'}; convert it, or give a directory "
                             f"of .txt/.jsonl files")
        return [path]
    files = [f for f in _walk(path) if not f.is_symlink()]
    for f in files:
        check_regular(f)
    if not files:
        raise ValueError(f"{path} holds no .txt or .jsonl files; give a directory of text, or a "
                         f"token file (.bin, .npy)")
    return files


def documents(files: list[Path], text: bool = False) -> Iterator[tuple[str | bytes, int]]:
    """Each .txt file is one document; each line of a .jsonl file is one (its ``text``);
    each with the bytes of the file it was (for progress).
    ``text``: .txt documents as strings, for a tokenizer of text; a file that is not UTF-8
    is refused naming the file and the byte (it is never guessed at or replaced: a Latin-1
    file read as UTF-8 would train on U+FFFD). The byte tokenizer takes bytes as they are."""
    for f in files:
        data = read_bounded(f, MAX_TEXT_FILE)
        if f.suffix != ".jsonl":
            if not text:
                yield data, len(data)
                continue
            try:
                yield data.decode("utf-8"), len(data)
            except UnicodeDecodeError as exc:
                raise ValueError(f"{f}: byte {exc.start} ({data[exc.start:exc.start + 4]!r}...) is not UTF-8; save "
                                 f"the file as UTF-8 (e.g. iconv -f latin1 -t utf-8), or train on its bytes with the "
                                 f"byte tokenizer (no --tokenizer)") from None
            continue
        for lineno, line in enumerate(data.splitlines(), 1):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
                raise ValueError(f"{f}:{lineno} is not a JSON object ({type(exc).__name__})") from None
            body = doc.get(TEXT_FIELD) if isinstance(doc, dict) else None
            if not isinstance(body, str):
                raise ValueError(f"{f}:{lineno} has no string field {TEXT_FIELD!r}; each .jsonl line must be "
                                 f"an object like {{\"{TEXT_FIELD}\": \"...\"}}")
            yield body, len(line) + 1


def pieces(doc: str | bytes, limit: int = PIECE) -> list[str | bytes]:
    """``doc`` cut into pieces of at most ``limit``, each cut after the last whitespace
    before the limit (a hard cut where a piece has none)."""
    if len(doc) <= limit:
        return [doc]
    space = (" ", "\n") if isinstance(doc, str) else (b" ", b"\n")
    out, start = [], 0
    while len(doc) - start > limit:
        end = max(doc.rfind(space[0], start, start + limit), doc.rfind(space[1], start, start + limit)) + 1
        end = end if end > start else start + limit
        out.append(doc[start:end])
        start = end
    return out + [doc[start:]]

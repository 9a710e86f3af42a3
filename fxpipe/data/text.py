"""Text data: ``.txt`` files, ``.jsonl`` files with a ``text`` field, or a directory of
them, tokenized once into a token file cached beside the data.

The cache is keyed by content, not by name or date: its file name carries a digest of
every text file's relative path and bytes, the tokenizer's digest and this format's
version, so editing one file or changing tokenizer makes another cache, and a cache
is never stale. It is written to a temporary name and renamed, so a run killed while
tokenizing leaves no half file under the cache's name (and two ranks tokenizing at
once under torchrun write the same bytes).
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterator

import numpy as np

from fxpipe.base.safe_io import check_regular, open_regular, read_bounded
from fxpipe.data.tokenizer import ByteTokenizer, HFTokenizer
from fxpipe.data.tokens import TokenDtype, open_token_file

TEXT_SUFFIXES = (".txt", ".jsonl")
MAX_TEXT_FILE = 4 << 30
"""One text file larger than this is refused (tokenize it into a .bin with your own tool)."""
TEXT_FIELD = "text"
"""The field of a .jsonl line holding the document (Hugging Face datasets' convention)."""
CACHE_VERSION = b"fxpipe-tokens-v2"
_BATCH_DOCS = 1024
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
            raise ValueError(f"{path}: fxpipe reads text from .txt or .jsonl files and tokens from .bin "
                             f"or .npy files, not {path.suffix or 'a file without a suffix'}; convert it, "
                             f"or give a directory of .txt/.jsonl files")
        return [path]
    files = [f for f in _walk(path) if not f.is_symlink()]
    for f in files:
        check_regular(f)
    if not files:
        raise ValueError(f"{path} holds no .txt or .jsonl files; give a directory of text, or a "
                         f"token file (.bin, .npy)")
    return files


def content_digest(files: list[Path], root: Path, tokenizer_digest: str) -> str:
    """sha256 of the files' relative paths and bytes, the tokenizer and the format."""
    h = hashlib.sha256(CACHE_VERSION + b"\0" + tokenizer_digest.encode())
    for f in files:
        h.update(b"\0" + str(f.relative_to(root) if f != root else f.name).encode() + b"\0")
        fd = open_regular(f)
        try:
            while chunk := os.read(fd, 1 << 22):
                h.update(chunk)
        finally:
            os.close(fd)
    return h.hexdigest()


def documents(files: list[Path], text: bool = False) -> Iterator[str | bytes]:
    """Each .txt file is one document; each line of a .jsonl file is one (its ``text``).
    ``text``: .txt documents as strings, for a tokenizer of text; a file that is not UTF-8
    is refused naming the file and the byte (it is never guessed at or replaced: a Latin-1
    file read as UTF-8 would train on U+FFFD). The byte tokenizer takes bytes as they are."""
    for f in files:
        data = read_bounded(f, MAX_TEXT_FILE)
        if f.suffix != ".jsonl":
            if not text:
                yield data
                continue
            try:
                yield data.decode("utf-8")
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
            text = doc.get(TEXT_FIELD) if isinstance(doc, dict) else None
            if not isinstance(text, str):
                raise ValueError(f"{f}:{lineno} has no string field {TEXT_FIELD!r}; each .jsonl line must be "
                                 f"an object like {{\"{TEXT_FIELD}\": \"...\"}}")
            yield text


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


def tokenize(docs: Iterator[str | bytes], tokenizer: "ByteTokenizer | HFTokenizer",
             dtype: TokenDtype) -> np.ndarray:
    """Every document's ids followed by the tokenizer's EOS, as one flat array (a long
    document encoded piece by piece: ``pieces``)."""
    parts: list[np.ndarray] = []
    batch: list[tuple[str | bytes, bool]] = []
    eos = np.array([tokenizer.eos_id], dtype=dtype.value)

    def flush() -> None:
        for ids, (_, last) in zip(tokenizer.encode_batch([p for p, _ in batch]), batch):
            arr = np.frombuffer(ids, dtype=np.uint8) if isinstance(ids, bytes) else np.asarray(ids)
            parts.extend((arr.astype(dtype.value), eos) if last else (arr.astype(dtype.value),))
        batch.clear()

    for doc in docs:
        cut = pieces(doc)
        for i, piece in enumerate(cut):
            batch.append((piece, i == len(cut) - 1))
            if len(batch) == _BATCH_DOCS:
                flush()
    flush()
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype.value)


def cache_path(path: Path, digest: str, dtype: TokenDtype) -> Path:
    """Beside the data: ``.NAME.fxpipe-DIGEST.DTYPE.bin`` in the data's directory (for a
    directory of text, in its parent)."""
    return path.parent / f".{path.name}.fxpipe-{digest[:20]}.{dtype.value}.bin"


def cached_tokens(path: str | os.PathLike, tokenizer: "ByteTokenizer | HFTokenizer") -> tuple[np.ndarray, Path]:
    """The token ids of the text at ``path`` (tokenized now, or read from the cache)."""
    path = Path(path)
    files = text_files(path)
    dtype = TokenDtype.fitting(tokenizer.vocab_size)
    cache = cache_path(path, content_digest(files, path if path.is_dir() else path, tokenizer.digest), dtype)
    if _cache_intact(cache):
        return open_token_file(cache, dtype), cache
    tokens = tokenize(documents(files, text=isinstance(tokenizer, HFTokenizer)), tokenizer, dtype)
    if tokens.size == 0:
        raise ValueError(f"{path} holds no text")
    tmp = cache.with_name(f"{cache.name}.{os.getpid()}.tmp")
    try:
        _write_synced(tmp, lambda f: tokens.astype(np.dtype(dtype.value).newbyteorder("<")).tofile(f))
        os.replace(tmp, cache)
        # The payload's digest beside it, written last: a cache cut short (a crash, a full
        # disk) or edited no longer matches and is tokenized again, never trained on.
        side = _sum_path(cache)
        _write_synced(tmp, lambda f: f.write(_payload_digest(cache).encode()))
        os.replace(tmp, side)
    except OSError:
        tmp.unlink(missing_ok=True)
        return tokens, cache  # a read-only data directory: tokenized again next time
    return open_token_file(cache, dtype), cache


def _sum_path(cache: Path) -> Path:
    return cache.with_name(cache.name + ".sha256")


def _payload_digest(cache: Path) -> str:
    h = hashlib.sha256()
    fd = open_regular(cache, follow=False)
    with open(fd, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _cache_intact(cache: Path) -> bool:
    """The cache and its digest file are regular files (no links) and agree."""
    side = _sum_path(cache)
    try:
        expected = read_bounded(side, 128, follow=False).decode("ascii").strip()
        return expected == _payload_digest(cache)
    except (OSError, ValueError, UnicodeDecodeError):  # missing, a link, not regular, garbled
        return False


def _write_synced(tmp: Path, write) -> None:
    """``write(file)`` into a new ``tmp`` (never through a link), flushed to disk."""
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with open(fd, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())

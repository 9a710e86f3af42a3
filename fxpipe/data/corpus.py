"""A corpus — text files or a Hugging Face dataset — tokenized once, in parallel, into
a cached token file that every run then memory-maps (``fxpipe/data/token_cache.py``).

``fxpipe prepare-data`` calls ``tokenized`` ahead of a run with a progress bar;
``fxpipe run`` calls it in its preflight (tokenizing there, once, when no cache is
found) and in every rank (which then finds the cache by its key: a ``stat`` and a few
small reads per file). Two processes tokenizing at once write under their own
temporary names and rename: the cache's bytes are the same whichever lands last.
"""
from __future__ import annotations

import errno
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from fxpipe.data.encode_pool import encoded
from fxpipe.data.hf_dataset import check_dataset_dir, dataset_files, is_dataset, open_rows
from fxpipe.data.text import documents, text_files
from fxpipe.data.token_cache import CacheWriter, cache_base, fingerprint, open_cache
from fxpipe.data.tokenizer import ByteTokenizer, HFTokenizer
from fxpipe.data.tokens import TokenDtype, TokenStream

DEFAULT_COLUMN = "text"


@dataclass(frozen=True)
class Corpus:
    """What a cache is made from: the files its key covers, and how to read documents."""
    path: Path
    files: list[Path]
    dataset: bool
    column: str

    @property
    def root(self) -> Path:
        return self.path if self.path.is_dir() else self.path.parent

    def size(self) -> int:
        return sum(f.stat().st_size for f in self.files)


def open_corpus(path: str | os.PathLike, column: str = DEFAULT_COLUMN) -> Corpus:
    """Text (.txt/.jsonl or a directory of them) or a dataset (``fxpipe/data/hf_dataset.py``)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(2, "No such file or directory", str(path))
    if is_dataset(path):
        check_dataset_dir(path)  # no links, no text beside the dataset files
        return Corpus(path, dataset_files(path), True, column)
    return Corpus(path, text_files(path), False, column)


def tokenized(corpus: Corpus, tokenizer: "ByteTokenizer | HFTokenizer | None", *,
              cache_dir: str | os.PathLike | None = None, workers: int = 1,
              progress: Callable[[int, str, int], None] | None = None,
              verify: bool = False) -> tuple[TokenStream, Path]:
    """The corpus's token stream and its cache file: found by key, or tokenized now by
    ``workers`` processes and written. ``tokenizer`` None: the byte tokenizer for text; a
    dataset's id rows are taken as they are (no EOS added). ``progress(done,
    unit, total)`` is called as batches finish (units: bytes of text, or rows).

    The cache is found by a key of each file's path, size, mtime and *sampled* bytes
    (``token_cache.fingerprint``: a stat and a few reads per file, so a found cache costs
    no pass over the data); an edit between the samples that restores size and mtime is
    not seen. ``verify``: tokenize every byte again whatever is found, and replace the
    cache with the result (``prepare-data --verify``)."""
    if tokenizer is None and not corpus.dataset:
        tokenizer = ByteTokenizer()
    base = cache_path(corpus, tokenizer, cache_dir)
    found = None if verify else open_cache(base, str(corpus.path))
    if found is not None:
        return found, base.with_name(base.name + ".bin")
    return _tokenize(corpus, tokenizer, base, workers, progress, explicit=cache_dir is not None)


def cache_path(corpus: Corpus, tokenizer: "ByteTokenizer | HFTokenizer | None",
               cache_dir: str | os.PathLike | None) -> Path:
    """Where ``corpus``'s token cache is (without ``.bin``/``.json``), by its sampled key."""
    if tokenizer is None and not corpus.dataset:
        tokenizer = ByteTokenizer()
    key = fingerprint(corpus.files, corpus.root, f"{tokenizer.digest if tokenizer else 'none'}\0"
                      f"{corpus.column if corpus.dataset else ''}")
    return cache_base(corpus.path, key, cache_dir)


def _documents(corpus: Corpus, tokenizer: "ByteTokenizer | HFTokenizer | None") -> tuple[Iterator, int, str, bool]:
    """(documents, total units, unit, ids?) of the corpus."""
    if corpus.dataset:
        rows = open_rows(corpus.path, corpus.column)
        if not rows.ids and tokenizer is None:
            tokenizer = ByteTokenizer()
        return rows.documents(), rows.rows, "rows", rows.ids
    return documents(corpus.files, text=isinstance(tokenizer, HFTokenizer)), corpus.size(), "B", False


def _tokenize(corpus: Corpus, tokenizer, base: Path, workers: int, progress,
              explicit: bool = False) -> tuple[TokenStream, Path]:
    docs, total, unit, ids = _documents(corpus, tokenizer)
    encoder = tokenizer or ByteTokenizer()  # the text rows of a dataset given no tokenizer: bytes
    eos = (tokenizer.eos_id if tokenizer is not None else None) if ids else encoder.eos_id
    # Id rows without a tokenizer say nothing of their vocabulary: kept as uint32.
    vocab = encoder.vocab_size if tokenizer is not None or not ids else None
    dtype = TokenDtype.fitting(vocab) if vocab is not None else TokenDtype.UINT32
    done = 0

    def advance(n: int) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress(done, unit, total)

    counted = _counting(docs)
    try:
        base.parent.mkdir(parents=True, exist_ok=True)
        writer = CacheWriter(base, dtype, vocab)
    except OSError as exc:
        why = f"{errno.errorcode.get(exc.errno or 0, type(exc).__name__)}: {exc.strerror or exc}"
        if explicit:  # the directory the user chose: never a silent fallback
            raise ValueError(f"--data-cache {base.parent}: the token cache cannot be written there ({why}); "
                             f"choose a directory this user can write") from None
        # A read-only data directory and no --data-cache: tokenized in memory, and said so.
        print(f"fxpipe: the token cache of {corpus.path} cannot be written beside it in {base.parent} ({why}): "
              f"tokenized in memory, and again on every run; give --data-cache DIR to keep it",
              file=sys.stderr, flush=True)
        parts = list(encoded(counted, encoder, eos, np.dtype(dtype.value), workers, advance))
        tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=dtype.value)
        _check_tokens(corpus, tokens.size, counted.count, eos)
        return TokenStream(tokens, str(corpus.path), vocab), base.with_name(base.name + ".bin")
    try:
        for part in encoded(counted, encoder, eos, np.dtype(dtype.value), workers, advance):
            writer.append(part)
        writer.documents = counted.count
        _check_tokens(corpus, writer.count, counted.count, eos)
        payload = writer.commit(dict(path=str(corpus.path), files=len(corpus.files), column=corpus.column
                                     if corpus.dataset else None, tokenizer=getattr(tokenizer, "name", None)))
    except BaseException:
        writer.abort()
        raise
    stream = open_cache(base, str(corpus.path))
    if stream is None:  # written and renamed just now: only another process can have removed it
        raise OSError(f"{payload}: the token cache written just now cannot be read back")
    return stream, payload


def _check_tokens(corpus: Corpus, tokens: int, documents: int, eos: int | None) -> None:
    """Refuse a corpus with nothing to train on: no tokens, or (a dataset of empty rows)
    only the end-of-text marker each document ends with."""
    if tokens == 0:
        raise ValueError(f"{corpus.path} holds no text")
    if eos is not None and tokens <= documents:
        raise ValueError(f"{corpus.path} holds {documents:,} documents but no tokens besides their end-of-text "
                         f"markers (empty rows or files): training would learn only the marker; check the "
                         f"{'column ' + repr(corpus.column) if corpus.dataset else 'files'}")


class _counting:
    """Documents passed through, counted (the manifest records how many)."""

    def __init__(self, docs: Iterator) -> None:
        self.docs, self.count = docs, 0

    def __iter__(self):
        for d in self.docs:
            self.count += 1
            yield d


def cached_tokens(path: str | os.PathLike, tokenizer: "ByteTokenizer | HFTokenizer | None", *,
                  column: str = DEFAULT_COLUMN, cache_dir: str | os.PathLike | None = None,
                  workers: int = 1) -> tuple[np.ndarray, Path]:
    """The ids of the corpus at ``path`` and their cache file (``tokenized``), every block
    verified: for callers that take the ids whole."""
    stream, cache = tokenized(open_corpus(path, column), tokenizer, cache_dir=cache_dir, workers=workers)
    return stream.read(0, len(stream.tokens)), cache

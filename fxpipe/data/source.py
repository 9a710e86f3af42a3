"""``--data``, ``--val-data``/``--val-fraction``, ``--tokenizer``, ``--data-dtype``
resolved into the training and validation windows every rank reads."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from fxpipe.data.builtin import stdlib_stream
from fxpipe.data.corpus import DEFAULT_COLUMN, open_corpus, tokenized
from fxpipe.data.tokenizer import load_tokenizer
from fxpipe.data.tokens import TOKEN_SUFFIXES, TokenStream, open_token_file
from fxpipe.data.windows import PackedWindows


@dataclass(frozen=True)
class DataSource:
    train: PackedWindows
    val: PackedWindows | None
    """None: no validation (``--val-fraction 0`` and no ``--val-data``)."""
    tokenizer_vocab: int | None
    """The tokenizer's vocabulary (None for a token file read without ``--tokenizer``)."""


@dataclass(frozen=True)
class CorpusOptions:
    """How text and datasets are read and where their token cache goes."""
    column: str = DEFAULT_COLUMN
    """A dataset's text column (``--text-column``); ``input_ids`` is read where it has none."""
    cache_dir: str | None = None
    """Where token caches go (``--data-cache``; None: beside the data)."""
    workers: int = 1
    """Processes that tokenize a corpus not yet cached."""
    progress: Callable[[str, int, str, int], None] | None = None
    """``progress(path, done, unit, total)`` while a corpus is tokenized (None: silent)."""


def open_stream(path: str | None, tokenizer: str | None, dtype: str,
                options: CorpusOptions = CorpusOptions()) -> TokenStream:
    """One token stream: a token file as it is; text or a dataset through the tokenizer
    (bytes when none is given; a dataset's ids as they are); no path: the built-in corpus."""
    if path is None:
        return stdlib_stream()
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(2, "No such file or directory", str(p))
    tok = load_tokenizer(tokenizer) if tokenizer is not None else None
    if p.suffix in TOKEN_SUFFIXES and not p.is_dir():
        return TokenStream(open_token_file(p, dtype), str(p), tok.vocab_size if tok else None)
    report = options.progress
    stream, _ = tokenized(open_corpus(p, options.column), tok, cache_dir=options.cache_dir, workers=options.workers,
                          progress=(lambda done, unit, total: report(str(p), done, unit, total)) if report else None)
    return stream


def open_data(data: str | None, *, seq: int, val_data: str | None = None, val_fraction: float = 0.0,
              tokenizer: str | None = None, dtype: str = "uint16",
              options: CorpusOptions = CorpusOptions()) -> DataSource:
    """The windows of ``data`` (and of ``val_data``, or the last ``val_fraction`` of them)."""
    stream = open_stream(data, tokenizer, dtype, options)
    windows = PackedWindows(stream, seq)
    val = None
    if val_data is not None:
        val = PackedWindows(open_stream(val_data, tokenizer, dtype, options), seq)
    elif val_fraction > 0 and windows.count > 1:
        windows, val = windows.split(val_fraction)
    return DataSource(windows, val, stream.vocab_size)

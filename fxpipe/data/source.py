"""``--data``, ``--val-data``/``--val-fraction``, ``--tokenizer``, ``--data-dtype``
resolved into the training and validation windows every rank reads."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fxpipe.data.builtin import stdlib_stream
from fxpipe.data.text import cached_tokens
from fxpipe.data.tokenizer import ByteTokenizer, load_tokenizer
from fxpipe.data.tokens import TOKEN_SUFFIXES, TokenStream, open_token_file
from fxpipe.data.windows import PackedWindows


@dataclass(frozen=True)
class DataSource:
    train: PackedWindows
    val: PackedWindows | None
    """None: no validation (``--val-fraction 0`` and no ``--val-data``)."""
    tokenizer_vocab: int | None
    """The tokenizer's vocabulary (None for a token file read without ``--tokenizer``)."""


def open_stream(path: str | None, tokenizer: str | None, dtype: str) -> TokenStream:
    """One token stream: a token file as it is; text through the tokenizer (bytes when
    none is given); no path: the built-in corpus."""
    if path is None:
        return stdlib_stream()
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(2, "No such file or directory", str(p))
    tok = load_tokenizer(tokenizer) if tokenizer is not None else None
    if p.suffix in TOKEN_SUFFIXES and not p.is_dir():
        return TokenStream(open_token_file(p, dtype), str(p), tok.vocab_size if tok else None)
    tok = tok or ByteTokenizer()
    tokens, _ = cached_tokens(p, tok)
    return TokenStream(tokens, str(p), tok.vocab_size)


def open_data(data: str | None, *, seq: int, val_data: str | None = None, val_fraction: float = 0.0,
              tokenizer: str | None = None, dtype: str = "uint16") -> DataSource:
    """The windows of ``data`` (and of ``val_data``, or the last ``val_fraction`` of them)."""
    stream = open_stream(data, tokenizer, dtype)
    windows = PackedWindows(stream, seq)
    val = None
    if val_data is not None:
        val = PackedWindows(open_stream(val_data, tokenizer, dtype), seq)
    elif val_fraction > 0 and windows.count > 1:
        windows, val = windows.split(val_fraction)
    return DataSource(windows, val, stream.vocab_size)

"""Training text every machine has offline: the Python standard library's own source.

``fxpipe run`` without ``--data`` trains on it, through the same path as any text
(``fxpipe/data/encode_pool.py``'s tokenize, packed windows, per-replica shares): each .py
file is one document, the tokenizer is bytes (vocabulary 256, NUL between files), so
no tokenizer or download is needed.
"""
from __future__ import annotations

import os
import sysconfig

from fxpipe.data.encode_pool import tokenize
from fxpipe.data.tokenizer import ByteTokenizer
from fxpipe.data.tokens import TokenDtype, TokenStream

SOURCE = "the Python standard library's source"


def stdlib_documents(max_bytes: int = 8 << 20) -> list[bytes]:
    """The standard library's .py files, sorted by path (deterministic), up to ``max_bytes``."""
    root = sysconfig.get_paths()["stdlib"]
    docs, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "test", "tests", "__pycache__"))
        for fn in sorted(filenames):
            if not fn.endswith(".py"):
                continue
            try:
                with open(os.path.join(dirpath, fn), "rb") as f:
                    data = f.read(max_bytes - total)
            except OSError:
                continue
            docs.append(data)
            total += len(data)
            if total >= max_bytes:
                return docs
    if total == 0:
        raise RuntimeError(f"no Python source found under {root}")
    return docs


def stdlib_stream(max_bytes: int = 8 << 20) -> TokenStream:
    """The built-in corpus as a token stream (bytes, files separated by NUL)."""
    tokenizer = ByteTokenizer()
    tokens = tokenize(iter(stdlib_documents(max_bytes)), tokenizer, TokenDtype.UINT16)
    return TokenStream(tokens, SOURCE, tokenizer.vocab_size)

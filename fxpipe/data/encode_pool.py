"""Tokenizing with every core: documents cut into pieces, batches of pieces encoded by
worker processes, their ids handed back in order.

The reading and cutting stay in one process (they are I/O and ``str.rfind``); the
encoding, which is most of the time with a BPE tokenizer, runs in ``workers`` forked
processes. At most ``2 * workers`` batches are in flight, so memory stays a few
batches whatever the corpus. Forked workers inherit the tokenizer (no pickling) and
turn off the tokenizers library's own threads: one process per core is the
parallelism, and its Rust threads after a fork can deadlock.
"""
from __future__ import annotations

import multiprocessing
import os
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any, Callable, Iterator

import numpy as np

from fxpipe.data.text import pieces
from fxpipe.data.tokens import TokenDtype

TASK_CHARS = 4 << 20
"""Characters (bytes, ids) of input per task: large enough that a task's encoding outweighs
sending it, small enough that ``2 * workers`` of them are little memory."""
Piece = tuple["str | bytes | np.ndarray", bool]
"""A piece of a document (text, or ids already tokenized) and whether it ends one."""

_TOKENIZER: Any = None


Document = tuple["str | bytes | np.ndarray", int]
"""A document and the units of input it was (bytes of a file, one row of a dataset), for progress."""


def batches(documents: Iterator[Document], task: int | None = None) -> Iterator[tuple[list[Piece], int]]:
    """Documents cut into pieces (``pieces``: at whitespace, at most 1 MiB each) and grouped
    into batches of about ``task`` characters; ids pass whole. Each with its units of input."""
    task = task or TASK_CHARS  # read at call time (tests make it small)
    batch: list[Piece] = []
    size = units = 0
    for doc, doc_units in documents:
        cut = [doc] if isinstance(doc, np.ndarray) else pieces(doc)
        units += doc_units
        for i, piece in enumerate(cut):
            batch.append((piece, i == len(cut) - 1))
            size += len(piece)
            if size >= task or len(batch) >= 4096:
                yield batch, units
                batch, size, units = [], 0, 0
    if batch or units:
        yield batch, units


def encode_batch(tokenizer: Any, batch: list[Piece], eos: int | None, dtype: np.dtype) -> np.ndarray:
    """One batch's ids, ``eos`` after each document's last piece (None: ids rows taken as
    they are, as a token file's)."""
    texts = [p for p, _ in batch if not isinstance(p, np.ndarray)]
    encoded = iter(tokenizer.encode_batch(texts) if texts else [])
    parts = []
    tail = np.array([] if eos is None else [eos], dtype=dtype)
    for piece, last in batch:
        ids = piece if isinstance(piece, np.ndarray) else next(encoded)
        if isinstance(ids, np.ndarray) and ids.size and int(ids.max()) > np.iinfo(dtype).max:
            raise ValueError(f"token id {int(ids.max())} does not fit {np.dtype(dtype).name}: beyond the "
                             f"tokenizer's vocabulary; the ids were made with another tokenizer")
        arr = np.frombuffer(ids, dtype=np.uint8) if isinstance(ids, bytes) else np.asarray(ids)
        parts.append(arr.astype(dtype, copy=False))
        if last:
            parts.append(tail)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def _start_worker(tokenizer: Any) -> None:
    global _TOKENIZER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _TOKENIZER = tokenizer


def _encode_in_worker(batch: list[Piece], eos: int | None, dtype: np.dtype) -> np.ndarray:
    return encode_batch(_TOKENIZER, batch, eos, dtype)


def encoded(documents: Iterator[Document], tokenizer: Any, eos: int | None, dtype: np.dtype,
            workers: int = 1, progress: Callable[[int], None] | None = None) -> Iterator[np.ndarray]:
    """Each batch's ids in document order, encoded by ``workers`` processes (1: here).
    ``progress(n)`` is called with the units of input each batch held, once it is done."""
    if workers <= 1:
        for batch, units in batches(documents):
            yield encode_batch(tokenizer, batch, eos, dtype)
            if progress is not None:
                progress(units)
        return
    context = multiprocessing.get_context("fork")  # the workers inherit the tokenizer as it is
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_start_worker, initargs=(tokenizer,)) as pool:
        pending: deque[tuple[Future, int]] = deque()
        for batch, units in batches(documents):
            pending.append((pool.submit(_encode_in_worker, batch, eos, dtype), units))
            if len(pending) >= 2 * workers:
                yield from _finish(pending.popleft(), progress)
        while pending:
            yield from _finish(pending.popleft(), progress)


def tokenize(documents: Iterator["str | bytes"], tokenizer: Any, dtype: "TokenDtype") -> np.ndarray:
    """Every document's ids followed by the tokenizer's EOS, as one flat array in memory
    (a small corpus, here: the built-in one)."""
    parts = list(encoded(((d, 0) for d in documents), tokenizer, tokenizer.eos_id, np.dtype(dtype.value)))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype.value)


def _finish(item: tuple[Future, int], progress: Callable[[int], None] | None) -> Iterator[np.ndarray]:
    future, size = item
    yield future.result()
    if progress is not None:
        progress(size)

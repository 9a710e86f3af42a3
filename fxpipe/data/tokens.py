"""Flat token files: the stream of token ids a run trains on, memory-mapped.

Two formats, both a flat 1-D array of ids with documents already separated by the
tokenizer's EOS:
- ``.bin``: raw little-endian ``uint16`` or ``uint32`` (nanoGPT's ``train.bin`` and
  Megatron's ``.bin`` payload convention), read with ``numpy.memmap`` — the dtype
  is not in the file, so it comes from ``--data-dtype`` and must divide the size;
- ``.npy``: numpy's own header, mapped with ``allow_pickle=False`` (an object array
  would need pickle, which is never loaded from a file) and refused unless it is 1-D
  of an unsigned or signed integer type.

The file is hostile input: a regular file (``safe_io.check_regular``), never read
whole — ``numpy.memmap`` pages in only the windows a rank reads — and its largest id
is found in bounded chunks (``max_token``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from fxpipe.base.enums import NamedEnum
from fxpipe.base.safe_io import check_regular


class TokenDtype(NamedEnum, what="--data-dtype"):
    """Element type of a ``.bin`` token file (the file does not say)."""
    UINT16 = "uint16"
    """Vocabularies up to 65,536 (GPT-2's 50,257): nanoGPT's choice."""
    UINT32 = "uint32"
    """Larger vocabularies (Llama 3's 128,256)."""

    @classmethod
    def fitting(cls, vocab_size: int) -> "TokenDtype":
        """The smallest dtype that holds every id below ``vocab_size``."""
        return cls.UINT16 if vocab_size <= 1 << 16 else cls.UINT32


TOKEN_SUFFIXES = (".bin", ".npy")
_SCAN_CHUNK = 1 << 24
"""Ids read per chunk when scanning for the largest (64 MiB of uint32)."""


def open_token_file(path: str | os.PathLike, dtype: "str | TokenDtype" = TokenDtype.UINT16) -> np.ndarray:
    """The ids of a ``.bin`` or ``.npy`` token file as a read-only memory map. An empty
    file, a size the dtype does not divide, or an ``.npy`` that is not a 1-D integer
    array is a ``ValueError`` naming the numbers and the fix."""
    path = Path(path)
    size = check_regular(path).st_size  # FileNotFoundError passes through, as a missing file
    if path.suffix == ".npy":
        try:
            array = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, EOFError, OSError) as exc:  # EOFError: an empty or cut-off file
            raise ValueError(f"{path} is not a plain numpy array file ({exc or type(exc).__name__}); "
                             f"save the ids with numpy.save(path, ids) as a 1-D integer array") from None
        if not isinstance(array, np.ndarray):  # an .npz archive under a .npy name
            array.close()
            raise ValueError(f"{path} is a numpy archive (.npz), not one array; save the ids with "
                             f"numpy.save(path, ids) as a 1-D integer array")
        if array.ndim != 1 or array.dtype.kind not in "iu":
            raise ValueError(f"{path} holds a {array.ndim}-D {array.dtype} array; a token file is a 1-D "
                             f"integer array (numpy.save(path, ids.ravel().astype(numpy.uint32)))")
        if array.size == 0:
            raise ValueError(f"{path} holds no tokens")
        if array.dtype.kind == "i" and int(_scan(array, np.minimum.reduce)) < 0:
            raise ValueError(f"{path} holds negative token ids; ids are indices into the vocabulary")
        return array
    if path.suffix != ".bin":
        raise ValueError(f"{path}: a token file ends in .bin or .npy, got {path.suffix!r}")
    kind = TokenDtype.parse(dtype)
    itemsize = np.dtype(kind.value).itemsize
    if size == 0:
        raise ValueError(f"{path} is empty (0 bytes); it must hold the token ids")
    if size % itemsize:
        other = TokenDtype.UINT16 if kind is TokenDtype.UINT32 else TokenDtype.UINT32
        hint = f"--data-dtype {other.value}" if size % np.dtype(other.value).itemsize == 0 else \
            "check that the file is a flat array of token ids"
        raise ValueError(f"{path} is {size} bytes, not a multiple of {itemsize} ({kind.value}); "
                         f"it was not written as {kind.value}: {hint}")
    return np.memmap(path, dtype=np.dtype(kind.value).newbyteorder("<"), mode="r")


def _scan(array: np.ndarray, reduce) -> int:
    return int(reduce([reduce(array[i:i + _SCAN_CHUNK]) for i in range(0, len(array), _SCAN_CHUNK)]))


def max_token(array: np.ndarray) -> int:
    """The largest id in ``array``, read in bounded chunks (a memmap is never loaded whole)."""
    return _scan(array, np.maximum.reduce)


class BlockCheck(Protocol):
    """Verifies a token file's blocks as they are first read (``fxpipe/data/token_cache.py``)."""

    def check(self, tokens: np.ndarray, start: int, stop: int) -> None: ...


@dataclass(frozen=True)
class TokenStream:
    """The ids one run reads (training or validation) and where they came from."""
    tokens: np.ndarray
    """1-D ids, documents separated by ``eos`` (a memmap, or an array in memory)."""
    source: str
    """For messages: the path (or 'python standard library') the ids came from."""
    vocab_size: int | None = None
    """The tokenizer's vocabulary when known (the ids of a token file carry none)."""
    largest: int | None = None
    """The largest id when a prepared cache's manifest records it (its blocks are verified
    against the manifest as they are read, so the record holds for every id trained on);
    None: scanned (``max_token``)."""
    blocks: BlockCheck | None = field(default=None, repr=False, compare=False)
    """Verifies the blocks a read touches, once each (None: nothing to verify against)."""

    def read(self, start: int, stop: int) -> np.ndarray:
        """``tokens[start:stop]`` as an array, its blocks verified first."""
        if self.blocks is not None:
            self.blocks.check(self.tokens, start, stop)
        return np.asarray(self.tokens[start:stop])

    def largest_id(self) -> int:
        return self.largest if self.largest is not None else max_token(self.tokens)

    def scanned_largest_id(self) -> int:
        """The largest id read from the ids themselves, in bounded chunks — what the
        launcher checks against the model's vocabulary before any worker starts. A
        manifest's record is not evidence (whoever can edit the ids can rewrite the record
        and the block digests with them): a cache whose ids disagree with its record is
        refused as edited or damaged (``ValueError``)."""
        found = max_token(self.tokens)
        if self.largest is not None and found != self.largest:
            where = getattr(self.tokens, "filename", None) or self.source
            raise ValueError(f"the token cache {where} (of {self.source}) holds id {found}, but its manifest records "
                             f"{self.largest} as the largest: the cache was edited or damaged on disk; delete it and "
                             f"its .json (fxpipe prepare-data or the next run tokenizes the corpus again)")
        return found

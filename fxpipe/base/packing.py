"""Several tensors of different dtypes as one byte buffer, so that one collective moves
them all: a collective's latency (on gloo, its worker thread's round trips) is paid once,
not once per tensor (``runtime/head_blocks.py``'s broadcast of the head's input, targets
and token weights; ``compiler/vocab_placement.py`` prices it as one broadcast).

Each tensor's bytes start at a multiple of ``ALIGN`` bytes, so every part of the buffer
can be viewed back as its dtype without a copy."""
from __future__ import annotations

import math
from typing import Sequence

import torch

ALIGN = 8
"""Bytes each part starts at a multiple of: the widest element of a packed dtype."""


def _span(shape: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes a tensor of ``shape`` and ``dtype`` takes in the buffer, padding included."""
    nbytes = math.prod(shape) * dtype.itemsize
    return -(-nbytes // ALIGN) * ALIGN


def packed_nbytes(specs: Sequence[tuple[Sequence[int], torch.dtype]]) -> int:
    """Bytes of the buffer ``pack`` makes of tensors of these (shape, dtype)s."""
    return sum(_span(shape, dtype) for shape, dtype in specs)


def pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors' bytes in one uint8 buffer (``unpack`` reads them back)."""
    for t in tensors:
        if t.dtype.itemsize > ALIGN:
            raise ValueError(f"cannot pack {t.dtype}: elements of {t.dtype.itemsize} bytes (at most {ALIGN})")
    specs = [(t.shape, t.dtype) for t in tensors]
    buf = torch.zeros(packed_nbytes(specs), dtype=torch.uint8, device=tensors[0].device if tensors else None)
    at = 0
    for t, spec in zip(tensors, specs):
        nbytes = t.numel() * t.dtype.itemsize
        buf[at:at + nbytes] = t.detach().contiguous().reshape(-1).view(torch.uint8)
        at += _span(*spec)
    return buf


def unpack(buf: torch.Tensor, specs: Sequence[tuple[Sequence[int], torch.dtype]]) -> list[torch.Tensor]:
    """Views of ``buf`` as tensors of these (shape, dtype)s, as ``pack`` laid them out."""
    if buf.dtype != torch.uint8 or buf.numel() != packed_nbytes(specs):
        raise ValueError(f"a packed buffer of {packed_nbytes(specs)} uint8 bytes expected, got {buf.numel()} "
                         f"of {buf.dtype}")
    out, at = [], 0
    for shape, dtype in specs:
        nbytes = math.prod(shape) * dtype.itemsize
        out.append(buf[at:at + nbytes].view(dtype).view(tuple(shape)))
        at += _span(shape, dtype)
    return out

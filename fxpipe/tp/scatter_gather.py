"""Scatter-gather between pipeline stages (Narayanan et al., SC21 §4.1).

Without sequence parallelism a stage's output activation is replicated on its t
TP ranks, so sending it whole from every rank to its peer in the next stage
moves the same b·s·h values t times. Instead each TP rank sends only its 1/t
chunk and the receiving stage all-gathers over its TP group (fast NVLink):
inter-node bytes per rank drop from bsh to bsh/t.

The runtime wires these to its p2p sends and receives. The same holds for the
gradient going back (it is replicated too when the consumer is replicated).
"""
from __future__ import annotations

import math

import torch

from fxpipe.base.dtypes import itemsize
from fxpipe.tp.group import TPGroup


def _chunk_len(numel: int, tp: int) -> int:
    return math.ceil(numel / tp)


def scatter_chunk(t: torch.Tensor, tp_rank: int, tp: int) -> torch.Tensor:
    """This TP rank's 1-D chunk of the flattened ``t`` (zero-padded to a multiple of tp)."""
    if not 0 <= tp_rank < tp:
        raise ValueError(f"tp_rank={tp_rank} is not in [0, {tp})")
    flat = t.detach().reshape(-1)
    size = _chunk_len(flat.numel(), tp)
    chunk = flat[tp_rank * size:(tp_rank + 1) * size]
    if chunk.numel() < size:
        chunk = torch.cat([chunk, chunk.new_zeros(size - chunk.numel())])
    return chunk.contiguous()


def gather_chunks(chunk: torch.Tensor, group: TPGroup, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
    """Rebuild the full tensor of ``shape`` from every rank's chunk (all-gather)."""
    flat = group.all_gather(chunk.reshape(-1), 0)
    numel = math.prod(shape)
    assert flat.numel() >= numel, (flat.numel(), tuple(shape))
    return flat[:numel].reshape(shape)


def inter_stage_bytes(shape: tuple[int, ...], dtype: torch.dtype, tp: int, *,
                      scatter_gather: bool) -> int:
    """Bytes one TP rank sends for one stage-boundary activation (one microbatch).

    With scatter-gather each rank sends ceil(numel/t) elements, without it all of them."""
    numel = math.prod(shape)
    n = _chunk_len(numel, tp) if scatter_gather and tp > 1 else numel
    return n * itemsize(dtype)


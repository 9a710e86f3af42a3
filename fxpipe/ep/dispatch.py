"""Dispatch and combine: the two graph ops around a rank's experts.

The expert-parallel pass (``passes/expert_parallel.py``) puts them around the part of
a grouped MoE that runs the experts: that part reads tokens sorted by expert ``x``
(S, H) and the cumulative counts ``offs`` (E,) that say which rows belong to which
expert, and returns one row per input row. Because it is row-wise, the same part
runs unchanged on the tokens of other ranks:

    x_local, offs_local, route = ep_dispatch(x, offs, layer)   # my E/ep experts' tokens
    y_local = experts(x_local, offs_local, W[mine])             # the graph's own code
    y = ep_combine(y_local, route)                              # back to my rows, in order

Dispatch: this rank's per-expert counts (E,) are exchanged first (an equal-split
all-to-all: rank r gets every rank's counts for its experts), then the rows (uneven
splits: a rank's experts are contiguous in the sorted order, so the rows for rank r
are one slice). Received rows arrive source-major — (source, expert) — and are put
expert-major — (expert, source) — so every local expert's rows are contiguous, as
``offs_local`` says. Combine undoes the permutation and sends every row home.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fxpipe.ep.comm import all_to_all, current_expert_context


@dataclass(frozen=True)
class Route:
    """How one dispatch moved rows, for its combine."""
    send: tuple[int, ...]
    """Rows this rank sent to each rank of the group."""
    recv: tuple[int, ...]
    """Rows it received from each rank."""
    order: torch.Tensor
    """Received row (source-major) of each local row (expert-major)."""


def expert_major(counts: torch.Tensor) -> torch.Tensor:
    """``counts`` (P, L): rows from source s for local expert j, laid out source-major.
    Returns the source-major position of each row in expert-major order."""
    P, L = counts.shape
    flat = counts.flatten()
    start = (flat.cumsum(0) - flat).view(P, L).T.flatten()  # (L·P,) block starts, expert-major
    lengths = counts.T.flatten()
    block_start = torch.repeat_interleave(start, lengths)
    within = torch.arange(int(lengths.sum()), device=counts.device) - \
        torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths)
    return block_start + within


def ep_dispatch(x: torch.Tensor, offs: torch.Tensor, layer: int, *rows_alike: torch.Tensor) -> tuple:
    """This rank's tokens sorted by expert (``x``, rows of expert e up to ``offs[e]``) ->
    every rank's tokens for the experts this rank owns, grouped by local expert, their
    cumulative counts, the route back, and ``rows_alike`` (tensors with a row per row of
    ``x``, such as per-expert biases gathered per token) moved the same way. Counts
    tokens per expert for ``layer``."""
    ctx = current_expert_context()
    group = ctx.group
    P, E = group.size, offs.numel()
    assert E % P == 0, f"{E} experts over an expert group of {P}"  # checked by the pass's config
    L = E // P
    counts = torch.diff(offs.to(torch.int64), prepend=offs.new_zeros(1, dtype=torch.int64))  # (E,)
    ctx.record(layer, counts)
    got = group.all_to_all(counts, [L] * P, [L] * P).view(P, L)  # got[s, j]: from s for my expert j
    send = tuple(counts.view(P, L).sum(1).tolist())
    recv = tuple(got.sum(1).tolist())
    rows = all_to_all(x, send, recv, group)  # (Σ recv, H), source-major
    order = expert_major(got)
    offs_local = got.sum(0).cumsum(0).to(offs.dtype)
    moved = tuple(all_to_all(t, send, recv, group)[order] for t in rows_alike)
    return (rows[order], offs_local, Route(send, recv, order), *moved)


def ep_combine(y: torch.Tensor, route: Route) -> torch.Tensor:
    """The experts' output rows (expert-major, as ``ep_dispatch`` handed them out) ->
    this rank's rows in its own sorted order."""
    back = torch.empty_like(route.order)
    back[route.order] = torch.arange(route.order.numel(), device=route.order.device)
    return all_to_all(y[back], route.recv, route.send, current_expert_context().group)

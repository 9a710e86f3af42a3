"""Attention written in the forms that keep heads out of a dim of their own.

Three forms, each found from the channel layout, never from names:

- **Heads merged with the batch** (Bloom's ``[b·heads, s, d]`` views for ``baddbmm``
  with ALiBi): along the merged dim rank r holds rows ``o·n + r·m + j`` (every batch
  row ``o``, its heads block ``j < m``): a *strided block*. A replicated operand of that
  dim (the ALiBi bias, built per head from slopes) is narrowed by viewing the dim as
  ``(outer, n)`` and keeping block r of the inner part (``strided_blocks``).
- **Fused QKV picked by a constant index** (Falcon's ``fused[..., [-2], :]``): the
  constant index picks head rows; when every picked row of each rank is one it holds,
  the index is rewritten to one local (strided) slice of the rank's rows
  (``local_index``).
- **Multi-query fused QKV** (GPT-BigCode's ``c_attn`` = [q of all heads | one k | one v]):
  the query part is split by heads; the shared k/v part is cut into one block per
  rank, computed there and all-gathered after the projection (``split_shared``,
  ``SharedChannels``; ``gathered.py`` uses the same for a whole projection).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fxpipe.passes.tensor_parallel import graph_ops as G


def strided_blocks(held: tuple[np.ndarray, ...], full: int) -> tuple[int, int] | None:
    """``(outer, n)`` when rank r holds, along a dim of size ``full``, the rows
    ``{o·n + r·m + j : o < outer, j < m}`` with ``n = m·tp`` — the r-th block of the
    inner part once the dim is viewed as ``(outer, n)``; None for any other pattern.
    ``outer = 1`` is a plain contiguous block (the caller's ordinary scatter)."""
    tp = len(held)
    count = len(held[0])
    if full % tp or any(len(h) != count for h in held):
        return None
    for outer in range(2, full // tp + 1):
        if full % outer or count % outer:
            continue
        n, m = full // outer, count // outer
        if m * tp != n:
            continue
        base = (np.arange(outer)[:, None] * n + np.arange(m)[None, :]).ravel()
        if all(np.array_equal(h, base + r * m) for r, h in enumerate(held)):
            return outer, n
    return None


@dataclass(frozen=True)
class SharedChannels:
    """Output channels of a column-parallel projection that every rank uses whole (the one
    key/value head of multi-query attention inside a fused QKV linear). Each rank computes
    ``chunk`` of them, the r-th block; an all-gather makes them whole (``rewrite``). Its
    backward keeps the rank's block of the gradient: every consumer of a replicated value
    gives it the full gradient (f/scatter at the sharded consumers), so each rank's rows of
    the weight get their whole gradient, and its input-gradient share is summed by the
    projection's f like the split channels' — computing every shared row on every rank
    instead would count their input gradient tp times."""
    start: int
    """Local index of the first shared channel, in the rank's output and in the layout."""
    chunk: int
    """Shared channels computed per rank."""
    total: int


def split_shared(own: list[np.ndarray], shared: np.ndarray) -> tuple[list[np.ndarray], SharedChannels] | None:
    """Rows each rank holds when its ``own`` channels are joined by the r-th block of the
    ``shared`` ones (sorted full indices), and where they sit; None when tp does not divide
    them or the shared channels are not one run between the same own ones on every rank."""
    tp = len(own)
    if len(shared) % tp:
        return None
    chunk = len(shared) // tp
    held, starts = [], set()
    for r, mine in enumerate(own):
        block = shared[r * chunk:(r + 1) * chunk]
        rows = np.sort(np.concatenate([mine, block]))
        local = np.flatnonzero(np.isin(rows, block))
        before = int(np.searchsorted(mine, shared[0]))
        if not (np.array_equal(local, np.arange(before, before + chunk))
                and np.searchsorted(mine, shared[-1]) == before):
            return None  # own channels between the shared ones: no single run
        held.append(rows)
        starts.add(before)
    if len(starts) != 1:
        return None
    return held, SharedChannels(starts.pop(), chunk, len(shared))


MAX_INDEX = 1 << 16
"""Largest constant index read at compile time (a picked-rows table, not data)."""


def constant_values(node: object, constants: dict) -> np.ndarray | None:
    """The integer values of a graph constant (a lifted tensor, through copies/casts), or
    None: computed in the graph, not an integer tensor, or too large to read."""
    while getattr(node, "op", None) == "call_function" and node.target in G.SAME_LAYOUT:
        node = node.args[0]
    value = constants.get(getattr(node, "name", None))
    if value is None or value.is_floating_point() or value.is_complex() or value.numel() > MAX_INDEX:
        return None
    return value.detach().cpu().numpy().astype(np.int64)


def local_index(index: np.ndarray, size: int, held: tuple[np.ndarray, ...],
                out_held: tuple[np.ndarray, ...] | None) -> tuple[int, int, int] | None:
    """``x[..., index, ...]`` along a dim of ``size`` split over ranks (rank r holds rows
    ``held[r]``) as one local slice ``(start, stop, step)``, the same on every rank: each
    rank's picked rows (those of the output positions ``out_held[r]`` it holds; all of
    them when the output is not split there) must be rows it holds, evenly spaced in its
    shard (every third row of a per-head interleaved [q k v] layout). None: not
    expressible as one slice (left replicated)."""
    if index.ndim != 1 or index.size == 0:
        return None
    index = np.where(index < 0, index + size, index)
    found = set()
    for r, rows in enumerate(held):
        picked = index if out_held is None else index[out_held[r]]
        local = np.searchsorted(rows, picked)
        if (local >= len(rows)).any() or not np.array_equal(rows[np.minimum(local, len(rows) - 1)], picked):
            return None  # picks a row this rank does not hold
        step = int(local[1] - local[0]) if len(local) > 1 else 1
        if step < 1 or not np.array_equal(local, local[0] + step * np.arange(len(local))):
            return None
        found.add((int(local[0]), int(local[-1]) + 1, step))
    return found.pop() if len(found) == 1 else None

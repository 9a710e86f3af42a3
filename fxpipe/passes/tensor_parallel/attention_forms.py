"""Attention written in the forms that keep heads out of a dim of their own.

Three forms, each found from the channel layout, never from names:

- **Heads merged with the batch** (Bloom's ``[b·heads, s, d]`` views for ``baddbmm``
  with ALiBi): along the merged dim rank r holds rows ``o·n + r·m + j`` (every batch
  row ``o``, its heads block ``j < m``): a *strided block*. A replicated operand of that
  dim (the ALiBi bias, built per head from slopes) is narrowed by viewing the dim as
  ``(outer, n)`` and keeping block r of the inner part (``strided_blocks``).
- **Fused QKV picked by a constant index** (Falcon's ``fused[..., idx, :]``): the
  constant index picks head rows; when every picked row of each rank is one it holds,
  the index is rewritten to the rank's local rows (``local_index``).
- **Multi-query fused QKV** (GPT-BigCode's ``c_attn`` = [q of all heads | one k | one v]):
  the shared k/v part is computed by every rank, its weight gradients all-reduced
  (``placement``), while the query part is split by heads.
"""
from __future__ import annotations

import numpy as np


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

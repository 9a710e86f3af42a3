"""Local layouts: what each rank holds of every tensor, and whether the graph can say it.

Given the owner of every channel class, a tensor's elements on rank r are those
whose channels rank r owns (or that are replicated). The pass accepts a layout
only if, for every rank, that set is a product of index sets along the dims
(a "rectangular" shard) of the same size on all ranks: then the rank-local
tensor is the full one restricted to its indices in row-major order, and every
view, split or slice of it is the same op with rewritten constants. Anything
else raises :class:`LayoutFailure`, whose channels are then replicated.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fxpipe.passes.tensor_parallel.assign import ALL, Assignment


@dataclass(frozen=True)
class Layout:
    shape: tuple[int, ...]
    """Local shape, the same on every rank."""
    full: tuple[int, ...]
    sharded: tuple[int, ...] = ()
    """Dims split across ranks."""
    blocks: frozenset[int] = frozenset()
    """Sharded dims along which rank r holds the r-th contiguous block."""
    positions: tuple[tuple[np.ndarray, ...], ...] = ()
    """Per sharded dim (in ``sharded`` order), per rank, the full-tensor indices held."""
    vocab: bool = False
    """Sharded along a padded vocabulary (the last rank may hold padding)."""

    @property
    def is_sharded(self) -> bool:
        return bool(self.sharded)

    def held(self, dim: int, rank: int) -> np.ndarray:
        return self.positions[self.sharded.index(dim)][rank]


class LayoutFailure(Exception):
    """Channels ``ids`` cannot be sharded here; they will be replicated."""

    def __init__(self, ids: np.ndarray, reason: str) -> None:
        super().__init__(reason)
        self.ids = np.unique(np.asarray(ids).ravel())
        self.reason = reason


def is_sharded(lay: object) -> bool:
    """A Layout (or a list of them, for split-like nodes) that differs between ranks."""
    if isinstance(lay, list):
        return any(l.is_sharded for l in lay)
    return isinstance(lay, Layout) and lay.is_sharded


def replicated(full: tuple[int, ...]) -> Layout:
    return Layout(full, full)


def layout_of(ids: np.ndarray, full: tuple[int, ...], asg: Assignment, tp: int, where: str) -> Layout:
    """The local layout of a tensor of shape ``full`` whose channels are ``ids``."""
    owner = asg.owner(ids)
    if (owner == ALL).all():
        return replicated(full)
    members = [(owner == r) | (owner == ALL) for r in range(tp)]
    labels = asg.labels[ids]
    local, sharded, blocks, positions = list(full), [], set(), []
    vocab = False
    for d in range(ids.ndim):
        if ids.shape[d] == 1:
            continue
        other = tuple(i for i in range(ids.ndim) if i != d)
        held = [np.flatnonzero(m.any(axis=other)) for m in members]
        if all(len(h) == full[d] for h in held):
            continue
        counts = {len(h) for h in held}
        blocks_here = asg.block_of_label[labels[owner != ALL]]
        if blocks_here.size and blocks_here.min() > 0 and blocks_here.min() == blocks_here.max():
            size = int(blocks_here[0])
            if not all(np.array_equal(h, np.arange(r * size, min((r + 1) * size, full[d])))
                       for r, h in enumerate(held)):
                raise LayoutFailure(ids, f"vocabulary shards of {where} are not contiguous blocks")
            vocab = True
            if size * tp == full[d]:  # no padding: rank r holds the r-th of tp equal blocks
                blocks.add(d)
        elif len(counts) != 1:
            raise LayoutFailure(ids, f"{where} would hold {sorted(counts)} elements on different "
                                     f"ranks along dim {d}")
        else:
            size = counts.pop()
            if all(np.array_equal(h, np.arange(r * size, (r + 1) * size)) for r, h in enumerate(held)):
                blocks.add(d)
        local[d] = size
        sharded.append(d)
        positions.append(tuple(held))
    for r, m in enumerate(members):
        product = np.ones(ids.shape, dtype=bool)
        for d, held in zip(sharded, positions):
            sel = np.zeros(ids.shape[d], dtype=bool)
            sel[held[r]] = True
            product &= sel.reshape([-1 if i == d else 1 for i in range(ids.ndim)])
        if not np.array_equal(np.broadcast_to(m, ids.shape), product):
            raise LayoutFailure(ids, f"rank {r}'s part of {where} is not a rectangular shard")
    return Layout(tuple(local), full, tuple(sharded), frozenset(blocks), tuple(positions), vocab)


def local_range(layout: Layout, dim: int, start: int, stop: int, where: str,
                ids: np.ndarray) -> tuple[int, int]:
    """Local [a, b) of the full range [start, stop) along a sharded dim; the same on
    every rank, and contiguous in local coordinates, or the split is refused."""
    if layout.vocab:
        raise LayoutFailure(ids, f"{where} slices a vocabulary-parallel dim")
    found = set()
    for held in layout.positions[layout.sharded.index(dim)]:
        inside = np.flatnonzero((held >= start) & (held < stop))
        if len(inside) and not np.array_equal(inside, np.arange(inside[0], inside[-1] + 1)):
            raise LayoutFailure(ids, f"{where} takes a non-contiguous part of a shard")
        first = int(inside[0]) if len(inside) else int(np.searchsorted(held, start))
        found.add((first, first + len(inside)))
    if len(found) != 1:
        raise LayoutFailure(ids, f"{where} takes different parts of the shard on different ranks")
    return found.pop()

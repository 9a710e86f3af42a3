"""Channel-id arrays and the record of what the provenance analysis found: the data
both the analysis (``provenance.py``) and its per-op rules (``provenance_ops.py``,
``mixers.py``, ``writes.py``) work on, below all of them."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class AttentionUse:
    node: str
    q: np.ndarray
    """(H, D) ids of the query per head."""
    k: np.ndarray
    """(Hk, D) ids of the key per head (Hk = H after a repeat_kv expand)."""
    v: np.ndarray
    out: np.ndarray
    """(H, Dv) fresh ids of the output per head."""
    enable_gqa: bool


@dataclass
class Provenance:
    ids: dict[str, object] = field(default_factory=dict)
    """Node -> ids array (or a list of them for split-like nodes)."""
    n_ids: int = 0
    sources: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Projection / attention node -> (first id, count) of the ids it creates."""
    edges: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    poison: list[tuple[np.ndarray, str]] = field(default_factory=list)
    """(ids, reason): channels consumed where they cannot stay sharded."""
    rows: dict[str, np.ndarray] = field(default_factory=dict)
    """Projection -> ids along its contraction dim (1-D)."""
    attention: dict[str, AttentionUse] = field(default_factory=dict)
    losses: dict[str, np.ndarray] = field(default_factory=dict)
    """Cross-entropy node -> ids along the class dim (1-D)."""
    mixers: list[tuple[int, str]] = field(default_factory=list)
    """(an id, op) for every reduction that mixes channels: why a class cannot split."""
    statistics: dict[str, np.ndarray] = field(default_factory=dict)
    """Linear reduction (mean/sum) over channels only -> the channel ids it sums."""
    private: set[str] = field(default_factory=set)
    """Statistics whose input only their own norm reads (``norms.private_norm``)."""
    split_statistics: frozenset[str] = frozenset()
    broadcasts: dict[str, np.ndarray] = field(default_factory=dict)
    """Expand of a value whose channels vary along its last dim only, to copies along
    another dim -> the channel ids copied."""
    copies: frozenset[str] = frozenset()
    """Of those, the ones whose every copy gets ids of its own (``shared_copies``)."""
    constants: dict = field(default_factory=dict)
    """Placeholder -> value of the graph's constants (a fused QKV's picked-rows index)."""
    broadcast_whole: list[tuple[np.ndarray, str]] = field(default_factory=list)
    """(ids, node): channels an element-wise op broadcasts against other channels without
    uniting them (``mixers.combine``); they must stay whole on every rank."""
    """Of those, the ones whose channels stay split: a partial sum, all-reduced
    (``split_statistics``); the others unite their channels like any reduction."""

    def fresh(self, node: str, ids_shape: tuple[int, ...]) -> np.ndarray:
        count = int(np.prod(ids_shape))
        self.sources[node] = (self.n_ids, count)
        out = np.arange(self.n_ids, self.n_ids + count, dtype=np.int64).reshape(ids_shape)
        self.n_ids += count
        return out

    def union(self, a: np.ndarray, b: np.ndarray) -> None:
        a, b = np.broadcast_arrays(a, b)
        differ = a != b
        if differ.any():
            self.edges.append((a[differ].copy(), b[differ].copy()))

    def kill(self, ids: np.ndarray, reason: str) -> None:
        self.poison.append((np.unique(ids), reason))


def _align(ids: np.ndarray, ndim: int) -> np.ndarray:
    return ids.reshape((1,) * (ndim - ids.ndim) + ids.shape)


def reshape_groups(a: tuple[int, ...], b: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """Pair up runs of dims with equal products: (2,16,192) -> (32,192) gives
    ([0,1],[0]) and ([2],[1])."""
    groups, i, j = [], 0, 0
    while i < len(a) or j < len(b):
        ga, gb, pa, pb = [], [], 1, 1
        if i < len(a):
            ga.append(i); pa *= a[i]; i += 1  # noqa: E702
        if j < len(b):
            gb.append(j); pb *= b[j]; j += 1  # noqa: E702
        while pa != pb:
            if pa < pb:
                ga.append(i); pa *= a[i]; i += 1  # noqa: E702
            else:
                gb.append(j); pb *= b[j]; j += 1  # noqa: E702
        groups.append((ga, gb))
    return groups


def reshape_ids(ids: np.ndarray, in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> np.ndarray:
    """Move ids as a reshape moves data: each run of dims that carries channels is
    materialised and reshaped; runs without channels stay size 1."""
    src, dst = [1] * len(in_shape), [1] * len(out_shape)
    for ga, gb in reshape_groups(in_shape, out_shape):
        if any(ids.shape[d] > 1 for d in ga):
            for d in ga:
                src[d] = in_shape[d]
            for d in gb:
                dst[d] = out_shape[d]
    return _compact(np.broadcast_to(ids, src).reshape(dst))


def _compact(ids: np.ndarray) -> np.ndarray:
    """Size 1 along every dim the ids do not vary along: a view that merged batch with
    heads (Bloom's (B·H, T, D)) and split them again carries the heads only."""
    if ids.size == 0:
        return ids
    for d in range(ids.ndim):
        if ids.shape[d] > 1 and (ids == np.take(ids, [0], axis=d)).all():
            ids = np.take(ids, [0], axis=d)
    return ids


class _Unsupported(Exception):
    pass

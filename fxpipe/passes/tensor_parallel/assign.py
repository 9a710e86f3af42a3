"""Which TP rank owns each channel class.

A *class* is a connected set of channel ids (provenance unions, plus the
attention core: every channel of query head h, of output head h and, when k/v
heads are split, of the k/v head that h reads). Ranks are given the way
Megatron does (Shoeybi et al. 2019 §3): a row-parallel projection's input
channels are cut into tp contiguous blocks, so rank r gets heads
[r·a/t, (r+1)·a/t) or FFN channels [r·f/t, (r+1)·f/t); the column-parallel
projections that feed them follow their classes, wherever those rows sit in the
fused weight. A vocabulary-parallel LM head is cut into contiguous blocks of
the vocabulary padded to a multiple of tp. Every other class is replicated
(``ALL``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from fxpipe.passes.tensor_parallel.channel_ids import AttentionUse, Provenance

ALL = -1
"""Rank of a replicated class: every rank holds it."""


def components(n: int, edges: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """Connected-component label (smallest member id) of every id, vectorised."""
    labels = np.arange(n, dtype=np.int64)
    if not edges or n == 0:
        return labels
    a = np.concatenate([e[0] for e in edges])
    b = np.concatenate([e[1] for e in edges])
    while True:
        low = np.minimum(labels[a], labels[b])
        new = labels.copy()
        np.minimum.at(new, a, low)
        np.minimum.at(new, b, low)
        while True:  # pointer jumping: every id points at its component's current root
            jumped = new[new]
            if np.array_equal(jumped, new):
                break
            new = jumped
        if np.array_equal(new, labels):
            return labels
        labels = new


@dataclass(frozen=True)
class AttentionDecision:
    node: str
    heads: int
    kv_heads: int
    split_kv: bool
    """k/v heads sharded with their query heads; False: k/v projections replicated."""


@dataclass
class Assignment:
    labels: np.ndarray
    """Channel id -> class label."""
    class_rank: np.ndarray
    """Class label -> owning TP rank, or ALL."""
    vocab_block: dict[int, int] = field(default_factory=dict)
    """Class label -> rows per rank of its (padded) vocabulary."""
    rows: dict[str, str] = field(default_factory=dict)
    """Row-parallel projection -> 'attention' or 'mlp'."""
    vocab: dict[str, int] = field(default_factory=dict)
    """Vocabulary-parallel cross-entropy node -> vocabulary size."""
    attention: dict[str, AttentionDecision] = field(default_factory=dict)
    reasons: dict[int, str] = field(default_factory=dict)
    """Class label -> why it cannot be split (first reason found)."""

    @property
    def block_of_label(self) -> np.ndarray:
        """Class label -> vocabulary block size (0: not a vocabulary class)."""
        if getattr(self, "_blocks", None) is None:
            self._blocks = np.zeros(len(self.class_rank), dtype=np.int64)
            for label, size in self.vocab_block.items():
                self._blocks[label] = size
        return self._blocks

    def owner(self, ids: np.ndarray) -> np.ndarray:
        return self.class_rank[self.labels[ids]]


def _distinct_heads(ids: np.ndarray) -> int:
    # Heads repeated by a repeat_kv expand carry the same ids: count distinct rows.
    return len({tuple(sorted(row.ravel().tolist())) for row in ids})


def _attention_edges(use: AttentionUse, tp: int, describe: Callable[[str], str]
                     ) -> tuple[AttentionDecision, list[tuple[np.ndarray, np.ndarray]]]:
    heads, k_heads = use.q.shape[0], use.k.shape[0]
    kv = _distinct_heads(use.k)
    if use.enable_gqa:
        kv_of = [h // (heads // k_heads) for h in range(heads)]
    else:
        kv_of = list(range(heads))
    split = kv % tp == 0 and use.k.size > 0 and use.v.size > 0
    if not split and use.enable_gqa:
        raise ValueError(
            f"tensor parallelism: {describe(use.node)}: {kv} key/value heads must be split over "
            f"tp={tp} (the attention groups queries inside the kernel), and {kv} is not divisible "
            f"by {tp}; choose tp among {_divisors(kv)}")
    edges = []
    for h in range(heads):
        parts = [use.q[h].ravel(), use.out[h].ravel()]
        if split:
            parts += [use.k[kv_of[h]].ravel(), use.v[kv_of[h]].ravel()]
        ids = np.concatenate(parts)
        edges.append((np.full(len(ids) - 1, ids[0]), ids[1:]))
    return AttentionDecision(use.node, heads, kv, split), edges


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0][:8]


def assign(prov: Provenance, tp: int, extra_poison: list[tuple[np.ndarray, str]],
           describe: Callable[[str], str]) -> Assignment:
    """Give every class a rank. ``extra_poison`` (ids, reason) comes from layout
    checks that failed in an earlier round; ``describe(node)`` names a layer for errors."""
    edges = list(prov.edges)
    decisions = {}
    for use in prov.attention.values():
        decisions[use.node], more = _attention_edges(use, tp, describe)
        edges += more
    labels = components(prov.n_ids, edges)
    poisoned = np.zeros(prov.n_ids, dtype=bool)
    reasons: dict[int, str] = {}

    def kill(ids: np.ndarray, reason: str) -> None:
        lab = np.unique(labels[ids])
        for label in lab[~poisoned[lab]]:
            reasons.setdefault(int(label), reason)
        poisoned[lab] = True

    for ids, reason in prov.poison:
        kill(ids, f"its channels {reason}")
    for i, op in prov.mixers:  # not poison: a mixed class may still live whole on every rank
        reasons.setdefault(int(labels[i]), f"its output channels are mixed by {op}")
    for ids, reason in extra_poison:
        kill(ids, reason)

    attention_ids = np.zeros(prov.n_ids, dtype=bool)
    for use in prov.attention.values():
        first, count = prov.sources[use.node]
        attention_ids[first:first + count] = True

    while True:  # poisoning a class can invalidate a row decided before it: repeat
        class_rank = np.full(prov.n_ids, ALL, dtype=np.int64)
        vocab_block: dict[int, int] = {}
        rows: dict[str, str] = {}
        vocab: dict[str, int] = {}
        before = int(poisoned.sum())
        for node, ids in prov.rows.items():
            lab = labels[ids]
            if poisoned[lab].any():
                kill(ids, f"feed projection {node}, whose other input channels are replicated")
                continue
            if len(np.unique(lab)) == 1:
                continue  # one mixed class: a replicated input, not a row-parallel one
            kind = "attention" if attention_ids[ids].any() else "mlp"
            if kind == "mlp" and len(ids) % tp == 0:
                # Channel groups wider than one channel outside an SDPA core (heads of an
                # attention written as matmuls, k/v groups that tp does not divide): if
                # they straddle the blocks, they stay replicated, reported; not an error.
                owner = _blocks(lab, len(ids) // tp, tp, lambda: None)
                if owner is None:
                    kill(ids, f"feed projection {node} in {len(np.unique(lab))} groups (heads or "
                              f"key/value head groups) that tp={tp} cannot cut into equal blocks")
                    continue
            else:
                owner = _blocks(lab, len(ids) // tp if len(ids) % tp == 0 else 0, tp,
                                lambda: _split_error(node, ids, lab, kind, tp, describe))
            if _conflicts(class_rank, lab, owner):
                kill(ids, f"are claimed by two row-parallel projections ({node})")
                continue
            class_rank[lab] = owner
            rows[node] = kind
        for node, ids in prov.losses.items():
            lab = labels[ids]
            if poisoned[lab].any():
                kill(ids, f"feed {node} together with replicated logits")
                continue
            block = math.ceil(len(ids) / tp)
            owner = _blocks(lab, block, tp, lambda: None)
            if owner is None or _conflicts(class_rank, lab, owner):
                kill(ids, f"cannot be cut into vocabulary blocks for {node}")
                continue
            class_rank[lab] = owner
            for label in np.unique(lab):
                vocab_block[int(label)] = block
            vocab[node] = len(ids)
        for ids, node in prov.broadcast_whole:  # mixers.combine: broadcast, so whole
            lab = labels[ids]
            if ((class_rank[lab] != ALL) & ~poisoned[lab]).any():
                kill(ids, f"are broadcast against other split channels ({node})")
        if int(poisoned.sum()) == before:
            break
    class_rank[poisoned] = ALL
    return Assignment(labels, class_rank, vocab_block, rows, vocab, decisions, reasons)


def _blocks(lab: np.ndarray, block: int, tp: int, on_error: Callable[[], object]) -> np.ndarray | None:
    """Owner of each position when positions are cut into blocks of ``block``;
    every class must fall in one block, else ``on_error()`` (raises or returns None)."""
    if block > 0:
        owner = np.minimum(np.arange(len(lab)) // block, tp - 1)
        low = np.full(lab.max() + 1, tp, dtype=np.int64)
        high = np.full(lab.max() + 1, -1, dtype=np.int64)
        np.minimum.at(low, lab, owner)
        np.maximum.at(high, lab, owner)
        if np.array_equal(low[lab], high[lab]):
            return owner
    on_error()
    return None


def _conflicts(class_rank: np.ndarray, lab: np.ndarray, owner: np.ndarray) -> bool:
    prev = class_rank[lab]
    return bool(((prev != ALL) & (prev != owner)).any())


def _split_error(node: str, ids: np.ndarray, lab: np.ndarray, kind: str, tp: int,
                 describe: Callable[[str], str]) -> None:
    groups = len(np.unique(lab))
    width = len(ids)
    if kind == "attention":
        what = (f"{groups} attention heads (or key/value head groups) of {width // groups} "
                f"channels, {width} in all,")
        fix = f"choose tp dividing {groups}: {_divisors(groups)}"
    else:
        what = f"an FFN of size {width}"
        fix = f"choose tp dividing {width}: {_divisors(width)}"
    raise ValueError(f"tensor parallelism: {describe(node)} reads {what} which cannot be split "
                     f"evenly over tp={tp}; {fix}")

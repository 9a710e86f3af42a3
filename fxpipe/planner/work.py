"""Times of a piece of work for one microbatch, split by what the time is spent on."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping


class Component(enum.Enum):
    """Where iteration time goes; ``--explain`` compares layouts component by component."""
    GEMM = "gemm"
    """Matrix multiplies, attention bmm's included (roofline: compute or memory bound)."""
    ELEMENTWISE = "elementwise"
    """Memory-bound kernels (norms, GeLU, softmax, dropout, cross-entropy) and launches."""
    TP_COMM = "tp comm"
    """Tensor-parallel all-reduces (or all-gather + reduce-scatter with SP)."""
    RECOMPUTE = "recompute"
    """Forward work rerun in backward."""
    P2P = "p2p"
    """Stage-boundary sends (blocking on the sender) and scatter-gather's all-gather."""
    BUBBLE = "bubble"
    """Pipeline idle time of the critical rank."""
    DP_SYNC = "dp sync"
    """Exposed data-parallel gradient all-reduce (and the tied-embedding all-reduce)."""
    VOCAB_LOOKUP = "vocab lookup"
    """Vocabulary passes: the first microbatch's embedding lookup parts, sent point to
    point by the table's owners before the first stage's first forward (later ones are
    sent ahead and overlap; ``runtime/lookup_exchange.py``)."""
    OPTIMIZER = "optimizer"
    """The Adam step (memory bound)."""


def _frozen(d: Mapping[Component, float]) -> Mapping[Component, float]:
    return MappingProxyType({k: v for k, v in d.items() if v})


@dataclass(frozen=True)
class Work:
    """Forward and backward seconds by component, for one microbatch."""

    forward: Mapping[Component, float]
    backward: Mapping[Component, float]
    """The full backward B, recomputation included."""
    weight: float = 0.0
    """The part of ``backward`` that is weight-gradient GEMMs (zero bubble's W)."""

    @staticmethod
    def make(forward: Mapping[Component, float] | None = None,
             backward: Mapping[Component, float] | None = None, weight: float = 0.0) -> "Work":
        return Work(_frozen(forward or {}), _frozen(backward or {}), weight)

    @property
    def forward_s(self) -> float:
        return sum(self.forward.values())

    @property
    def backward_s(self) -> float:
        return sum(self.backward.values())

    def __add__(self, other: "Work") -> "Work":
        return Work.make(_add(self.forward, other.forward), _add(self.backward, other.backward),
                         self.weight + other.weight)

    def scaled(self, k: float) -> "Work":
        return Work.make({c: v * k for c, v in self.forward.items()},
                         {c: v * k for c, v in self.backward.items()}, self.weight * k)

    def total(self) -> dict[Component, float]:
        """Forward + backward by component."""
        return _add(self.forward, self.backward)


def _add(a: Mapping[Component, float], b: Mapping[Component, float]) -> dict[Component, float]:
    out = dict(a)
    for c, v in b.items():
        out[c] = out.get(c, 0.0) + v
    return out


ZERO = Work.make()

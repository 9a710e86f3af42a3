"""How much of the model the TP pass sharded: the line ``parallelize`` prints, the
error ``strict=True`` raises, and the per-rank parameter share ``fxpipe run`` reports.

A weight matrix is a trainable parameter of 2 dims or more that is not only a
lookup table indexed by positions (Megatron keeps those whole too). The share is
this rank's parameter count over the model's; every rank holds the same local
shapes, so it is also the largest rank's share (ideal 1/tp, a little more with
vocabulary padding and replicated norms/biases).
"""
from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass

from fxpipe.passes.tensor_parallel import graph_ops as G
from fxpipe.ir.shard_spec import ShardKind, ShardSpec
from fxpipe.ir.program import Program

TOP_REASONS = 3


@dataclass(frozen=True)
class TPCoverage:
    tp: int
    parameters: int
    """Trainable parameters of the whole model (tied groups once)."""
    local_parameters: int
    """Of those, how many this rank holds (padding rows included)."""
    whole: tuple[tuple[str, int, str], ...]
    """(name, numel, reason) of every weight matrix left whole on every rank."""

    @property
    def share(self) -> float:
        return self.local_parameters / self.parameters if self.parameters else 1.0

    @property
    def complete(self) -> bool:
        return not self.whole

    def reasons(self) -> list[tuple[int, str]]:
        """(count, reason) over the whole matrices, layer numbers and node names dropped."""
        counts = Counter(generic_reason(r) for _, _, r in self.whole)
        return [(n, r) for r, n in counts.most_common()]

    def describe(self) -> str:
        """One line: what stayed whole, the share against the ideal, the top reasons."""
        numel = sum(n for _, n, _ in self.whole)
        top = "; ".join(f"{n}× {r}" for n, r in self.reasons()[:TOP_REASONS])
        what = "weight matrix" if len(self.whole) == 1 else "weight matrices"
        return (f"tensor parallel: tp={self.tp} left {len(self.whole)} {what} "
                f"({_count(numel)} parameters) whole on every rank; this rank holds "
                f"{self.share:.2f} of the model's parameters (ideal {1 / self.tp:.2f}); "
                f"top reasons: {top}")


def generic_reason(reason: str) -> str:
    """A reason without layer numbers and graph node names, so that the same cause in
    every layer is counted once."""
    reason = re.sub(r"\.\d+\.", ".N.", reason)
    reason = re.sub(r"\blayer \d+", "layer N", reason)
    return re.sub(r" \(\w+\)", "", reason)


def measure_coverage(program: Program, specs: dict[str, ShardSpec], tp: int) -> TPCoverage:
    """``program``: the program the pass read (full shapes); ``specs``: its result."""
    nodes = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    users: dict[str, set] = {}
    for p in program.params:
        users.setdefault(p.canonical, set()).update(u.target for u in nodes[p.node].users)
    total = local = 0
    whole = []
    for p in program.trainable():
        spec = specs[p.canonical]
        total += p.numel
        local += math.prod(spec.local_shape)
        if spec.kind is ShardKind.REPLICATED and len(p.shape) >= 2 and \
                users.get(p.canonical) != {G.EMBEDDING}:
            whole.append((p.canonical, p.numel, spec.reason))
    return TPCoverage(tp, total, local, tuple(whole))


def _count(n: int) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)

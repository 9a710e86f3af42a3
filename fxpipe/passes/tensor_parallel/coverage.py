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

from fxpipe.ir.program import Program
from fxpipe.ir.shard_spec import ShardKind, ShardSpec
from fxpipe.ir.tp_result import TPCoverage
from fxpipe.passes.tensor_parallel import graph_ops as G


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



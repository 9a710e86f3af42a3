"""The cost model every method is scored with: exact seconds and bytes.

Per stage k (what is counted, and nothing else):

* **compute** = Σ (fwd + bwd) of its nodes.
* **communication.** A node u with ``out_bytes > 0`` placed at stage a whose
  consumers sit at stages b > a makes one transfer to each *distinct* consumer
  stage b; a skip connection goes straight from a to b, not through the stages
  in between. One transfer costs t_u = latency + out_bytes / bandwidth one way
  and is paid four times: forward, sender a and receiver b each spend t_u
  (Megatron's 1F1B p2p is blocking, so no overlap is assumed); backward, the
  gradient of the same size goes b -> a and both spend t_u again. So every
  transfer adds 2·t_u to stage a and 2·t_u to stage b. Consumers inside stage a
  cost nothing. Transfers between two stages on the same rank (interleaving)
  are charged like remote ones: conservative, and the stage modules still
  exchange them as explicit inputs.
* **time** = compute + communication; the bottleneck max_k time(k) sets the
  steady-state step time of a pipeline (Narayanan et al., SC21 §2.2).

Memory of rank r = Σ over its stages k of Σ_{n in k} static_bytes(n) +
inflight(k)·act_bytes(n). Received activations are not counted again: the
consumer's ``act_bytes`` already covers the inputs it saves for backward.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from fxpipe.partition.problem import PartitionProblem

# Each transfer is paid forward (activation) and backward (gradient) on each side.
DIRECTIONS = 2


@dataclass(frozen=True, kw_only=True)
class StageCost:
    """Predicted cost of one stage under the model above."""

    stage: int
    rank: int
    num_nodes: int
    layers: tuple[int, ...]
    """Distinct transformer-layer indices with at least one node in this stage."""
    params: int
    fwd_s: float
    bwd_s: float
    comm_s: float
    """Send + receive time, forward and backward (see module docstring)."""
    send_bytes: int
    """Bytes sent forward to later stages (one count per transfer)."""
    recv_bytes: int
    """Bytes received forward from earlier stages."""
    static_bytes: int
    act_bytes: int
    """Activation bytes per microbatch."""
    inflight: int
    memory_bytes: int
    """This stage's share of its rank's memory: static + inflight·act."""

    @property
    def compute_s(self) -> float:
        return self.fwd_s + self.bwd_s

    @property
    def time_s(self) -> float:
        return self.compute_s + self.comm_s


def transfers(problem: PartitionProblem, stages: Sequence[int]) -> list[tuple[int, int, int]]:
    """(producer node index, sender stage, receiver stage) for every transfer, sorted."""
    out = []
    for u, vs in enumerate(problem.succ):
        if problem.out_bytes[u] == 0:
            continue
        a = stages[u]
        out.extend((u, a, b) for b in sorted({stages[v] for v in vs if stages[v] > a}))
    return out


def evaluate(problem: PartitionProblem, stages: Sequence[int]) -> tuple[tuple[StageCost, ...], tuple[int, ...]]:
    """Per-stage costs and per-rank memory of a valid assignment (one stage per node)."""
    s = problem.num_stages
    t = problem.transfer_s
    comm = np.zeros(s)
    send = [0] * s
    recv = [0] * s
    for u, a, b in transfers(problem, stages):
        comm[a] += DIRECTIONS * t[u]
        comm[b] += DIRECTIONS * t[u]
        send[a] += problem.out_bytes[u]
        recv[b] += problem.out_bytes[u]
    members: list[list[int]] = [[] for _ in range(s)]
    for i, k in enumerate(stages):
        members[k].append(i)
    costs = []
    for k, idx in enumerate(members):
        static = sum(problem.static_bytes[i] for i in idx)
        act = sum(problem.act_bytes[i] for i in idx)
        costs.append(StageCost(
            stage=k, rank=problem.stage_to_rank[k], num_nodes=len(idx),
            layers=tuple(sorted({problem.layer[i] for i in idx} - {None})),
            params=sum(problem.params[i] for i in idx),
            fwd_s=float(problem.fwd_s[idx].sum()), bwd_s=float(problem.bwd_s[idx].sum()),
            comm_s=float(comm[k]), send_bytes=send[k], recv_bytes=recv[k],
            static_bytes=static, act_bytes=act, inflight=problem.inflight[k],
            memory_bytes=static + problem.inflight[k] * act))
    rank_memory = [0] * problem.num_ranks
    for c in costs:
        rank_memory[c.rank] += c.memory_bytes
    return tuple(costs), tuple(rank_memory)


def trivial_lower_bound_s(problem: PartitionProblem) -> float:
    """max(largest node, total compute / S): no assignment beats it (comm >= 0)."""
    c = problem.compute_s
    return float(max(c.max(), c.sum() / problem.num_stages))

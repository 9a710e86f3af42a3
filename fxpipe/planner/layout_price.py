"""What one compiled layout costs: the one price (``step_price.py``) on its captured graph.

``price(compiled)`` brings what the graph knows — the partition's stage times (each
node timed here or modelled), the tensor-parallel collectives and the expert-parallel
all-to-alls the graph runs (as rings on the links), the vocabulary passes' S and T as
timed, the stage-boundary transfer, each rank's parameters — and ``step_price`` composes
the step from them exactly as ``fxpipe plan`` does (the schedule simulated with the
runtime's fixed cost per action, the cores the ranks share, the data-parallel
synchronisation as the runtime overlaps it, the optimizer step); the memory is the
partition's per-rank model. The layout search (``planner/auto_layout.py``) ranks layouts
by it.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Sequence

import torch

from fxpipe.base.hardware import Collective, Hardware
from fxpipe.base.recompute_mode import RecomputeMode
from fxpipe.ep.dispatch import ep_combine, ep_dispatch
from fxpipe.ir.artifact import CompiledPipeline
from fxpipe.ir.parallel_config import ParallelConfig
from fxpipe.ir.program import Program
from fxpipe.planner.options import PlannerOptions
from fxpipe.planner.step_price import (ADAM_FP32_BYTES, dp_sync_s, optimizer_step_s, rank_finish, shared_cores_floor,
                                       step_collectives_s, step_s, with_action_overhead)
from fxpipe.planner.transfer_price import LookupWork, lookup_work, transfer_counts, with_transfers
from fxpipe.runtime.launch import local_world_size
from fxpipe.schedules.simulate import StageDurations, simulate


@dataclass(frozen=True)
class PricedLayout:
    """One layout and what the search predicts for it."""
    config: ParallelConfig
    step_s: float
    """Predicted seconds per training step: the simulated pipeline plus the dp all-reduce."""
    memory_bytes: int
    """The largest rank's predicted memory: training state plus activations in flight."""
    bubble: float
    """Simulated idle share of the step on the busiest pipeline rank (0 without a pipeline)."""
    allreduce_s: float
    """The data-parallel gradient all-reduce included in ``step_s``."""

    def describe(self) -> str:
        return describe(self.config)


def describe(c: ParallelConfig) -> str:
    """A layout in one line: ``tp=1 pp=2 dp=1 m=4 zb-v v=2 vocab-passes``."""
    what = f"tp={c.tp} pp={c.pp} dp={c.dp} m={c.num_microbatches}"
    if c.pp > 1:
        what += f" {c.schedule.value}" + (f" v={c.chunks}" if c.chunks > 1 else "")
        what += " vocab-passes" if c.vocab_passes else (" blockwise-loss" if c.split_loss else "")
    what += f" ep={c.ep}" if c.ep > 1 else ""
    what += " zero-1" if c.zero else ""
    what += " sp" if c.sp else ""
    return what + (f" recompute-{c.recompute.value}" if c.recompute is not RecomputeMode.NONE else "")


# The tensor-parallel ops (fxpipe/tp/ops.py) by the collective each runs forward and
# backward, with the tensor size it moves as a multiple of the op's output (the full,
# gathered size, as ``Hardware.collective_s`` takes it); the vocabulary-parallel loss
# all-reduces three fp32 statistics per token (max, sum-exp, target logit).
# ``True``: the moved tensor is the op's input, tp times its output (a reduce-scatter's
# input, a scatter's gradient).
_TP_FORWARD = {"reduce_from_tp": (Collective.ALL_REDUCE, False), "all_reduce_max": (Collective.ALL_REDUCE, False),
               "vocab_parallel_embedding": (Collective.ALL_REDUCE, False),
               "gather_seq": (Collective.ALL_GATHER, False), "reduce_scatter_seq": (Collective.REDUCE_SCATTER, True),
               "gather": (Collective.ALL_GATHER, False)}
_TP_BACKWARD = {"copy_to_tp": (Collective.ALL_REDUCE, False), "gather_seq": (Collective.REDUCE_SCATTER, False),
                "reduce_scatter_seq": (Collective.ALL_GATHER, True), "scatter": (Collective.ALL_GATHER, True)}
_LOSS_STATISTICS = 3


def tp_collective_times(program: Program, tp: int, hw: Hardware, num_stages: int,
                        skip: frozenset[str] = frozenset()) -> tuple[list[float], list[float]]:
    """Per stage, the seconds one microbatch's tensor-parallel collectives take forward and
    backward on the hardware's links (the cost pass prices compute, not these); the nodes
    in ``skip`` left out (the search's bound: the head's)."""
    fwd, bwd = [0.0] * num_stages, [0.0] * num_stages
    if tp == 1:
        return fwd, bwd
    per_node = hw.members_per_node(tp, 1)
    for node in program.graph.nodes:
        if node.op != "call_function" or getattr(node.target, "namespace", None) != "fxpipe_tp" \
                or node.name in skip:
            continue
        name, stage = node.target._schema.name.split("::")[1], program.stages.get(node.name, 0)
        out = program.costs[node.name].out_bytes if node.name in program.costs else 0
        if name == "vocab_parallel_cross_entropy":
            logits = node.args[0].meta["val"]
            tokens = logits.numel() // logits.shape[-1]
            fwd[stage] += _LOSS_STATISTICS * hw.collective_s(Collective.ALL_REDUCE, 4 * tokens, tp, per_node)
            continue
        for table, times in ((_TP_FORWARD, fwd), (_TP_BACKWARD, bwd)):
            if name in table:
                kind, of_input = table[name]
                times[stage] += hw.collective_s(kind, out * (tp if of_input else 1), tp, per_node)
    return fwd, bwd


def ep_collective_times(program: Program, hw: Hardware, num_stages: int, stride: int) -> tuple[list[float], list[float]]:
    """Per stage, the seconds one microbatch's expert-parallel all-to-alls take forward and
    backward: a dispatch moves its token rows (and the rows that travel with them) to the
    experts' owners, a combine moves the experts' output rows back; backward moves their
    gradients the other way (``ep/comm.py``). ``stride``: ranks between expert-group members."""
    fwd, bwd = [0.0] * num_stages, [0.0] * num_stages
    ep = program.expert_parallel.ep if program.expert_parallel is not None else 1
    if ep == 1:
        return fwd, bwd
    per_node = hw.members_per_node(ep, stride)
    size = lambda n: program.costs[n.name].out_bytes if n.name in program.costs else 0  # noqa: E731
    for node in program.graph.nodes:
        if node.op != "call_function" or node.target not in (ep_dispatch, ep_combine):
            continue
        moved = [node.args[0], *node.args[3:]] if node.target is ep_dispatch else [node.args[0]]
        t = hw.collective_s(Collective.ALL_TO_ALL, sum(size(a) for a in moved if hasattr(a, "name")), ep, per_node)
        stage = program.stages.get(node.name, 0)
        fwd[stage] += t
        bwd[stage] += t
    return fwd, bwd


def gradient_sync_s(compiled: CompiledPipeline, hw: Hardware, backward_s: Sequence[float] | None = None,
                    forward_s: Sequence[float] | None = None) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per pipeline rank, (its data-parallel gradient synchronisation, its optimizer step)
    in seconds (``step_price.dp_sync_s``, ``optimizer_step_s``), fp32 gradients: every
    replica sums the gradients of what it holds; under expert parallelism an expert's
    gradient only over the dp/ep replicas that hold that expert. ``backward_s``: each
    rank's last backward, behind which the dense buckets run (None: after it).
    ``forward_s``: each rank's first forward, behind which ZeRO-1's gather of the updated
    weights runs where the runtime waits for each weight at its first reader
    (``runtime/param_waits.py``; None: the gather is counted whole, as the search's bound,
    ``layout_bound.py``, takes it)."""
    config, program = compiled.config, compiled.program
    stages = program.partition.stages
    params = [sum(c.params for c in stages if c.rank == r) for r in range(config.pp)]
    experts = [0] * config.pp
    ep = program.expert_parallel
    if ep is not None and ep.ep > 1:
        ranks, nodes, seen = compiled.schedule.stage_ranks, {n.name: n for n in program.graph.nodes}, set()
        for p in program.params:
            if p.canonical in ep.specs and p.canonical not in seen and p.node in nodes:
                seen.add(p.canonical)
                stage = next((program.stages[u.name] for u in nodes[p.node].users if u.name in program.stages), 0)
                experts[ranks[stage]] += p.numel // ep.ep
    tied, union = _tied_bytes(compiled)
    tensors = _rank_tensors(compiled)
    members, zero = config.replicas, bool(config.zero)
    weight = config.precision.dtype.itemsize
    traffic = ADAM_FP32_BYTES if weight == 4 else PlannerOptions.optimizer_bytes_per_param
    hidden = backward_s if backward_s is not None and members > 1 else [None] * config.pp
    behind = forward_s if forward_s is not None else [0.0] * config.pp
    group = members // config.ep
    sync, step = [], []
    for r, (p, e, b, f) in enumerate(zip(params, experts, hidden, behind)):
        # A tied copy leaves the dp buckets: its pipeline sum and dp average are one
        # all-reduce over its ranks × the replicas (runtime/grad_sync.py), whose first
        # rank's copy — the embedding — is final only when that rank's backward ends: exposed.
        dense = dp_sync_s(hw, grad_bytes=max(0.0, 4 * (p - e) - tied[r]), weight_bytes=weight * (p - e), dp=members,
                          per_node=hw.members_per_node(members, config.tp), zero=zero,
                          backward_s=b or 0.0, bucket_mb=config.bucket_mb if b is not None else 0.0,
                          gather_hidden_s=f)
        # Expert stacks ride in the same buckets, on the replicas of the same experts.
        held = dp_sync_s(hw, grad_bytes=4 * e, weight_bytes=weight * e, dp=group,
                         per_node=hw.members_per_node(group, config.tp * config.ep), zero=False,
                         backward_s=b or 0.0, bucket_mb=config.bucket_mb if b is not None else 0.0)
        shared = sum(hw.collective_s(Collective.ALL_REDUCE, nbytes, n * members, hw.members_per_node(members, config.tp))
                     for nbytes, n in union[r])
        sync.append(dense + held + shared)
        dense_t, expert_t = tensors[r]
        step.append(optimizer_step_s(hw, p - e, dp=members, zero=zero, traffic_bytes=traffic, tensors=dense_t)
                    + optimizer_step_s(hw, e, dp=group, zero=False, traffic_bytes=traffic, tensors=expert_t))
    return tuple(sync), tuple(step)


def _rank_tensors(compiled: CompiledPipeline) -> list[tuple[int, int]]:
    """Per pipeline rank, (dense, expert) trainable parameter tensors the optimizer steps
    there: each tensor once per rank whose stages read it (a tied copy on every rank that
    holds one). Read off the partition, so a layout the search compiled only that far is
    priced as its full compile is: a table whose rows a later pass splits over the
    pipeline ranks (``passes/vocab_rows.py``) counts on every rank that reads it."""
    config, program = compiled.config, compiled.program
    ranks, nodes = compiled.schedule.stage_ranks, {n.name: n for n in program.graph.nodes}
    experts = program.expert_parallel.specs if program.expert_parallel is not None else {}
    held: list[dict[str, bool]] = [{} for _ in range(config.pp)]
    for p in program.params:
        if not p.requires_grad or p.node not in nodes:
            continue
        for user in nodes[p.node].users:
            if user.name in program.stages:
                held[ranks[program.stages[user.name]]][p.canonical] = p.canonical in experts
    return [(sum(not e for e in h.values()), sum(h.values())) for h in held]


def _tied_bytes(compiled: CompiledPipeline) -> tuple[list[float], list[list[tuple[float, int]]]]:
    """Per pipeline rank: fp32 gradient bytes of the tied tensors (read by stages on several
    pipeline ranks) its partition count includes — each once, on the rank of the first
    stage reading it (``assign_stages``) —, and (bytes, pipeline ranks holding it) of each
    tied tensor it holds: the union all-reduces it joins."""
    pp, plan, program = compiled.config.pp, compiled.plan, compiled.program
    counted: list[float] = [0.0] * pp
    union: list[list[tuple[float, int]]] = [[] for _ in range(pp)]
    if plan is None:
        return counted, union
    for p in program.params:
        stages = plan.tied_stages.get(p.canonical, ())
        ranks = sorted({compiled.schedule.stage_to_rank(s) for s in stages})
        if len(ranks) < 2:
            continue
        counted[compiled.schedule.stage_to_rank(min(stages))] += 4.0 * p.numel
        for r in ranks:
            union[r].append((4.0 * p.numel, len(ranks)))
    return counted, union


def price(compiled: CompiledPipeline, hardware: Hardware | None = None, *,
          concurrent: int | None = None, vocab_passes_s: tuple[float, float] | None = None,
          lookups: Sequence[LookupWork] | None = None,
          lookup_parts: dict[tuple, tuple[float, float]] | None = None) -> PricedLayout:
    """Predicted step time and memory of a compiled layout (module docstring), on
    ``hardware`` (default: the one its partition was priced on). ``concurrent``: how many
    ranks can compute at once on the machine (None: each has a device of its own); fewer
    than the world and the ranks' summed compute time-shares what there is.
    ``vocab_passes_s``: one vocabulary pass S and T as timed (``vocab_passes_here``),
    instead of the head's share of the partition's times. ``lookups``: the layout's
    row-split embedding lookups (``transfer_price.py``; None: read off its plan, none
    without one), ``lookup_parts``: their parts as timed (else the cost model)."""
    config, program = compiled.config, compiled.program
    result = program.partition
    hw = hardware or program.partition_config.hardware
    stages = result.stages
    if compiled.vocab_timing is not None:
        timing = compiled.vocab_timing
        durations, p2p, collective = timing.durations, timing.p2p_latency, timing.collective_latency
        if vocab_passes_s is not None:
            pp = len(durations.vocab_forward)
            durations = dataclasses.replace(durations, vocab_forward=(vocab_passes_s[0],) * pp,
                                            vocab_backward=(vocab_passes_s[1],) * pp)
    else:
        backward = tuple(c.bwd_s for c in stages)
        durations = StageDurations(forward=tuple(c.fwd_s for c in stages), backward=backward,
                                   weight=tuple(b / 2 for b in backward))
        p2p = hw.p2p_s(max((c.send_bytes for c in stages), default=0), intra_node=True)
        collective = None
    for comm_f, comm_b in (tp_collective_times(program, config.tp, hw, len(durations.forward)),
                           ep_collective_times(program, hw, len(durations.forward), config.tp)):
        durations = dataclasses.replace(durations, forward=tuple(f + c for f, c in zip(durations.forward, comm_f)),
                                        backward=tuple(b + c for b, c in zip(durations.backward, comm_b)))
    if config.pp > 1:
        if lookups is None:
            lookups = lookup_work(compiled.plan, compiled.schedule.stage_to_rank, config.pp) \
                if compiled.plan is not None else ()
        counts = transfer_counts(program, compiled.schedule.stage_to_rank, len(durations.forward))
        durations = with_transfers(durations, counts, compiled.schedule.stage_ranks, lookups, lookup_parts or {}, hw)
    durations = with_action_overhead(durations, hw.action_overhead_s, compiled.schedule.splits_backward)
    sim = simulate(compiled.schedule, durations, p2p_latency=p2p, collective_latency=collective)
    # Every tp rank and replica runs the pipeline's compute: with fewer cores than ranks
    # the machine does all of it before any rank is done.
    floor = shared_cores_floor(sim.busy, config.tp * config.replicas, config.tp * config.pp * config.replicas,
                               concurrent)
    ranks = compiled.schedule.stage_ranks  # each rank's last backward hides its buckets
    # ZeRO-1's gather waits at each weight's first reader, behind the rank's first forward.
    first_forward = [durations.forward[ranks.index(rank)] if rank in ranks else 0.0 for rank in range(config.pp)] \
        if config.gathers_behind_forward else None
    sync, optimizer = gradient_sync_s(compiled, hw, [sum(b for b, r in zip(durations.backward, ranks) if r == rank)
                                                     for rank in range(config.pp)], first_forward)
    step, critical = step_s(rank_finish(sim, floor), sync, optimizer)
    world = config.tp * config.pp * config.replicas
    step += step_collectives_s(hw, world=world, pp=config.pp, dp=config.replicas,
                               per_node=hw.members_per_node(world, 1))
    bubble = sim.max_bubble_fraction if config.pp > 1 else 0.0
    return PricedLayout(config=config, step_s=step, memory_bytes=max(result.rank_memory_bytes),
                        bubble=bubble, allreduce_s=sync[critical])


def ranks_at_once(world_size: int, device: torch.device | str = "cpu") -> int | None:
    """How many of ``world_size`` running ranks (this one among them) can compute at once:
    on CPUs, the cores over each rank's threads, per node (None when every rank has cores
    of its own, or on GPUs)."""
    if torch.device(device).type != "cpu":
        return None
    per_node = local_world_size(world_size)
    at_once = max(1, (os.cpu_count() or 1) // torch.get_num_threads())
    return at_once * max(1, world_size // per_node) if per_node > at_once else None


def local_world(world_size: int, per_node: int | None = None) -> tuple[int, int | None]:
    """(threads per rank, ``concurrent``) for ``world_size`` CPU ranks, ``per_node`` of them
    (default: all) started on each machine like this one, as ``fxpipe run`` and torchrun
    start them (each with cores / local ranks threads, at least one)."""
    per_node = per_node or world_size
    cores = os.cpu_count() or 1
    threads = max(1, cores // per_node)
    if per_node * threads <= cores:
        return threads, None
    return threads, cores // threads * max(1, world_size // per_node)



"""The runtime's schedule under vocabulary passes, placed on the compiled stages' costs.

``ParallelConfig.schedule_ir()`` must exist before the partition (its in-flight counts
size the partition's activation memory), so it places the vocabulary passes
(``schedules/vocab_actions.py``) with unit times. Once the partition and split are
known, ``vocab_timing`` prices one microbatch of every stage from what the partition
balanced (``PartitionResult.stages``: the node times it summed, measured or modelled,
without the head, which ``PartitionConfig.elsewhere`` kept off the stages) and the
head's nodes (``passes/vocab_head.head_nodes``) split evenly over the pipeline ranks
as S and T (``split_output_layer``'s convention: Yeung et al.'s even split of the
vocabulary) — or, where the stage times were measured on CPU, S and T timed as the
runtime runs them (``costs/local.vocab_passes_here``), the times the layout search
prices: it places on what it prices, and a measured runtime places on the same kind of
numbers. ``placed_schedule`` then searches the S delay and T lead on a simulation
(``place_vocab_passes``) at offset 0 only: a positive offset runs forwards earlier and
holds more microbatches in flight than the partition planned memory for; at offset 0
every rank's F/B/I/W order is the unit schedule's, so ``stage_inflight`` and the
partition's memory hold for the placed schedule too.

Every rank must walk the same collective order, so every rank must place on the same
numbers: the stage times come from the partition result global rank 0 solved and
broadcast, and the compiler passes the whole ``VocabTiming`` through
``CompileHooks.decide`` (rank 0's copy everywhere) before placing; the search itself
is deterministic.
"""
from __future__ import annotations

import math

import torch

from fxpipe.base.hardware import Collective
from fxpipe.base.packing import packed_nbytes
from fxpipe.costs.local import vocab_pass_shape, vocab_passes_here
from fxpipe.ir.parallel_config import ParallelConfig
from fxpipe.ir.pass_configs import PartitionConfig
from fxpipe.ir.pass_results import VocabTiming
from fxpipe.ir.stage_plan import PipelinePlan
from fxpipe.passes.vocab_head import head_nodes
from fxpipe.schedules.registry import generate
from fxpipe.schedules.schedule import Schedule
from fxpipe.schedules.simulate import StageDurations, simulate
from fxpipe.schedules.vocab_actions import add_vocab_passes, place_vocab_passes

STATS_PER_TOKEN = 3
"""fp32 softmax statistics each block gathers per token: max, sum-exp and target logit."""


def vocab_timing(plan: PipelinePlan, config: ParallelConfig, pconfig: PartitionConfig,
                 device: torch.device | str = "cpu") -> VocabTiming | None:
    """The stages' and the head's times (module docstring) under ``pconfig``, what the
    partition balanced; None where the partition did not balance times (uniform, params:
    nothing to place on) or there is no head."""
    program, head = plan.program, plan.vocab_head
    result = program.partition
    if head is None or result is None or not config.balances_time or not program.costs:
        return None
    hw = pconfig.hardware
    node_times = pconfig.node_times or {}
    head_f = head_b = 0.0
    for name in sorted(head_nodes(program)):
        cost = program.costs.get(name)
        if name in node_times:
            f, b = node_times[name]
        elif cost is not None:
            f, b = hw.forward_s(cost), hw.backward_s(cost)
        else:
            continue
        head_f, head_b = head_f + f, head_b + b
    forward = tuple(c.fwd_s for c in result.stages)
    backward = tuple(c.bwd_s for c in result.stages)
    if head_f + head_b <= 0 or not any(forward) or len(forward) != config.num_stages:
        return None
    pp = config.pp
    s_pass, t_pass = head_f / pp, head_b / pp
    if node_times and torch.device(device).type == "cpu":
        # Measured stage times: S and T timed as the runtime runs them (a block's logits
        # and its several passes over them, which the captured head's nodes do not show),
        # the same numbers the layout search prices (``costs/local.vocab_passes_here``).
        s_pass, t_pass = vocab_passes_here(*vocab_pass_shape(plan))
    durations = StageDurations(forward=forward, backward=backward, weight=tuple(b / 2 for b in backward),
                               vocab_forward=(s_pass,) * pp, vocab_backward=(t_pass,) * pp)
    latency, bandwidth = pconfig.link if pconfig.link is not None else (hw.p2p_latency, hw.p2p_bw)
    hidden = plan.values[head.hidden].spec
    tokens = math.prod(hidden.shape[:-1])
    hidden_bytes = tokens * (hidden.shape[-1] if hidden.shape else 1) * hidden.dtype.itemsize
    send = latency + hidden_bytes / bandwidth
    # ALLREDUCE_S is a collective, not a transfer (``runtime/head_blocks.py``): one
    # all-gather of every block's statistics over the pipeline ranks, again over the
    # tensor-parallel ranks when the head is split there too.
    groups = [(config.pp, hw.members_per_node(config.pp, config.tp * config.replicas))]
    if config.tp > 1:
        groups.append((config.tp, hw.members_per_node(config.tp, 1)))
    stats = sum(hw.collective_s(Collective.ALL_GATHER, size * 4 * STATS_PER_TOKEN * tokens, size, per_node)
                for size, per_node in groups)
    # BCAST_H and REDUCE_G are collectives too, not transfers: one broadcast of the bytes of
    # every value the last stage hands the head (its input, the targets, the tokens'
    # weights: ``base/packing.py``), one reduce of the input's gradient — each paying a
    # collective's latency (on gloo, the process group's worker thread:
    # benchmarks/bench_gloo_latency.py).
    pp_size, pp_node = groups[0]
    bcast = hw.collective_s(Collective.BROADCAST, packed_nbytes([(plan.values[n].spec.shape, plan.values[n].spec.dtype)
                                                                for n in head.outputs]), pp_size, pp_node)
    reduce_g = hw.collective_s(Collective.REDUCE, hidden_bytes, pp_size, pp_node)
    return VocabTiming(durations=durations, p2p_latency=send, collective_latency=(bcast, stats, reduce_g))


def placed_schedule(config: ParallelConfig, timing: VocabTiming | None) -> Schedule:
    """The compute-only schedule of ``config`` with its vocabulary passes placed on
    ``timing`` at offset 0 (None: unit times, ``config.schedule_ir()``)."""
    if timing is None:
        return config.schedule_ir()
    base = generate(config.schedule, config.pp, config.num_microbatches, config.chunks)
    placed = place_vocab_passes(base, timing.durations, p2p_latency=timing.p2p_latency,
                                collective_latency=timing.collective_latency, offsets=(0,))
    # Offset 0 keeps every rank's compute order (what the partition sized memory for).
    unit = add_vocab_passes(base)
    assert _compute_order(placed) == _compute_order(unit), "the placement moved a forward or backward"
    return placed


def _compute_order(schedule: Schedule) -> tuple[tuple, ...]:
    return tuple(tuple(a for a in acts if not a.kind.is_vocab) for acts in schedule.actions)


def describe(config: ParallelConfig, timing: VocabTiming | None, schedule: Schedule) -> str:
    """One line for ``fxpipe compile``: what the passes were placed on, and the simulated
    step of ``schedule`` against the unit placement on those times."""
    if timing is None:
        return "vocab passes placed with unit times (the partition balanced no times)"

    def span(s: Schedule) -> float:
        return 1e3 * simulate(s, timing.durations, p2p_latency=timing.p2p_latency,
                              collective_latency=timing.collective_latency).makespan

    d = timing.durations
    return (f"vocab passes placed on the stages' times (offset 0): S {1e3 * d.vocab_forward[0]:.3f} ms, "
            f"T {1e3 * d.vocab_backward[0]:.3f} ms per rank and microbatch; simulated step "
            f"{span(schedule):.3f} ms, {span(config.schedule_ir()):.3f} ms with unit-time placement")

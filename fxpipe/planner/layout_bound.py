"""A lower bound on a layout's price, from what every layout of one shape shares.

The search (``planner/auto_layout.py``) prices layouts in order of this bound and stops
at the first whose bound exceeds the best price found: the layouts it skips cannot be
cheaper, so the choice is the one pricing every layout would make (``price`` never
returns less than the bound; ``tests/planner/test_layout_bound.py`` checks it against
exhaustive pricing).

The bound needs no partition and no schedule simulation: only the body of the graph —
every node but the LM head and its loss, the nodes a layout may run differently (cut into
blocks, as blockwise loss, as vocabulary passes) — timed (or modelled) once per
(tp, sequence parallelism, micro-batch size), its tensor-parallel collectives, and its
parameter count. Whatever the partition does, those nodes run on some stage once per
microbatch, so:

- the pipeline's ranks together are busy at least m · (body compute + its collectives +
  the runtime's fixed cost of every compute action + the own time of the transfers
  across the boundaries between stages on two ranks + a tied embedding's lookup, which
  the head's ranks do for the first stage's unless a V shape puts both on one rank), and
  the busiest rank at least 1/pp of it;
- one microbatch's forward passes every stage in turn (a dependency chain), and its
  backward too where the backward is not split (under a split schedule W is off the chain);
- with fewer cores than ranks (``concurrent``), the tp·dp copies of that work share them
  and no rank finishes before all of it is done;
- the step is the latest rank's finish plus its synchronisation and optimizer step
  (``step_price.step_s``): the rank holding the most parameters — at least the mean
  share of the body's — finishes after the last forward, then reduces at least those
  bytes and steps at least its 1/dp of them.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from fxpipe.base.hardware import Collective, Hardware, get_hardware
from fxpipe.ir.parallel_config import ParallelConfig
from fxpipe.planner.options import PlannerOptions
from fxpipe.planner.step_price import ADAM_FP32_BYTES, optimizer_step_s, shared_cores_floor
from fxpipe.schedules.registry import ScheduleKind, generate, get_spec


@dataclass(frozen=True)
class ShapeWork:
    """One microbatch's body at one (tp, sp, micro-batch size), what a bound needs."""
    forward_s: float
    """Summed forward seconds of the body's nodes."""
    backward_s: float
    """Summed backward seconds, run whole (the fused backward's timing)."""
    backward_split_s: float
    """Summed backward seconds as I + W (the split schedules' timing)."""
    tp_comm_s: float
    """The body's tensor-parallel collectives, forward and backward, per microbatch."""
    params: int
    """Parameters the body's nodes read (each counted once)."""
    tied_lookup_s: float = 0.0
    """A tied embedding's lookup over its whole table, forward and backward, per microbatch
    (0: no table is both looked up and the head's weight). Across pipeline ranks the head's
    rank(s) own its rows and look every microbatch up for the first stage's rank
    (``transfer_price.py``); a part's time grows with its rows, so the owners together pay
    at least the whole table's lookup."""


def lower_bound_s(config: ParallelConfig, work: ShapeWork, hw: Hardware, *, num_stages: int,
                  splits_backward: bool, concurrent: int | None) -> float:
    """A price no compile of ``config`` goes below (module docstring). ``num_stages``: the
    schedule's stages (pp · chunks); ``splits_backward``: the schedule runs I and W apart."""
    backward = work.backward_split_s if splits_backward else work.backward_s
    # F and B per stage and microbatch, each with the runtime's fixed cost; B = I + W carries two.
    overhead = num_stages * (3 if splits_backward else 2) * hw.action_overhead_s
    # Every boundary between consecutive stages on two ranks sends at least one value
    # forward: two transfer ends (``transfer_price.py``), paid by the ranks and on the
    # forward chain.
    crossings, together = _rank_crossings(config.schedule, config.pp, num_stages) if config.pp > 1 else (0, True)
    chained = transfers = 2 * crossings * hw.transfer_cpu_s
    if work.tied_lookup_s and not together:
        # The first stage's rank takes the lookup from an owner: two more transfers each
        # way, and the owners' parts.
        transfers += 4 * hw.transfer_cpu_s + work.tied_lookup_s
    busy = config.num_microbatches * (work.forward_s + backward + work.tp_comm_s + overhead + transfers)
    forward_chain = work.forward_s + num_stages * hw.action_overhead_s + chained
    chain = forward_chain + (0.0 if splits_backward else backward)
    world = config.tp * config.pp * config.replicas
    floor = shared_cores_floor((busy,), config.tp * config.replicas, world, concurrent)
    finish = max(busy / config.pp, chain, floor)  # the last rank to finish
    if config.ep > 1:
        return finish
    # The rank holding the most parameters (at least the mean) finishes after the last
    # microbatch's forward, then synchronises and steps: its reduction moves at least the
    # mean share's bytes (a ZeRO-1 reduce and gather, the least of the ways it can run) and
    # its optimizer steps at least the mean share over the replicas.
    members, mean = config.replicas, work.params / config.pp
    per_node = hw.members_per_node(members, config.tp)
    weight = min(4, config.precision.dtype.itemsize)
    sync = (hw.collective_s(Collective.REDUCE_SCATTER, 4 * mean, members, per_node)
            + hw.collective_s(Collective.ALL_GATHER, weight * mean, members, per_node))
    step = optimizer_step_s(hw, mean, dp=members, zero=True,
                            traffic_bytes=min(ADAM_FP32_BYTES, PlannerOptions.optimizer_bytes_per_param))
    return max(finish, max(floor, forward_chain) + sync + step)


def layout_bound_s(config: ParallelConfig, work: ShapeWork, concurrent: int | None) -> float:
    """``lower_bound_s`` of ``config`` on its own hardware, its stage count and backward split
    read from its schedule's kind, not from a generated schedule: generating each of the
    1,660 candidates of 1000 ranks (p=1000: up to 100,000 actions each) kept ``fxpipe
    compile --world 1000`` silent for over ten minutes here."""
    chunks = config.chunks if config.chunks is not None else get_spec(config.schedule).default_chunks
    return lower_bound_s(config, work, get_hardware(config.hardware), num_stages=config.pp * chunks,
                         splits_backward=_splits_backward(config.schedule, chunks), concurrent=concurrent)


@functools.lru_cache(maxsize=None)
def _rank_crossings(kind: ScheduleKind, pp: int, num_stages: int) -> tuple[int, bool]:
    """(boundaries between consecutive stages that ``kind`` places on two ranks, whether it
    places the first and the last stage on one rank — a V shape, where the head's rows are
    where the lookup is consumed), read from its one-microbatch schedule."""
    rank = generate(kind, pp, 1, num_stages // pp).stage_to_rank
    return sum(rank(s) != rank(s + 1) for s in range(num_stages - 1)), rank(0) == rank(num_stages - 1)


@functools.lru_cache(maxsize=None)
def _splits_backward(kind: ScheduleKind, chunks: int) -> bool:
    """Whether ``kind`` splits B into I and W, read from its smallest schedule (one rank,
    one microbatch): a property of the generator, whatever p and m."""
    return generate(kind, 1, 1, chunks).splits_backward

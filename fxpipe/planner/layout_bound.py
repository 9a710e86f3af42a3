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
  the runtime's fixed cost of every compute action), and the busiest rank at least 1/pp
  of it;
- one microbatch's forward passes every stage in turn (a dependency chain), and its
  backward too where the backward is not split (under a split schedule W is off the chain);
- with fewer cores than ranks (``concurrent``), the tp·dp copies of that work share them;
- the data-parallel all-reduce moves at least the mean rank's share of the body's
  parameters (the largest rank's is priced).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from fxpipe.base.hardware import Collective, Hardware, get_hardware
from fxpipe.ir.parallel_config import ParallelConfig
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


def lower_bound_s(config: ParallelConfig, work: ShapeWork, hw: Hardware, *, num_stages: int,
                  splits_backward: bool, concurrent: int | None) -> float:
    """A price no compile of ``config`` goes below (module docstring). ``num_stages``: the
    schedule's stages (pp · chunks); ``splits_backward``: the schedule runs I and W apart."""
    backward = work.backward_split_s if splits_backward else work.backward_s
    # F and B per stage and microbatch, each with the runtime's fixed cost; B = I + W carries two.
    overhead = num_stages * (3 if splits_backward else 2) * hw.action_overhead_s
    busy = config.num_microbatches * (work.forward_s + backward + work.tp_comm_s + overhead)
    chain = work.forward_s + num_stages * hw.action_overhead_s + (0.0 if splits_backward else backward)
    makespan = max(busy / config.pp, chain)
    world = config.tp * config.pp * config.replicas
    if concurrent is not None and concurrent < world:
        makespan = max(makespan, busy * config.tp * config.replicas / concurrent)
    allreduce = 0.0
    if config.ep == 1:
        members = config.replicas
        allreduce = hw.collective_s(Collective.ALL_REDUCE, 4 * work.params / config.pp, members,
                                    hw.members_per_node(members, config.tp))
    return makespan + allreduce


def layout_bound_s(config: ParallelConfig, work: ShapeWork, concurrent: int | None) -> float:
    """``lower_bound_s`` of ``config`` on its own hardware, its stage count and backward split
    read from its schedule's kind, not from a generated schedule: generating each of the
    1,660 candidates of 1000 ranks (p=1000: up to 100,000 actions each) kept ``fxpipe
    compile --world 1000`` silent for over ten minutes here."""
    chunks = config.chunks if config.chunks is not None else get_spec(config.schedule).default_chunks
    return lower_bound_s(config, work, get_hardware(config.hardware), num_stages=config.pp * chunks,
                         splits_backward=_splits_backward(config.schedule, chunks), concurrent=concurrent)


@functools.lru_cache(maxsize=None)
def _splits_backward(kind: ScheduleKind, chunks: int) -> bool:
    """Whether ``kind`` splits B into I and W, read from its smallest schedule (one rank,
    one microbatch): a property of the generator, whatever p and m."""
    return generate(kind, 1, 1, chunks).splits_backward

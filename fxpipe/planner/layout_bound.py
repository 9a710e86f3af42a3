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


def lower_bound_s(config: ParallelConfig, work: ShapeWork, hw: Hardware, *, num_stages: int,
                  splits_backward: bool, concurrent: int | None) -> float:
    """A price no compile of ``config`` goes below (module docstring). ``num_stages``: the
    schedule's stages (pp · chunks); ``splits_backward``: the schedule runs I and W apart."""
    backward = work.backward_split_s if splits_backward else work.backward_s
    # F and B per stage and microbatch, each with the runtime's fixed cost; B = I + W carries two.
    overhead = num_stages * (3 if splits_backward else 2) * hw.action_overhead_s
    busy = config.num_microbatches * (work.forward_s + backward + work.tp_comm_s + overhead)
    forward_chain = work.forward_s + num_stages * hw.action_overhead_s
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
def _splits_backward(kind: ScheduleKind, chunks: int) -> bool:
    """Whether ``kind`` splits B into I and W, read from its smallest schedule (one rank,
    one microbatch): a property of the generator, whatever p and m."""
    return generate(kind, 1, 1, chunks).splits_backward

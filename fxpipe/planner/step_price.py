"""The one price: a layout's step time and memory from its stage times and parameters.

fxpipe prices a layout in two places, and both go through this module:

- the world-N layout search (``layout_price.price``: ``parallelize``, ``fxpipe run``,
  ``fxpipe compile --world``), on a compiled layout of the captured graph — each stage's
  time is its nodes' times, timed on this machine or modelled (``costs/local.py``,
  ``passes/cost.py``), plus its tensor-parallel collectives found in the graph;
- ``fxpipe plan`` at cluster scale (``predict.predict``), on the transformer shape read
  off the graph or a config — each stage's time is its layers' (``layer_cost.py``:
  GEMM FLOPs and memory-bound traffic against the hardware profile, Megatron's
  collectives per layer).

What each caller brings is per stage and per microbatch: forward, backward and (split
schedules) weight-gradient seconds with the tensor-parallel collectives inside, and the
stage-boundary point-to-point. From there the price is this module's:

    step = max over pipeline ranks r of  finish_r + lookup + sync_r + optimizer_r

- ``finish_r``: the rank's last compute end in the schedule simulated on those times
  (``schedules/simulate.py``), every compute action carrying the runtime's fixed cost
  (``with_action_overhead``), and on fewer cores than ranks never before the machine could
  have done everyone's compute (``shared_cores_floor``);
- ``lookup``: under vocabulary passes the first microbatch's embedding parts (``predict``);
- ``sync_r``: the data-parallel gradient reduction as the runtime overlaps it with the last
  backward (``dp_sync_s``: an all-reduce in buckets, or ZeRO-1's reduce onto owners and
  the owners' broadcast of the updated weights before the next forward);
- ``optimizer_r``: the Adam step over what rank r owns, memory bound, plus a fixed cost per
  tensor where the optimizer steps tensor by tensor (``optimizer_step_s``).

On the captured graph (``layout_price.price``) the step also carries the runtime's own
collective at its end (``step_collectives_s``: the batch digests and the loss sums, one
gather), latency-bound: nothing at cluster scale, a gloo latency or two on a CPU.

Memory per rank is ``state_bytes`` (weights, gradients, optimizer state, the last sharded
over the dp replicas by ZeRO-1) per parameter, plus the activations the schedule keeps
in flight (recomputation keeps a layer's input only): the partition's memory model on the
graph (``passes/assign_stages.py``) and ``predict.rank_memory`` on the shape both count
state with ``ParallelConfig.state_bytes_per_param_byte`` / ``PlannerOptions.state_bytes``,
which are ``fxpipe.base.train_state.state_bytes`` with their precisions.

The SC21 closed forms (``sc21.py``) are a test reference, not a price.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from fxpipe.base.hardware import Collective, Hardware
from fxpipe.base.train_state import state_bytes
from fxpipe.planner.dp_overlap import DEFAULT_BUCKET_MB, exposed_reduction_s
from fxpipe.schedules.simulate import SimResult, StageDurations

__all__ = ["ADAM_FP32_BYTES", "DEFAULT_BUCKET_MB", "dp_sync_s", "exposed_reduction_s", "optimizer_step_s",
           "rank_finish", "shared_cores_floor", "state_bytes", "step_collectives_s", "step_s", "with_action_overhead"]

ADAM_FP32_BYTES = 28.0
"""Memory traffic of one fp32 Adam step per parameter: read the gradient (4), read and
write the weight (8) and both moments (16). Mixed precision adds the master copy's
traffic (``PlannerOptions.optimizer_bytes_per_param``)."""


def with_action_overhead(d: StageDurations, overhead: float, split: bool) -> StageDurations:
    """Every compute action ``overhead`` seconds longer: F, B (under a split backward I and W
    each, so B = I + W carries two), S and T."""
    if overhead <= 0:
        return d
    per_b = 2 * overhead if split else overhead
    return dataclasses.replace(
        d, forward=tuple(f + overhead for f in d.forward), backward=tuple(b + per_b for b in d.backward),
        weight=tuple(w + overhead for w in d.weight) if split else d.weight,
        vocab_forward=tuple(s + overhead for s in d.vocab_forward),
        vocab_backward=tuple(t + overhead for t in d.vocab_backward))


def shared_cores_floor(busy: Sequence[float], copies: int, world: int, concurrent: int | None) -> float:
    """The earliest any rank can finish when only ``concurrent`` of the ``world`` ranks
    compute at once (CPU ranks sharing cores): every one of the ``copies`` (tp·dp) of the
    pipeline's compute ``busy`` is done by the machine. 0 when every rank has its own device."""
    if concurrent is None or concurrent >= world:
        return 0.0
    return sum(busy) * copies / concurrent


def rank_finish(sim: SimResult, floor: float = 0.0) -> tuple[float, ...]:
    """Each pipeline rank's last compute end in ``sim``, never below ``floor``."""
    return tuple(max(float(e.max()) if len(e) else 0.0, floor) for e in sim.timeline.end)


def dp_sync_s(hw: Hardware, *, grad_bytes: float, weight_bytes: float, dp: int, per_node: int, zero: bool,
              backward_s: float, bucket_mb: float = DEFAULT_BUCKET_MB, gather_hidden_s: float = 0.0) -> float:
    """Exposed seconds of one rank's data-parallel gradient synchronisation over ``dp``
    replicas (``per_node`` of them on one node), as the runtime runs it
    (``runtime/grad_buckets.py``, ``runtime/zero.py``): ``grad_bytes`` of gradients in
    buckets of ``bucket_mb`` behind the last backward of ``backward_s`` (0: after it) —
    all-reduced, or under ZeRO-1 reduced onto their owners (a reduce-scatter's bytes; on gloo
    an all-reduce, ``Hardware.backend``) and the owners' ``weight_bytes`` of updated weights
    gathered back before the next forward, of which ``gather_hidden_s`` hides behind waiting
    for the first activation."""
    if dp <= 1:
        return 0.0
    kind = Collective.REDUCE_SCATTER if zero and hw.backend == "nccl" else Collective.ALL_REDUCE
    sync = exposed_reduction_s(grad_bytes, backward_s, lambda n: hw.collective_s(kind, n, dp, per_node), bucket_mb)
    if zero:
        sync += max(0.0, hw.collective_s(Collective.ALL_GATHER, weight_bytes, dp, per_node) - gather_hidden_s)
    return sync


def optimizer_step_s(hw: Hardware, params: float, *, dp: int, zero: bool, traffic_bytes: float,
                     tensors: float = 0.0) -> float:
    """The Adam step over ``params`` parameters in ``tensors`` tensors (1/dp of them owned
    under ZeRO-1): memory bound, ``traffic_bytes`` moved per parameter in four kernels'
    worth of launches, plus ``Hardware.optimizer_tensor_s`` per tensor (an optimizer that
    steps tensor by tensor). ``tensors`` 0: the per-tensor cost left out (a lower bound)."""
    share = dp if zero else 1
    owned = params / share
    per_tensor = hw.optimizer_tensor_s * tensors / share
    return (hw.memory_s(owned * traffic_bytes, 4) if owned > 0 else 0.0) + per_tensor


def step_collectives_s(hw: Hardware, *, world: int, pp: int, dp: int, per_node: int) -> float:
    """The runtime's own collective at every step's end, after the schedule
    (``runtime/api.py``): the batch digests, with each rank's loss sum, gathered over the
    world (a few float64 per rank) — latency-bound, each rank waiting for every other.
    ``pp`` and ``dp``: the mesh, which the one gather spans whatever its shape."""
    digest = 8 * 8 * world
    return hw.collective_s(Collective.ALL_GATHER, digest, world, min(per_node, world)) if world > 1 else 0.0


def step_s(finish: Sequence[float], sync: Sequence[float], optimizer: Sequence[float],
           lookup: float = 0.0) -> tuple[float, int]:
    """(step seconds, the rank that ends it): max over pipeline ranks of finish + lookup +
    sync + optimizer (module docstring)."""
    return max((f + lookup + s + o, r) for r, (f, s, o) in enumerate(zip(finish, sync, optimizer)))

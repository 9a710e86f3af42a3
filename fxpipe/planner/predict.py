"""Predict one layout of a transformer shape at any scale (``fxpipe plan``): iteration
time, its breakdown, memory per GPU, TFLOP/s per GPU — the one price (``step_price.py``)
on stage times from ``layer_cost.py``'s per-layer work.

Iteration = max over pipeline ranks r of
    finish_r (the simulated schedule, p2p inside the stage times; with vocabulary passes
              every rank's S and T and their collectives inside the schedule)
  + lookup   (vocabulary passes: the table's owners send each microbatch's part of the
              embedding lookup (b·s·h) point to point, two microbatches ahead, so only the
              first microbatch's arrival is exposed; the gradients go back overlapped)
  + sync_r   (data-parallel gradient all-reduce of r's parameters, ring over d ranks,
              exposed per ``DPOverlap``; the tied embedding's instead one all-reduce over
              the first and last rank × the d replicas when p > 1 without vocabulary passes)
  + opt_r    (the Adam step over r's parameters, memory bound).
TFLOP/s per GPU uses the paper's model FLOPs (``shapes.model_flops``: the 96·B·s·l·h²
formula with full recompute, 72 without).
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

import numpy as np

from fxpipe.base.hardware import Collective
from fxpipe.ir.stage_plan import LOOKUP_PARTS_AHEAD
from fxpipe.planner.layer_cost import CostModel
from fxpipe.planner.memory_model import (RankMemory, embedding_activation_bytes, final_norm_activation_bytes,
                                         head_activation_bytes, layer_activation_bytes, lookup_activation_bytes,
                                         recompute_working_bytes, vocab_block_activation_bytes)
from fxpipe.planner.options import CandidateLayout, DPOverlap, PlannerOptions, ScheduleKind
from fxpipe.planner.pipeline_time import PipelineTiming, simulate_pipeline, vocab_in_flight
from fxpipe.planner.shapes import TransformerShape, model_flops
from fxpipe.planner.stages import StagePlan, plan_stages
from fxpipe.planner.step_price import DEFAULT_BUCKET_MB, dp_sync_s, optimizer_step_s, step_s, with_action_overhead
from fxpipe.planner.work import Component


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """What the cost model and the simulator predict for one layout."""

    config: CandidateLayout
    iteration_s: float
    """Seconds per training iteration."""
    breakdown: Mapping[Component, float]
    """The critical rank's iteration by component; sums to ``iteration_s``."""
    critical_rank: int
    """The pipeline rank that finishes last."""
    makespan_s: float
    """The pipeline schedule alone."""
    bubble_ratio: float
    """Idle / compute of the busiest rank during the schedule (SC21's convention)."""
    memory: RankMemory
    """The pipeline rank with the most memory."""
    fits: bool
    """memory.total <= the device's usable memory."""
    model_flops: float
    tflops_per_gpu: float
    percent_of_peak: float
    stages: StagePlan
    pipeline: PipelineTiming

    @property
    def memory_gb(self) -> float:
        return self.memory.total / 1e9


def rank_memory(model: CostModel, cfg: CandidateLayout, stages: StagePlan,
                in_flight: tuple[int, ...]) -> list[RankMemory]:
    """Peak memory of every pipeline rank: training state of its stages, plus its peak
    in-flight chunk-microbatches × its largest chunk's activations (the first stage adds
    the embedding's, the last the head's once), plus recomputation's working layer. With
    vocabulary passes the last stage keeps only the final norm's input; every rank holds
    its block (head input and V/(t·p) logits) for each microbatch between S and T, and
    every rank its parts of the embedding lookup in flight (the first stage's in-flight
    microbatches and the ones sent ahead, ``runtime/lookup_exchange.py``)."""
    shape, opts = model.shape, model.options
    t, b, p, S = cfg.tp, cfg.micro_batch, cfg.pp, cfg.num_stages
    sp = cfg.sequence_parallel and t > 1
    dims = dict(seq=shape.seq, micro_batch=b, hidden=shape.hidden, heads=shape.heads, tp=t,
                sequence_parallel=sp, fused_attention=opts.fused_attention or shape.fused_attention,
                kv_dim=shape.kv_dim, ffn=shape.ffn, gated=shape.gated_mlp, dropout=shape.dropout)
    per_layer = layer_activation_bytes(recompute=cfg.recompute, **dims)
    scale = opts.dtype_bytes / 2  # the formulas count fp16 activations
    working = recompute_working_bytes(recompute=cfg.recompute, **dims) * scale
    widest = np.asarray(stages.layers).reshape(cfg.chunks, p).max(axis=0)
    flight = np.asarray(in_flight, dtype=np.float64)
    act = flight * widest * per_layer
    act[0] += min(flight[0], cfg.num_microbatches) * embedding_activation_bytes(shape, b, t, sp)
    if cfg.vocab_passes:
        act[(S - 1) % p] += final_norm_activation_bytes(shape, b, t, sp)
        act += vocab_in_flight(cfg.schedule, p, cfg.num_microbatches, cfg.chunks) \
            * vocab_block_activation_bytes(shape, b, t, p)
        act += lookup_activation_bytes(shape, b, min(int(flight[0]) + LOOKUP_PARTS_AHEAD, cfg.num_microbatches))
    else:
        act[(S - 1) % p] += head_activation_bytes(shape, b, t, sp)  # freed soon after its forward
    params = stages.ranks(stages.params)
    weight, grad, optim = opts.state_bytes(cfg.zero, cfg.dp)
    return [RankMemory(rank=r, params=float(params[r]), weight_bytes=float(params[r]) * weight,
                       gradient_bytes=float(params[r]) * grad, optimizer_bytes=float(params[r]) * optim,
                       activation_bytes=float(act[r]) * scale, working_bytes=working) for r in range(p)]


def _sync_s(model: CostModel, cfg: CandidateLayout, stages: StagePlan, r: int, params: float) -> float:
    """Exposed gradient synchronisation of pipeline rank r."""
    hw, opts, shape = model.hw, model.options, model.shape
    # DPOverlap.BACKWARD: the gradients reduced in buckets behind the last backward, as the
    # runtime runs them (``dp_overlap.py``); NONE: the whole reduction after it. ZeRO-1 /
    # the distributed optimizer: reduced onto their owners, the updated weights (compute
    # dtype) gathered back, with overlap behind the next iteration's first forward
    # (Megatron's --overlap-param-gather).
    overlap = opts.dp_overlap is DPOverlap.BACKWARD
    # Megatron's embedding group: first and last rank (vocabulary passes hold each row once).
    # The runtime sums the two copies and averages over dp in ONE all-reduce over the pair
    # × the dp replicas (``runtime/grad_sync.py``), so the table leaves the dp buckets. Its
    # gradient on the first rank is final only when that rank's backward ends (the lookup
    # is the first thing forward does), and the last rank's copy waits for it: exposed whole.
    tied = cfg.pp > 1 and r in (0, cfg.pp - 1) and not cfg.vocab_passes
    vocab = shape.padded_vocab(cfg.tp) * shape.hidden / cfg.tp if tied else 0.0
    dp = dp_sync_s(hw, grad_bytes=(params - vocab) * opts.grad_bytes, weight_bytes=params * opts.dtype_bytes,
                   dp=cfg.dp, per_node=hw.members_per_node(cfg.dp, cfg.tp), zero=bool(cfg.zero),
                   backward_s=float(stages.backward[r]), bucket_mb=DEFAULT_BUCKET_MB if overlap else 0.0,
                   gather_hidden_s=float(stages.forward[r]) if overlap else 0.0)
    if tied:
        per_node = hw.members_per_node(cfg.dp, cfg.tp) * hw.members_per_node(2, cfg.tp * cfg.dp * (cfg.pp - 1))
        dp += hw.collective_s(Collective.ALL_REDUCE, vocab * opts.grad_bytes, 2 * cfg.dp, per_node)
    return dp


def lookup_s(model: CostModel, cfg: CandidateLayout) -> float:
    """Vocabulary passes: the first microbatch's embedding lookup, whose parts (b·s·h
    from each of the table's owners, point to point) the first stage waits for before
    its first forward; later parts are sent ahead and the gradients go
    back without a wait (``runtime/lookup_exchange.py``), so they overlap the schedule."""
    if not cfg.vocab_passes:
        return 0.0
    hw, shape = model.hw, model.shape
    nbytes = model.dtype * cfg.micro_batch * shape.seq * shape.hidden
    return hw.p2p_s(nbytes, intra_node=hw.members_per_node(cfg.pp, cfg.tp * cfg.dp) == cfg.pp)


def predict(shape: TransformerShape, cfg: CandidateLayout, options: PlannerOptions,
            model: CostModel | None = None) -> Prediction:
    """Price ``cfg`` for ``shape``: simulate its schedule and add sync and optimizer."""
    model = model or CostModel(shape, options)
    hw = options.hardware
    stages = plan_stages(model, cfg)
    collectives = model.vocab_collectives(cfg.tp, cfg.pp, cfg.dp, cfg.micro_batch) if cfg.vocab_passes else None
    durations = with_action_overhead(stages.durations(), hw.action_overhead_s,
                                     cfg.schedule in (ScheduleKind.ZB_H1, ScheduleKind.ZB_V))
    timing = simulate_pipeline(cfg.schedule, cfg.pp, cfg.num_microbatches, cfg.chunks, durations,
                               collectives=collectives, budget=options.simulate_budget)
    lookup = lookup_s(model, cfg)
    rank_params = stages.ranks(stages.params)
    sync = [_sync_s(model, cfg, stages, r, float(rank_params[r])) for r in range(cfg.pp)]
    opt = [optimizer_step_s(hw, float(rank_params[r]), dp=cfg.dp, zero=bool(cfg.zero),
                            traffic_bytes=options.optimizer_bytes_per_param) if options.optimizer else 0.0
           for r in range(cfg.pp)]
    iteration, crit = step_s(timing.finish, sync, opt, lookup)
    parts: dict[Component, float] = {}
    for c, v in stages.rank_work(crit).total().items():
        parts[c] = v * cfg.num_microbatches
    # The runtime's fixed cost per action (``with_action_overhead``) is in the simulated
    # busy time but in no layer's work: counted with the element-wise kernels' launches.
    actions = timing.busy[crit] - sum(parts.values())
    if actions > 0:
        parts[Component.ELEMENTWISE] = parts.get(Component.ELEMENTWISE, 0.0) + actions
    parts[Component.BUBBLE] = max(0.0, timing.finish[crit] - timing.busy[crit])
    parts[Component.VOCAB_LOOKUP] = lookup
    parts[Component.DP_SYNC] = sync[crit]
    parts[Component.OPTIMIZER] = opt[crit]
    peak = max(rank_memory(model, cfg, stages, timing.in_flight), key=lambda m: m.total)
    busiest = max(timing.busy)
    flops = model_flops(shape, cfg.global_batch, cfg.recompute)
    tflops = flops / (iteration * cfg.gpus * 1e12)
    return Prediction(
        config=cfg, iteration_s=iteration,
        breakdown=MappingProxyType({c: v for c, v in parts.items() if v > 0}),
        critical_rank=crit, makespan_s=timing.makespan,
        bubble_ratio=(timing.makespan - busiest) / busiest if busiest > 0 else 0.0,
        memory=peak, fits=peak.total <= hw.usable_memory_bytes, model_flops=flops,
        tflops_per_gpu=tflops, percent_of_peak=100 * tflops * 1e12 / hw.peak_flops,
        stages=stages, pipeline=timing)


def lower_bound_s(cfg: CandidateLayout, stages: StagePlan) -> float:
    """A time no schedule can beat: rank r cannot start before microbatch 0's forward has
    crossed the stages before it, then needs its m·(F + B) of compute (sync and optimizer
    excluded). Used to prune the search before simulating."""
    p = cfg.pp
    busy = cfg.num_microbatches * stages.rank_busy()
    prefix = np.concatenate(([0.0], np.cumsum(stages.forward[:p - 1])))
    return float((busy + prefix).max())

"""Search layouts: enumerate, drop what does not divide or fit, simulate the promising.

Enumeration (N GPUs, global batch B):
- t divides the heads (and N); t up to ``max_tp`` — beyond a node its collectives
  run over InfiniBand, which the hardware model prices;
- p divides N/t and p·v <= l (p need not divide l: see ``LayerBalance``);
- d = N/(t·p) divides B; b divides B/d, b <= ``max_micro_batch``; m = B/(d·b);
- schedule 1F1B and ZB-H1 with v = 1; interleaved with 2 <= v <= ``max_chunks``
  (fxpipe's interleaving runs for any m >= 1; its bubble is simulated, not assumed);
  with p = 1 only 1F1B (no pipeline, all schedules coincide);
- recompute none / selective / full; SP on every t > 1 layout when asked;
- vocabulary passes per ``VocabPasses``: off, on (p >= 2 only) or both (p >= 2).

Memory is checked in closed form first (training state + activations × the schedule's
in-flight microbatches). Every fitting layout gets a lower bound on its time
(``predict.lower_bound_s``); layouts are simulated in order of that bound, and the
search stops once the bound exceeds the K-th best simulated time — the answer equals
simulating everything (the tests check it against brute force).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from itertools import product

from fxpipe.planner.layer_cost import CostModel
from fxpipe.planner.options import CandidateLayout, LayerBalance, PlannerOptions, ScheduleKind, VocabPasses
from fxpipe.planner.pipeline_time import in_flight
from fxpipe.planner.predict import Prediction, lower_bound_s, predict, rank_memory
from fxpipe.planner.shapes import TransformerShape
from fxpipe.planner.stages import StagePlan, plan_stages


def divisors(n: int) -> list[int]:
    small = [k for k in range(1, int(n ** 0.5) + 1) if n % k == 0]
    return sorted(set(small + [n // k for k in small]))


def enumerate_layouts(shape: TransformerShape, gpus: int, global_batch: int,
                      options: PlannerOptions) -> list[CandidateLayout]:
    """Every layout that satisfies the divisibility rules above (memory not checked)."""
    out = []
    max_tp = options.max_tp or gpus
    sps = (False, True) if options.sequence_parallel is None else (options.sequence_parallel,)
    vocab = {VocabPasses.OFF: (False,), VocabPasses.ON: (True,),
             VocabPasses.SEARCH: (False, True)}[options.vocab_passes]
    pins = options.pins
    for t in divisors(gpus):
        if t > max_tp or shape.heads % t or pins.tp not in (None, t):
            continue
        for p in divisors(gpus // t):
            if p > shape.layers or pins.pp not in (None, p):
                continue
            d = gpus // (t * p)
            if global_batch % d or pins.dp not in (None, d):
                continue
            for b in divisors(global_batch // d):
                if (b > options.max_micro_batch and pins.micro_batch is None) or pins.micro_batch not in (None, b):
                    continue
                m = global_batch // (d * b)
                if pins.num_microbatches not in (None, m):
                    continue
                for kind in options.schedules if pins.schedule is None else (pins.schedule,):
                    if p == 1 and kind is not ScheduleKind.ONE_F_ONE_B:
                        continue
                    chunk_range = range(2, options.max_chunks + 1) if kind is ScheduleKind.INTERLEAVED else (1,)
                    if pins.chunks is not None:
                        chunk_range = (pins.chunks,) if pins.chunks in chunk_range or kind is \
                            ScheduleKind.INTERLEAVED else ()
                    for v in chunk_range:
                        if p * v > shape.layers:
                            continue
                        if options.balance is LayerBalance.MEGATRON and shape.layers % (p * v):
                            continue
                        # SP needs t > 1, ZeRO d > 1: otherwise the variant is the plain layout
                        variants = dict.fromkeys((rc, vp, sp and t > 1, zero if d > 1 else 0) for rc, vp, sp, zero
                                                 in product(options.recomputes, vocab, sps, options.zeros))
                        for rc, vp, sp, zero in variants:
                            if vp and p == 1:  # nothing to split the head over
                                continue
                            out.append(CandidateLayout(tp=t, pp=p, dp=d, micro_batch=b, num_microbatches=m,
                                                      chunks=v, schedule=kind, recompute=rc,
                                                      sequence_parallel=sp, vocab_passes=vp, zero=zero))
    return out


@dataclass(frozen=True, kw_only=True)
class PlanResult:
    """The best layouts and how the search went."""

    predictions: tuple[Prediction, ...]
    """Best first (shortest iteration)."""
    enumerated: int
    """Layouts satisfying divisibility."""
    fitting: int
    """Of those, layouts that fit in memory."""
    simulated: int
    """Of those, layouts simulated before the bound stopped the search."""
    wall_s: float
    smallest_memory_gb: float
    """The least memory per GPU any enumerated layout needs (tells what would fit)."""


def memory_only(model: CostModel, cfg: CandidateLayout, stages: StagePlan) -> float:
    """Peak memory per GPU without simulating (in-flight counts are closed form)."""
    flight = in_flight(cfg.schedule, cfg.pp, cfg.num_microbatches, cfg.chunks)
    return max(m.total for m in rank_memory(model, cfg, stages, flight))


def plan(shape: TransformerShape, gpus: int, global_batch: int, options: PlannerOptions,
         *, top: int = 5, exhaustive: bool = False) -> PlanResult:
    """The ``top`` fastest layouts of ``shape`` on ``gpus`` GPUs at ``global_batch``
    sequences per iteration that fit in memory. ``exhaustive`` simulates every fitting
    layout (for tests; the bound gives the same answer)."""
    if gpus < 1 or global_batch < 1 or top < 1:
        raise ValueError(f"gpus, global batch and top must be >= 1, got {gpus}, {global_batch}, {top}")
    start = time.perf_counter()
    model = CostModel(shape, options)
    layouts = enumerate_layouts(shape, gpus, global_batch, options)
    if not layouts and options.vocab_passes is VocabPasses.ON and enumerate_layouts(
            shape, gpus, global_batch, dataclasses.replace(options, vocab_passes=VocabPasses.OFF)):
        raise ValueError(f"vocabulary passes need p >= 2, but no layout of {shape.name} on {gpus} GPUs "
                         f"with global batch {global_batch} has p >= 2: use --vocab-passes off or search")
    if not layouts:
        raise ValueError(
            f"no layout of {shape.name} on {gpus} GPUs with global batch {global_batch}: t must divide "
            f"the {shape.heads} heads and {gpus}, d = N/(t·p) must divide {global_batch}; try a global "
            f"batch that is a multiple of {gpus} or a GPU count sharing factors with {shape.heads}")
    limit = options.hardware.usable_memory_bytes
    smallest = float("inf")
    scored = []
    for cfg in layouts:
        stages = plan_stages(model, cfg)
        mem = memory_only(model, cfg, stages)
        smallest = min(smallest, mem)
        if mem <= limit:
            scored.append((lower_bound_s(cfg, stages), len(scored), cfg))
    if not scored:
        raise ValueError(
            f"no layout of {shape.name} fits {limit / 1e9:.1f} GB per GPU "
            f"({options.hardware.name}, {options.hardware.usable_memory_fraction:.0%} of "
            f"{options.hardware.memory_bytes / 2**30:.0f} GiB): the smallest needs {smallest / 1e9:.1f} GB. "
            f"Use more GPUs, allow full recompute (--recompute full) or sequence parallelism"
            + ("; or try --vocab-passes search" if options.vocab_passes is VocabPasses.ON else ""))
    scored.sort(key=lambda x: (x[0], x[1]))
    best: list[Prediction] = []
    simulated = 0
    for bound, _, cfg in scored:
        if not exhaustive and len(best) >= top and bound > best[-1].iteration_s:
            break
        pred = predict(shape, cfg, options, model)
        simulated += 1
        best.append(pred)
        best.sort(key=lambda p: p.iteration_s)
        if not exhaustive:
            del best[top:]
    return PlanResult(predictions=tuple(best[:top]), enumerated=len(layouts), fitting=len(scored),
                      simulated=simulated, wall_s=time.perf_counter() - start,
                      smallest_memory_gb=smallest / 1e9)


"""Time the captured graph's coarse groups on this rank's device.

The graph is cut into *probe groups* (``fxpipe.partition.coarsen`` of the fine
DAG, the same unit the ILP chooses between) and each group becomes a one-group
stage run by the real :class:`~fxpipe.runtime.stage_runner.StageRunner`: forward,
fused backward (B), and the zero-bubble halves I and W, with the microbatch's real
shapes, after a warm-up, median of ``repeats``. Groups run in order, so each one
sees real activations from the one before and real gradients from the ones after.

Spread over ranks: the groups are cut into one contiguous chunk per (pp, dp) cell of
the mesh, balanced on the cost model; the tp ranks of a cell time their chunk
together (the graph's tensor-parallel collectives need all of them). A rank builds
only the parameters of its chunk, so profiling holds a 1/(pp·dp) share of the
model. A chunk's first group receives synthetic activations (random floats; chunks
start where no integer arrives, ``costs._real_starts``) and its last group synthetic
gradients: timing depends on shapes, not values. All ranks time at once, as they will
train — contention included.

A group's time is what its ops cost, net of what calling a stage costs whatever it
computes (the runner's dict building, the GraphModule call, autograd's engine start:
~0.1 ms forward and ~0.13 ms backward on a CPU core, ``runner_fixed_cost``). The runtime
pays that once per action, and the price adds it once per action
(``Hardware.action_overhead_s``); left in, a stage of 30 small groups was priced at 1.7×
what it runs in as one action (deep-narrow, 12 layers of width 32).
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable, Mapping, Sequence

import torch
import torch.fx as fx

from fxpipe.ir.program import TensorSpec
from fxpipe.ir.stage_plan import PipelinePlan, Stage, StageValue
from fxpipe.runtime.stage_runner import StageRunner

PHASES = ("fwd", "bwd", "input", "weight")
"""What is timed per group: forward, fused backward, its input- and weight-gradient halves."""
MIN_GROUP_S = 1e-6
"""The least a timed group costs: about what one kernel's dispatch does on a CPU."""


def chunks(weights: Sequence[float], parts: int) -> list[range]:
    """Contiguous ranges of indices with near-equal total weight (at least one each,
    while there are enough indices)."""
    n = len(weights)
    parts = max(1, min(parts, n))
    total = sum(weights) or 1.0
    bounds, acc, k = [0], 0.0, 1
    for i, w in enumerate(weights):
        acc += w
        left_items, left_parts = n - (i + 1), parts - k
        if k < parts and (acc >= total * k / parts or left_items == left_parts) and left_items >= left_parts:
            bounds.append(i + 1)
            k += 1
    bounds.append(n)
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def _synthetic(spec: TensorSpec, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    if spec.dtype.is_floating_point:
        return torch.randn(spec.shape, generator=gen, dtype=torch.float32).to(device=device, dtype=spec.dtype)
    if spec.dtype == torch.bool:
        return torch.ones(spec.shape, dtype=torch.bool, device=device)
    return torch.zeros(spec.shape, dtype=spec.dtype, device=device)


class _Clock:
    """Seconds now: after the device's queued work on a GPU; with ``cpu_time``, this
    thread's CPU seconds (a single-threaded CPU rank with no peer to wait for computes
    exactly while its thread runs, so its timing does not take in what other processes
    on the machine take from it)."""

    def __init__(self, device: torch.device, cpu_time: bool = False) -> None:
        self.cuda = device.type == "cuda"
        self.now = time.thread_time if cpu_time and device.type == "cpu" else time.perf_counter

    def __call__(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return self.now()


def _null_plan(plan: PipelinePlan) -> PipelinePlan:
    """``plan`` reduced to one stage that computes next to nothing: one received float
    times one, sent on (what a stage call costs apart from its ops)."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output((graph.call_function(torch.ops.aten.mul.Tensor, (x, 1.0)),))
    spec = TensorSpec((1,), torch.float32)
    stage = Stage(index=0, graph_module=fx.GraphModule(torch.nn.Module(), graph), params=(), batch_inputs=(),
                  inputs=("x",), outputs=("y",), is_last=False, num_nodes=1)
    values = {"x": StageValue("x", -1, (0,), spec, True), "y": StageValue("y", 0, (), spec, True)}
    return dataclasses.replace(plan, stages=(stage,), values=values, lookups=(), vocab_head=None)


def runner_fixed_cost(plan: PipelinePlan, device: torch.device, context: Callable | None = None,
                      repeats: int = 15, cpu_time: bool = False) -> tuple[float, float, float, float]:
    """(fwd, bwd, input, weight) median seconds of a stage call that computes next to
    nothing, run as ``time_groups`` runs a group (same runner, context and clock): what
    each group's timing holds beyond its ops (module docstring)."""
    import contextlib
    null = _null_plan(plan)
    runner = StageRunner(null, null.stages[0], {}, loss_scale=1.0, context=context or contextlib.nullcontext)
    clock = _Clock(device, cpu_time)
    samples: dict[str, list[float]] = {p: [] for p in PHASES}
    for i in range(repeats + 2):  # the first two: warm-up
        for split in (False, True):
            t = clock()
            runner.forward(0, (), {"x": torch.ones(1, device=device)})
            forward = clock() - t
            grad = {"y": torch.ones(1, device=device)}
            t = clock()
            if split:
                runner.backward_input(0, grad)
                mid = clock()
                runner.backward_weight(0)
                done = clock()
                if i >= 2:
                    samples["input"].append(mid - t)
                    samples["weight"].append(done - mid)
            else:
                runner.backward(0, grad)
                if i >= 2:
                    samples["bwd"].append(clock() - t)
            if i >= 2 and not split:
                samples["fwd"].append(forward)
    return tuple(statistics.median(samples[p]) for p in PHASES)


def time_groups(plan: PipelinePlan, groups: range, state: Mapping[str, torch.Tensor],
                batch: Sequence[torch.Tensor], device: torch.device, *, repeats: int = 3,
                warmup: int = 1, context: Callable = None, enough_s: float | None = None,
                progress: Callable[[str], None] | None = None,
                cpu_time: bool = False, steady: float | None = None,
                fixed: Sequence[float] | None = None) -> dict[int, tuple[float, float, float, float]]:
    """(fwd, bwd, input, weight) median seconds of each stage in ``groups`` of ``plan``
    (a plan with one stage per probe group); ``state`` holds their parameters.
    ``enough_s``: stop repeating once the recorded repeats took that long (at least one):
    a large shape's timing is long enough to be steady, and the layout search times many.
    ``steady``: stop repeating once two recorded rounds in a row took times within that
    fraction of each other (the median of two such is their mean; a round slowed by the
    machine's other work is out of line with the next, so a third is timed and the median
    leaves the outlier out). With ``steady`` and no ``warmup``, a first round slower than
    the second by more than ``steady`` is dropped as the warm-up it was, and ``enough_s``
    never ends the timing on the first round.
    Each time is net of ``runner_fixed_cost`` (module docstring; ``fixed``: that cost as
    already timed for this runner, context and clock). ``cpu_time``: time by this thread's
    CPU seconds (``_Clock``; only where the groups wait for no peer and the CPU rank runs
    one thread)."""
    import contextlib
    ctx = context or contextlib.nullcontext
    runners = {g: StageRunner(plan, plan.stages[g], state, loss_scale=1.0, context=ctx) for g in groups}
    gen = torch.Generator().manual_seed(0)
    clock = _Clock(device, cpu_time)
    samples: dict[int, dict[str, list[float]]] = {g: {p: [] for p in PHASES} for g in groups}

    def forward_all(record: bool) -> None:
        values: dict[str, torch.Tensor] = {}
        for g in groups:
            st = plan.stages[g]
            received = {n: values[n] if n in values else _synthetic(plan.values[n].spec, device, gen)
                        for n in st.inputs}
            t = clock()
            sends = runners[g].forward(0, batch, received)
            if record:
                samples[g]["fwd"].append(clock() - t)
            values.update(sends)

    def backward_all(record: bool, split: bool) -> None:
        grads: dict[str, torch.Tensor] = {}
        halves = []
        for g in reversed(groups):
            st = plan.stages[g]
            mine = {}
            for n in st.outputs:
                if not plan.values[n].requires_grad:
                    continue
                mine[n] = grads[n] if n in grads else _synthetic(plan.values[n].spec, device, gen)
            t = clock()
            got = runners[g].backward_input(0, mine) if split else runners[g].backward(0, mine)
            if record:
                samples[g]["input" if split else "bwd"].append(clock() - t)
            for n, v in got.items():
                grads[n] = grads[n] + v if n in grads else v
            halves.append(g)
        for g in halves if split else ():  # W after every I, as the split schedules run them
            t = clock()
            runners[g].backward_weight(0)
            if record:
                samples[g]["weight"].append(clock() - t)

    recorded, rounds, first = 0.0, [], {}
    for i in range(warmup + repeats):
        record = i >= warmup
        start = clock()
        for split in (False, True):
            forward_all(record)
            backward_all(record, split)
        if progress is not None and record:
            progress(f"costs: timed {len(groups)} groups, repeat {i - warmup + 1}/{repeats}")
        if record:
            rounds.append(clock() - start)
            recorded += rounds[-1]
            if len(rounds) == 1:
                first = {g: {p: len(samples[g][p]) for p in PHASES} for g in groups}
        if enough_s is not None and recorded >= enough_s and (warmup or len(rounds) >= 2):
            break
        if steady is not None and len(rounds) >= 2 and abs(rounds[-1] - rounds[-2]) <= steady * min(rounds[-2:]):
            break
    if not warmup and steady is not None and len(rounds) >= 2 and rounds[0] > (1 + steady) * rounds[1]:
        # No warm-up was timed, and the first round was slower than the next by more than
        # ``steady`` (first calls, first touches of memory): it was the warm-up.
        for g in groups:
            for p in PHASES:
                del samples[g][p][:first[g][p]]
    for t in state.values():
        t.grad = None
    if fixed is None:
        fixed = runner_fixed_cost(plan, device, ctx, cpu_time=cpu_time)
    # A group whose ops cost less than the clock tells apart from the fixed cost keeps
    # MIN_GROUP_S: ops are never free, and a time of zero would say they are.
    return {g: tuple(max(MIN_GROUP_S, statistics.median(samples[g][p]) - f) for p, f in zip(PHASES, fixed))
            for g in groups}


def fit_to_whole(rows: Mapping[int, tuple[float, ...]], whole: Sequence[float]) -> dict[int, tuple[float, ...]]:
    """Group times, each phase shifted by one constant per group, that sum to ``whole``:
    the same graph's time run as one stage (net of the runner's fixed cost, as the groups
    are). Timed one by one, every group also pays what running a stage costs beyond its
    ops, and the null stage ``runner_fixed_cost`` times is only an estimate of that: on
    gpt-tiny (56 groups, most of a few ops) the groups' raw sum was 1.93 ms forward where
    the graph ran whole in 0.98, and less the null stage's 31 us each, 0.68 ms. What the
    graph costs whole is what the runtime runs; the groups only share it out (the
    partition needs their shares). A group is never below ``MIN_GROUP_S``."""
    if not rows:
        return {}
    shift = [_shift([r[p] for r in rows.values()], w) for p, w in enumerate(whole)]
    return {g: tuple(max(MIN_GROUP_S, t - d) for t, d in zip(r, shift)) for g, r in rows.items()}


def _shift(times: Sequence[float], total: float) -> float:
    """The d with sum(max(MIN_GROUP_S, t - d)) = total (or as near as the floor allows):
    the sum falls as d grows, so bisect."""
    lo, hi = min(0.0, (sum(times) - total) / len(times)), max(times)
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(max(MIN_GROUP_S, t - mid) for t in times) > total:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2

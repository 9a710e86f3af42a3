"""Text for ``fxpipe plan``: the ranking table and why the winner wins."""
from __future__ import annotations

from fxpipe.planner.options import CandidateLayout, ScheduleKind
from fxpipe.planner.predict import Prediction
from fxpipe.planner.search import PlanResult
from fxpipe.planner.work import Component


def plan_table(result: PlanResult) -> str:
    head = (f"{'#':>2} {'t':>3} {'p':>3} {'d':>4} {'b':>3} {'m':>5} {'v':>2} {'schedule':<11} "
            f"{'recompute':<9} {'sp':<3} {'zero':<4} {'vocab':<5} {'iter s':>9} {'TFLOP/s':>8} {'%peak':>6} {'GB/GPU':>7} {'bubble':>7}")
    rows = [head, "-" * len(head)]
    for i, p in enumerate(result.predictions, 1):
        c = p.config
        rows.append(
            f"{i:>2} {c.tp:>3} {c.pp:>3} {c.dp:>4} {c.micro_batch:>3} {c.num_microbatches:>5} "
            f"{c.chunks:>2} {c.schedule.value:<11} {c.recompute.value:<9} "
            f"{'yes' if c.sequence_parallel else 'no':<3} {c.zero:<4} {'yes' if c.vocab_passes else 'no':<5} "
            f"{p.iteration_s:>9.3f} {p.tflops_per_gpu:>8.1f} "
            f"{p.percent_of_peak:>5.1f}% {p.memory_gb:>7.1f} {100 * p.bubble_ratio:>6.1f}%")
    return "\n".join(rows)


def _shown(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(getattr(value, "value", value))


def _differences(a: CandidateLayout, b: CandidateLayout) -> list[str]:
    fields = (("tp", "t"), ("pp", "p"), ("dp", "d"), ("micro_batch", "b"), ("num_microbatches", "m"),
              ("chunks", "v"), ("schedule", "schedule"), ("recompute", "recompute"),
              ("sequence_parallel", "sp"), ("vocab_passes", "vocab passes"))
    out = []
    for attr, name in fields:
        x, y = getattr(a, attr), getattr(b, attr)
        if x != y:
            x, y = _shown(x), _shown(y)
            out.append(f"{name} {x} vs {y}")
    return out


def _why(c: Component, a: Prediction, b: Prediction) -> str:
    ca, cb = a.config, b.config
    if c is Component.BUBBLE:
        return (f"pipeline bubble {100 * a.bubble_ratio:.1f}% vs {100 * b.bubble_ratio:.1f}% of compute "
                f"(p={ca.pp}/{cb.pp}, m={ca.num_microbatches}/{cb.num_microbatches}, "
                f"v={ca.chunks}/{cb.chunks}, {ca.schedule.value}/{cb.schedule.value})")
    if c is Component.TP_COMM:
        return f"tensor-parallel collectives on the critical rank (t={ca.tp}/{cb.tp})"
    if c is Component.RECOMPUTE:
        zb = " — zb-h1 reruns it in W as well" if ScheduleKind.ZB_H1 in (ca.schedule, cb.schedule) else ""
        return f"recomputation ({ca.recompute.value}/{cb.recompute.value}){zb}"
    if c is Component.DP_SYNC:
        return (f"gradient all-reduce after the schedule (d={ca.dp}/{cb.dp}, params per GPU; the tied "
                f"embedding's between the pipeline ends without vocabulary passes)")
    if c is Component.P2P:
        return f"stage-boundary transfers (p·v={ca.num_stages}/{cb.num_stages} stages)"
    if c is Component.VOCAB_LOOKUP:
        return "the first microbatch's embedding lookup from the table's owners (vocabulary passes)"
    if c is Component.OPTIMIZER:
        return "optimizer step over the parameters each GPU holds"
    return (f"{c.value} time per GPU (b={ca.micro_batch}/{cb.micro_batch}: GEMM shapes and "
            f"per-kernel overheads; t={ca.tp}/{cb.tp}; layers on the critical rank)")


def explain(a: Prediction, b: Prediction) -> str:
    """Why ``a`` (the top choice) beats ``b`` (the runner-up): the iteration of each
    one's critical rank, component by component."""
    lines = [f"Why #1 beats #2 ({b.iteration_s - a.iteration_s:+.3f} s per iteration, "
             f"{100 * (b.iteration_s / a.iteration_s - 1):+.1f}%):",
             f"  #1 {a.config.label()}", f"  #2 {b.config.label()}",
             f"  they differ in: {', '.join(_differences(a.config, b.config)) or 'nothing'}",
             f"  {'component':<12} {'#1 s':>10} {'#2 s':>10} {'#2 - #1':>10}"]
    deltas = []
    for c in Component:
        x, y = a.breakdown.get(c, 0.0), b.breakdown.get(c, 0.0)
        if x or y:
            lines.append(f"  {c.value:<12} {x:>10.3f} {y:>10.3f} {y - x:>+10.3f}")
            deltas.append((y - x, c))
    lines.append(f"  {'iteration':<12} {a.iteration_s:>10.3f} {b.iteration_s:>10.3f} "
                 f"{b.iteration_s - a.iteration_s:>+10.3f}")
    deltas.sort(key=lambda d: -abs(d[0]))
    for delta, c in deltas[:3]:
        if abs(delta) < 1e-3 * a.iteration_s:
            break
        side = "costs #2" if delta > 0 else "saves #2"
        lines.append(f"  - {c.value}: {side} {abs(delta):.3f} s — {_why(c, a, b)}")
    lines.append(f"  memory per GPU: {a.memory_gb:.1f} GB vs {b.memory_gb:.1f} GB "
                 f"(rank {a.memory.rank} / {b.memory.rank} binds)")
    return "\n".join(lines)


def search_summary(result: PlanResult) -> str:
    return (f"searched {result.enumerated} layouts ({result.fitting} fit in memory, "
            f"{result.simulated} simulated) in {result.wall_s:.2f} s")


BREAKDOWN = (("compute", (Component.GEMM, Component.ELEMENTWISE, Component.RECOMPUTE)),
             ("bubble", (Component.BUBBLE,)), ("TP", (Component.TP_COMM,)), ("p2p", (Component.P2P,)),
             ("dp all-reduce", (Component.DP_SYNC, Component.VOCAB_LOOKUP)), ("optimizer", (Component.OPTIMIZER,)))
"""The breakdown's lines: what each sums of ``Prediction.breakdown`` (the critical rank's)."""


def breakdown(p: Prediction) -> str:
    """One layout's iteration and memory by kind (``fxpipe plan`` prints it for #1, or for the
    one layout the flags pin)."""
    c, mem = p.config, p.memory
    lines = [f"layout {c.label()}: {p.iteration_s:.3f} s per iteration, {p.tflops_per_gpu:.1f} TFLOP/s per GPU "
             f"({p.percent_of_peak:.1f}% of peak), critical pipeline rank {p.critical_rank}"]
    for name, comps in BREAKDOWN:
        v = sum(p.breakdown.get(k, 0.0) for k in comps)
        detail = ", ".join(f"{k.value} {p.breakdown[k]:.3f}" for k in comps if len(comps) > 1 and k in p.breakdown)
        lines.append(f"  {name:<14} {v:9.3f} s  {100 * v / p.iteration_s:5.1f}%" + (f"  ({detail})" if detail else ""))
    lines.append("  overhead       per-kernel launch and per-action costs of the hardware profile, inside the "
                 "lines above")
    gb = 1e9
    lines.append(f"memory per GPU (pipeline rank {mem.rank}): {mem.total / gb:.1f} GB = parameters "
                 f"{mem.weight_bytes / gb:.1f} + gradients {mem.gradient_bytes / gb:.1f} + optimizer state "
                 f"{mem.optimizer_bytes / gb:.1f} + activations {mem.activation_bytes / gb:.1f} + recompute working "
                 f"{mem.working_bytes / gb:.1f}; {'fits' if p.fits else 'does NOT fit'}")
    return "\n".join(lines)

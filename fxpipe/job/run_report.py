"""What ``fxpipe run`` reports while and after it trains: the progress bar, the bubble
share of a step, recomputed FLOPs, the per-stage balance table and the measured
timeline of the last step (Perfetto JSON + PNG)."""
from __future__ import annotations

import sys

import torch.distributed as dist

from fxpipe.job.config import TrainConfig
from fxpipe.job.input_registry import InputRegistry
from fxpipe.passes.recompute import regions_of
from fxpipe.runtime.api import ParallelModel
from fxpipe.runtime.balance import BalanceMeter, balance, balance_table
from fxpipe.schedules.render.gantt import render_gantt
from fxpipe.schedules.render.trace import render_trace
from fxpipe.schedules.timeline import Timeline


def progress_bar(step: int, total: int, loss: float, width: int = 30) -> None:
    if not sys.stderr.isatty():
        return
    done = int(width * step / total)
    sys.stderr.write(f"\r[{'#' * done}{'.' * (width - done)}] {step}/{total} loss {loss:.4f}")
    sys.stderr.flush()
    if step == total:
        sys.stderr.write("\n")


def bubble_share(events: tuple, start: float, end: float) -> float:
    """Idle share of this rank's step: 1 − (compute time / step wall time)."""
    busy = sum(e - s for a, s, e in events if a.kind.is_compute)
    return max(0.0, 1.0 - busy / max(end - start, 1e-12))


def recomputed_flops(pm: "ParallelModel") -> int:
    """Forward matmul FLOPs re-run in backward by recompute regions, per microbatch, all
    stages; per-rank costs × tp approximates the whole model's under tensor parallelism."""

    costs = pm.plan.program.costs
    total = sum(costs[n].fwd_flops for st in pm.plan.stages for r in regions_of(st.graph_module)
                for n in r.nodes if n in costs)
    return total * pm.groups.mesh.tp


def report_balance(pm: "ParallelModel", meter: "BalanceMeter") -> float:
    """Per-stage predicted vs measured F/B (rank 0 prints); the measured imbalance."""
    summaries = [None] * pm.groups.mesh.pp
    dist.all_gather_object(summaries, meter.summary(), group=pm.groups.pp_group)
    rows, imbalance = balance(pm.partition, summaries) if pm.partition is not None else ([], 1.0)
    if dist.get_rank() == 0 and rows:
        print(balance_table(rows, imbalance), flush=True)
    return imbalance


def write_timeline(pm: "ParallelModel", config: TrainConfig, imbalance: float = 1.0) -> None:
    """Gather the last step's per-action times from every pipeline rank; rank 0 draws them."""
    if config.timeline is None:
        return

    gathered = [None] * config.parallel.pp
    dist.all_gather_object(gathered, (pm.last_stats.events, pm.last_stats.exposed), group=pm.groups.pp_group)
    if dist.get_rank() != 0:
        return
    events = [e for e, _ in gathered]
    waited = ", ".join(f"{1e3 * x.total_s:.1f}" for _, x in gathered)
    t0 = min(s for rank in events for _, s, _ in rank)
    per_rank = [[(a, (s - t0) * 1e3, (e - t0) * 1e3) for a, s, e in rank if a.kind.is_compute]
                for rank in events]
    timeline = Timeline.from_events(per_rank, unit="ms", num_chunks=pm.schedule.num_chunks,
                                    title=f"measured {config.parallel.schedule.value} p={config.parallel.pp} "
                                          f"m={config.parallel.num_microbatches}, "
                                          f"stage imbalance {imbalance:.2f}, exposed communication per "
                                          f"rank {waited} ms")
    render_trace(timeline, config.timeline + ".json", InputRegistry.of(config).identities())
    render_gantt(timeline, config.timeline + ".png")
    print(f"timeline of the last step: {config.timeline}.json (Perfetto), {config.timeline}.png", flush=True)

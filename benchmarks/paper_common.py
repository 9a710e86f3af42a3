"""Shared helpers of the ``paper_*.py`` scripts: result files, plots, and the small
measured runs (real gloo processes through ``fxpipe.parallelize``) with the planner's
prediction for the same configuration.

The measured model is fxpipe's GPT at h=256, 4 heads, s=128, V=256 (bytes), fp32,
dropout 0, on this machine's CPU cores, one thread per process. Its prediction uses
the profile ``benchmarks/results/cpu_profile.json`` that ``fxpipe calibrate`` writes
right before the measurements (``--cached-profile`` reuses the last one), fp32 bytes,
fused attention (CPU SDPA), 16 bytes of fp32 Adam state per parameter and no
optimizer step (``train_step`` does not step it).
"""
from __future__ import annotations

import csv
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
PROFILE = os.path.join(RESULTS, "cpu_profile.json")
sys.path.insert(0, os.path.dirname(HERE))

HIDDEN, HEADS, SEQ, VOCAB = 256, 4, 128, 256


# ---- result files ------------------------------------------------------------------------
def write_table(name: str, header: Sequence[str], rows: Sequence[Sequence], notes: str = "") -> str:
    """benchmarks/results/<name>.csv and .md; returns the markdown."""
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"{name}.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    fmt = [[_fmt(x) for x in r] for r in rows]
    md = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    md += ["| " + " | ".join(r) + " |" for r in fmt]
    text = "\n".join(md) + ("\n\n" + notes.strip() + "\n" if notes else "\n")
    with open(os.path.join(RESULTS, f"{name}.md"), "w") as f:
        f.write(text)
    return text


def _fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) < 1000 else f"{x:.0f}"
    return str(x)


def figure(width: float = 6.4, height: float = 3.6, ncols: int = 1, nrows: int = 1):
    """(fig, axes) for a small PNG; axes is one Axes, or an array with ncols/nrows > 1."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt.subplots(nrows, ncols, figsize=(width, height))


def save_plot(fig, name: str, dpi: int = 90) -> str:
    """A small PNG (~100 dpi) in benchmarks/results."""
    import matplotlib.pyplot as plt
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, f"{name}.png")
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


# ---- measured runs -----------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Run:
    """One small measured configuration."""

    label: str
    layers: int
    pp: int = 1
    dp: int = 1
    micro_batch: int = 2
    microbatches: int = 4
    schedule: str = "1f1b"
    chunks: int = 1
    recompute: str = "none"
    """none | full: full applies fxpipe's recompute pass to every stage's graph."""

    @property
    def world(self) -> int:
        return self.pp * self.dp


def cpu_profile(recalibrate: bool = False):
    from fxpipe.base.hardware import Hardware
    from fxpipe.planner.machine_speeds import calibrate

    if recalibrate or not os.path.exists(PROFILE):
        hw, meas = calibrate(name="cpu-measured", threads=1, distributed=True, log=print)
        os.makedirs(RESULTS, exist_ok=True)
        hw.save(PROFILE, meas)
    return Hardware.load(PROFILE)


def predict_run(run: Run, hw):
    """The planner's prediction for ``run`` on the calibrated CPU profile."""
    from fxpipe.passes.recompute import RecomputeMode
    from fxpipe.planner import CandidateLayout, PlannerOptions, ScheduleKind, TransformerShape, predict

    shape = TransformerShape(name=run.label, layers=run.layers, hidden=HIDDEN, heads=HEADS, seq=SEQ,
                             vocab=VOCAB, dropout=False)
    opts = PlannerOptions(hardware=hw, dtype_bytes=4, fused_attention=True, optimizer=False,
                          bytes_per_param=16, grad_bytes=4)
    cfg = CandidateLayout(tp=1, pp=run.pp, dp=run.dp, micro_batch=run.micro_batch,
                         num_microbatches=run.microbatches, chunks=run.chunks,
                         schedule=ScheduleKind.parse(run.schedule),
                         recompute=RecomputeMode.parse(run.recompute))
    return predict(shape, cfg, opts)


def _worker(rank: int, world: int, runs: list, steps: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from fxpipe.models.gpt import GPT, GPTConfig
    from fxpipe.passes.recompute import RecomputeMode, apply_recompute
    from fxpipe.parallel import parallelize

    results = []
    for run in runs:
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=run.layers, n_head=HEADS,
                              n_embd=HIDDEN, dropout=0.0))
        rows = run.micro_batch * run.microbatches * run.dp
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=gen)
        batch = (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
        t0 = time.perf_counter()
        pm = parallelize(model, pp=run.pp, dp=run.dp, microbatches=run.microbatches,
                         schedule=run.schedule, chunks=run.chunks, example_inputs=batch,
                         timeout_s=300)
        compile_s = time.perf_counter() - t0
        mode = RecomputeMode.parse(run.recompute)
        if mode is not RecomputeMode.NONE:  # per stage, after split (docs/recompute.md)
            for runner in pm.executor.runners.values():
                gm = apply_recompute(runner.stage.graph_module, pm.plan.program.layers, mode)
                runner.stage = dataclasses.replace(runner.stage, graph_module=gm)
        pm.train_step(batch)  # warm-up
        times, busy, cpu = [], [], []
        for _ in range(steps):
            dist.barrier()
            t, c = time.perf_counter(), time.process_time()
            pm.train_step(batch)
            times.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
            busy.append(sum(e - s for a, s, e in pm.last_stats.events if a.kind.is_compute))
        per_rank = [None] * world
        dist.all_gather_object(per_rank, (times, busy, cpu))
        best = min(range(steps), key=lambda i: max(r[0][i] for r in per_rank))
        results.append(dict(label=run.label, times=[max(r[0][i] for r in per_rank) for i in range(steps)],
                            busy_s=[r[1][best] for r in per_rank], cpu_s=[r[2][best] for r in per_rank],
                            compile_s=compile_s))
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


def measure(runs: Sequence[Run], steps: int = 3) -> dict[str, dict]:
    """Run every configuration (grouped by world size: one process group each) and return
    the median step time per label."""
    from datetime import timedelta

    import torch

    from fxpipe.runtime.local_world import run_local_world

    by_world: dict[int, list[Run]] = {}
    for r in runs:
        by_world.setdefault(r.world, []).append(r)
    out: dict[str, dict] = {}
    for world, group in sorted(by_world.items()):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "res.pt")
            run_local_world(world, _worker, list(group), steps, path, timeout=timedelta(seconds=300), threads=1)
            for res in torch.load(path, weights_only=False):
                out[res["label"]] = res
    return out


def compare(runs: Sequence[Run], measured: dict[str, dict], hw) -> list[list]:
    """Rows: label, measured best and median step ms, predicted ms, measured and predicted
    compute (busy) ms of the busiest rank, error % of the step vs the best.

    The best of the timed steps is the comparison point: this shared 2-core machine runs
    other jobs, which only ever add time, and calibration takes best-of times too. The busy
    columns separate a compute-speed error from a pipeline-structure one."""
    rows = []
    for run in runs:
        pred = predict_run(run, hw)
        res = measured[run.label]
        times = res["times"]
        best, med = min(times), statistics.median(times)
        cpu, busy = max(res["cpu_s"]), max(pred.pipeline.busy)
        rows.append([run.label, round(best * 1e3, 1), round(med * 1e3, 1), round(pred.iteration_s * 1e3, 1),
                     round(max(res["busy_s"]) * 1e3, 1), round(cpu * 1e3, 1), round(busy * 1e3, 1),
                     round(100 * (busy - cpu) / cpu, 1), round(100 * (pred.iteration_s - best) / best, 1)])
    return rows


MEASURED_HEADER = ["run", "measured best ms", "measured median ms", "predicted ms", "measured busy ms",
                   "measured CPU ms", "predicted busy ms", "compute error %", "error vs best %"]


def measured_section(name: str, runs: Sequence[Run], steps: int, recalibrate: bool, what: str) -> list[list]:
    """Measure ``runs``, predict them on the calibrated profile, write results/<name>.md/csv."""
    hw = cpu_profile(recalibrate)
    start = time.perf_counter()
    load = os.getloadavg()[0]
    got = measure(runs, steps)
    rows = compare(runs, got, hw)
    notes = (f"{what} fxpipe's GPT h={HIDDEN}, {HEADS} heads, s={SEQ}, V={VOCAB}, fp32, one thread per "
             f"process, gloo; {steps} timed steps after one warm-up (best and median). Prediction: the "
             f"planner on the calibrated profile `{os.path.relpath(PROFILE, os.path.dirname(HERE))}` "
             f"(no optimizer step). Mean |error| of the step vs best: {mean_abs([r[-1] for r in rows]):.1f}%; "
             f"of the compute (predicted busy vs measured CPU): {mean_abs([r[-2] for r in rows]):.1f}%. "
             f"Busy: wall time of the busiest rank's compute actions in the best step; CPU: its "
             f"process CPU time in that step (what other jobs cannot inflate). Load average "
             f"{load:.1f} → {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores while measuring "
             f"({time.perf_counter() - start:.0f} s).")
    print(write_table(name, MEASURED_HEADER, rows, notes))
    return rows


def mean_abs(values: Sequence[float]) -> float:
    return statistics.mean(abs(v) for v in values) if values else float("nan")


# ---- paper scale -------------------------------------------------------------------------
def paper_shape(label: str, layers: int, hidden: int, heads: int):
    """A GPT of the paper's family: s=2048, V=51200, dropout on."""
    from fxpipe.planner import TransformerShape
    return TransformerShape(name=label, layers=layers, hidden=hidden, heads=heads, seq=2048, vocab=51200)


def paper_options(**kw):
    """The figure scripts' settings (Megatron-LM examples/sc21/run_figure_*.sh): A100,
    Megatron's equal layer split, DDP=local (all-reduce after the backward),
    scatter-gather on."""
    from fxpipe.planner import DPOverlap, LayerBalance, PlannerOptions
    return PlannerOptions(**{**dict(balance=LayerBalance.MEGATRON, dp_overlap=DPOverlap.NONE,
                                    scatter_gather=True), **kw})


def paper_config(*, t: int, p: int, d: int = 1, b: int = 1, B: int, v: int = 1, recompute: str = "full"):
    from fxpipe.passes.recompute import RecomputeMode
    from fxpipe.planner import CandidateLayout, ScheduleKind
    return CandidateLayout(tp=t, pp=p, dp=d, micro_batch=b, num_microbatches=B // (d * b), chunks=v,
                          schedule=ScheduleKind.INTERLEAVED if v > 1 else ScheduleKind.ONE_F_ONE_B,
                          recompute=RecomputeMode.parse(recompute))


def common_args(description: str, measured: bool = True):
    import argparse
    ap = argparse.ArgumentParser(description=description)
    if measured:
        ap.add_argument("--no-measured", action="store_true", help="paper scale only (seconds)")
        ap.add_argument("--steps", type=int, default=5, help="timed steps per measured run (best counts)")
        ap.add_argument("--cached-profile", action="store_true",
                        help="reuse results/cpu_profile.json instead of calibrating right before "
                             "measuring (the default: this shared machine's load changes)")
    return ap.parse_args()


def measured_panel(ax, rows: list[list], title: str = "small GPT on this CPU (gloo)") -> None:
    """Grouped bars: measured best step time vs the prediction, per run."""
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r[1] for r in rows], 0.4, label="measured (best)")
    ax.bar([i + 0.2 for i in x], [r[3] for r in rows], 0.4, label="predicted")
    ax.scatter([i - 0.2 for i in x], [r[5] for r in rows], marker="_", s=200, color="k", zorder=3,
               label="measured CPU (busiest rank)")
    ax.scatter([i + 0.2 for i in x], [r[6] for r in rows], marker="_", s=200, color="r", zorder=3,
               label="predicted busy")
    ax.set_xticks(list(x), [r[0] for r in rows], rotation=30, fontsize=7, ha="right")
    ax.set_ylabel("ms per step")
    ax.set_title(f"{title}: mean |err| step {mean_abs([r[-1] for r in rows]):.0f}%, "
                 f"compute {mean_abs([r[-2] for r in rows]):.0f}%", fontsize=8)
    ax.legend(fontsize=7)

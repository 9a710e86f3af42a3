"""fxpipe's pipeline runtime vs torch.distributed.pipelining vs one process.

    .venv/bin/python benchmarks/bench_runtime.py [--steps 10]

HF GPT-2 config (8 layers, h=256, 4 heads, s=128, V=50257), pp=2 on 2 processes
with 1 thread each, 1F1B, m=8 microbatches of 2 sequences. Both pipelines run
fxpipe's stage GraphModules (the same split, from the ILP partitioner), so the
difference is the runtime alone. The single-process baseline runs the eager model
with gradient accumulation over the same 8 microbatches on 1 thread.

Also writes the measured per-rank timeline of one fxpipe step and the simulator's
prediction for the same per-stage costs (benchmarks/results/runtime_*.png) and
prints the prediction error of the makespan. Medians over --steps timed steps
after 2 warm-up steps.
"""
from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

M, B_MICRO, SEQ, LAYERS, HIDDEN, HEADS, VOCAB = 8, 2, 128, 8, 256, 4, 50257
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def workload():
    from fxpipe.losses import causal_lm_loss
    from fxpipe.models.hf import _gpt2

    torch.manual_seed(0)
    model = _gpt2(layers=LAYERS, hidden=HIDDEN, heads=HEADS, vocab=VOCAB, seq=SEQ)
    ids = torch.randint(0, VOCAB, (M * B_MICRO, SEQ), generator=torch.Generator().manual_seed(0))
    return model, (ids, ids.clone()), causal_lm_loss


class _PiPPyStage(nn.Module):
    """One fxpipe stage GraphModule as the nn.Module torch.distributed.pipelining drives.

    Parameters become registered parameters; batch inputs that a later stage reads
    (labels, ids for position ids) come from ``self.microbatches``, in microbatch
    order, as 1F1B runs each stage's forwards in that order."""

    def __init__(self, plan, stage, state):
        super().__init__()
        self.plan, self.stage = plan, stage
        self.names = plan.stage_params(stage.index)
        self.params = nn.ParameterList([nn.Parameter(state[n].detach().clone()) for n in self.names])
        self.microbatches: list = []
        self.calls = 0

    def forward(self, *received):
        state = dict(zip(self.names, self.params))
        batch = self.microbatches[self.calls % len(self.microbatches)]
        self.calls += 1
        recv = dict(zip(self.stage.inputs, received))
        out = self.stage.call(state, self.plan.canonical, batch, recv)
        if self.stage.is_last:  # pipelining concatenates last-stage outputs: no 0-d tensors
            return out[-1].reshape(1)
        return out[0] if len(out) == 1 else out


def _time(fn, steps):
    for _ in range(2):
        fn()
    times = []
    for _ in range(steps):
        dist.barrier()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def worker(rank: int, port: int, steps: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=120))
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from fxpipe.runtime.api import parallelize

    model, batch, loss_fn = workload()
    pm = parallelize(model, pp=2, microbatches=M, schedule="1f1b", example_inputs=batch, loss_fn=loss_fn)
    fx_time = _time(lambda: pm.train_step(batch), steps)
    events = pm.last_stats.events

    stage = pm.plan.stages[rank]
    module = _PiPPyStage(pm.plan, stage, pm.state)
    pstage = PipelineStage(module, rank, 2, torch.device("cpu"))
    sched = Schedule1F1B(pstage, n_microbatches=M, loss_fn=lambda loss, target: loss.sum())
    micro = [tuple(t.chunk(M)[i] for t in batch) for i in range(M)]
    dummy_target = torch.zeros(M * B_MICRO)

    def pippy_step():
        module.microbatches, module.calls = micro, 0
        if rank == 0:
            sched.step(batch[0])
        else:
            sched.step(target=dummy_target)

    pippy_time = _time(pippy_step, steps)
    dist.barrier()
    # The cost model's own prediction per stage (CPU preset, uncalibrated), for comparison.
    from fxpipe.hardware import CPU
    predicted = {"F": [0.0, 0.0], "B": [0.0, 0.0]}
    for name, k in pm.plan.program.stages.items():
        c = pm.plan.program.costs[name]
        predicted["F"][k] += CPU.forward_s(c) * 1e3
        predicted["B"][k] += CPU.backward_s(c) * 1e3
    torch.save(dict(fx=fx_time, pippy=pippy_time, events=[(str(a), s, e) for a, s, e in events],
                    schedule=pm.schedule, predicted=predicted), os.path.join(out, f"{rank}.pt"))
    dist.destroy_process_group()


def single_process(steps: int) -> float:
    torch.set_num_threads(1)
    model, batch, loss_fn = workload()
    micro = [tuple(t.chunk(M)[i] for t in batch) for i in range(M)]

    def step():
        for ids, labels in micro:
            (loss_fn(model(ids), labels) / M).backward()

    for _ in range(2):
        step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def timelines(per_rank_events, schedule, predicted) -> None:
    from fxpipe.schedules.ir import Action, ActionKind
    from fxpipe.schedules.render.gantt import render_gantt
    from fxpipe.schedules.simulate import StageDurations, simulate
    from fxpipe.schedules.timeline import Timeline

    t0 = min(s for ev in per_rank_events for _, s, _ in ev)
    measured = [[(Action.parse(a), (s - t0) * 1e3, (e - t0) * 1e3) for a, s, e in ev] for ev in per_rank_events]
    compute = [[x for x in ev if x[0].kind.is_compute] for ev in measured]
    tl = Timeline.from_events(compute, unit="ms", title="measured fxpipe 1F1B, HF GPT-2 8L h256, p=2 m=8")
    dur = {k: [[] for _ in range(schedule.num_stages)] for k in (ActionKind.F, ActionKind.B)}
    for ev in compute:
        for a, s, e in ev:
            dur[a.kind][a.stage].append(e - s)
    med = {k: [statistics.median(x) for x in v] for k, v in dur.items()}
    durations = StageDurations(forward=med[ActionKind.F], backward=med[ActionKind.B],
                               weight=[b / 2 for b in med[ActionKind.B]])
    sim = simulate(schedule.compute_only(), durations)
    measured_span = max(float(e.max()) for e in tl.end) - min(float(s.min()) for s in tl.start)
    os.makedirs(RESULTS, exist_ok=True)
    render_gantt(tl, os.path.join(RESULTS, "runtime_measured.png"))
    sim_tl = Timeline(actions=sim.timeline.actions, start=sim.timeline.start, end=sim.timeline.end,
                      unit="ms", title="simulated with the measured per-stage F/B medians")
    render_gantt(sim_tl, os.path.join(RESULTS, "runtime_simulated.png"))
    print(f"per-stage medians: F {['%.1f' % x for x in med[ActionKind.F]]} ms, "
          f"B {['%.1f' % x for x in med[ActionKind.B]]} ms")
    print(f"makespan of one step: measured {measured_span:.1f} ms, simulated {sim.makespan:.1f} ms "
          f"(error {(sim.makespan - measured_span) / measured_span:+.1%}); "
          f"bubble measured {1 - sum(float((e - s).sum()) for s, e in zip(tl.start, tl.end)) / (2 * measured_span):.1%}, "
          f"simulated {sum(sim.bubble_fraction) / 2:.1%}")
    model = simulate(schedule.compute_only(), StageDurations(
        forward=predicted["F"], backward=predicted["B"], weight=[b / 2 for b in predicted["B"]]))
    print(f"cost model alone (CPU preset, uncalibrated): F {['%.1f' % x for x in predicted['F']]} ms, "
          f"B {['%.1f' % x for x in predicted['B']]} ms, makespan {model.makespan:.1f} ms "
          f"(error {(model.makespan - measured_span) / measured_span:+.1%})")
    print(f"timelines: {RESULTS}/runtime_measured.png, runtime_simulated.png")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    print(f"machine: {platform.machine()} cpus={os.cpu_count()} torch={torch.__version__}; "
          f"2 processes x 1 thread, gloo")
    with tempfile.TemporaryDirectory() as out, socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        mp.start_processes(worker, args=(port, args.steps, out), nprocs=2, start_method="spawn")
        res = [torch.load(os.path.join(out, f"{r}.pt"), weights_only=False) for r in range(2)]
    single = single_process(args.steps)
    fx = max(r["fx"] for r in res)
    pippy = max(r["pippy"] for r in res)
    print(f"median step time over {args.steps} steps (ms): fxpipe {fx * 1e3:.1f}, "
          f"torch.distributed.pipelining {pippy * 1e3:.1f}, single process {single * 1e3:.1f}")
    print(f"ratios: fxpipe / pipelining = {fx / pippy:.3f}; single process / fxpipe = {single / fx:.3f} "
          f"(speed-up from 2 pipeline processes)")
    timelines([r["events"] for r in res], res[0]["schedule"], res[0]["predicted"])


if __name__ == "__main__":
    main()

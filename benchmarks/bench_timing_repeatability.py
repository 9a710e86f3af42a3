"""How repeatable the layout search's timing of one shape is, and the calibrated cost per
action: the same measurement taken again and again in one process.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_timing_repeatability.py [--calls 8]
        [--models gpt-tiny deep-narrow wide-vocab] [--rows 1 16]

For each model of ``bench_auto_layout.py`` (global batch 16 × 32) and micro-batch size,
the search's timing of one tp rank's compute at that shape (``CaptureCosts._timed``:
probe groups, each net of the stage runner's fixed cost, ``costs/measure.py``) is taken
``--calls`` times in a row in this process, one thread, nothing cached between calls;
after each call a fixed reference (a 32×64 layer norm, matmul and GELU and a small
softmax, forward and backward, median of 40, thread CPU time) says whether the machine
itself was slower at that moment. Then ``measure_action_overhead`` (what ``fxpipe
calibrate`` writes as the runtime's cost per action) is taken ``--calls`` times with seven
interleaved windows each (each window's own listed, the call's the median), then
``--calls`` times with one window each, as calibration takes it.

First the reference alone every half second for ``--watch-s`` seconds: the machine's
own speed and how it moves. Prints each call's summed forward and backward (ms), their spread (max / min) and the
reference's spread. A shape's price is the sum over its nodes, so a spread here moves
every layout of that shape together; the reference tells a machine that slowed down
from a timing that moved by itself. Writes benchmarks/results/bench_timing_repeatability.txt.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_auto_layout import workload  # noqa: E402
from benchmarks.results_log import recorded  # noqa: E402
from fxpipe.base.hardware import get_hardware  # noqa: E402
from fxpipe.ir.parallel_config import ParallelConfig  # noqa: E402
from fxpipe.planner.layout_costs import CaptureCosts  # noqa: E402
from fxpipe.planner.machine_speeds import measure_action_overhead  # noqa: E402

BATCH, SEQ = 16, 32


def reference_s(reps: int = 40) -> float:
    """Median thread CPU seconds of a fixed small forward and backward (the machine's
    speed at this moment, for ops of the sizes a tiny model's groups run)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(32, 64, generator=gen, requires_grad=True)
    w = torch.randn(64, 192, generator=gen, requires_grad=True)
    a = torch.randn(2, 4, 32, 32, generator=gen)
    out = []
    for _ in range(reps):
        start = time.thread_time()
        y = torch.nn.functional.gelu(torch.nn.functional.layer_norm(x, (64,)) @ w)
        (torch.softmax(a * 0.1, -1).sum() + y.sum()).backward()
        out.append(time.thread_time() - start)
    return statistics.median(out)


def _spread(values: list[float]) -> str:
    return (f"min {min(values) * 1e3:.3f}  median {statistics.median(values) * 1e3:.3f}  "
            f"max {max(values) * 1e3:.3f} ms  (max/min {max(values) / min(values):.2f})")


def shape_calls(model: str, rows: int, calls: int, hardware: str) -> None:
    w = workload(model, BATCH, SEQ)
    base = ParallelConfig(hardware=hardware)
    costs = CaptureCosts(w.model, w.example_inputs, base, w.loss_fn, True, 1)
    config = dataclasses.replace(base, num_microbatches=BATCH // rows)
    fwd, bwd, ref = [], [], []
    print(f"## {model}, micro-batch {rows}x{SEQ}: {calls} timings of the shape in one process")
    print("call  forward ms  backward ms  reference us")
    for call in range(calls):
        costs.timed.clear()  # time it again: nothing kept from the call before
        timed = costs._timed(config, rows)
        if timed is None:
            print(f"timing failed: {costs.notes[-1]}")
            return
        fwd.append(sum(t[0] for t in timed.fused.values()))
        bwd.append(sum(t[1] for t in timed.fused.values()))
        ref.append(reference_s())
        print(f"{call:>4}  {fwd[-1] * 1e3:>10.3f}  {bwd[-1] * 1e3:>11.3f}  {ref[-1] * 1e6:>12.0f}", flush=True)
    print(f"forward   {_spread(fwd)}")
    print(f"backward  {_spread(bwd)}")
    print(f"reference {_spread(ref)}\n")


def action_calls(calls: int, hardware: str) -> None:
    hw = get_hardware(hardware)
    got = []
    print(f"## the runtime's cost per action (measure_action_overhead), {calls} calls of seven interleaved windows each")
    print("call  step m=1 ms  step m=8 ms  per action us  reference us  its windows' own us")
    for call in range(calls):
        a = measure_action_overhead(hw, trials=7)
        got.append(a["action_overhead_s"])
        print(f"{call:>4}  {a['step_m1_s'] * 1e3:>11.2f}  {a['step_m8_s'] * 1e3:>11.2f}  "
              f"{a['action_overhead_s'] * 1e6:>13.0f}  {reference_s() * 1e6:>12.0f}  "
              f"{' '.join(f'{t * 1e6:.0f}' for t in a['action_overhead_trials_s'])}", flush=True)
    _per_action(got)
    single = [measure_action_overhead(hw, trials=1)["action_overhead_s"] for _ in range(calls)]
    print(f"one window each (as `fxpipe calibrate` takes it): {' '.join(f'{g * 1e6:.0f}' for g in single)} us")
    _per_action(single)


def _per_action(got: list[float]) -> None:
    positive = [g for g in got if g > 0]
    print(f"per action: min {min(got) * 1e6:.0f}  median {statistics.median(got) * 1e6:.0f}  max {max(got) * 1e6:.0f} us"
          + (f"  (max/min {max(positive) / min(positive):.2f})" if len(positive) == len(got) else ""))


def speed_over_time(seconds: float, every: float = 0.5) -> None:
    """The reference alone, every ``every`` seconds for ``seconds``: the machine's own
    speed as it moves, with nothing of fxpipe's running."""
    print(f"## the reference alone, every {every:g} s for {seconds:g} s (us)")
    got, start = [], time.perf_counter()
    while time.perf_counter() - start < seconds:
        got.append(reference_s())
        time.sleep(max(0.0, every - got[-1] * 40))
    for i in range(0, len(got), 15):
        print(" ".join(f"{g * 1e6:4.0f}" for g in got[i:i + 15]))
    q = statistics.quantiles(got, n=10)
    print(f"10th percentile {q[0] * 1e6:.0f} us, 90th {q[-1] * 1e6:.0f} us (x{q[-1] / q[0]:.2f}); "
          f"median {statistics.median(got) * 1e6:.0f} us\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=8)
    p.add_argument("--models", nargs="+", default=["gpt-tiny", "deep-narrow", "wide-vocab"])
    p.add_argument("--rows", nargs="+", type=int, default=[1, 16])
    p.add_argument("--watch-s", type=float, default=30.0, help="seconds of the reference alone (0: none)")
    p.add_argument("--hardware", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                      "bench_auto_layout_hardware.json"),
                   help="the profile the timings' cost model falls back to (default: bench_auto_layout's)")
    args = p.parse_args()
    torch.set_num_threads(1)  # as each rank of the world-2 benchmark runs
    with recorded("bench_timing_repeatability"):
        start = time.perf_counter()
        print(f"torch {torch.__version__}, 1 thread, load average {os.getloadavg()[0]:.1f} at start\n")
        if args.watch_s > 0:
            speed_over_time(args.watch_s)
        for model in args.models:
            for rows in args.rows:
                shape_calls(model, rows, args.calls, args.hardware)
        action_calls(args.calls, args.hardware)
        print(f"\n{time.perf_counter() - start:.0f} s, load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()

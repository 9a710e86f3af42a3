"""``fxpipe calibrate``: measure this machine into a ``Hardware`` profile (~15-20 s); the
compute measurements are ``compute_speeds.py``'s.

- matmul: fp32 square products (256…1024) on ``threads`` threads give the peak; the
  median rate of training-shaped GEMMs in their forward and backward layouts over the
  peak is the matmul efficiency;
- memory: a 128 MB copy and a mix of element-wise kernels (add, GeLU, LayerNorm, softmax)
  on 2 MB tensors; the larger rate is the peak, the mix's share of it the memory
  efficiency (on a CPU the mix may run from cache, or be compute bound, as GeLU);
- attention: a causal SDPA forward + backward, FLOPs counted as the planner counts
  them, over the GEMM rate is the attention efficiency;
- all of the above alone and by two processes at once; the profile keeps the loaded
  numbers (every core busy, as in a multi-rank run); compute is timed in thread CPU
  time (best of repeats), so other jobs on a shared machine do not slow the profile;
- per-kernel overhead: a 1-element add (eager dispatch), then raised to what fxpipe's own
  path costs (fx GraphModule + autograd): the value that makes the cost model reproduce
  a tiny, overhead-bound GPT's measured step (``measure_framework_overhead``);
- per-action overhead: what the runtime pays per forward or backward of one microbatch
  on one stage beyond the cost model, from a tiny GPT trained with 1 and with 8
  microbatches in a world of one (``measure_action_overhead``; the layout search adds it);
- per optimizer tensor: torch's AdamW over 64 tiny tensors, whose bytes cost nothing, in
  thread CPU time (``measure_optimizer_tensor``; the price adds it per tensor a rank steps);
- gloo, two fresh processes: ping-pong send/recv and all-reduce over 4 KB…8 MB (wall
  time, median of repeats); a least-squares line t = latency + bytes/bandwidth per
  collective (all-reduce on 2 ranks: t = S/busbw + 2·latency, the ring formula of
  ``Hardware.collective_s``); and each transfer end's own cost, the mean time the runtime
  takes to post a send or a receive inside a tiny 2-stage pipeline (``pipeline_posts``;
  the price adds it per transfer a pipeline rank makes).
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import platform
import statistics
import tempfile
import time
from typing import Any, Callable

import numpy as np
import torch

from fxpipe.base.hardware import CPU, Hardware, Link
from fxpipe.compiler.capture import capture
from fxpipe.compiler.driver import run_passes
from fxpipe.models.gpt import GPT, GPTConfig
from fxpipe.planner.compute_speeds import best_rate, measure_compute
from fxpipe.planner.layout_price import price
from fxpipe.planner.options import CandidateLayout, PlannerOptions
from fxpipe.planner.predict import predict
from fxpipe.planner.shapes import TransformerShape
from fxpipe.planner.tiny_runtime import tiny_batch, tiny_runtime
from fxpipe.planner.transfer_speeds import describe_end, pipeline_posts, transfer_end_s
from fxpipe.runtime.local_world import free_port, join_local_world

SIZES = (4 << 10, 64 << 10, 512 << 10, 2 << 20, 8 << 20)
"""Message sizes in bytes for the gloo measurements."""


def measure_framework_overhead(hw: Hardware) -> dict[str, float]:
    """Per-kernel overhead of fxpipe's own path (fx GraphModule + autograd), from a tiny GPT
    (h=32, 4 layers, 16 tokens) whose step is all overhead: the value that makes the
    planner's cost model reproduce its measured forward + backward. The planner's time is
    linear in ``op_overhead_s``, so two predictions give the slope."""

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=32)
    x, y = torch.randint(0, 64, (1, 16)), torch.randint(0, 64, (1, 16))
    prog, _ = run_passes(capture(GPT(cfg), (x, y)))
    state = {k: t.detach().clone().requires_grad_(t.requires_grad) for k, t in prog.state.items()}
    args = [state[p.canonical] for p in prog.params] + [x, y]

    def step() -> None:
        out = prog.graph_module(*args)
        (out[prog.loss_output] if isinstance(out, (tuple, list)) else out).backward()

    measured = 1.0 / best_rate(step, 1.0, 0.3)
    shape = TransformerShape(name="tiny", layers=4, hidden=32, heads=2, seq=16, vocab=64, dropout=False)
    layout = CandidateLayout(tp=1, pp=1, dp=1, micro_batch=1, num_microbatches=1)

    def model(overhead: float) -> float:
        opts = PlannerOptions(hardware=dataclasses.replace(hw, op_overhead_s=overhead), dtype_bytes=4,
                              fused_attention=True, optimizer=False)
        return predict(shape, layout, opts).iteration_s

    base, slope = model(0.0), (model(1e-6) - model(0.0)) / 1e-6
    return dict(tiny_step_s=measured, op_overhead_s=max(hw.op_overhead_s, (measured - base) / slope))


def measure_action_overhead(hw: Hardware, steps: int = 15, trials: int = 1) -> dict[str, float]:
    """The runtime's fixed cost per compute action (``Hardware.action_overhead_s``): a tiny
    GPT (h=16, one layer, 8 rows of 8 tokens) trained by the real runtime in a world of one
    with m = 1 and m = 8 microbatches; what the 8 microbatches cost beyond what the layout
    search predicts for them (FLOPs, bytes and per-kernel overhead at ``hw``), over their
    2·7 extra forward and backward actions.

    ``trials`` > 1: the two timed in that many interleaved windows of ``steps`` steps, the
    cost the median of the windows' own (``action_overhead_trials_s`` lists them). More
    windows did not make it repeatable on the 2-vCPU VM, whose own speed moves by 1.3-1.5x
    between states that last seconds (``benchmarks/bench_timing_repeatability.py``: six
    calls of seven windows gave 193-737 us, six of one window 193-616 us), so calibration
    keeps one."""
    import torch.distributed as dist  # a process group of one, only while measuring

    torch.manual_seed(0)
    batch = tiny_batch()
    ours = not dist.is_initialized()
    predicted, models = {}, {}
    # A world of one waits for no peer: with one thread its step takes exactly its
    # thread's CPU time, whatever else the machine runs (as the search's timing).
    now = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    try:
        for m in (1, 8):
            compiled, models[m] = tiny_runtime(1, batch, microbatches=m)
            predicted[m] = price(compiled, hw).step_s
            models[m].train_step(batch)
        windows: dict[int, list[float]] = {1: [], 8: []}
        for _ in range(trials):
            for m, pm in models.items():
                times = []
                for _ in range(steps):
                    start = now()
                    pm.train_step(batch)
                    times.append(now() - start)
                windows[m].append(statistics.median(times))
    finally:
        for pm in models.values():
            pm.close()
        if ours and dist.is_initialized():
            dist.destroy_process_group()
    per_trial = [((m8 - m1) - (predicted[8] - predicted[1])) / (2 * 7) for m1, m8 in zip(windows[1], windows[8])]
    return dict(step_m1_s=statistics.median(windows[1]), step_m8_s=statistics.median(windows[8]),
                action_overhead_s=max(0.0, statistics.median(per_trial)),
                action_overhead_trials_s=per_trial)


def measure_optimizer_tensor(hw: Hardware, tensors: int = 64, steps: int = 21) -> dict[str, float]:
    """The optimizer step's fixed cost per parameter tensor (``Hardware.optimizer_tensor_s``):
    torch's AdamW over ``tensors`` tensors of 8 elements, whose bytes cost nothing beside
    it, median thread CPU seconds of a step over the tensors (the first step, which creates
    the moments, left out)."""
    params = [torch.zeros(8, requires_grad=True) for _ in range(tensors)]
    for t in params:
        t.grad = torch.ones(8)
    opt = torch.optim.AdamW(params, lr=1e-3)
    opt.step()
    times = []
    for _ in range(steps):
        start = time.thread_time()
        opt.step()
        times.append(time.thread_time() - start)
    return dict(adamw_step_s=statistics.median(times), tensors=tensors,
                optimizer_tensor_s=statistics.median(times) / tensors)


def _fit(sizes: list[int], times: list[float]) -> tuple[float, float]:
    """(seconds per byte, intercept) of the line through the points, least squares on the
    relative error (so the small messages set the latency, the large the bandwidth)."""
    t = np.asarray(times, float)
    slope, intercept = np.polyfit(np.asarray(sizes, float), t, 1, w=1 / t)
    return max(float(slope), 1e-15), max(float(intercept), 0.0)


def _gloo_worker(rank: int, port: int, out: str, threads: int) -> None:
    """One of the two measuring processes: compute while the other computes too (a fully
    loaded machine, as in a 2-rank run), then p2p ping-pong and all-reduce."""
    import json

    import torch.distributed as dist

    join_local_world(rank, 2, port, timeout=datetime.timedelta(seconds=60))
    dist.barrier()
    compute = measure_compute(threads)
    warm = torch.zeros(SIZES[-1] // 4)
    for _ in range(3):  # connection set-up and first-touch costs stay out of the numbers
        dist.all_reduce(warm)
        if rank == 0:
            dist.send(warm, 1)
        else:
            dist.recv(warm, 0)
    p2p, ar = [], []
    for nbytes in SIZES:
        buf = torch.zeros(nbytes // 4)
        reps = 20 if nbytes < (1 << 20) else 6
        rtts, times = [], []
        for i in range(reps + 2):
            dist.barrier()
            t = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            if i >= 2:
                rtts.append(time.perf_counter() - t)
        # The mean, not the median: the price sums a step's collectives, and a gloo
        # all-reduce's time is not one value with noise around it. Each is handed to the
        # process group's worker thread and back; on a 2-vCPU VM a 4 KB all-reduce took
        # 0.53 ms at its 25th percentile and 3.2 ms at its 75th (median 0.80, mean 1.96 ms:
        # benchmarks/bench_gloo_latency.py), so a median of 20 said 0.44 ms where a step's
        # 200 TP all-reduces cost about 2 ms each.
        for i in range(3 * reps + 2):
            dist.barrier()
            t = time.perf_counter()
            dist.all_reduce(buf)
            if i >= 2:
                times.append(time.perf_counter() - t)
        p2p.append(statistics.median(rtts) / 2)
        ar.append(statistics.mean(times))
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(dict(compute=compute, p2p=p2p, all_reduce=ar, posts=pipeline_posts()), f)
    dist.destroy_process_group()


def measure_gloo(threads: int) -> dict[str, Any]:
    """Two fresh interpreters (not multiprocessing's spawn, which would re-run the caller's
    ``__main__``, e.g. ``python -m fxpipe``)."""
    import json
    import subprocess
    import sys

    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        code = "import sys; from fxpipe.planner.machine_speeds import _gloo_worker as w; " \
               "w(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))"
        procs = [subprocess.Popen([sys.executable, "-c", code, str(r), str(port), tmp, str(threads)])
                 for r in range(2)]
        codes = [p.wait(timeout=120) for p in procs]
        if any(codes):
            raise RuntimeError(f"calibration workers failed with exit codes {codes}")
        res = [json.load(open(os.path.join(tmp, f"{r}.json"))) for r in range(2)]
    sizes = list(SIZES)
    p2p_slope, p2p_lat = _fit(sizes, res[0]["p2p"])
    ar_slope, ar_int = _fit(sizes, res[0]["all_reduce"])
    return dict(sizes=sizes, p2p_s=res[0]["p2p"], all_reduce_s=res[0]["all_reduce"],
                p2p_bw=1 / p2p_slope, p2p_latency=p2p_lat,
                collective_bw=1 / ar_slope, collective_latency=ar_int / 2,
                transfer_cpu_s=transfer_end_s([r["posts"] for r in res]), posts=[r["posts"] for r in res],
                compute_concurrent=[r["compute"] for r in res])


def _ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return CPU.memory_bytes


def _refine(hw: Hardware, measurements: dict[str, Any], key: str, measure: Callable[[Hardware], dict[str, Any]],
            field: str) -> tuple[Hardware, dict[str, Any]]:
    """One overhead measured against the profile so far (it prices the rest of a tiny
    step, so the later measurement sees the earlier one), kept under ``key`` and written
    into the profile's ``field``."""
    got = measure(hw)
    measurements[key] = got
    return dataclasses.replace(hw, **{field: got[field]}), got


def calibrate(*, name: str = "cpu-measured", threads: int = 1, distributed: bool = True,
              log: Callable[[str], None] = print) -> tuple[Hardware, dict[str, Any]]:
    """Measure this machine; returns the profile and the raw measurements.

    With ``distributed`` the profile's compute numbers are those measured by two processes
    at once (every core busy, shared caches and memory bandwidth, as in a multi-rank run;
    a device of the node model); the single-process numbers are kept in the measurements."""
    start = time.perf_counter()
    alone = measure_compute(threads)
    measurements: dict[str, Any] = dict(compute_alone=alone)
    compute, link = alone, CPU.intra_node
    if distributed:
        gloo = measure_gloo(threads)
        measurements["gloo"] = gloo
        loaded = gloo["compute_concurrent"]
        compute = {k: statistics.mean(c[k] for c in loaded) for k in loaded[0]
                   if isinstance(loaded[0][k], float)}
        link = Link(p2p_bw=gloo["p2p_bw"], p2p_latency=gloo["p2p_latency"],
                    collective_bw=gloo["collective_bw"], collective_latency=gloo["collective_latency"])
    for label, c in (("alone", alone), ("profile", compute)):
        log(f"{label:<8} matmul peak {c['peak_flops'] / 1e9:.1f} GFLOP/s fp32 ({threads} thread(s)), "
            f"training GEMMs {c['training_gemm_flops'] / 1e9:.1f} (eff {c['matmul_efficiency']:.2f}); "
            f"copy {c['copy_bw'] / 1e9:.2f} GB/s, element-wise {c['elementwise_bw'] / 1e9:.2f} "
            f"(eff {c['memory_efficiency']:.2f}); attention eff {c['attention_efficiency']:.2f}; "
            f"kernel overhead {c['op_overhead_s'] * 1e6:.1f} us")
    if distributed:
        log(f"gloo     p2p {link.p2p_bw / 1e9:.2f} GB/s + {link.p2p_latency * 1e6:.0f} us; all-reduce "
            f"busbw {link.collective_bw / 1e9:.2f} GB/s + {link.collective_latency * 1e6:.0f} us per step; "
            f"{gloo['transfer_cpu_s'] * 1e6:.0f} us of a rank's own time per transfer end{describe_end(gloo['posts'])}")
    hw = Hardware(
        name=name, peak_flops=compute["peak_flops"], matmul_efficiency=compute["matmul_efficiency"],
        peak_memory_bw=compute["peak_memory_bw"], memory_efficiency=compute["memory_efficiency"],
        attention_efficiency=compute["attention_efficiency"], memory_bytes=_ram_bytes(),
        gpus_per_node=os.cpu_count() or 1, intra_node=link, inter_node=link,
        op_overhead_s=compute["op_overhead_s"],
        transfer_cpu_s=measurements["gloo"]["transfer_cpu_s"] if distributed else CPU.transfer_cpu_s,
        backend="gloo",
        source=f"fxpipe calibrate, {platform.node()} {platform.machine()} "
               f"{datetime.date.today().isoformat()}, {threads} thread(s), torch {torch.__version__}"
               + (", compute measured by 2 processes at once" if distributed else ""))
    hw, framework = _refine(hw, measurements, "framework", measure_framework_overhead, "op_overhead_s")
    log(f"fxpipe   a tiny GPT's step {framework['tiny_step_s'] * 1e3:.2f} ms: per-kernel overhead "
        f"{hw.op_overhead_s * 1e6:.1f} us (fx + autograd), kernel dispatch alone "
        f"{compute['op_overhead_s'] * 1e6:.1f} us")
    hw, action = _refine(hw, measurements, "action", measure_action_overhead, "action_overhead_s")
    log(f"runtime  a tiny GPT's step {action['step_m1_s'] * 1e3:.2f} ms with 1 microbatch, "
        f"{action['step_m8_s'] * 1e3:.2f} ms with 8: {hw.action_overhead_s * 1e6:.0f} us per forward or backward "
        f"action beyond the cost model")
    hw, optimizer = _refine(hw, measurements, "optimizer", measure_optimizer_tensor, "optimizer_tensor_s")
    log(f"optimizer AdamW over {optimizer['tensors']} small tensors {optimizer['adamw_step_s'] * 1e3:.2f} ms: "
        f"{hw.optimizer_tensor_s * 1e6:.0f} us per tensor")
    log(f"calibrated in {time.perf_counter() - start:.1f} s")
    return hw, measurements

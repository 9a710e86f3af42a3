"""This machine's compute speeds for ``fxpipe calibrate`` (``machine_speeds.py``): matmul
peak and training-GEMM efficiency, the memory-bound kernel mix, a fused attention step and
one kernel's dispatch, each the best of repeats in this thread's CPU time."""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch


def best_rate(fn: Callable[[], None], work: float, budget_s: float = 0.4) -> float:
    """``work`` per second of the fastest call, timed in this thread's CPU time: on a shared
    machine wall time also counts the moments the scheduler runs someone else, CPU time
    does not (the kernels run single-threaded on the calling thread: ``threads=1``)."""
    fn()  # warm-up
    best, spent = float("inf"), 0.0
    while spent < budget_s:
        t = time.thread_time()
        fn()
        dt = time.thread_time() - t
        best, spent = min(best, dt), spent + dt
    return work / max(best, 1e-9)


GEMM_SHAPES = ((512, 768, 256), (512, 256, 256), (512, 1024, 256), (512, 256, 1024), (256, 1024, 512))
"""(M, N, K) of training-like GEMMs (a small transformer's projections); each is timed as
A·B, Aᵀ·B and A·Bᵀ, the three layouts forward and backward use."""


def _gemm_rates(threads: int) -> list[float]:
    rates = []
    for M, N, K in GEMM_SHAPES:
        a, b = torch.randn(M, K), torch.randn(K, N)
        at, bt = a.t().contiguous(), b.t().contiguous()
        flops = 2.0 * M * N * K
        rates += [best_rate(lambda: torch.mm(a, b), flops, 0.1),
                  best_rate(lambda: torch.mm(at.t(), b), flops, 0.1),
                  best_rate(lambda: torch.mm(a, bt.t()), flops, 0.1)]
    return rates


def _elementwise_rate() -> float:
    """Bytes/s over a mix of a layer's memory-bound kernels (add, GeLU, LayerNorm, softmax)
    on fp32 (512, 1024) tensors, each counted as its reads + writes."""
    x, y = torch.randn(512, 1024), torch.randn(512, 1024)
    w, bias = torch.ones(1024), torch.zeros(1024)
    nbytes = x.numel() * 4
    kernels = ((lambda: x + y, 3 * nbytes), (lambda: torch.nn.functional.gelu(x), 2 * nbytes),
               (lambda: torch.nn.functional.layer_norm(x, (1024,), w, bias), 2 * nbytes),
               (lambda: torch.softmax(x, -1), 2 * nbytes))
    seconds = sum(work / best_rate(fn, work, 0.1) for fn, work in kernels)
    return sum(work for _, work in kernels) / seconds


def _attention_rate() -> float:
    """FLOP/s of a causal SDPA forward + backward, FLOPs counted as the planner does
    (4·b·s²·h forward over the full s×s, 2.5× that backward)."""
    b, a, s, dh = 2, 4, 128, 64
    q, k, v = (torch.randn(b, a, s, dh, requires_grad=True) for _ in range(3))

    def step() -> None:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.sum().backward()

    return best_rate(step, 3.5 * 4.0 * b * s * s * a * dh, 0.2)


def measure_compute(threads: int) -> dict[str, Any]:
    """Peak and per-op efficiencies: square GEMMs give the peak; training-shaped GEMMs
    (all three layouts), an element-wise kernel mix and a fused attention step give the
    efficiencies the cost model applies (``Hardware`` docs)."""
    torch.set_num_threads(threads)
    square = {}
    for n in (256, 512, 1024):
        a, b = torch.randn(n, n), torch.randn(n, n)
        square[n] = best_rate(lambda: torch.mm(a, b), 2.0 * n ** 3, 0.2)
    peak = max(square.values())
    gemm = statistics.median(_gemm_rates(threads))
    x = torch.empty(32 << 20)  # 128 MB of fp32
    y = torch.empty_like(x)
    x.fill_(1.0)
    bw = best_rate(lambda: y.copy_(x), 2.0 * x.numel() * 4)
    elementwise = _elementwise_rate()
    attention = _attention_rate()
    tiny = torch.ones(1)
    reps = 2000

    def adds() -> None:
        for _ in range(reps):
            tiny.add_(1.0)

    overhead = 1.0 / best_rate(adds, reps, budget_s=0.2)
    # Cache-resident element-wise kernels can beat a 128 MB copy: the larger is the peak.
    peak_bw = max(bw, elementwise)
    return dict(square_matmul_flops={str(k): v for k, v in square.items()}, peak_flops=peak,
                training_gemm_flops=gemm, matmul_efficiency=min(1.0, gemm / peak),
                copy_bw=bw, peak_memory_bw=peak_bw, elementwise_bw=elementwise,
                memory_efficiency=elementwise / peak_bw,
                attention_flops=attention, attention_efficiency=min(1.0, attention / gemm),
                op_overhead_s=overhead, threads=threads)

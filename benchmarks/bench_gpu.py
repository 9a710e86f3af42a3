"""One GPU, world size 1 (NCCL): fxpipe's runtime against the eager model.

    python benchmarks/bench_gpu.py [--steps 10] [--out benchmarks/results/gpu.md]

For each case (model shape × precision) it runs, on the same GPU and batch:

- **eager**: the unmodified model, gradient accumulation over the same microbatches,
  ``torch.optim.AdamW`` (bf16: ``torch.autocast`` with fp32 weights, the usual
  single-GPU recipe);
- **fxpipe**: ``fxpipe.parallelize(model, tp=1, pp=1, microbatches=m, precision=...)``
  over NCCL, ``train_step`` + the same optimizer (bf16: bf16 compute weights with
  fp32 masters, fxpipe's mixed precision).

It checks that the first step's loss agrees (fp32: the same graph, so within 1e-5
relative) and reports the median step time over ``--steps`` steps after 3 warm-up
steps, model TFLOP/s (Megatron's model FLOPs from fxpipe's cost pass, no
recomputation), MFU against the GPU's dense peak, and peak CUDA memory
(``torch.cuda.max_memory_allocated``) beside the training state's ideal bytes
(16 B/param: fp32 weights or masters, fp32 gradients, Adam's two moments).
Needs a CUDA GPU; prints the table and writes it to ``--out``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

# Dense tensor-core peaks (NVIDIA datasheets, SXM parts), TFLOP/s: (bf16, tf32).
PEAKS = {"H100": (989.4, 494.7), "H200": (989.4, 494.7), "A100": (312.0, 156.0)}


def _peak(precision: str) -> tuple[str, float]:
    name = torch.cuda.get_device_name()
    for key, (bf16, tf32) in PEAKS.items():
        if key in name:
            return name, bf16 if precision == "bf16" else tf32
    return name, float("nan")


def _median_step(fn, steps: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _case(name: str, layers: int | None, seq: int, mb: int, m: int, precision: str, steps: int) -> dict:
    import fxpipe
    from fxpipe.models import build_workload

    dev = torch.device("cuda")
    w = build_workload(name, batch=mb * m, seq=seq, layers=layers)
    n_params = sum(p.numel() for p in w.model.parameters())
    batch_cpu = w.example_inputs

    # eager baseline ------------------------------------------------------------------------
    model = w.model.to(dev)
    batch = tuple(t.to(dev) for t in batch_cpu)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def loss_of(*b):
        out = model(*b[:-1]) if w.loss_fn is not None else model(*b)
        if w.loss_fn is not None:
            return w.loss_fn(out, b[-1])
        return out.loss if hasattr(out, "loss") else out

    def eager_step() -> float:
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for part in zip(*(t.chunk(m) for t in batch)):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16"):
                loss = loss_of(*part) / m
            loss.backward()
            total += loss.detach()
        opt.step()
        return total

    torch.cuda.reset_peak_memory_stats()
    eager_first = float(eager_step()) if precision == "fp32" else None
    t_eager = _median_step(eager_step, steps)
    mem_eager = torch.cuda.max_memory_allocated()
    del opt, model
    torch.cuda.empty_cache()

    # fxpipe ---------------------------------------------------------------------------------
    w = build_workload(name, batch=mb * m, seq=seq, layers=layers)  # same seed: same weights
    torch.cuda.reset_peak_memory_stats()
    pm = fxpipe.parallelize(w.model, tp=1, pp=1, microbatches=m, example_inputs=batch_cpu,
                            loss_fn=w.loss_fn, precision=precision, device=dev)
    del w
    popt = torch.optim.AdamW(pm.parameters(), lr=1e-4, fused=True)

    def fx_step() -> float:
        loss = pm.train_step(batch_cpu)
        popt.step()
        return loss

    fx_first = fx_step() if precision == "fp32" else None
    t_fx = _median_step(fx_step, steps)
    mem_fx = torch.cuda.max_memory_allocated()
    flops = pm.model_stats.flops_per_step
    gpu, peak = _peak(precision)
    per_param = 16  # fp32 weights (or masters) 4 + fp32 gradients 4 + Adam moments 8
    return dict(case=f"{name}{'' if layers is None else f' ({layers} layers)'}", precision=precision,
                params=n_params, tokens=mb * m * seq, gpu=gpu,
                eager_ms=t_eager * 1e3, fxpipe_ms=t_fx * 1e3,
                eager_tflops=flops / t_eager / 1e12, fxpipe_tflops=flops / t_fx / 1e12,
                eager_mfu=flops / t_eager / 1e12 / peak, fxpipe_mfu=flops / t_fx / 1e12 / peak,
                eager_gib=mem_eager / 2**30, fxpipe_gib=mem_fx / 2**30,
                state_gib=n_params * per_param / 2**30,
                loss_rel_diff=None if eager_first is None else abs(fx_first - eager_first) / abs(eager_first))


CASES = [  # (model, layers, seq, micro-batch, microbatches, precision)
    ("gpt2-medium", None, 1024, 4, 4, "fp32"),
    ("gpt2-medium", None, 1024, 8, 4, "bf16"),
    ("gpt-1.7b", 8, 2048, 4, 4, "bf16"),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "gpu.md"))
    ap.add_argument("--quick", action="store_true", help="first case only")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA GPU here", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = True  # fp32 matmuls on tensor cores (TF32), both sides
    torch.backends.cudnn.allow_tf32 = True
    rows = []
    for case in CASES[:1] if args.quick else CASES:
        row = _case(*case, steps=args.steps)
        rows.append(row)
        print(row, flush=True)
    head = ("| case | prec | params | tokens/step | eager ms | fxpipe ms | fxpipe/eager | eager TFLOP/s | "
            "fxpipe TFLOP/s | eager MFU | fxpipe MFU | eager peak GiB | fxpipe peak GiB | state GiB | "
            "step-1 loss rel. diff |")
    lines = [f"GPU: {rows[0]['gpu']}, torch {torch.__version__}, world size 1 (NCCL), medians of "
             f"{args.steps} steps after 3 warm-ups. MFU against the dense peak "
             f"(bf16 {PEAKS['H100'][0]}, tf32 {PEAKS['H100'][1]} TFLOP/s on H100).", "", head,
             "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        diff = "n/a" if r["loss_rel_diff"] is None else f"{r['loss_rel_diff']:.1e}"
        lines.append(f"| {r['case']} | {r['precision']} | {r['params'] / 1e6:.0f}M | {r['tokens']} | "
                     f"{r['eager_ms']:.1f} | {r['fxpipe_ms']:.1f} | {r['fxpipe_ms'] / r['eager_ms']:.2f} | "
                     f"{r['eager_tflops']:.1f} | {r['fxpipe_tflops']:.1f} | {r['eager_mfu']:.1%} | "
                     f"{r['fxpipe_mfu']:.1%} | {r['eager_gib']:.2f} | {r['fxpipe_gib']:.2f} | "
                     f"{r['state_gib']:.2f} | {diff} |")
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

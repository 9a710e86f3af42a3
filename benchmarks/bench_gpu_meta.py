"""A whole model built on the meta device and materialised on one GPU by fxpipe.

    python benchmarks/bench_gpu_meta.py [--model gpt-1.7b] [--precision bf16] [--steps 6]

World size 1 (NCCL). Reports the time to compile and materialise (deferred init: the
model's own init rules replayed on the GPU's shard, here all of it), peak CUDA memory
(``torch.cuda.max_memory_allocated``) beside the training state's bytes, and the median
step time as model TFLOP/s and MFU against the dense bf16 peak. Appends a row to
benchmarks/results/gpu_meta.md.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

PEAK_BF16 = {"H100": 989.4, "H200": 989.4, "A100": 312.0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt-1.7b")
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--recompute", default="none")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "gpu_meta.md"))
    args = ap.parse_args()
    import fxpipe
    from fxpipe.models import build_workload
    from fxpipe.models.registry import GPT_CONFIGS

    torch.backends.cuda.matmul.allow_tf32 = True
    cfg = GPT_CONFIGS[args.model]
    rows = args.micro_batch * args.microbatches
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (rows, args.seq + 1), generator=g)
    batch = (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    w = build_workload(args.model, batch=rows, seq=args.seq, device="meta")
    params = sum(p.numel() for p in w.model.parameters())
    start = time.perf_counter()
    pm = fxpipe.parallelize(w.model, microbatches=args.microbatches, example_inputs=batch, loss_fn=w.loss_fn,
                            precision=args.precision, recompute=args.recompute, device=torch.device("cuda"))
    torch.cuda.synchronize()
    built = time.perf_counter() - start
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4, fused=True)
    times, losses = [], []
    for _ in range(args.steps):
        t = time.perf_counter()
        losses.append(pm.train_step(batch))
        opt.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    step = statistics.median(times[2:] if len(times) > 3 else times)
    tflops = pm.model_stats.flops_per_step / step / 1e12
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in PEAK_BF16.items() if k in name), float("nan"))
    mem = torch.cuda.max_memory_allocated() / 2**30
    state = params * (16 if args.precision == "fp32" else 18) / 2**30  # + bf16 copy under mixed precision
    row = (f"| {args.model} | {params / 1e9:.2f}B | {args.precision} | {args.recompute} | {rows}×{args.seq} | "
           f"{built:.1f} s | {step * 1e3:.0f} ms | {tflops:.0f} | {tflops / peak:.1%} | {mem:.1f} | {state:.1f} | "
           f"{losses[0]:.3f} → {losses[-1]:.3f} |")
    head = ("| model | params | precision | recompute | tokens/step | compile + init | step | model TFLOP/s | MFU | "
            "peak GiB | state GiB | loss |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    print(f"GPU: {name}, torch {torch.__version__}")
    print(head + row)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    new = not os.path.exists(args.out)
    with open(args.out, "a") as f:
        if new:
            f.write(f"# Built on meta, materialised on one GPU ({name}, torch {torch.__version__})\n\n" + head)
        f.write(row + "\n")
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

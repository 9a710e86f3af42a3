"""fxpipe.parallelize on one GPU (NCCL world of 1) against the eager model on the same GPU.

    python benchmarks/gpu_equivalence.py [MODEL ...] > benchmarks/results/gpu_equivalence.txt

First-step loss and every gradient (fp32, TF32 off, dropout 0), for models written outside
transformers (the functional graph: in-place sliding-window masks, a data-dependent dropless
MoE, autocast regions, complex rotary) and registry/HF ones. Runs on CPU (gloo) where no
GPU is present. A zoo model that computes in bf16 somewhere declares its tolerance
(``ZooModel.bf16_rtol``)."""
import sys, time, torch
import fxpipe
from fxpipe.models import build_workload
from fxpipe.models.zoo import ZOO

names = sys.argv[1:] or ["zoo:swa-gpt", "zoo:moe", "zoo:autocast", "zoo:complex-rope", "zoo:llama3",
                          "hf:llama", "hf:gpt2", "gpt-small"]
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
worst = 0.0
for name in names:
    t0 = time.perf_counter()
    try:
        w = build_workload(name, batch=8, seq=64)
        model = w.model.to(dev)
        batch = tuple(t.to(dev) for t in w.example_inputs)
        out = model(*batch[:-1]) if w.loss_fn is not None else model(*batch)
        ref = w.loss_fn(out, batch[-1]) if w.loss_fn is not None else (out.loss if hasattr(out, "loss") else out)
        ref.backward()
        ref_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        w2 = build_workload(name, batch=8, seq=64)  # same seed: same weights
        pm = fxpipe.parallelize(w2.model, tp=1, pp=1, microbatches=2, example_inputs=w2.example_inputs,
                                loss_fn=w2.loss_fn, costs="measure")
        loss = pm.train_step(w2.example_inputs)
        grads = {n: p.grad for n, p in pm.named_parameters() if p.grad is not None}
        declared = ZOO[name.split(":", 1)[1]].bf16_rtol if name.startswith("zoo:") else None
        tol = declared or 1e-4
        big = max(g.abs().max().item() for g in ref_grads.values())
        bad = []
        for n, g in ref_grads.items():
            d = (grads[n].to(dev) - g).abs().max().item()
            scale = max(g.abs().max().item(), 1e-3 * big)
            worst = worst if declared else max(worst, d / scale)
            if d > tol * scale:
                bad.append(f"{n} {d:.2e}/{scale:.2e}")
        rel = abs(float(loss) - ref.item()) / abs(ref.item())
        ok = rel < (declared or 1e-5) and not bad and len(grads) == len(ref_grads)
        print(f"{name:18s} {'PASS' if ok else 'FAIL'}  loss eager {ref.item():.6f} fxpipe {float(loss):.6f} "
              f"rel {rel:.1e}  grads {len(grads)}/{len(ref_grads)}  {time.perf_counter() - t0:.1f} s"
              + (f"  off: {bad[:3]}" if bad else ""), flush=True)
        pm.close()
    except Exception as exc:  # report and go on to the next model
        print(f"{name:18s} ERROR {type(exc).__name__}: {str(exc).splitlines()[0][:300]}", flush=True)
print(f"worst gradient difference / scale (fp32 models): {worst:.2e}")

"""Per-process optimizer state with and without ZeRO-1 (``parallelize(zero=1)``).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_zero_state.py [--model gpt-small] [--dp 2]

Spawns ``dp`` gloo processes (tp = pp = 1); for fp32 and bf16, without and with ZeRO-1,
takes one AdamW step and reports each process's AdamW state bytes (exp_avg, exp_avg_sq,
step) and fp32 master bytes (mixed precision), and the first loss (equal with and
without ZeRO). Writes benchmarks/results/zero_state.md.
"""
from __future__ import annotations

import argparse
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from fxpipe.runtime.local_world import run_local_world

BATCH_PER_DP, SEQ, MICROBATCHES = 4, 64, 4


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
               if isinstance(v, torch.Tensor))


def _worker(rank: int, world: int, model: str, outdir: str) -> None:
    from fxpipe.models import build_workload
    from fxpipe.parallel import parallelize

    rows = []
    for precision in ("fp32", "bf16"):
        for zero in (0, 1):
            w = build_workload(model, batch=BATCH_PER_DP * world, seq=SEQ, seed=0)
            gen = torch.Generator().manual_seed(0)
            batch = w.batch_from_tokens(torch.randint(0, w.vocab_size, (BATCH_PER_DP * world, SEQ + 1),
                                                      generator=gen))
            pm = parallelize(w.model, dp=world, microbatches=MICROBATCHES, example_inputs=batch,
                             loss_fn=w.loss_fn, partition="uniform", precision=precision, zero=zero)
            opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
            loss = pm.train_step(batch)
            opt.step()
            masters = sum(t.numel() * t.element_size() for t in pm.master.masters.values()) if pm.master else 0
            rows.append((precision, zero, rank, loss, optimizer_state_bytes(opt), masters))
    torch.save(rows, Path(outdir) / f"{rank}.pt")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt-small")
    ap.add_argument("--dp", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as outdir:
        run_local_world(args.dp, _worker, args.model, outdir, timeout=timedelta(seconds=300), threads=1)
        rows = sorted(r for k in range(args.dp) for r in torch.load(Path(outdir) / f"{k}.pt"))
    lines = [f"# Optimizer state per process, {args.model}, dp={args.dp} (tp = pp = 1)", "",
             "| precision | zero | rank | first loss | AdamW state MB | fp32 masters MB | total MB |",
             "|---|---|---|---|---|---|---|"]
    for precision, zero, rank, loss, adam, masters in rows:
        lines.append(f"| {precision} | {zero} | {rank} | {loss:.6f} | {adam / 1e6:.2f} | {masters / 1e6:.2f} "
                     f"| {(adam + masters) / 1e6:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(__file__).parent / "results" / "zero_state.md"
    out.write_text(text)


if __name__ == "__main__":
    main()

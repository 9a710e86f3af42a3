"""fxpipe's data parallelism against torch's DistributedDataParallel, step time and
exposed communication.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_data_parallel.py [--rounds 3] [--steps 1] [--no-world4]
    PYTHONPATH=. .venv/bin/python benchmarks/bench_data_parallel.py --world1-only --rounds 10

World 2 (gloo, one thread per process): on a compute-bound Llama-style model (V=8192,
width 256, 6 layers, global batch 16×128) and a gradient-bound one (V=32000, width 512,
8 layers, batch 8×64; 58M parameters), with 1 and 4 microbatches, one AdamW step each:
- fxpipe dp=2 (gradients reduced in 25 MB buckets during the last backward,
  ``runtime/grad_buckets.py``) against ``DistributedDataParallel`` (25 MB buckets,
  ``no_sync`` on all but the last microbatch);
- fxpipe ZeRO-1 against DDP with ``ZeroRedundancyOptimizer``.
Systems run in interleaved rounds, the order rotated each round; medians over every
timed step, each ratio also as the median of the steps' ratios round by round (paired). World 4 (on however many cores there are: reported, not tuned): tp=2 × dp=2
and pp=2 × dp=2 with the overlap (bucket_mb=25) and without (bucket_mb=0).
Writes benchmarks/results/bench_data_parallel.txt.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from fxpipe.runtime.local_world import run_local_world

MODELS = {  # name: (vocab, width, layers, heads, global batch, seq)
    "compute-bound": (8192, 256, 6, 4, 16, 128),
    "gradient-bound": (32000, 512, 8, 8, 8, 64),
}


def _model(name: str, seed: int = 0):
    from fxpipe.models.hf import _llama

    vocab, width, layers, heads, batch, seq = MODELS[name]
    torch.manual_seed(seed)
    model = _llama(layers=layers, hidden=width, heads=heads, vocab=vocab, seq=seq)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    return model, (ids, ids.clone())


class _Fxpipe:
    def __init__(self, name: str, m: int, **layout) -> None:
        from fxpipe.models.losses import causal_lm_loss
        from fxpipe.parallel import parallelize

        model, self.batch = _model(name)
        self.pm = parallelize(model, microbatches=m, example_inputs=self.batch, loss_fn=causal_lm_loss,
                              partition="uniform", costs="model", timeout_s=600, **layout)
        self.opt = torch.optim.AdamW(self.pm.parameters(), lr=1e-4)

    def step(self) -> float:
        self.opt.zero_grad()
        self.pm.train_step(self.batch)
        self.opt.step()
        return self.pm.last_stats.exposed.total_s

    def close(self) -> None:
        self.pm.close()


class _DDP:
    def __init__(self, name: str, m: int, zero: bool) -> None:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        model, (ids, labels) = _model(name)
        rank, world = dist.get_rank(), dist.get_world_size()
        self.ids, self.labels = ids.chunk(world)[rank].chunk(m), labels.chunk(world)[rank].chunk(m)
        self.model = DistributedDataParallel(model, bucket_cap_mb=25)
        self.opt = ZeroRedundancyOptimizer(self.model.parameters(), torch.optim.AdamW, lr=1e-4) if zero \
            else torch.optim.AdamW(self.model.parameters(), lr=1e-4)

    def step(self) -> float:
        from fxpipe.models.losses import causal_lm_loss

        self.opt.zero_grad()
        m = len(self.ids)
        for i, (x, y) in enumerate(zip(self.ids, self.labels)):
            ctx = self.model.no_sync() if i < m - 1 else _null()
            with ctx:
                (causal_lm_loss(self.model(x), y) / m).backward()
        self.opt.step()
        return float("nan")

    def close(self) -> None:
        pass


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _timed(systems: dict, rounds: int, steps: int) -> dict[str, tuple[float, float, list[float]]]:
    """Median step time and exposed communication of each system, interleaved rounds, and
    every timed step (the slowest rank's) in order, for ratios of steps taken side by side."""
    names = list(systems)
    for s in systems.values():  # warm-up: allocations, first collectives
        s.step()
    times: dict[str, list[float]] = {n: [] for n in names}
    exposed: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            for _ in range(steps):
                dist.barrier()
                t0 = time.perf_counter()
                e = systems[n].step()
                times[n].append(time.perf_counter() - t0)
                exposed[n].append(e)
    # The step of the slowest rank is the step: rank 0 takes every rank's times' max.
    out = {}
    for n in names:
        t = torch.tensor(times[n], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        e = torch.tensor(exposed[n], dtype=torch.float64)
        dist.all_reduce(e, op=dist.ReduceOp.MAX)
        out[n] = (statistics.median(t.tolist()), statistics.median(e.tolist()), t.tolist())
    return out


def _paired(r: dict, a: str, b: str) -> float:
    """Median over the rounds of a's step / b's step taken in the same round: a drift of the
    machine between rounds moves both, where a ratio of the two medians carries it."""
    return statistics.median(x / y for x, y in zip(r[a][2], r[b][2]))


def _world2(rank: int, world: int, outdir: str, rounds: int, steps: int) -> None:
    rows = []
    for name in MODELS:
        for m in (1, 4):
            systems = {"fxpipe": _Fxpipe(name, m), "ddp": _DDP(name, m, zero=False),
                       "fxpipe-nooverlap": _Fxpipe(name, m, bucket_mb=0)}
            res = _timed(systems, rounds, steps)
            for s in systems.values():
                s.close()
            del systems
            zsystems = {"fxpipe-zero1": _Fxpipe(name, m, zero=1), "ddp-zero": _DDP(name, m, zero=True)}
            res.update(_timed(zsystems, rounds, steps))
            for s in zsystems.values():
                s.close()
            del zsystems
            rows.append((name, m, res))
    if rank == 0:
        torch.save(rows, Path(outdir) / "world2.pt")
    dist.destroy_process_group()


def _world4(rank: int, world: int, outdir: str, rounds: int, steps: int) -> None:
    rows = []
    for layout in (dict(tp=2), dict(pp=2)):
        systems = {f"bucket_mb={b}": _Fxpipe("gradient-bound", 2, bucket_mb=b, **layout) for b in (25, 0)}
        rows.append((layout, _timed(systems, rounds, steps)))
        for s in systems.values():
            s.close()
    if rank == 0:
        torch.save(rows, Path(outdir) / "world4.pt")
    dist.destroy_process_group()


def _world1(rounds: int) -> list[str]:
    """fxpipe's own forward and backward against the model's eager loop, one process, one
    rank's share of the global batch at dp=2: what is left when no communication is."""
    from fxpipe.models.losses import causal_lm_loss
    from fxpipe.parallel import parallelize

    torch.set_num_threads(1)
    lines = ["| model | m | eager forward+backward | fxpipe forward+backward | ratio (paired) |", "|---|---|---|---|---|"]
    for name in MODELS:
        for m in (1, 4):
            model, batch = _model(name)
            half = tuple(t[: t.shape[0] // 2] for t in batch)
            pm = parallelize(model, microbatches=m, example_inputs=half, loss_fn=causal_lm_loss,
                             partition="uniform", costs="model")
            eager, _ = _model(name)
            pairs = list(zip(half[0].chunk(m), half[1].chunk(m)))

            def run_fxpipe() -> None:
                pm.train_step(half)

            def run_eager() -> None:
                eager.zero_grad(set_to_none=True)
                for x, y in pairs:
                    (causal_lm_loss(eager(x), y) / m).backward()
            systems = {"eager": run_eager, "fxpipe": run_fxpipe}
            times: dict[str, list[float]] = {k: [] for k in systems}
            for fn in systems.values():
                fn()
            for r in range(rounds):
                for k in (("eager", "fxpipe") if r % 2 == 0 else ("fxpipe", "eager")):
                    t0 = time.perf_counter()
                    systems[k]()
                    times[k].append(time.perf_counter() - t0)
            e, f = (statistics.median(times[k]) for k in ("eager", "fxpipe"))
            paired = statistics.median(a / b for a, b in zip(times["fxpipe"], times["eager"]))
            lines.append(f"| {name} | {m} | {1e3 * e:.0f} | {1e3 * f:.0f} | {f / e:.3f} ({paired:.3f}) |")
            pm.close()
    return lines


def _launch(fn, world: int, outdir: str, rounds: int, steps: int) -> None:
    run_local_world(world, fn, outdir, rounds, steps, timeout=timedelta(seconds=900), threads=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=1, help="timed steps per system per round")
    ap.add_argument("--no-world4", action="store_true")
    ap.add_argument("--world1-only", action="store_true",
                    help="only fxpipe's forward and backward against the eager loop in one process (printed, "
                         "not written)")
    args = ap.parse_args()
    if args.world1_only:
        print(f"# world 1: one thread, {args.rounds} alternating rounds, medians (ms)\n")
        print("\n".join(_world1(args.rounds)))
        return
    lines = [f"# bench_data_parallel: world 2 gloo, 1 thread per process, {os.cpu_count()} cores, "
             f"{args.rounds} rounds x {args.steps} steps, order rotated; medians (ms)", ""]
    with tempfile.TemporaryDirectory() as outdir:
        start = time.time()
        _launch(_world2, 2, outdir, args.rounds, args.steps)
        rows = torch.load(Path(outdir) / "world2.pt")
        lines.append("| model | m | DDP | fxpipe | ratio (paired) | fxpipe no overlap | ratio (paired) | exposed "
                     "fxpipe | exposed no overlap | DDP+ZeroRedundancyOptimizer | fxpipe ZeRO-1 | ratio (paired) | "
                     "exposed ZeRO-1 |")
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for name, m, r in rows:
            ms = {k: (1e3 * t, 1e3 * e) for k, (t, e, _) in r.items()}

            def ratio(a: str, b: str) -> str:
                return f"{ms[a][0] / ms[b][0]:.3f} ({_paired(r, a, b):.3f})"
            lines.append(f"| {name} | {m} | {ms['ddp'][0]:.0f} | {ms['fxpipe'][0]:.0f} | {ratio('fxpipe', 'ddp')} | "
                         f"{ms['fxpipe-nooverlap'][0]:.0f} | {ratio('fxpipe-nooverlap', 'ddp')} | {ms['fxpipe'][1]:.0f} | "
                         f"{ms['fxpipe-nooverlap'][1]:.0f} | {ms['ddp-zero'][0]:.0f} | {ms['fxpipe-zero1'][0]:.0f} | "
                         f"{ratio('fxpipe-zero1', 'ddp-zero')} | {ms['fxpipe-zero1'][1]:.0f} |")
        lines.append(f"\nworld 2: {time.time() - start:.0f} s")
        if not args.no_world4:
            start = time.time()
            _launch(_world4, 4, outdir, max(2, args.rounds // 2), args.steps)
            lines += ["", "World 4 on the same cores (oversubscribed: reported, not tuned), gradient-bound "
                      "model, 2 microbatches:", "",
                      "| layout | step, overlap | step, bucket_mb=0 | ratio | exposed, overlap | exposed, "
                      "bucket_mb=0 |", "|---|---|---|---|---|---|"]
            for layout, r in torch.load(Path(outdir) / "world4.pt"):
                (a, ea, _), (b, eb, _) = r["bucket_mb=25"], r["bucket_mb=0"]
                what = "tp=2 x dp=2" if layout.get("tp") else "pp=2 x dp=2 (1F1B)"
                lines.append(f"| {what} | {1e3 * a:.0f} | {1e3 * b:.0f} | {a / b:.3f} | {1e3 * ea:.0f} | "
                             f"{1e3 * eb:.0f} |")
            lines.append(f"\nworld 4: {time.time() - start:.0f} s")
    lines.append(f"load average at the end (1, 5, 15 min): {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    text = "\n".join(lines) + "\n"
    print(text)
    (Path(__file__).parent / "results" / "bench_data_parallel.txt").write_text(text)


if __name__ == "__main__":
    main()

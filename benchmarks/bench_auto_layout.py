"""The layout search against measurement: layouts of a world, predicted and timed, under
workloads where different layouts win.

    .venv/bin/python benchmarks/bench_auto_layout.py [--world 2] [--models gpt-tiny deep-narrow ...]
        [--workloads m4 m8 m16 batch1 memlimit] [--top 5] [--sample 3] [--rounds 5] [--max-minutes 10]

For each model and workload the search (``fxpipe/planner/auto_layout.py``) prices every
layout of ``--world`` ranks for the workload's global batch (``exhaustive``: nothing
pruned, so every layout has a prediction); the ``--top`` fastest predicted and a
``--sample`` of the rest (seeded) are built with ``fxpipe.parallelize`` in one gloo world
(the config the search priced: measured costs, chain-DP partition) and trained — the
schedule and an AdamW step, as ``fxpipe run`` steps — for ``--steps`` steps per round, in ``--rounds`` rounds, every layout once per round and the
order rotated by one each round (so drift and a neighbour's load hit all alike); medians.
Per model and workload: the chosen layout's measured step over the best measured one,
the median |predicted − measured| / measured, Spearman's ρ and Kendall's τ-b
(``rank_stats.py``). The workloads (global batch ``--batch`` × ``--seq``):

- ``m4``, ``m8``, ``m16``: the microbatches pinned at 4, 8, 16 (gradient accumulation
  as users set it), everything else searched;
- ``batch1``: a global batch of one sequence (no data parallelism possible);
- ``memlimit``: a memory limit between the largest-memory pipeline layout's need and the
  smallest data-parallel one's (memory savers included), which rules data parallelism out.

``--max-minutes`` bounds the run: model/workload pairs not started by then are listed as
skipped. CPU figures: the machine, its cores and its load are printed with the table.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import random
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.rank_stats import kendall_tau_b, median_relative_error, spearman  # noqa: E402
from fxpipe.ir.parallel_config import ParallelConfig  # noqa: E402
from fxpipe.job.optimizer import param_groups  # noqa: E402
from fxpipe.models.registry import build_workload  # noqa: E402
from fxpipe.models.workload import Workload  # noqa: E402
from fxpipe.planner.auto_layout import search_layout  # noqa: E402
from fxpipe.planner.layout_space import SEARCHED  # noqa: E402
from fxpipe.runtime.local_world import run_local_world  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "bench_auto_layout.txt")
MODELS = ("gpt-tiny", "deep-narrow", "wide-vocab", "zoo:moe", "zoo:llama3", "hf:gpt2")
"""A registry GPT; 12 layers of width 32; V = 8192 over width 64; an MoE (zoo, outside
transformers); grouped-query attention with a gated MLP (zoo, outside transformers); a
Hugging Face GPT-2 (tied head)."""
WORKLOADS = ("m4", "m8", "m16", "batch1", "memlimit")


def _gpt(layers: int, width: int, vocab: int, batch: int, seq: int) -> Workload:
    from fxpipe.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=vocab, block_size=seq, n_layer=layers, n_head=4, n_embd=width))
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    return Workload(model, (ids[:, :-1].contiguous(), ids[:, 1:].contiguous()), None, None, vocab_size=vocab)


LOCAL = {"deep-narrow": lambda b, s: _gpt(12, 32, 256, b, s), "wide-vocab": lambda b, s: _gpt(2, 64, 8192, b, s)}


def workload(name: str, batch: int, seq: int) -> Workload:
    if name in LOCAL:
        return LOCAL[name](batch, seq)
    return build_workload(name, batch=batch, seq=seq, seed=0)


def _worker(rank: int, world: int, args, layouts: list[dict]) -> list[float] | None:
    import fxpipe

    w = workload(args.model, args.rows, args.seq)
    models = []
    for fields in layouts:
        model = workload(args.model, args.rows, args.seq).model
        pm = fxpipe.parallelize(model, example_inputs=w.example_inputs, loss_fn=w.loss_fn, costs="measure",
                                partition="dp", **fields)
        # The step the price prices, as `fxpipe run` takes it: the schedule and the optimizer.
        # As `fxpipe run` builds it: parameter groups, which may be empty (a pipeline rank
        # whose stages compute only parameter-free ops holds none; a flat empty list is refused).
        opt = torch.optim.AdamW(param_groups(pm.named_parameters(), 0.0), lr=1e-4)
        pm.train_step(w.example_inputs)  # warm-up: first-step allocations, the optimizer's state
        opt.step()
        models.append((pm, opt))
    times: list[list[float]] = [[] for _ in layouts]
    for r in range(args.rounds):
        for k in range(len(models)):
            i = (k + r) % len(models)  # the order rotated each round
            for _ in range(args.steps):
                dist.barrier()
                start = time.perf_counter()
                pm, opt = models[i]
                pm.train_step(w.example_inputs)
                opt.step()
                times[i].append(time.perf_counter() - start)
    for pm, _ in models:
        pm.close()
    return [statistics.median(t) for t in times] if rank == 0 else None


def _search(args, w: Workload, memory_limit_gb: float | None = None):
    pinned = {"num_microbatches": int(args.workload[1:])} if args.workload in ("m4", "m8", "m16") else {}
    cores = os.cpu_count() or 1
    # The ranks run one thread each (_worker): the search times compute as they will run it,
    # and with more ranks than cores it prices the cores they share.
    return search_layout(w.model, w.example_inputs, args.world, loss_fn=w.loss_fn,
                         base=ParallelConfig(memory_limit_gb=memory_limit_gb, hardware=args.hardware),
                         pinned=pinned, threads=1,
                         concurrent=cores if args.world > cores else None, exhaustive=True)


def _memory_limit(found) -> float | None:
    """Between the largest pipeline layout's need and the smallest data-parallel one's."""
    dp = [p.memory_bytes for p in found.ranked if p.config.replicas > 1]
    other = [p.memory_bytes for p in found.ranked if p.config.replicas == 1]
    if not dp or not other or min(other) >= min(dp):
        return None
    return (min(other) + min(dp)) / 2 / 2**30


def bench(args) -> tuple[list[str], dict]:
    rows = 1 if args.workload == "batch1" else args.batch
    args = argparse.Namespace(**{**vars(args), "rows": rows})
    w = workload(args.model, rows, args.seq)
    found = _search(args, w)
    note = ""
    if args.workload == "memlimit":
        limit = _memory_limit(found)
        if limit is None:
            return [f"## {args.model} memlimit: no limit separates data parallelism (skipped)"], {}
        found = _search(args, w, memory_limit_gb=limit)
        note = f", memory limit {limit * 2**10:.2f} MiB"
    ranked = list(found.ranked)
    rest = list(range(args.top, len(ranked)))
    picked = list(range(min(args.top, len(ranked)))) + sorted(random.Random(0).sample(rest, min(args.sample,
                                                                                               len(rest))))
    layouts = [{f: getattr(ranked[i].config, f) for f in SEARCHED} for i in picked]
    layouts = [dict(f, microbatches=f.pop("num_microbatches")) for f in layouts]
    try:
        measured = run_local_world(args.world, _worker, args, layouts, timeout=timedelta(seconds=600), threads=1)[0]
    except Exception as exc:  # noqa: BLE001 - one pair's failure is reported, the others still run
        why = next((ln.strip() for ln in reversed(str(exc).splitlines()) if ln.strip()), type(exc).__name__)
        return [f"## {args.model} / {args.workload}: failed while measuring: {why[:300]}",
                "layouts: " + "; ".join(ranked[i].describe() for i in picked)], {}
    predicted = [ranked[i].step_s for i in picked]
    best = min(range(len(measured)), key=measured.__getitem__)
    stats = dict(ratio=measured[0] / measured[best], error=median_relative_error(predicted, measured),
                 rho=spearman(predicted, measured), tau=kendall_tau_b(predicted, measured),
                 predicted=predicted, measured=measured, chosen=ranked[0].describe(),
                 best=ranked[picked[best]].describe(), n=len(picked), priced=len(ranked), search=found.seconds)
    lines = [f"## {args.model} / {args.workload}: world {args.world}, batch {rows}x{args.seq}{note}; "
             f"{len(ranked)} layouts priced ({len(found.refused)} refused), {len(picked)} measured "
             f"(top {args.top} + {len(picked) - min(args.top, len(ranked))} sampled); search {found.seconds:.1f} s",
             f"{'layout':<52} {'predicted ms':>12} {'measured ms':>12}"]
    for k, i in enumerate(picked):
        mark = "chosen" if k == 0 else ("best measured" if k == best else "")
        lines.append(f"{ranked[i].describe():<52} {1e3 * predicted[k]:12.2f} {1e3 * measured[k]:12.2f}  {mark}")
    lines.append(f"chosen / best measured {stats['ratio']:.3f}; median |pred - meas| / meas {stats['error']:.3f}; "
                 f"Spearman {stats['rho']:.3f}; Kendall tau-b {stats['tau']:.3f}")
    return lines, stats


def _summary(results: dict) -> list[str]:
    """The markdown table: one row per model/workload, and per model its pooled figures."""
    lines = ["| model | workload | measured / priced | chosen | best measured | chosen / best | median err | "
             "Spearman | Kendall |", "|---|---|---|---|---|---|---|---|---|"]
    for (model, wl), st in results.items():
        lines.append(f"| {model} | {wl} | {st['n']} / {st['priced']} | {st['chosen']} | {st['best']} | "
                     f"{st['ratio']:.3f} | {st['error']:.3f} | {st['rho']:.3f} | {st['tau']:.3f} |")
    for model in dict.fromkeys(m for m, _ in results):
        mine = [st for (m, _), st in results.items() if m == model]
        rho = statistics.median(st["rho"] for st in mine)
        err = median_relative_error([p for st in mine for p in st["predicted"]],
                                    [x for st in mine for x in st["measured"]])
        lines.append(f"| {model} | all | | | | worst {max(st['ratio'] for st in mine):.3f} | {err:.3f} | "
                     f"median {rho:.3f} | |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--models", nargs="+", default=list(MODELS),
                   help=f"registry names, or {', '.join(LOCAL)} (default: %(default)s)")
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    p.add_argument("--batch", type=int, default=16, help="global batch rows (batch1: 1)")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--top", type=int, default=5, help="the fastest predicted layouts measured")
    p.add_argument("--sample", type=int, default=3, help="layouts measured from the rest, seeded")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--max-minutes", type=float, default=10.0, help="start no model/workload after this")
    p.add_argument("--output", default=RESULTS, help="results file (default: %(default)s)")
    p.add_argument("--hardware", default="calibrate",
                   help="the search's hardware profile: 'calibrate' (default: `fxpipe calibrate` on this machine "
                        "first, one thread per process, as the ranks run; written beside --output), a preset "
                        "or a profile's path")
    args = p.parse_args()
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    if args.hardware == "calibrate":
        # The price's links (gloo's p2p and all-reduce) and the runtime's cost per action are
        # this machine's, measured as `fxpipe calibrate` measures them, not the CPU preset's guesses.
        from fxpipe.planner.machine_speeds import calibrate
        hw, measurements = calibrate(name="bench-auto-layout", threads=1, log=print)
        args.hardware = os.path.splitext(args.output)[0] + "_hardware.json"
        hw.save(args.hardware, measurements)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    head = (f"# bench_auto_layout — {time.strftime('%Y-%m-%d %H:%M')}, {platform.machine()} {os.cpu_count()} cpus, "
            f"load {load:.1f} at start, torch {torch.__version__}; command: benchmarks/bench_auto_layout.py "
            f"{' '.join(sys.argv[1:])}")
    from fxpipe.base.hardware import get_hardware
    hw = get_hardware(args.hardware)
    head += (f"\n# hardware {args.hardware}: p2p {hw.intra_node.p2p_latency * 1e6:.0f} us + "
             f"{hw.intra_node.p2p_bw / 1e9:.2f} GB/s, collective {hw.intra_node.collective_latency * 1e6:.0f} us "
             f"per step + {hw.intra_node.collective_bw / 1e9:.2f} GB/s, {hw.action_overhead_s * 1e6:.0f} us per action, "
             f"{hw.transfer_cpu_s * 1e6:.0f} us of a rank's own time per transfer end")
    lines, results, skipped, start = [head], {}, [], time.perf_counter()
    print(head, flush=True)
    for model in args.models:
        for wl in args.workloads:
            if time.perf_counter() - start > 60 * args.max_minutes:
                skipped.append(f"{model}/{wl}")
                continue
            got, stats = bench(argparse.Namespace(**{**vars(args), "model": model, "workload": wl}))
            print("\n".join(got), flush=True)
            lines += got
            if stats:
                results[(model, wl)] = stats
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    tail = [f"# {time.perf_counter() - start:.0f} s, load {load:.1f} at the end"] + _summary(results)
    if skipped:
        tail.append(f"skipped (--max-minutes {args.max_minutes:g}): {', '.join(skipped)}")
    print("\n".join(tail), flush=True)
    with open(args.output, "w") as f:
        f.write("\n".join(lines + tail) + "\n")


if __name__ == "__main__":
    main()

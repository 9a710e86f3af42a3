"""Peak memory per process against the ideal world-size share.

    python benchmarks/bench_memory.py [--model gpt2-medium] [--seq 64] [--steps 2]
    python benchmarks/bench_memory.py --model gpt-1.7b --layouts 2,2,1 --meta

For each (tp, pp, dp[, zero][, vocab]) layout it spawns tp·pp·dp gloo processes (1 thread
each) that build the model (``--meta``: on the meta device, materialised by fxpipe
shard by shard), ``fxpipe.parallelize`` it, and train ``--steps`` AdamW steps; each
reports its peak resident set size (``ru_maxrss``: everything the process ever held,
Python and torch included). The one-process run (1,1,1) is the reference: the table
gives each layout's largest per-process peak as a ratio to (one-process peak / world
size) — 1.0 is a perfect split of everything, including the fixed cost of a Python
process with torch loaded, which does not shrink. Writes
benchmarks/results/memory.md (and .json).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time

import torch

from fxpipe.runtime.local_world import run_local_world

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
DEFAULT_LAYOUTS = ["1,1,1", "2,1,1", "1,2,1", "2,2,1", "1,1,2", "1,1,2,zero"]


def _batch(vocab: int, rows: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab, (rows, seq + 1), generator=g)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def _worker(rank: int, world: int, out: str, layout: dict, args: argparse.Namespace) -> None:
    os.environ.update(CUDA_VISIBLE_DEVICES="")  # host memory, gloo, also on a GPU machine
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // world))
    import fxpipe
    import fxpipe.runtime.api  # noqa: F401  (what every process loads before it builds anything)
    from torch import export as _export  # noqa: F401
    from fxpipe.models import build_workload
    from fxpipe.models.registry import GPT_CONFIGS

    fixed = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Python, torch, fxpipe: never shrinks

    cfg = GPT_CONFIGS[args.model]
    rows = args.micro_batch * args.microbatches * layout["dp"]
    batch = _batch(cfg.vocab_size, rows, args.seq)
    start = time.perf_counter()
    w = build_workload(args.model, batch=rows, seq=args.seq, device="meta" if args.meta else "cpu")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # what parallelize starts from
    options = dict(zero=1) if layout["zero"] else {}
    if layout["vocab"]:  # the LM head and embedding's rows owned by every pipeline rank
        options["vocab_passes"] = True
    pm = fxpipe.parallelize(w.model, tp=layout["tp"], pp=layout["pp"], dp=layout["dp"],
                            microbatches=args.microbatches, example_inputs=batch, loss_fn=w.loss_fn,
                            partition=args.partition, costs=args.costs, timeout_s=1800, device=torch.device("cpu"), **options)
    del w
    built = time.perf_counter() - start
    built_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # what building alone reached
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
    losses = []
    for _ in range(args.steps):
        losses.append(pm.train_step(batch))
        opt.step()
    local = sum(t.numel() for t in pm.state.values())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(dict(rank=rank, peak=peak, built_peak=built_peak, fixed=fixed, before=before, losses=losses,
                       local_elements=local, build_s=built), f)
    torch.distributed.destroy_process_group()


def _run(layout: dict, args: argparse.Namespace) -> list[dict]:
    world = layout["tp"] * layout["pp"] * layout["dp"]
    with tempfile.TemporaryDirectory() as out:
        run_local_world(world, _worker, out, layout, args)
        return [json.load(open(os.path.join(out, f"{r}.json"))) for r in range(world)]


def _parse(text: str) -> dict:
    parts = text.split(",")
    tp, pp, dp = (int(p) for p in parts[:3])
    unknown = set(parts[3:]) - {"zero", "vocab"}
    if unknown:
        raise SystemExit(f"layout {text!r}: unknown flag(s) {sorted(unknown)}; use tp,pp,dp[,zero][,vocab]")
    return dict(tp=tp, pp=pp, dp=dp, zero="zero" in parts[3:], vocab="vocab" in parts[3:], name=text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2-medium")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--meta", action="store_true", help="build the model on the meta device")
    ap.add_argument("--threads", type=int, default=1, help="threads per process (0: cores / processes)")
    ap.add_argument("--layouts", nargs="+", default=DEFAULT_LAYOUTS, help="tp,pp,dp[,zero][,vocab] ... (vocab: vocab_passes=True)")
    ap.add_argument("--partition", default="uniform",
                    help="uniform (default: fixed cuts, no profiling) or ilp (parallelize's default: "
                         "each rank times its share of the graph first)")
    ap.add_argument("--costs", default="measure", help="measure or model (what the ilp balances)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="rounds over the layouts (interleaved); medians are reported")
    ap.add_argument("--out", default=os.path.join(RESULTS, "memory"))
    args = ap.parse_args()
    runs: dict[str, list[list[dict]]] = {text: [] for text in args.layouts}
    layouts = {text: _parse(text) for text in args.layouts}
    for r in range(args.repeats):  # interleaved rounds: a drift of the machine hits every layout
        for text, layout in layouts.items():
            t = time.perf_counter()
            runs[text].append(_run(layout, args))
            print(f"round {r + 1}/{args.repeats} {text}: peaks (GiB) "
                  f"{[round(x['peak'] / 2**30, 2) for x in runs[text][-1]]}, {time.perf_counter() - t:.0f} s", flush=True)
    rows = []
    for text, done in runs.items():
        # Per rank the median over rounds; the layout's peak is the median of each round's worst.
        per_rank = [statistics.median(run[i]["peak"] for run in done) for i in range(len(done[0]))]
        rows.append(dict(layout=text, world=len(per_rank),
                         peak_gib=statistics.median(max(x["peak"] for x in run) for run in done) / 2**30,
                         peaks_gib=[round(p / 2**30, 2) for p in per_rank],
                         rounds_gib=[round(max(x["peak"] for x in run) / 2**30, 2) for run in done],
                         built_gib=[round(x["built_peak"] / 2**30, 2) for x in done[-1]],
                         fixed_gib=statistics.median(x["fixed"] for run in done for x in run) / 2**30,
                         # The worst process's peak above its resident size before parallelize.
                         net_gib=statistics.median(max(x["peak"] - x["before"] for x in run) for run in done) / 2**30,
                         elements=[x["local_elements"] for x in done[-1]], loss=done[-1][0]["losses"]))
        print(rows[-1], flush=True)
    ref = next((r for r in rows if r["layout"] == "1,1,1"), None)
    lines = [f"# Peak resident memory per process: {args.model}, seq {args.seq}, "
             f"{args.microbatches} microbatches of {args.micro_batch}, {args.steps} AdamW steps"
             f"{', built on meta' if args.meta else ''}, partition {args.partition}"
             f"{', costs ' + args.costs if args.partition in ('ilp', 'dp') else ''}", "",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, gloo, "
             f"{args.threads or 'cores/processes'} thread(s) per process. Ratio = largest per-process peak / "
             f"(one-process peak / world size); medians of {args.repeats} interleaved round(s) (largest: each "
             f"round's worst process; `vocab`: vocab_passes=True).", "",
             "Floor: the ratio a perfect split of everything but the fixed cost of a process would reach, "
             "(F + (one-process peak - F) / world) / (one-process peak / world), F = the process's peak after "
             "importing torch and fxpipe (median over processes). Net ratio: the largest (peak - resident size "
             "before parallelize) of a process, to (the one-process run's) / world size.", "",
             "| tp,pp,dp | processes | peak per process (GiB) | largest | rounds' largest | ratio to ideal share | "
             "floor (F GiB) | net ratio | parameter elements per process | losses |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['peak_gib'] / (ref['peak_gib'] / r['world']):.2f}" if ref else "n/a"
        fixed, world = r["fixed_gib"], r["world"]
        floor = f"{(fixed + (ref['peak_gib'] - fixed) / world) / (ref['peak_gib'] / world):.2f} ({fixed:.2f})" \
            if ref else "n/a"
        net = f"{r['net_gib'] / (ref['net_gib'] / r['world']):.2f}" if ref else "n/a"
        lines.append(f"| {r['layout']} | {r['world']} | {', '.join(map(str, r['peaks_gib']))} | "
                     f"{r['peak_gib']:.2f} | {', '.join(map(str, r['rounds_gib']))} | {ratio} | {floor} | {net} | "
                     f"{', '.join(f'{e / 1e6:.1f}M' for e in r['elements'])} | "
                     f"{', '.join(f'{x:.4f}' for x in r['loss'])} |")
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".md", "w") as f:
        f.write(text)
    with open(args.out + ".json", "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

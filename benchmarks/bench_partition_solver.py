"""Partition-solver speed and quality on a synthetic GPT-3-175B-shaped DAG.

    cd /work/main && PYTHONPATH=. .venv/bin/python benchmarks/bench_partition_solver.py

(``--shape gpt2-medium`` runs the GPT-2-medium shapes of issue 4 at p = 4 and 8.)

The graph is built from closed-form costs, not a capture, so the solver is
measured alone. Assumptions, per GPU of one pipeline stage:

* Tensor parallel t = 8 with sequence parallelism and selective activation
  recompute, the Megatron setup of Korthikanti et al. 2022 ("Reducing Activation
  Recomputation", §4-5): every compute, parameter and activation figure is
  divided by t; activations are 34·s·b·h/t bytes per layer and microbatch
  (their Table 2), split over the ops as the paper itemises them.
* Compute: matmuls at 150 TFLOP/s, element-wise ops (layer norm, GELU,
  residual add, embedding gather, loss) memory bound at 2 TB/s; backward = 2 x
  forward. FLOPs: 2·m·n·k per matmul, 4·s²·h·b for attention (Narayanan et al. SC21).
* Static memory: 18 bytes per parameter — fp16 weight (2) + fp32 main grad (4)
  + fp32 master weight (4) + Adam moments (8), Megatron mixed precision without
  the distributed optimizer. 175B / 16 ranks x 18 B would be ~200 GB, hence t = 8.
  The tied embedding / LM head matrix is counted at both ends.
* p2p: 25 GB/s (200 Gb/s InfiniBand per GPU), 10 µs latency; a cut sends the
  tensor's 1/t shard (sequence-parallel residual stream, or the head/column shard).
* In-flight microbatches: 1F1B, rank r holds min(p - r, m) (m = 64). Interleaved
  1F1B: Megatron's warm-up of 2·(p - r - 1) + (v - 1)·p forwards plus one, assigned
  to chunks in groups of p — an approximation until the schedule simulator provides it.
"""
from __future__ import annotations

import argparse
import time

import networkx as nx

from fxpipe.partition import PartitionProblem, coarsen, partition

MATMUL_FLOPS = 150e12
HBM_BYTES_PER_S = 2e12
BYTES_PER_PARAM = 18
SHAPES = {  # layers, hidden, seq, vocab, tensor-parallel degree
    "gpt3-175b": (96, 12288, 2048, 51200, 8),
    "gpt2-medium": (24, 1024, 1024, 50257, 1),
}


def gpt_graph(layers: int, h: int, s: int, vocab: int, tp: int, b: int = 1) -> nx.DiGraph:
    """Layered DAG with the residual skips of a pre-LN GPT (one node per op group)."""
    g = nx.DiGraph()
    sbh = s * b * h

    def add(name, *, flops=0.0, moved=0.0, params=0, act=0.0, out=0.0, layer=None, inputs=()):
        fwd = (flops / MATMUL_FLOPS + moved * 2 / HBM_BYTES_PER_S) / tp  # moved: fp16 elements
        g.add_node(name, fwd=fwd, bwd=2 * fwd, params=params // tp,
                   static_bytes=params * BYTES_PER_PARAM // tp, act_bytes=int(act * sbh / tp),
                   out_bytes=int(out * 2 / tp), layer=layer, key=name)
        g.add_edges_from((i, name) for i in inputs)
        return name

    x = add("embed", moved=2 * sbh, params=vocab * h + s * h, out=sbh)
    for i in range(layers):
        p = f"layers.{i}."
        ln1 = add(p + "ln_1", moved=2 * sbh, params=2 * h, act=2, out=sbh, layer=i, inputs=[x])
        qkv = add(p + "attn.qkv", flops=2 * sbh * 3 * h, params=3 * h * h + 3 * h, act=2, out=3 * sbh,
                  layer=i, inputs=[ln1])
        core = add(p + "attn.core", flops=4 * s * s * h * b, act=6, out=sbh, layer=i, inputs=[qkv])
        proj = add(p + "attn.proj", flops=2 * sbh * h, params=h * h + h, act=2, out=sbh, layer=i, inputs=[core])
        res1 = add(p + "res_1", moved=3 * sbh, act=1, out=sbh, layer=i, inputs=[x, proj])
        ln2 = add(p + "ln_2", moved=2 * sbh, params=2 * h, act=2, out=sbh, layer=i, inputs=[res1])
        fc1 = add(p + "mlp.fc1", flops=2 * sbh * 4 * h, params=4 * h * h + 4 * h, act=2, out=4 * sbh,
                  layer=i, inputs=[ln2])
        gelu = add(p + "mlp.gelu", moved=8 * sbh, act=8, out=4 * sbh, layer=i, inputs=[fc1])
        fc2 = add(p + "mlp.fc2", flops=2 * sbh * 4 * h, params=4 * h * h + h, act=8, out=sbh, layer=i, inputs=[gelu])
        x = add(p + "res_2", moved=3 * sbh, act=1, out=sbh, layer=i, inputs=[res1, fc2])
    lnf = add("ln_f", moved=2 * sbh, params=2 * h, act=2, out=sbh, inputs=[x])
    logits = add("lm_head", flops=2 * sbh * vocab, params=vocab * h, act=2, out=s * b * vocab, inputs=[lnf])
    add("loss", moved=3 * s * b * vocab, act=4 * s * b * vocab / sbh, out=2, inputs=[logits])
    return g


def inflight(p: int, v: int, m: int = 64) -> tuple[int, ...]:
    """Per stage k (chunk k // p on rank k % p): peak in-flight microbatches (module doc)."""
    per_stage = [0] * (p * v)
    for r in range(p):
        warmup = min(2 * (p - r - 1) + (v - 1) * p, m * v) if v > 1 else min(p - r - 1, m)
        for f in range(warmup + 1):
            per_stage[((f // p) % v) * p + r] += 1
    return tuple(max(1, c) for c in per_stage)


def run(shape: str, p: int, v: int, limit_gb: float, max_groups: int, time_limit_s: float, workers: int) -> None:
    layers, h, s, vocab, tp = SHAPES[shape]
    fine = gpt_graph(layers, h, s, vocab, tp)
    t0 = time.perf_counter()
    coarse = coarsen(fine, max_groups)
    t_coarsen = time.perf_counter() - t0
    kw = dict(num_stages=p * v, stage_to_rank=tuple(k % p for k in range(p * v)), inflight=inflight(p, v),
              memory_limit_bytes=int(limit_gb * 1e9), bandwidth_bytes_per_s=25e9, latency_s=10e-6)
    problem = PartitionProblem(graph=coarse.graph, **kw)
    fine_problem = PartitionProblem(graph=fine, **kw)
    print(f"\n{shape} (tp={tp})  p={p} v={v}  limit {limit_gb:.0f} GB/rank  {fine.number_of_nodes()} nodes -> "
          f"{coarse.graph.number_of_nodes()} groups in {t_coarsen:.2f} s")
    print(f"  {'method':8} {'time s':>7} {'bottleneck ms':>14} {'vs ilp':>7} {'balance':>8} "
          f"{'first/last ms':>14} {'peak GB':>8} fits")
    best = None
    for method in ("ilp", "dp", "params", "uniform"):
        options = dict(time_limit_s=time_limit_s, seed=0, num_workers=workers) if method == "ilp" else {}
        # Baselines see the fine graph, as Megatron / DeepSpeed would; ilp and dp the coarse one.
        r = partition(problem if method in ("ilp", "dp") else fine_problem, method, **options)
        best = best or r
        solve = r.wall_time_s + (t_coarsen if method in ("ilp", "dp") else 0.0)
        ends = f"{r.stages[0].time_s * 1e3:.1f}/{r.stages[-1].time_s * 1e3:.1f}"
        note = f"  [{r.status.value}, gap {r.gap:.3%}]" if method == "ilp" else ""
        print(f"  {method:8} {solve:7.2f} {r.bottleneck_s * 1e3:14.2f} {r.bottleneck_s / best.bottleneck_s - 1:+7.1%} "
              f"{r.balance_ratio:8.3f} {ends:>14} {max(r.rank_memory_bytes) / 1e9:8.1f} "
              f"{'yes' if r.fits_memory else 'NO'}{note}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="gpt3-175b")
    ap.add_argument("--max-groups", type=int, default=400)
    ap.add_argument("--time-limit", type=float, default=15.0, help="CP-SAT deterministic time")
    ap.add_argument("--workers", type=int, default=1, help="CP-SAT workers")
    args = ap.parse_args()
    if args.shape == "gpt3-175b":
        cases = [(16, 1, 80.0), (8, 2, 80.0), (8, 2, 62.0)]
    else:
        cases = [(4, 1, 80.0), (8, 1, 80.0)]
    for p, v, limit in cases:
        run(args.shape, p, v, limit, args.max_groups, args.time_limit, args.workers)


if __name__ == "__main__":
    from results_log import recorded

    with recorded("bench_partition_solver"):
        main()

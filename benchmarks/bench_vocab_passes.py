"""Simulated: the LM head on the last stage (today) against vocabulary passes on every rank.

    .venv/bin/python benchmarks/bench_vocab_passes.py [--hardware benchmarks/results/cpu_profile.json]

The model of ``bench_runtime.py`` (HF GPT-2 shape: 8 layers, h=256, 4 heads, s=128,
V=50257, b=2 per microbatch, m=8, fp32) priced by the planner's cost model
(``planner/layer_cost.py``) on a hardware profile (default: the calibrated CPU
profile ``results/cpu_profile.json``). Layers are split evenly; the embedding sits on
stage 0. "head on last": the head (final norm, logits, cross-entropy) is part of the
last stage's F and B. "head blocks": today's partition, which cuts the head's
logits into blocks (``passes/split_matmul.py``) and may put layers and blocks on any
stage after the last layer's output exists: here the chain embedding, 8 layers,
64 equal head blocks split into p contiguous stages of least maximum time (what
the ILP aims at; the real run adds work this does not model, issue 25).
"vocab passes": the last stage sheds the head and every rank runs
S = head forward / p and T = head backward / p (Yeung et al. 2025), placed by
``place_vocab_passes``; the hidden-state broadcast and the gradient reduce cost one
stage-boundary transfer each, the statistics all-reduce a ring all-reduce of 3 fp32
per token. Prints, per schedule and pp, the simulated step time, each rank's busy
time and the imbalance (max busy / mean busy). Nothing is run: these are the
simulator's numbers, the gain to expect before the runtime executes the passes.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fxpipe.base.hardware import Collective, get_hardware  # noqa: E402
from fxpipe.planner.options import PlannerOptions  # noqa: E402
from fxpipe.planner.layer_cost import CostModel  # noqa: E402
from fxpipe.planner.shapes import TransformerShape  # noqa: E402
from fxpipe.base.recompute_mode import RecomputeMode  # noqa: E402
from fxpipe.schedules import StageDurations, generate, simulate, split_output_layer, validate  # noqa: E402
from fxpipe.schedules import lower  # noqa: E402
from fxpipe.schedules.vocab_actions import place_vocab_passes  # noqa: E402

M, B_MICRO, SEQ, LAYERS, HIDDEN, HEADS, VOCAB = 8, 2, 128, 8, 256, 4, 50257  # bench_runtime.py's
PROFILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "cpu_profile.json")


def costs(hardware: str, num_stages: int, split_backward: bool):
    """(head-on-last durations, head work, boundary send s, stats all-reduce s) for one microbatch."""
    shape = TransformerShape(name="gpt2-8x256", layers=LAYERS, hidden=HIDDEN, heads=HEADS, seq=SEQ, vocab=VOCAB,
                             dropout=False)
    hw = get_hardware(hardware)
    model = CostModel(shape, PlannerOptions(hardware=hw, dtype_bytes=4))
    layer = model.layer(1, B_MICRO, RecomputeMode.NONE, False, split_backward)
    emb, head = model.embedding(1, B_MICRO, False), model.head(1, B_MICRO, False)
    per_stage = LAYERS // num_stages
    assert per_stage * num_stages == LAYERS, (LAYERS, num_stages)
    f = [per_stage * layer.forward_s for _ in range(num_stages)]
    b = [per_stage * layer.backward_s for _ in range(num_stages)]
    w = [per_stage * layer.weight for _ in range(num_stages)]
    f[0], b[0] = f[0] + emb.forward_s, b[0] + emb.backward_s
    f[-1], b[-1], w[-1] = f[-1] + head.forward_s, b[-1] + head.backward_s, w[-1] + head.weight
    send, _gather = model.boundary(1, B_MICRO, False, True)
    return StageDurations(forward=f, backward=b, weight=w), (emb, layer, head), send, hw


HEAD_BLOCKS = 64


def head_blocks(works, num_stages: int) -> StageDurations:
    """The chain [embedding + layer, layer, ..., head block, ...] cut into ``num_stages``
    contiguous stages of least maximum F+B (exact DP over the cut points)."""
    emb, layer, head = works
    lf, lb, lw = layer.forward_s, layer.backward_s, layer.weight
    items = [(lf + emb.forward_s, lb + emb.backward_s, lw)] + [(lf, lb, lw)] * (LAYERS - 1)
    k = HEAD_BLOCKS
    items += [(head.forward_s / k, head.backward_s / k, head.weight / k)] * k
    cost = [f + b for f, b, _ in items]
    prefix = [0.0]
    for c in cost:
        prefix.append(prefix[-1] + c)
    n = len(items)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for e in range(s, n + 1):
            for a in range(s - 1, e):
                v = max(best[s - 1][a], prefix[e] - prefix[a])
                if v < best[s][e]:
                    best[s][e], cut[s][e] = v, a
    bounds, e = [], n
    for s in range(num_stages, 0, -1):
        bounds.append((cut[s][e], e))
        e = cut[s][e]
    bounds.reverse()
    return StageDurations(forward=[sum(items[i][0] for i in range(a, e)) for a, e in bounds],
                          backward=[sum(items[i][1] for i in range(a, e)) for a, e in bounds],
                          weight=[sum(items[i][2] for i in range(a, e)) for a, e in bounds])


def row(name: str, pp: int, hardware: str) -> list[str]:
    base = generate(name, pp, M)
    head_last, works, send, hw = costs(hardware, base.num_stages, base.splits_backward)
    head = works[2]
    stats = hw.collective_s(Collective.ALL_REDUCE, 3 * 4 * B_MICRO * SEQ, pp, hw.members_per_node(pp, 1))
    before = simulate(base, head_last, p2p_latency=send)
    blocks = simulate(base, head_blocks(works, base.num_stages), p2p_latency=send)
    vocab = split_output_layer(head_last, pp, forward=head.forward_s, backward=head.backward_s,
                               weight=head.weight)
    coll = (send, stats, send)
    sched = place_vocab_passes(base, vocab, p2p_latency=send, collective_latency=coll)
    validate(lower(sched))
    after = simulate(sched, vocab, p2p_latency=send, collective_latency=coll)
    out = []
    for label, res in (("head on last", before), ("head blocks", blocks), ("vocab passes", after)):
        busy = res.busy
        imbalance = max(busy) / (sum(busy) / len(busy))
        out.append(f"| {name} | {pp} | {label} | {res.makespan * 1e3:.1f} | "
                   f"{' / '.join(f'{x * 1e3:.1f}' for x in busy)} | {imbalance:.3f} | "
                   f"{max(res.peak_in_flight)} |")
    out.append(f"| {name} | {pp} | vocab passes' speed-up | {before.makespan / after.makespan:.3f}x over head on "
               f"last, {blocks.makespan / after.makespan:.3f}x over head blocks | | | |")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hardware", default=PROFILE, help="hardware preset or profile (default: %(default)s)")
    parser.add_argument("--schedules", default="1f1b,interleaved,zb-h1,zb-v")
    args = parser.parse_args()
    name = os.path.basename(args.hardware)
    print(f"Simulated (not measured): GPT-2 {LAYERS}x{HIDDEN}, V={VOCAB}, s={SEQ}, b={B_MICRO}, m={M}, fp32, "
          f"planner cost model on {name}.")
    _, (emb, layer, head), _, _ = costs(args.hardware, 2, False)
    total = emb.forward_s + emb.backward_s + LAYERS * (layer.forward_s + layer.backward_s) \
        + head.forward_s + head.backward_s
    print(f"The head (final norm, logits, cross-entropy) is {(head.forward_s + head.backward_s) / total:.1%} "
          f"of one microbatch's work.")
    print("| schedule | pp | head | step ms | busy per rank ms | imbalance | peak in flight |")
    print("|---|---|---|---|---|---|---|")
    for sched in args.schedules.split(","):
        for pp in (2, 4):
            print("\n".join(row(sched, pp, args.hardware)))


if __name__ == "__main__":
    main()

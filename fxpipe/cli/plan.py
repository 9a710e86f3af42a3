"""``fxpipe plan``: rank tp/pp/dp layouts with the simulator (argument parsing and printing;
the search is ``fxpipe/planner``)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import time

from fxpipe.base.hardware import PRESETS, get_hardware
from fxpipe.base.recompute_mode import RecomputeMode
from fxpipe.planner.options import PLANNED, DPOverlap, LayerBalance, PlannerOptions, VocabPasses, planned_schedule


def _csv(parse):
    def f(text: str):
        return tuple(parse(x.strip()) for x in text.split(",") if x.strip())
    return f


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help="any model fxpipe run takes: a registry name (gpt-1.7b ... gpt-1t, gpt3-175b), hf:FAMILY, "
                        "zoo:NAME, package.module:function or a Hugging Face model directory; built on the meta "
                        "device and captured, the planner's shape read off its graph (fxpipe/planner/captured.py)")
    p.add_argument("--gpus", type=int, required=True, help="GPUs N = t·p·d")
    p.add_argument("--global-batch", type=int, required=True, help="sequences per iteration B")
    p.add_argument("--hardware", default="a100",
                   help=f"preset ({', '.join(PRESETS)}) or a profile JSON from `fxpipe calibrate` "
                        f"(default: %(default)s)")
    p.add_argument("--seq", type=int, default=None, help="sequence length s (default: the model's)")
    p.add_argument("--dropout", choices=("model", "on", "off"), default="model",
                   help="price dropout's masks: as the captured model has it (model), or as if it had "
                        "dropout (on: the SC21 paper's setting) or none (off) (default: %(default)s)")
    p.add_argument("--top", type=int, default=5, help="layouts to print (default: %(default)s)")
    p.add_argument("--explain", action="store_true", help="why the top layout beats the runner-up")
    p.add_argument("--schedules", type=_csv(planned_schedule), default=PLANNED,
                   help="schedules to search (default: 1f1b,interleaved,zb-h1)")
    p.add_argument("--recompute", type=_csv(RecomputeMode.parse), default=tuple(RecomputeMode),
                   help="recompute modes to search (default: none,selective,full)")
    p.add_argument("--sequence-parallel", action="store_true", help="use SP whenever t > 1")
    p.add_argument("--no-scatter-gather", action="store_true",
                   help="send whole stage boundaries from every TP rank (SC21 §4.1 off)")
    p.add_argument("--fused-attention", action="store_true",
                   help="price flash attention (no s×s activations) instead of the paper's kernels")
    p.add_argument("--dp-overlap", choices=[k.value for k in DPOverlap], default="none",
                   help="data-parallel all-reduce after the backward or overlapped with the last "
                        "microbatch's (default: %(default)s)")
    p.add_argument("--balance", choices=[k.value for k in LayerBalance], default="fxpipe",
                   help="layer split: fxpipe (any l) or megatron (l %% (p·v) == 0) (default: %(default)s)")
    p.add_argument("--vocab-passes", choices=[k.value for k in VocabPasses], default="off",
                   help="the LM head and cross-entropy as vocabulary passes on every pipeline rank "
                        "(`fxpipe run --vocab-passes`): off, on (every layout, p >= 2) or search "
                        "(both; the table's vocab column says which) (default: %(default)s)")
    p.add_argument("--max-tp", type=int, default=None, help="largest t (default: any divisor of the heads)")
    p.add_argument("--max-chunks", type=int, default=4, help="largest interleaving v (default: %(default)s)")
    p.add_argument("--max-micro-batch", type=int, default=16, help="largest b (default: %(default)s)")
    p.add_argument("--json", metavar="FILE", help="write the ranked layouts as JSON")


def options_from_args(args: argparse.Namespace) -> PlannerOptions:
    return PlannerOptions(
        hardware=get_hardware(args.hardware), schedules=tuple(args.schedules),
        recomputes=tuple(args.recompute), sequence_parallel=args.sequence_parallel,
        scatter_gather=not args.no_scatter_gather, fused_attention=args.fused_attention,
        dp_overlap=DPOverlap(args.dp_overlap), balance=LayerBalance(args.balance),
        vocab_passes=VocabPasses(args.vocab_passes),
        max_tp=args.max_tp, max_chunks=args.max_chunks, max_micro_batch=args.max_micro_batch)


MAX_GPUS = 2**20
MAX_GLOBAL_BATCH = 65536
"""Sequences per iteration the search takes (GPT-3 trained at 1536): the per-layout in-flight
counts grow with the microbatch count, and at 10^7 one search took 49 s and 0.9 GB."""


def run_plan(args: argparse.Namespace) -> int:
    # loaded when the command runs, not on import: `fxpipe --help` stays quick
    from fxpipe.job.preflight_sizes import check_shape
    from fxpipe.planner.explain import explain, plan_table, search_summary
    from fxpipe.planner.captured import captured_shape
    from fxpipe.planner.search import plan

    for flag, value, limit in (("--gpus", args.gpus, MAX_GPUS), ("--global-batch", args.global_batch,
                                                                 MAX_GLOBAL_BATCH)):
        if not 1 <= value <= limit:
            raise ValueError(f"{flag} must be in [1, {limit}], got {value}")
    check_shape(args.model)  # layers, width, vocabulary bounded before the capture (10^6 layers: gigabytes)
    captured = captured_shape(args.model, seq=args.seq)
    print(f"fxpipe plan: {captured.describe()}")
    shape = captured.shape
    if args.dropout != "model":
        shape = dataclasses.replace(shape, dropout=args.dropout == "on")
    options = options_from_args(args)
    hw = options.hardware
    start = time.perf_counter()
    result = plan(shape, args.gpus, args.global_batch, options, top=args.top)
    searched = time.perf_counter() - start
    print(f"fxpipe plan: {shape.name} ({shape.num_params / 1e9:.1f}B parameters: l={shape.layers} "
          f"h={shape.hidden} a={shape.heads} s={shape.seq} V={shape.vocab}) on {args.gpus} × {hw.name} "
          f"({hw.peak_flops / 1e12:.0f} TFLOP/s peak, {hw.memory_bytes / 2**30:.0f} GiB), "
          f"global batch {args.global_batch}")
    print(plan_table(result))
    print(search_summary(result) + f" (search {searched:.1f} s, capture {captured.seconds:.1f} s)")
    print("TFLOP/s per GPU: SC21 model FLOPs counting recomputation (96·B·s·l·h²(1 + s/6h + V/16lh) "
          "with full recompute, 72·B·s·l·h²(…) without); bubble: idle/compute of the busiest "
          "pipeline rank; GB/GPU: the rank with the most memory.")
    if args.explain:
        if len(result.predictions) < 2:
            print("--explain: only one layout fits; nothing to compare")
        else:
            print()
            print(explain(result.predictions[0], result.predictions[1]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dict(config=p.config.label(), tp=p.config.tp, pp=p.config.pp, dp=p.config.dp,
                            micro_batch=p.config.micro_batch, microbatches=p.config.num_microbatches,
                            chunks=p.config.chunks, schedule=p.config.schedule.value,
                            recompute=p.config.recompute.value, vocab_passes=p.config.vocab_passes,
                            iteration_s=p.iteration_s,
                            tflops_per_gpu=p.tflops_per_gpu, memory_gb=p.memory_gb,
                            bubble_ratio=p.bubble_ratio,
                            breakdown={c.value: v for c, v in p.breakdown.items()})
                       for p in result.predictions], f, indent=2)
        print(f"layouts written to {args.json}")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_plan_arguments(p)
    p.set_defaults(fn=run_plan)

"""``fxpipe plan``: rank tp/pp/dp layouts with the simulator (argument parsing and printing;
the search is ``fxpipe/planner``). ``fxpipe run``'s layout flags pin the search; all of them
price one layout, printed with its breakdown."""
from __future__ import annotations

import argparse
import dataclasses
import json
import time

from fxpipe.base.hardware import PRESETS, get_hardware
from fxpipe.base.recompute_mode import RecomputeMode
from fxpipe.job.flags import LAYOUT_FLAGS, TRAIN_FLAGS, add_flags
from fxpipe.planner.options import (PLANNED, DPOverlap, GradAccumulation, LayerBalance, LayoutPins, PlannerOptions,
                                    VocabPasses, planned_schedule)

PINNED_LAYOUT = ("tp", "pp", "dp", "num_microbatches", "schedule", "chunks", "sp", "zero")
"""``fxpipe run``'s layout flags (``job/flags.py``) that ``fxpipe plan`` takes as pins."""


def _csv(parse):
    def f(text: str):
        return tuple(parse(x.strip()) for x in text.split(",") if x.strip())
    return f


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help="any model fxpipe run takes: a registry name (gpt-1.7b ... gpt-1t, gpt3-175b), hf:FAMILY, "
                        "zoo:NAME, package.module:function or a Hugging Face model directory; built on the meta "
                        "device and captured, the planner's shape read off its graph (fxpipe/planner/captured.py)")
    p.add_argument("--gpus", type=int, default=None, help="GPUs N = t·p·d (default: --tp·--pp·--dp when all given)")
    p.add_argument("--global-batch", type=int, default=None,
                   help="sequences per iteration B (default: --dp·--micro-batch-size·--microbatches when all given)")
    # The layout flags of `fxpipe run`, one definition (job/flags.py): each given pins the search;
    # all given (and one --recompute) price that one layout.
    add_flags(p, {k: LAYOUT_FLAGS[k] for k in PINNED_LAYOUT}, {})
    add_flags(p, {"micro_batch_size": TRAIN_FLAGS["micro_batch_size"]}, {})
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
                   help="schedules to search (default: 1f1b,interleaved,zb-h1; --schedule pins one)")
    p.add_argument("--recompute", type=_csv(RecomputeMode.parse), default=tuple(RecomputeMode),
                   help="recompute mode: one pins it (as fxpipe run's), a comma list searches those "
                        "(default: none,selective,full)")
    p.add_argument("--sequence-parallel", dest="sp", action="store_true", default=argparse.SUPPRESS,
                   help="the same as --sp")
    p.add_argument("--no-sp", dest="sp", action="store_false", default=argparse.SUPPRESS,
                   help="no sequence parallelism (default: SP on every t > 1 layout: its all-gather and "
                        "reduce-scatter move the all-reduce's bytes and it shards the norms' work and memory, "
                        "so this price never prefers a layout without it)")
    p.add_argument("--tp-overlap", action="store_true",
                   help="TP collectives overlapped with their GEMMs (Megatron-Core's --tp-comm-overlap): "
                        "only what outlasts a pass's GEMMs is exposed")
    p.add_argument("--no-scatter-gather", action="store_true",
                   help="send whole stage boundaries from every TP rank (SC21 §4.1 off)")
    attention = p.add_mutually_exclusive_group()
    attention.add_argument("--fused-attention", action="store_true",
                           help="price flash attention (no s×s activations) whatever the model calls (default: "
                                "flash where the captured graph calls scaled_dot_product_attention)")
    attention.add_argument("--unfused-attention", action="store_true",
                           help="price the SC21 paper's unfused kernels (s×s scores, softmax and dropout kept) "
                                "whatever the model calls")
    p.add_argument("--dp-overlap", choices=[k.value for k in DPOverlap], default="backward",
                   help="data-parallel all-reduce after the backward or in buckets overlapped with the "
                        "last microbatch's, as fxpipe's runtime runs it (default: %(default)s)")
    p.add_argument("--grad-accumulation", choices=[k.value for k in GradAccumulation], default="fused",
                   help="each microbatch's weight gradients added in the GEMM (fused: Megatron since 2022) or "
                        "by an element-wise pass over the rank's gradients (separate: Megatron 2021, autograd) "
                        "(default: %(default)s)")
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


def pins_from_args(args: argparse.Namespace) -> LayoutPins:
    schedule = getattr(args, "schedule", None)
    return LayoutPins(tp=getattr(args, "tp", None), pp=getattr(args, "pp", None), dp=getattr(args, "dp", None),
                      micro_batch=getattr(args, "micro_batch_size", None),
                      num_microbatches=getattr(args, "num_microbatches", None), chunks=getattr(args, "chunks", None),
                      schedule=planned_schedule(schedule) if schedule is not None else None)


def options_from_args(args: argparse.Namespace) -> PlannerOptions:
    # Not searched unless pinned: SP on and ZeRO-1 are never slower nor larger in this price
    # (ZeRO-1's reduce-scatter + all-gather move 6 bytes per parameter where the fp32 all-reduce
    # moves 8, and its Adam step covers 1/d), so searching both ways would only double the work.
    return PlannerOptions(
        hardware=get_hardware(args.hardware), schedules=tuple(args.schedules), pins=pins_from_args(args),
        recomputes=tuple(args.recompute), sequence_parallel=getattr(args, "sp", True),
        zeros=(getattr(args, "zero", 1),), tp_overlap=args.tp_overlap,
        scatter_gather=not args.no_scatter_gather, fused_attention=args.fused_attention,
        dp_overlap=DPOverlap(args.dp_overlap), grad_accumulation=GradAccumulation(args.grad_accumulation),
        balance=LayerBalance(args.balance),
        vocab_passes=VocabPasses(args.vocab_passes),
        max_tp=args.max_tp, max_chunks=args.max_chunks, max_micro_batch=args.max_micro_batch)


MAX_GPUS = 2**20
MAX_GLOBAL_BATCH = 65536
"""Sequences per iteration the search takes (GPT-3 trained at 1536): the per-layout in-flight
counts grow with the microbatch count, and at 10^7 one search took 49 s and 0.9 GB."""


def sizes_from_args(args: argparse.Namespace, pins: LayoutPins) -> tuple[int, int]:
    """(GPUs, global batch): given, or the product of the pinned layout's sizes."""
    gpus, batch = args.gpus, args.global_batch
    if gpus is None and None not in (pins.tp, pins.pp, pins.dp):
        gpus = pins.tp * pins.pp * pins.dp
    if batch is None and None not in (pins.dp, pins.micro_batch, pins.num_microbatches):
        batch = pins.dp * pins.micro_batch * pins.num_microbatches
    if gpus is None or batch is None:
        raise ValueError("give --gpus and --global-batch, or pin the layout that implies them "
                         "(--tp --pp --dp for the GPUs, --dp --micro-batch-size --microbatches for the batch)")
    if pins.tp and pins.pp and pins.dp and pins.tp * pins.pp * pins.dp != gpus:
        raise ValueError(f"--tp {pins.tp} × --pp {pins.pp} × --dp {pins.dp} = {pins.tp * pins.pp * pins.dp} "
                         f"GPUs, but --gpus is {gpus}")
    if pins.dp and pins.micro_batch and pins.num_microbatches and \
            pins.dp * pins.micro_batch * pins.num_microbatches != batch:
        raise ValueError(f"--dp × --micro-batch-size × --microbatches = "
                         f"{pins.dp * pins.micro_batch * pins.num_microbatches}, but --global-batch is {batch}")
    return gpus, batch


def run_plan(args: argparse.Namespace) -> int:
    # loaded when the command runs, not on import: `fxpipe --help` stays quick
    from fxpipe.job.preflight_sizes import check_shape
    from fxpipe.planner.explain import breakdown, explain, plan_table, search_summary
    from fxpipe.planner.captured import captured_shape
    from fxpipe.planner.predict import predict
    from fxpipe.planner.search import PlanResult, enumerate_layouts, plan

    options = options_from_args(args)
    args.gpus, args.global_batch = sizes_from_args(args, options.pins)
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
    if args.unfused_attention:
        shape = dataclasses.replace(shape, fused_attention=False)
    hw = options.hardware
    start = time.perf_counter()
    layouts = enumerate_layouts(shape, args.gpus, args.global_batch, options)
    if len(layouts) == 1:  # the flags pin one layout: priced whether it fits or not
        one = predict(shape, layouts[0], options)
        result = PlanResult(predictions=(one,), enumerated=1, fitting=int(one.fits), simulated=1,
                            wall_s=time.perf_counter() - start, smallest_memory_gb=one.memory_gb)
    else:
        result = plan(shape, args.gpus, args.global_batch, options, top=args.top)
    searched = time.perf_counter() - start
    print(f"fxpipe plan: {shape.name} ({shape.num_params / 1e9:.1f}B parameters: l={shape.layers} "
          f"h={shape.hidden} a={shape.heads} s={shape.seq} V={shape.vocab}) on {args.gpus} × {hw.name} "
          f"({hw.peak_flops / 1e12:.0f} TFLOP/s peak, {hw.memory_bytes / 2**30:.0f} GiB), "
          f"global batch {args.global_batch}")
    print(plan_table(result))
    print(search_summary(result) + f" (search {searched:.1f} s, capture {captured.seconds:.1f} s)")
    print(breakdown(result.predictions[0]))
    print("TFLOP/s per GPU: model FLOPs counting recomputation, from the captured layer's matrices and the "
          "attention core over the full s×s (for a GPT the SC21 formulas, 96·B·s·l·h²(1 + s/6h + V/16lh) with full "
          "recompute, 72·B·s·l·h²(…) without); bubble: idle/compute of the busiest pipeline rank; GB/GPU: the "
          "rank with the most memory; sp and zero: on unless pinned (never slower nor larger in this price).")
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
                            sequence_parallel=p.config.sequence_parallel, zero=p.config.zero,
                            memory_by_kind=dict(parameters=p.memory.weight_bytes,
                                                gradients=p.memory.gradient_bytes,
                                                optimizer_state=p.memory.optimizer_bytes,
                                                activations=p.memory.activation_bytes + p.memory.working_bytes),
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

"""``fxpipe compile | run | viz | plan`` — the command-line front end.

Each subcommand parses its flags here and hands a config to library code; no
compiler logic lives in this file.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Sequence


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (a size or count of zero is never meant)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="gpt-tiny",
                   help="registry name (gpt-tiny, gpt-small, gpt2-small, gpt2-medium, gpt3-175b, "
                        "hf:gpt2, hf:llama, hf:gpt_neox, hf:opt) or package.module:function "
                        "returning (model, batch[, loss_fn]) (default: %(default)s)")
    p.add_argument("--batch", type=positive_int, default=2, help="sequences per batch B (default: %(default)s)")
    p.add_argument("--seq", type=positive_int, default=None,
                   help="sequence length s (default: the model's own maximum)")
    p.add_argument("--layers", type=positive_int, default=None, help="override the number of layers")
    p.add_argument("--device", default=None,
                   help="device to build the model on; 'meta' allocates no weights "
                        "(default: meta for gpt2-medium and larger, else cpu)")


def _layout(args: argparse.Namespace):
    """The ``ParallelConfig`` of ``fxpipe compile``'s or ``fxpipe run``'s flags."""
    from fxpipe.config import ParallelConfig

    fields = dict(tp=args.tp, pp=args.pp, sp=args.sp, schedule=args.schedule, chunks=args.chunks,
                  microbatches=args.microbatches, partition=args.partition, costs=args.costs)
    for flag, name in (("dp", "dp"), ("seed", "seed"), ("precision", "precision"), ("recompute", "recompute"),
                       ("zero", "zero"), ("compile", "compile"), ("timeout", "timeout_s"),
                       ("memory_limit", "memory_limit_gb"), ("allow_over_limit", "allow_over_limit"),
                       ("hardware", "hardware"), ("time_limit", "time_limit_s"), ("split_loss", "split_loss"),
                       ("strict_tp", "strict_tp")):
        if hasattr(args, flag):
            fields[name] = getattr(args, flag)
    if getattr(args, "no_scatter_gather", False):
        fields["scatter_gather"] = False
    return ParallelConfig(**fields)


def _cmd_compile(args: argparse.Namespace) -> int:
    from fxpipe.compiler import CompileHooks, compile_pipeline
    from fxpipe.models.registry import build_workload
    from fxpipe.passes.tensor_parallel import render_sharding_report
    from fxpipe.preflight import capture_device
    from fxpipe.report import compile_summary

    layout = _layout(args)
    device = args.device or capture_device(args.model)
    workload = build_workload(args.model, batch=args.batch, seq=args.seq, device=device,
                              layers=args.layers)
    pipelined = args.pp > 1 or args.chunks
    measured: list[str] = []

    def measure(program, config, ctx):
        config, name = _measured_config(program, config, ctx, workload, args)
        measured.append(name)
        return config

    # The same pipeline parallelize runs (fxpipe/compiler.py); one stage needs no partition.
    result = compile_pipeline(workload.model, workload.example_inputs, layout, loss_fn=workload.loss_fn,
                              hooks=CompileHooks(measure=measure), skip=args.skip_pass, debug=args.debug,
                              until=None if pipelined else "cost")
    print(compile_summary(result.program, list(result.timings)))
    print(f"capture      {result.capture_s:.2f} s on {device}")
    if result.program.tensor_parallel is not None:
        print()
        print(render_sharding_report(result.program.tensor_parallel))
    if pipelined:
        _print_partition(result, measured[0] if measured else layout.hardware, args)
    if args.graph:
        with open(args.graph, "w") as f:
            f.write(str(result.program.graph))
        print(f"graph text   written to {args.graph}")
    return 0


def _measured_config(program, config, ctx, workload, args: argparse.Namespace):
    """The partition config with costs measured in this process (or read from a profile)."""
    import torch

    from fxpipe.costs import apply_profile, measured_profile
    from fxpipe.costs.profile import device_name

    if args.tp > 1 and args.costs == "measure":
        raise ValueError("--costs measure times the graph with its tensor-parallel collectives, which "
                         "needs the tp ranks: measure with `fxpipe run --costs measure` (it caches the "
                         "profile) and pass the file, or use --costs model here")
    if any(t.is_meta for t in program.state.values()) and args.costs == "measure":
        raise ValueError(f"--costs measure runs the model, but {args.model} was built on the meta device "
                         f"(no weights); add --device cpu (needs the memory) or use --costs model")
    device = torch.device("cpu")
    state_for = lambda names: {n: program.state[n].detach().clone().requires_grad_(  # noqa: E731
        program.state[n].requires_grad) for n in names}
    profile, probe, fine = measured_profile(program, config, args.costs, device=device, state_for=state_for,
                                            batch=workload.example_inputs)
    measured = apply_profile(config, profile, probe, fine, ctx.schedule.splits_backward)
    return measured, f"measured: {device_name(device)}"


def _print_partition(result, hw_name: str, args: argparse.Namespace) -> None:
    import json

    from fxpipe.report import stage_rows, stage_table

    layout, program, partition = result.config, result.program, result.partition
    assignment = dict(program.stages)
    print()
    print(f"pipeline     pp={layout.pp} chunks={layout.chunks} schedule={layout.schedule.value} "
          f"microbatches={layout.num_microbatches}")
    print(stage_table(program, assignment, partition, hw_name))
    if layout.tp > 1:
        print(_inter_stage_bytes(result.plan, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(method=partition.method.value, bottleneck_s=partition.bottleneck_s,
                           balance_ratio=partition.balance_ratio, gap=partition.gap,
                           status=partition.status.value, stages=stage_rows(program, assignment, partition)),
                      f, indent=2)
        print(f"stage table  written to {args.json}")


def _inter_stage_bytes(plan, args: argparse.Namespace) -> str:
    """Bytes each tp rank sends between stages per step, with and without scatter-gather."""
    from fxpipe.report import human
    from fxpipe.tp import inter_stage_bytes

    totals = {}
    for sg in (False, True):
        per_mb = 0
        for v in plan.values.values():
            chunked = sg and v.tp_replicated
            n = inter_stage_bytes(v.spec.shape, v.spec.dtype, args.tp, scatter_gather=chunked)
            # forward activation, plus its gradient back when one flows
            per_mb += n * len(v.consumers) * (2 if v.requires_grad else 1)
        totals[sg] = per_mb * args.microbatches
    saved = 1 - totals[True] / totals[False] if totals[False] else 0.0
    return (f"inter-stage  {human(totals[False], 'B')} per step per tp rank without scatter-gather, "
            f"{human(totals[True], 'B')} with (-{saved:.0%}; SC21 §4.1)")


def _cmd_run(args: argparse.Namespace) -> int:
    from fxpipe.preflight import check_flags, check_run
    from fxpipe.launcher import launch
    from fxpipe.train import TrainConfig

    check_flags(args)  # by flag name, before the configs refuse the same values by field
    config = TrainConfig(model=args.model, parallel=_layout(args), micro_batch_size=args.micro_batch_size,
                         global_batch=args.global_batch, seq=args.seq, steps=args.steps, lr=args.lr,
                         log_interval=args.log_interval,
                         timeline=None if args.timeline == "none" else args.timeline,
                         checkpoint_dir=args.checkpoint_dir, save_interval=args.save_interval,
                         resume=args.resume, resume_from=args.resume_from, export=args.export,
                         overwrite=args.overwrite,
                         init_from=args.init_from)
    # Everything checkable is checked here, before a worker starts (fxpipe/preflight.py).
    # Under torchrun every rank is a worker already: the model is captured by each anyway.
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    check_run(config, model=not under_torchrun)
    return launch(config, debug=args.debug)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fxpipe", description="Compile and run an unmodified PyTorch model with tensor and "
                                   "pipeline parallelism.")
    sub = parser.add_subparsers(dest="command", metavar="{compile,run,viz,plan,calibrate}")
    sub.required = True

    p = sub.add_parser("compile", help="capture a model, run the passes, print a summary")
    _add_model_args(p)
    p.add_argument("--graph", metavar="FILE", help="write the compiled ATen graph as text")
    p.add_argument("--skip-pass", action="append", default=[], metavar="NAME",
                   help="skip a pass of the compile pipeline by name (repeatable; names: fxpipe/compiler.py)")
    p.add_argument("--debug", action="store_true",
                   help="lint the graph and check invariants after every pass; full tracebacks")
    p.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel size t; >1 prints the sharding report")
    p.add_argument("--sp", action="store_true", help="sequence parallelism (with --tp)")
    p.add_argument("--no-scatter-gather", action="store_true",
                   help="send full activations between stages instead of 1/t chunks (SC21 §4.1)")
    p.add_argument("--pp", type=positive_int, default=1, help="pipeline ranks p; >1 prints the stage table")
    p.add_argument("--chunks", type=positive_int, default=None, help="stages per rank v (default: the schedule's)")
    p.add_argument("--schedule", default="1f1b", help="schedule whose in-flight microbatches size "
                   "activation memory (default: %(default)s)")
    p.add_argument("--microbatches", type=positive_int, default=8, help="microbatches m (default: %(default)s)")
    p.add_argument("--partition", default="ilp", help="ilp, uniform, params, dp (default: %(default)s)")
    p.add_argument("--memory-limit", type=positive_float, default=None, metavar="GIB",
                   help="per-rank memory limit in GiB; every method must meet it, only ilp and dp "
                        "take it into account (default: none)")
    p.add_argument("--allow-over-limit", action="store_true",
                   help="print a uniform/params plan that exceeds --memory-limit instead of "
                        "refusing it (to compare methods)")
    p.add_argument("--hardware", default="cpu", help="cost model preset: cpu, a100 (default: %(default)s)")
    p.add_argument("--costs", default="model", metavar="model|measure|PATH",
                   help="what the partition balances: the --hardware model's estimate, times measured "
                        "on this machine (cached), or a saved cost profile (default: %(default)s)")
    p.add_argument("--split-loss", action="store_true",
                   help="compute the cross-entropy over a split LM head block by block, spread with "
                        "its blocks over the stages (off by default; docs/costs.md)")
    p.add_argument("--time-limit", type=positive_float, default=10.0, help="ILP time limit, s (default: %(default)s)")
    p.add_argument("--json", metavar="FILE", help="write the stage table as JSON")
    p.set_defaults(fn=_cmd_compile)

    p = sub.add_parser("run", help="compile and train (the embedded default: a small GPT on CPU)",
                       description="Train a model with tensor × pipeline × data parallelism on the "
                                   "Python standard library's source as byte-level text. Without "
                                   "torchrun, starts tp·pp·dp local worker processes itself.")
    p.add_argument("--model", default="gpt-small", help="model registry name (default: %(default)s)")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default: %(default)s)")
    p.add_argument("--sp", action="store_true", help="sequence parallelism (with --tp > 1)")
    p.add_argument("--strict-tp", action="store_true",
                   help="fail when tensor parallelism leaves weight matrices whole on every rank")
    p.add_argument("--pp", type=int, default=2, help="pipeline-parallel size (default: %(default)s)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel size (default: %(default)s)")
    p.add_argument("--schedule", default="1f1b",
                   help="gpipe, 1f1b, interleaved, zb-h1, zb-v (default: %(default)s)")
    p.add_argument("--chunks", type=int, default=None,
                   help="stages per pipeline rank (default: the schedule's own)")
    p.add_argument("--microbatches", type=int, default=4, help="microbatches per step m (default: %(default)s)")
    p.add_argument("--micro-batch-size", type=int, default=4, help="sequences per microbatch b (default: %(default)s)")
    p.add_argument("--global-batch", type=int, default=None,
                   help="sequences per step; must equal b·m·dp (default: b·m·dp)")
    p.add_argument("--seq", type=int, default=128, help="sequence length s (default: %(default)s)")
    p.add_argument("--steps", type=int, default=80, help="training steps (default: %(default)s)")
    p.add_argument("--lr", type=float, default=2e-3, help="peak AdamW learning rate (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="model init and data seed (default: %(default)s)")
    p.add_argument("--log-interval", type=int, default=10, help="steps between log lines (default: %(default)s)")
    p.add_argument("--partition", default="ilp", help="ilp, uniform, params, dp (default: %(default)s)")
    p.add_argument("--costs", default="measure", metavar="measure|model|PATH",
                   help="what the partition balances: forward/backward times of the graph measured "
                        "on the workers before training (cached on disk), the CPU cost model, or a "
                        "saved cost profile (default: %(default)s)")
    p.add_argument("--split-loss", action="store_true",
                   help="compute the cross-entropy over a split LM head block by block, spread with "
                        "its blocks over the stages (off by default; docs/costs.md)")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"],
                   help="fp32; bf16; fp16 with dynamic loss scaling (16-bit modes keep fp32 master "
                        "weights) (default: %(default)s)")
    p.add_argument("--init-from", default=None, metavar="DIR",
                   help="take the weights from a Hugging Face directory (save_pretrained: "
                        "model.safetensors or its sharded index); each rank reads only its shards")
    p.add_argument("--zero", type=int, default=0, choices=[0, 1],
                   help="1: ZeRO stage 1 - shard optimizer state and fp32 masters over the --dp "
                        "replicas (gradients reduced to each tensor's owner, parameters broadcast)")
    p.add_argument("--recompute", default="none", choices=["none", "selective", "full"],
                   help="activation recomputation: selective = attention core, full = whole layer "
                        "(default: %(default)s)")
    p.add_argument("--compile", action="store_true",
                   help="compile each pipeline stage with AOTAutograd + TorchInductor before the "
                        "first step (C++ kernels on CPU, Triton on GPU; a stage that cannot be "
                        "compiled runs eagerly with a warning; Inductor's disk cache is reused)")
    p.add_argument("--timeline", default="fxpipe-timeline",
                   help="path prefix for the last step's measured timeline (.json, .png); 'none' "
                        "to skip (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="seconds before a collective or p2p transfer gives up (default: %(default)s)")
    p.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="save torch.distributed.checkpoint checkpoints here (atomic; the newest 3 "
                        "kept) at the end, every --save-interval steps and on SIGTERM/Ctrl-C, "
                        "after which the job exits 128+signal (default: no checkpoints)")
    p.add_argument("--save-interval", type=int, default=None, metavar="N",
                   help="save every N steps (default: only at the end)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in --checkpoint-dir: model, optimizer, "
                        "RNG and data position; any tp/pp/dp layout")
    p.add_argument("--overwrite", action="store_true",
                   help="start a new run in a --checkpoint-dir that holds another run's checkpoints, "
                        "deleting them at this run's first save (without it, and without --resume, such "
                        "a directory is refused)")
    p.add_argument("--resume-from", type=int, default=None, metavar="STEP",
                   help="like --resume, but from the checkpoint of STEP (an error if it is missing or "
                        "corrupt); without it --resume takes the newest intact checkpoint")
    p.add_argument("--export", default=None, metavar="PATH",
                   help="at the end, write the model's state_dict under its own parameter names, "
                        "streamed one tensor at a time: a directory or *.safetensors gets safetensors "
                        "(+ config.json for Hugging Face models: from_pretrained loads the directory), "
                        "any other name one torch.save file for load_state_dict")
    p.add_argument("--debug", action="store_true",
                   help="on failure, print every failed rank's full traceback (default: one line)")
    p.set_defaults(fn=_cmd_run)

    p = sub.add_parser("viz", help="draw a pipeline schedule (ASCII, PNG/SVG Gantt, Perfetto JSON)")
    try:
        from fxpipe.schedules.cli import add_viz_arguments, run_viz
        add_viz_arguments(p)
        p.set_defaults(fn=run_viz)
    except ImportError:  # schedules package not present in this build
        p.set_defaults(fn=lambda a: _missing("viz"))

    from fxpipe.planner.cli import (add_calibrate_arguments, add_plan_arguments, run_calibrate,
                                    run_plan)

    p = sub.add_parser("plan", help="search tp/pp/dp layouts with the simulator")
    add_plan_arguments(p)
    p.set_defaults(fn=run_plan)
    p = sub.add_parser("calibrate", help="measure this machine's matmul, memory and gloo speeds")
    add_calibrate_arguments(p)
    p.set_defaults(fn=run_calibrate)
    for name in ("viz", "plan", "calibrate"):  # compile and run have their own --debug
        sub.choices[name].add_argument("--debug", action="store_true",
                                       help="print the full traceback of an error")
    return parser


def _missing(cmd: str) -> int:
    print(f"fxpipe {cmd}: not available in this build", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    from fxpipe.capture import CaptureError

    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args) or 0)
    except (ValueError, TypeError, CaptureError, OSError) as exc:
        # User errors carry their own fix hint; the traceback only with --debug.
        if args.debug:
            raise
        print(f"fxpipe {args.command}: error: {_message(exc)}", file=sys.stderr)
        return 2


def _message(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.filename is not None:
        return f"{exc.strerror or type(exc).__name__}: {exc.filename}"
    return str(exc)


if __name__ == "__main__":
    sys.exit(main())

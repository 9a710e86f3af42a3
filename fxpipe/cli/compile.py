"""``fxpipe compile``: capture a model, run the passes, print what ``parallelize`` would run."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from fxpipe.ir.parallel_config import ParallelConfig
from fxpipe.job.flags import LAYOUT_FLAGS, TARGET_FLAGS, TRAIN_FLAGS, add_flags, given, positive_int, with_layout


@dataclass(frozen=True, kw_only=True)
class CompileTarget:
    """What ``fxpipe compile`` builds: a model and one example batch."""
    model: str = "gpt-tiny"
    batch: int = 2
    seq: int | None = None
    """None: the model's own maximum."""
    layers: int | None = None
    device: str | None = None
    """None: meta for registry GPTs above ~300M parameters, else cpu."""


DEFAULT_LAYOUT = ParallelConfig(num_microbatches=8)
"""One rank by default; 8 microbatches size the in-flight activations of a pipelined plan."""
SKIPPED = frozenset({"inductor", "timeout_s"})
"""Layout fields that only a running job uses."""
TARGET = {"model": TRAIN_FLAGS["model"], "seq": TRAIN_FLAGS["seq"], **TARGET_FLAGS}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_flags(p, TARGET, vars(CompileTarget()))
    add_flags(p, LAYOUT_FLAGS, vars(DEFAULT_LAYOUT), skip=SKIPPED)
    p.add_argument("--graph", metavar="FILE", help="write the compiled ATen graph as text")
    p.add_argument("--skip-pass", action="append", default=[], metavar="NAME",
                   help="skip a pass of the compile pipeline by name (repeatable; names: fxpipe/compiler/pass_list.py)")
    p.add_argument("--debug", action="store_true",
                   help="lint the graph and check invariants after every pass; full tracebacks")
    p.add_argument("--json", metavar="FILE", help="write the stage table as JSON")
    p.add_argument("--world", type=positive_int, metavar="N",
                   help="let the compiler choose the layout of N ranks for --batch (docs/layout_search.md): "
                        "prints the layouts it priced and compiles its choice; layout flags given pin the search")
    p.set_defaults(fn=run)


def run(args: argparse.Namespace) -> int:
    # loaded when the command runs, not on import: `fxpipe --help` stays quick
    from fxpipe.compiler.compile_report import compile_summary
    from fxpipe.compiler.pipeline import CompileHooks, compile_pipeline
    from fxpipe.job.preflight_sizes import check_shape
    from fxpipe.models.registry import build_device, build_workload
    from fxpipe.passes.tensor_parallel import render_sharding_report

    target = CompileTarget(**given(args, TARGET))
    layout = with_layout(DEFAULT_LAYOUT, given(args, LAYOUT_FLAGS))
    check_shape(target.model, target.layers)  # layers, width, vocabulary bounded before the build and capture
    device = target.device or build_device(target.model)
    workload = build_workload(target.model, batch=target.batch, seq=target.seq, device=device,
                              layers=target.layers)
    example = workload.example_inputs
    if args.world is not None:
        layout, example = _searched(layout, args, workload)
    pipelined = layout.pp > 1 or "chunks" in given(args, LAYOUT_FLAGS)
    measured: list[str] = []

    def measure(program, config, ctx):
        config, name = _measured_config(program, config, ctx, workload, layout, target)
        measured.append(name)
        return config

    # The same pipeline parallelize runs (fxpipe/compiler/pipeline.py); one stage needs no partition.
    result = compile_pipeline(workload.model, example, layout, loss_fn=workload.loss_fn,
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


def _searched(layout: ParallelConfig, args: argparse.Namespace, workload) -> tuple[ParallelConfig, tuple]:
    """The layout the search chooses for ``--world`` ranks on the whole ``--batch`` (the layout
    flags given pin it), and one microbatch of one replica of it to compile."""
    # loaded when the command runs, not on import: `fxpipe --help` stays quick
    from fxpipe.planner.auto_layout import cache_enabled
    from fxpipe.planner.layout_price import local_world
    from fxpipe.planner.layout_space import SEARCHED
    from fxpipe.planner.resolve import resolve_layout

    pinned = {f: getattr(layout, f) for f in given(args, LAYOUT_FLAGS) if f in SEARCHED}
    threads, concurrent = local_world(args.world)  # as fxpipe run would start the ranks here
    batch = workload.example_inputs
    chosen = resolve_layout(layout, pinned, args.world, lambda: (workload.model, batch, workload.loss_fn),
                            threads=threads, concurrent=concurrent, cache=cache_enabled())
    print()
    rows = chosen.microbatch_rows(batch[0].shape[0])
    return chosen.config, tuple(t[:rows] for t in batch)


def _measured_config(program, config, ctx, workload, layout: ParallelConfig, target: CompileTarget):
    """The partition config with costs measured in this process (or read from a profile).
    Measuring needs what one process may not have — the tp ranks (the graph holds their
    collectives) and weights (a meta-device model has none): then the cost model is
    used, and the stage table's header says so."""
    import torch

    # loaded when the command runs, not on import: `fxpipe --help` stays quick
    from fxpipe.costs import apply_profile, measured_profile
    from fxpipe.costs.profile import device_name

    if layout.costs == "measure":
        if layout.tp > 1:
            return config, (f"{layout.hardware} cost model, as measuring needs the tp ranks (fxpipe run "
                            f"--costs measure caches a profile: pass its path)")
        if any(t.is_meta for t in program.state.values()):
            return config, f"{layout.hardware} cost model, as {target.model} has no weights to time (meta device)"
    device = torch.device("cpu")
    state_for = lambda names: {n: program.state[n].detach().clone().requires_grad_(  # noqa: E731
        program.state[n].requires_grad) for n in names}
    profile, probe, fine = measured_profile(program, config, layout.costs, device=device, state_for=state_for,
                                            batch=workload.example_inputs)
    measured = apply_profile(config, profile, probe, fine, ctx.schedule.splits_backward)
    return measured, f"measured: {device_name(device)}"


def _print_partition(result, hw_name: str, args: argparse.Namespace) -> None:
    import json

    # loaded when the command runs, not on import: `fxpipe --help` stays quick
    from fxpipe.compiler.compile_report import stage_rows, stage_table

    layout, program, partition = result.config, result.program, result.program.partition
    assignment = dict(program.stages)
    print()
    print(f"pipeline     pp={layout.pp} chunks={layout.chunks} schedule={layout.schedule.value} "
          f"microbatches={layout.num_microbatches}")
    print(stage_table(program, assignment, partition, hw_name))
    if layout.vocab_passes and result.plan is not None:
        # loaded when the command runs, not on import: `fxpipe --help` stays quick
        from fxpipe.compiler.vocab_placement import describe

        print(describe(layout, result.vocab_timing, result.schedule))
    if layout.tp > 1:
        print(_inter_stage_bytes(result.plan, layout))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(method=partition.method.value, bottleneck_s=partition.bottleneck_s,
                           balance_ratio=partition.balance_ratio, gap=partition.gap,
                           status=partition.status.value, stages=stage_rows(program, assignment, partition)),
                      f, indent=2)
        print(f"stage table  written to {args.json}")


def _inter_stage_bytes(plan, layout: ParallelConfig) -> str:
    """Bytes each tp rank sends between stages per step, with and without scatter-gather."""
    # loaded when the command runs, not on import: `fxpipe --help` stays quick
    from fxpipe.compiler.compile_report import human
    from fxpipe.tp import inter_stage_bytes

    totals = {}
    for sg in (False, True):
        per_mb = 0
        for v in plan.values.values():
            chunked = sg and v.tp_replicated
            n = inter_stage_bytes(v.spec.shape, v.spec.dtype, layout.tp, scatter_gather=chunked)
            # forward activation, plus its gradient back when one flows
            per_mb += n * len(v.consumers) * (2 if v.requires_grad else 1)
        totals[sg] = per_mb * layout.num_microbatches
    saved = 1 - totals[True] / totals[False] if totals[False] else 0.0
    return (f"inter-stage  {human(totals[False], 'B')} per step per tp rank without scatter-gather, "
            f"{human(totals[True], 'B')} with (-{saved:.0%}; SC21 §4.1)")

"""The compile pipeline: model + one microbatch + ``ParallelConfig`` -> ``CompiledPipeline``.

One ordered list of passes (``compiler/pass_list.py``), run by the pass driver (``compiler/driver.py``) — timed,
skippable by name, linted after every pass in debug mode — and used by all three
front ends: ``fxpipe.parallelize`` (every rank), ``fxpipe compile`` (prints what it
made) and ``fxpipe run``'s preflight (stops after the cheap passes). What differs
between them is not the pipeline but its hooks (``CompileHooks``, ``ir/compile_context.py``):
how costs are measured (the ranks of a mesh together, this process alone, or not at
all), the one collective (``decide``: rank 0 computes what every rank must hold
identically — the partition, the vocabulary passes' times — and broadcasts it), and a
check of the caller's input once the model's facts are known (``parallelize``: the
batch's token ids against the vocabulary, before anything is measured).

    capture                 torch.export -> Program (fxpipe/compiler/capture.py)
    canonicalize            drop asserts and dead values
    causal_mask             a constant mask that is exactly the causal pattern -> SDPA's is_causal
    model_stats             whole-model FLOPs, parameter count, token inputs (before TP shards them)
    tensor_parallel         Megatron column/row blocks, vocabulary-parallel embedding and loss
    expert_parallel         grouped MoEs' experts owned by ep data-parallel ranks, all-to-all around them
    grouped_attention       repeated keys/values of grouped-query attention read by SDPA itself (cpu)
    cost                    FLOPs and bytes per node, per tp rank
    device                  retarget device constants to the device stages run on
    split_matmul            cut ops heavier than half a stage's share into blocks
    split_loss              the cross-entropy over such blocks, block by block (opt-in)
    measure_costs           time the graph's groups on the devices (hook; costs='measure' or a profile)
    partition               stage of every node (ILP by default; rank 0 solves: ``decide``)
    coalesce_blocks         a split's neighbouring blocks on one stage back into one
    split                   Program -> PipelinePlan: one GraphModule per stage, values between them
    vocab_head              the LM head + loss cut off the last stage for the vocabulary passes (opt-in)
    vocab_rows              each pipeline rank holds only the rows of the LM head (tied embedding) it reads
    recompute               activation recomputation regions per stage
    (place)                 vocab_passes: the S/T passes re-placed on the stages' costs (``compiler/vocab_placement.py``)
    (lower)                 the schedule with SEND/RECV placed, per rank (``schedules/lowering.py``)

Every pass is ``name_pass(ir, ctx) -> ir``, ``ctx`` the one ``CompileContext``; what a pass
finds that is not per node is a typed field of the Program it returns (``Program.tensor_parallel``,
``.partition``, ...), and ``CompiledPipeline`` (``fxpipe/ir/artifact.py``) exposes them.
"""
from __future__ import annotations

import copy
import dataclasses
import time
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.nn as nn

from fxpipe.compiler import pass_list
from fxpipe.compiler.capture import capture
from fxpipe.compiler.capture_rows import BatchCaptures
from fxpipe.compiler.context import CompileContext, CompileHooks
from fxpipe.compiler.driver import run_passes
from fxpipe.compiler.pass_list import pass_names, pipeline_names
from fxpipe.compiler.vocab_placement import placed_schedule, vocab_timing
from fxpipe.ir.artifact import CompiledPipeline, PassTiming
from fxpipe.ir.parallel_config import ParallelConfig
from fxpipe.ir.program import Program
from fxpipe.ir.stage_plan import PipelinePlan
from fxpipe.runtime.mixed_precision import Precision
from fxpipe.schedules.lowering import lower

__all__ = ["BatchCaptures", "CompileContext", "CompileHooks", "batch_captures", "capture_for", "compile_pipeline", "compile_program", "pipeline_names"]


def capture_for(model: nn.Module, microbatch: Sequence[torch.Tensor], config: ParallelConfig,
                loss_fn: Callable[..., torch.Tensor] | None = None) -> Program:
    """Capture ``model`` as it will run: a low-precision copy under bf16/fp16 (so every
    dtype in the plan is the one that runs; the user's fp32 model keeps the master
    weights), and with meta inputs for a meta-device model (deferred initialisation)."""
    traced = model if config.precision is Precision.FP32 else copy.deepcopy(model).to(config.precision.dtype)
    on_meta = any(t.is_meta for t in model.parameters())
    return capture(traced, tuple(t.to("meta") if on_meta else t for t in microbatch), loss_fn)


def batch_captures(model: nn.Module, batch: Sequence[torch.Tensor], config: ParallelConfig,
                   loss_fn: Callable[..., torch.Tensor] | None = None) -> BatchCaptures:
    """``capture_for`` of ``batch``'s first rows at every row count asked for, from one
    export (``compiler/capture_rows.py``): what the layout search captures."""
    traced = model if config.precision is Precision.FP32 else copy.deepcopy(model).to(config.precision.dtype)
    on_meta = any(t.is_meta for t in model.parameters())
    return BatchCaptures(traced, tuple(t.to("meta") if on_meta else t for t in batch), loss_fn)


def compile_program(program: Program, config: ParallelConfig, *, device: torch.device | str = "cpu",
                    hooks: CompileHooks = CompileHooks(), skip: Iterable[str] = (), until: str | None = None,
                    resume: str | None = None, debug: bool = False) -> CompiledPipeline:
    """Run the pipeline on a captured Program (``until``: stop after that pass; ``resume``:
    start at that pass, ``program`` having been through the ones before it — a prefix
    the layout search shares between the layouts that agree on what those passes read)."""
    passes, names = pass_list.PIPELINE, pass_names(pass_list.PIPELINE)
    for name in (until, resume):
        if name is not None and name not in names:
            raise ValueError(f"unknown pass {name!r}; passes are: {', '.join(names)}")
    if until is not None:
        passes = passes[:names.index(until) + 1]
    if resume is not None:
        passes = passes[names.index(resume):]
    ctx = CompileContext.of(config, device=device, hooks=hooks)
    schedule = ctx.schedule
    out, timings = run_passes(program, ctx, passes=passes, skip=skip, debug=debug)
    last_program = out if isinstance(out, Program) else out.program
    plan = out if isinstance(out, PipelinePlan) else None
    timing = None
    if plan is not None and config.vocab_passes:
        # The partition and split are known: place the passes on the stages' own times,
        # rank 0's on every rank (one collective order; compiler/vocab_placement.py).
        start = time.perf_counter()
        timing = hooks.on_rank0(lambda: vocab_timing(plan, config, last_program.partition_config or ctx.partition,
                                                     ctx.device))
        schedule = placed_schedule(config, timing)
        timings.append(PassTiming("vocab_placement", time.perf_counter() - start,
                                  sum(len(s.graph_module.graph.nodes) for s in plan.stages)))
    return CompiledPipeline(config=config, schedule=schedule, program=last_program, plan=plan,
                            actions=lower(schedule) if plan is not None else None, timings=tuple(timings),
                            vocab_timing=timing)


def compile_pipeline(model: nn.Module, microbatch: Sequence[torch.Tensor], config: ParallelConfig, *,
                     loss_fn: Callable[..., torch.Tensor] | None = None, layout_search: str | None = None,
                     **kwargs: Any) -> CompiledPipeline:
    """Capture ``model`` on one microbatch and compile it for ``config`` (module docstring).
    ``layout_search``: the search's table when it chose ``config`` (kept on the artifact).
    Other keyword arguments as ``compile_program``."""
    start = time.perf_counter()
    program = capture_for(model, microbatch, config, loss_fn)
    captured = time.perf_counter() - start
    return dataclasses.replace(compile_program(program, config, **kwargs), capture_s=captured,
                               layout_search=layout_search)

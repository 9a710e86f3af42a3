"""``build_runtime``: one rank's runtime objects from a ``CompiledPipeline``.

Everything here is read off the artifact (``fxpipe/ir/artifact.py``): the stages this
rank runs and their parameters from the plan, its action list from the lowered
schedule, the shard of every parameter from the shard specs. Nothing is compiled,
lowered or solved again; the mesh's process groups are the only other input.

    compiled ─┬─ ShardBuilder ─> state (this rank's shards), fp32 masters, ZeRO owners
              ├─ StageRunner per stage of this rank (compiled by Inductor if asked)
              ├─ Transport (plan shapes, scatter-gather over the tp group)
              ├─ PipelineExecutor (compiled.actions[pp_rank])
              └─ GradSync (tied copies, data parallel, expert replicas)   -> ParallelModel
"""
from __future__ import annotations

import dataclasses
import warnings
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from fxpipe.ir.artifact import CompiledPipeline
from fxpipe.ir.program import ParamKind, Program
from fxpipe.ir.shard_spec import shard_state
from fxpipe.ir.stage_plan import PipelinePlan
from fxpipe.params.rank_state import ShardBuilder
from fxpipe.runtime.api import ParallelModel, RankParts
from fxpipe.runtime.compiled import compile_stages, example_args
from fxpipe.runtime.executor import PipelineExecutor
from fxpipe.runtime.grad_sync import GradSync
from fxpipe.runtime.head_blocks import HeadBlock
from fxpipe.runtime.lookup_exchange import VocabLookups, wire_name
from fxpipe.runtime.mesh import MeshGroups
from fxpipe.runtime.mixed_precision import LossScaler, MasterWeights, Precision
from fxpipe.runtime.param_waits import ParamWaits, first_read_order, with_param_waits
from fxpipe.runtime.rank_mesh import RankMesh
from fxpipe.runtime.stage_runner import StageRunner
from fxpipe.runtime.transport import Transport
from fxpipe.runtime.zero import ZeroPartition
from fxpipe.schedules.actions import ActionKind
from fxpipe.schedules.schedule import Schedule


def build_runtime(compiled: CompiledPipeline, mesh: RankMesh, shards: ShardBuilder, *, model: nn.Module,
                  loss_scaler: dict | None = None) -> ParallelModel:
    """This rank's ``ParallelModel`` for ``compiled`` (see the module docstring) on ``mesh``
    (its groups, device, tensor-parallel group and the context stage code runs in). ``shards``
    builds parameters at their local shapes (the one the cost measurement used, if any)."""
    groups, device, context, experts = mesh.groups, mesh.device, mesh.context, mesh.experts
    tp_group, tp_rng = mesh.tp_group, mesh.tp_rng
    assert compiled.plan is not None and compiled.actions is not None, "compile the whole pipeline first"
    config, plan = compiled.config, compiled.plan
    # This rank's share of every split parameter: its TP shard, of which only the rows
    # its stages read where the vocabulary layers are split over stages (vocab_rows),
    # and of expert-parallel stacks its own experts (runtime/experts.py).
    specs = compiled.rank_specs(groups.pp_rank, experts.ep_rank if experts is not None else 0)
    if specs != dict(compiled.program.tp_specs):
        shards = shards.with_specs(specs)
    timeout = timedelta(seconds=config.timeout_s)
    my_stages = compiled.schedule.stages_of_rank(groups.pp_rank)
    # Its stages' tensors, and the rows of a table it owns for the lookups (vocab_lookup).
    names = plan.rank_params(groups.pp_rank, my_stages)
    deferred = shards.deferred(names)
    mine = shards.build(names)
    state = {n: t for n, (t, _) in mine.items()}
    shards.forget()  # tensors timed by the cost profile and not needed here are dropped
    # The shards are taken: the plan keeps parameter shapes only (meta), so no full copy
    # of the model stays alive in this process (buffers and constants are small).
    plan = dataclasses.replace(plan, program=_meta_parameters(plan.program))
    compiled = dataclasses.replace(compiled, plan=plan, program=_meta_parameters(compiled.program))
    # ZeRO-1 (runtime/zero.py): each data-parallel replica owns a balanced share of the
    # trainable tensors; only the owner keeps optimizer state and an fp32 master.
    zero = ZeroPartition.build(groups, {n: t for n, t in state.items() if t.requires_grad}) \
        if config.zero and groups.mesh.dp > 1 else None
    master = None
    prec = config.precision
    if prec is not Precision.FP32:
        owned = [n for n, t in state.items() if t.requires_grad and (zero is None or zero.owns(n))]
        if deferred:
            shards32 = {n: mine[n][1] if mine[n][1] is not None else shards.shard(n).float() for n in owned}
        else:
            originals = dict(model.named_parameters())
            shards32 = shard_state({n: originals[n].detach().float() for n in owned}, specs, groups.tp_rank)
        masters = {n: t.to(device).clone().requires_grad_(True) for n, t in shards32.items()}
        master = MasterWeights(prec, state, masters,
                               LossScaler(**(loss_scaler or {})) if prec is Precision.FP16 else None)
    runners = {s: StageRunner(plan, plan.stages[s], state, loss_scale=1.0 / config.num_microbatches,
                              context=context) for s in my_stages}
    compiled_stages = _compile_runners(runners, plan, compiled.schedule, state, groups, context, device) \
        if config.inductor else ()
    value_ids = {n: i for i, n in enumerate(sorted(plan.values) + sorted(wire_name(lk.name) for lk in plan.lookups))}
    transport = Transport(device=device, timeout=timeout, value_ids=value_ids, num_values=max(1, len(value_ids)),
                          scatter_gather=tp_group if config.scatter_gather else None)
    lookups = VocabLookups(plan, compiled.actions, groups, state, device, transport) if plan.lookups else None
    param_waits = None
    if zero is not None and config.gathers_behind_forward:
        # ZeRO-1's broadcast behind the first forward (runtime/param_waits.py): the tables
        # this rank looks rows up in first (their parts are looked up ahead), then the
        # tensors in the order the stages read them.
        tables = [lk.table for lk in plan.lookups]
        param_waits = ParamWaits(tables + first_read_order([plan.stages[s] for s in sorted(my_stages)], plan.canonical))
        for runner in runners.values():
            runner.stage = dataclasses.replace(runner.stage, graph_module=with_param_waits(
                runner.stage, plan.canonical, set(zero.owner), param_waits))
        if lookups is not None:
            lookups.param_ready = param_waits.wait_for
    vocab = None
    if plan.vocab_head is not None:  # this rank's block of the LM head (runtime/head_blocks.py)
        last = runners.get(plan.num_stages - 1)
        any_runner = next(iter(runners.values()))
        vocab = HeadBlock(plan, compiled.schedule, groups, state, device, transport,
                            loss_scale=lambda: any_runner.loss_scale, losses=last.losses if last else None)
    executor = PipelineExecutor(plan, compiled.actions, groups.pp_rank, runners, transport, groups.pp_peer,
                                lookups=lookups, vocab=vocab)
    holders = {**master.masters, **master.loose} if master else state
    grad_sync = GradSync.build(plan, compiled.schedule, groups, holders, timeout, like=state, zero=zero,
                               experts=experts, actions=compiled.actions, bucket_mb=config.bucket_mb,
                               lookup_final=lookups.final_points(compiled.actions.actions[groups.pp_rank])
                               if lookups is not None else None)
    executor.reduction = grad_sync.overlap  # armed around the actions that finish gradients
    pm = ParallelModel(compiled, RankParts(groups, state, executor, grad_sync, device, specs, master=master,
                                           compiled_stages=compiled_stages, tp_rng=tp_rng, experts=experts,
                                           param_waits=param_waits))
    _warn_without_parameters(pm, my_stages, zero is not None)
    return pm


class NoParametersWarning(UserWarning):
    """This rank holds no trainable tensor (``_warn_without_parameters``); a caller that
    builds its optimizer from parameter groups filters it by this category."""


def _warn_without_parameters(pm: ParallelModel, stages: Sequence[int], zero: bool) -> None:
    """Said on a rank that holds no trainable tensor — a pipeline rank whose stages compute
    only parameter-free ops (a time-balanced cut of a small model can give one such a
    stage), or a ZeRO-1 replica that owns none. Legal, and it trains, but torch's
    optimizers refuse an empty list: ``torch.optim.AdamW(pm.parameters())`` would fail on
    this rank alone, so the warning gives the form that works on every rank."""
    if next(pm.named_parameters(), None) is not None:
        return
    why = f"its stages {sorted(stages)} compute only parameter-free ops" + (
        ", or its ZeRO-1 replica owns none of their tensors" if zero else "")
    warnings.warn(f"fxpipe: rank {dist.get_rank()} holds no trainable parameter at this layout ({why}); torch's "
                  f"optimizers refuse an empty list: build the optimizer from parameter groups, which may be "
                  f"empty, e.g. torch.optim.AdamW([{{'params': list(pm.parameters())}}], lr=...) (as fxpipe run "
                  f"does), or give fewer pipeline stages", NoParametersWarning, stacklevel=3)


def _meta_parameters(program: Program) -> Program:
    """``program`` with its parameters as shapes only (meta): the runtime keeps this
    rank's shards, never a full copy of the model (buffers and constants are small)."""
    kinds = {p.canonical: p.kind for p in program.params}
    return program.replace(state={n: t.to("meta") if kinds.get(n) is ParamKind.PARAMETER else t
                                  for n, t in program.state.items()})


def _compile_runners(runners: dict, plan: PipelinePlan, sched: Schedule, state: dict, groups: MeshGroups,
                     context: Callable, device: torch.device) -> tuple:
    """Compile this rank's stages (``runtime/compiled.py``) and hand them to their runners."""

    def agree(ok: dict) -> dict:
        # Every rank running a stage (its TP group and DP replicas) runs it compiled or
        # every one eagerly, never mixed. Also the barrier after compiling: compile times
        # differ per stage, and the first step's transfers would time out waiting for a
        # peer still compiling — hence a group of its own with a long timeout.
        group = dist.new_group(backend="gloo", timeout=timedelta(hours=2))
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, ok, group=group)
        dist.destroy_process_group(group)
        return {s: all(o.get(s, True) for o in everyone) for s in ok}

    work = {s: (plan.stages[s].graph_module, example_args(plan, plan.stages[s], state, device))
            for s in runners}
    # Stages a zero-bubble schedule runs as I and W get their backward compiled as two
    # graphs (runtime/compiled_split.py); the others keep one compiled backward.
    weighed = {a.stage for actions in sched.actions for a in actions if a.kind is ActionKind.W}
    split = {s: len(plan.stages[s].inputs) + len(plan.stages[s].lookups) for s in runners if s in weighed}
    first = groups.tp_rank == 0 and groups.dp_rank == 0  # one progress line per stage
    fns, records = compile_stages(work, context=context, agree=agree, split=split,
                                  log=(lambda line: print(line, flush=True)) if first else None)
    for s, runner in runners.items():
        runner.compiled = fns[s] if fns[s] is not plan.stages[s].graph_module else None
    return tuple(records)

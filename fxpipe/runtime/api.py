"""``fxpipe.parallelize``: compile a model for this rank's place in the mesh and train it.

Every rank runs the same call (launched by torchrun or ``fxpipe run``). Each captures
the same Program; with measured costs each times a share of it and all see every
time; global rank 0 solves the partition and broadcasts the assignment (a
time-limited solver need not agree with itself), from which every rank splits the
same plan.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterator, Sequence

import contextlib
import os
import copy
import dataclasses

import torch
import torch.distributed as dist
import torch.nn as nn

from fxpipe.capture import capture
from fxpipe.costs import apply_profile, measured_profile, parse_costs
from fxpipe.partition import Method
from fxpipe.init import materialize_tensor, record_init
from fxpipe.program import ParamKind
from fxpipe.passes import canonicalize_pass, cost_pass, run_passes, total_cost
from fxpipe.passes.tensor_parallel import TPConfig, shard_state, unshard_state
from fxpipe.tp import DropoutRNG, ProcessGroupTP, tp_group_context
from fxpipe.passes.recompute import RecomputeMode, apply_recompute
from fxpipe.passes.device import retarget_device_pass
from fxpipe.passes.partition import PartitionConfig, partition_pass, stage_inflight
from fxpipe.passes.split import split_pass
from fxpipe.passes.coalesce_blocks import coalesce_blocks_pass
from fxpipe.passes.split_loss import split_loss_pass
from fxpipe.passes.split_matmul import split_matmul_pass
from fxpipe.plan import PipelinePlan
from fxpipe.runtime.executor import PipelineExecutor
from fxpipe.runtime.grad_sync import GradSync
from fxpipe.runtime.launch import init_distributed
from fxpipe.runtime.precision import LossScaler, MasterWeights, Precision
from fxpipe.runtime.mesh import Mesh, MeshGroups, build_groups, resolve_dp
from fxpipe.runtime.stage_runner import StageRunner
from fxpipe.runtime.transport import Transport
from fxpipe.runtime.zero import ZeroPartition
from fxpipe.schedules.ir import Schedule
from fxpipe.schedules.lowering import lower
from fxpipe.schedules.registry import generate, get_spec
from fxpipe.vocab import TokenInput, check_token_ids, token_inputs


@dataclass(frozen=True)
class ModelStats:
    """Whole-model numbers, counted before tensor parallelism shards the graph."""
    num_parameters: int
    flops_per_step: int
    """Model FLOPs of one step over the global batch: matmul forward + backward, the
    quantity of Megatron's 72·B·s·l·h²(1 + s/6h + V/12lh) (no recomputation)."""


@dataclass(frozen=True)
class StepStats:
    peak_in_flight: int
    """Most (stage, microbatch) activations this rank held at once in the last step."""
    events: tuple
    """(action, start, end) of every action this rank ran in the last step (perf_counter s)."""


class ParallelModel:
    """What ``parallelize`` returns: one rank's share of the model and its schedule."""

    def __init__(self, plan: PipelinePlan, schedule: Schedule, groups: MeshGroups,
                 state: dict[str, torch.Tensor], executor: PipelineExecutor,
                 grad_sync: GradSync, num_microbatches: int, device: torch.device,
                 master: MasterWeights | None = None, specs: dict | None = None) -> None:
        self.plan, self.schedule, self.groups = plan, schedule, groups
        self.state, self.executor, self.grad_sync = state, executor, grad_sync
        self.master = master
        """Mixed precision: fp32 masters (what the optimizer sees) for ``state``."""
        self.last_step_skipped = False
        self.specs = specs or {}
        """Tensor-parallel ShardSpec per sharded parameter (empty without TP)."""
        self.num_microbatches, self.device = num_microbatches, device
        specs = plan.program.input_specs
        self._mb_shapes = [s.shape for s in specs]
        self.last_stats: StepStats | None = None
        self.model_stats: ModelStats | None = None
        self.compiled_stages: tuple = ()
        """``compile=True``: one ``runtime.compiled.StageCompile`` per stage of this rank."""
        self.token_inputs: tuple[TokenInput, ...] = ()
        """Batch inputs that are token ids, with their vocabulary (``fxpipe/vocab.py``)."""
        self.zero: ZeroPartition | None = grad_sync.zero
        self.partition = None
        """The partitioner's result (``PartitionResult``): per-stage predicted times and memory."""
        """ZeRO-1: which data-parallel replica owns (steps) each trainable tensor."""

    # ---- parameters ----------------------------------------------------------------------
    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's trainable tensors under their original (canonical) names (the
        fp32 masters under mixed precision); under ZeRO-1 only those this data-parallel
        replica owns, so an optimizer built on them holds a 1/dp share of the state."""
        tensors = self.master.masters if self.master is not None else self.state
        for name, t in tensors.items():
            if t.requires_grad and self.owns(name):
                yield name, t

    def owns(self, name: str) -> bool:
        """Whether this replica's optimizer steps ``name`` (always, without ZeRO)."""
        return self.zero is None or name not in self.zero.owner or self.zero.owns(name)

    def sync_parameters(self) -> None:
        """Bring every copy of the parameters up to date after an optimizer step: the
        compute copies from the fp32 masters (mixed precision), then, under ZeRO-1, each
        owner's values to the other data-parallel replicas. ``train_step`` and
        checkpoint saves call it; call it before reading ``state`` yourself."""
        if self.master is not None:
            self.master.refresh()
        if self.zero is not None:
            self.zero.broadcast_parameters({n: self.state[n] for n in self.zero.owner})

    def parameters(self) -> Iterator[torch.Tensor]:
        for _, t in self.named_parameters():
            yield t

    def unshard_tp(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Full tensors from this rank's tensor-parallel shards (parameters or their
        gradients), gathered over the tp group; identity without TP. Collective."""
        if self.groups.mesh.tp == 1:
            return local
        shards: list[Any] = [None] * self.groups.mesh.tp
        dist.all_gather_object(shards, local, group=self.groups.tp_group)
        return unshard_state(shards, self.specs)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter of the model, gathered from all pipeline ranks (on CPU)."""
        local = self.unshard_tp({n: t.detach().cpu() for n, t in self.named_parameters()})
        gathered: list[Any] = [None] * self.groups.mesh.pp
        dist.all_gather_object(gathered, local, group=self.groups.pp_group)
        full: dict[str, torch.Tensor] = {}
        for part in gathered:
            for n, t in part.items():
                full.setdefault(n, t)
        return full

    # ---- training ------------------------------------------------------------------------
    def _microbatches(self, batch: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, ...]]:
        if isinstance(batch, torch.Tensor):
            batch = (batch,)
        mesh, m = self.groups.mesh, self.num_microbatches
        if len(batch) != len(self._mb_shapes):
            raise TypeError(f"train_step got {len(batch)} batch tensors, the example batch had "
                            f"{len(self._mb_shapes)}")
        out = []
        for t, mb_shape in zip(batch, self._mb_shapes):
            expected = (mb_shape[0] * m * mesh.dp, *mb_shape[1:])
            if tuple(t.shape) != expected:
                raise ValueError(f"batch tensor of shape {tuple(t.shape)}, expected {expected} "
                                 f"(the example batch's shape)")
            local = t.chunk(mesh.dp)[self.groups.dp_rank]  # this data-parallel rank's rows
            out.append(local.to(self.device).chunk(m))
        return [tuple(parts[i] for parts in out) for i in range(m)]

    def train_step(self, batch: Sequence[torch.Tensor]) -> float:
        """One schedule over all microbatches: gradients are left in ``.grad`` (zeroed
        first), averaged over data parallel and summed over tied copies. Returns the
        mean loss over the global batch, on every rank."""
        # One max per token input: an id past the vocabulary is an IndexError at tp=1
        # and silently wrong embeddings under vocabulary-parallel TP.
        check_token_ids((batch,) if isinstance(batch, torch.Tensor) else batch, self.token_inputs)
        for t in self.parameters():
            t.grad = None
        self.sync_parameters()
        if self.master is not None:
            for runner in self.executor.runners.values():
                runner.loss_scale = self.master.loss_scale / self.num_microbatches
        self.executor.run(self._microbatches(batch))
        self.grad_sync.sync()
        if self.master is not None:
            # fp16: gradients unscaled, or dropped when any rank overflowed.
            self.last_step_skipped = not self.master.finish()
        self.last_stats = StepStats(self.executor.peak_in_flight, tuple(self.executor.events))
        return self._mean_loss()

    def _mean_loss(self) -> float:
        last = self.plan.num_stages - 1
        runner = self.executor.runners.get(last)
        total = torch.zeros((), dtype=torch.float64)
        if runner is not None:
            total += sum(runner.losses.values())
            runner.losses.clear()
        # The last stage's rank knows the losses; sum over pp reaches everyone, then dp averages.
        dist.all_reduce(total, group=self.groups.pp_group)
        if self.groups.mesh.dp > 1:
            dist.all_reduce(total, group=self.groups.dp_group)
        return float(total) / (self.num_microbatches * self.groups.mesh.dp)


def _stored_weights(program, specs: dict, directory) -> dict:
    """Canonical name -> (WeightsDir, stored name) for every parameter, checked against
    the model's names and full shapes first (one error listing every mismatch)."""
    from fxpipe.mismatch import full_shapes
    from fxpipe.weights import WeightsDir

    wd = WeightsDir(directory)
    names = {p.name: p.canonical for p in program.params if p.kind is not ParamKind.CONSTANT}
    full = full_shapes(program, specs)
    required = {p.canonical for p in program.params if p.kind is ParamKind.PARAMETER}
    return {c: (wd, s) for c, s in wd.check(names, full, required).items()}


def _compile_runners(runners: dict, plan: PipelinePlan, state: dict, groups: MeshGroups,
                     context: Callable, device: torch.device) -> tuple:
    """Compile this rank's stages (``runtime/compiled.py``) and hand them to their runners."""
    from fxpipe.runtime.compiled import compile_stages, example_args

    def agree(ok: dict[int, bool]) -> dict[int, bool]:
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
    first = groups.tp_rank == 0 and groups.dp_rank == 0  # one progress line per stage
    fns, records = compile_stages(work, context=context, agree=agree,
                                  log=(lambda line: print(line, flush=True)) if first else None)
    for s, runner in runners.items():
        runner.compiled = fns[s] if fns[s] is not plan.stages[s].graph_module else None
    return tuple(records)


def parallelize(model: nn.Module, *, tp: int = 1, pp: int = 1, dp: int | None = None,
                microbatches: int, schedule: str = "1f1b", chunks: int | None = None,
                example_inputs: Sequence[torch.Tensor],
                loss_fn: Callable[..., torch.Tensor] | None = None,
                partition: str = "ilp", memory_limit_gb: float | None = None,
                precision: str = "fp32", loss_scaler: dict | None = None,
                recompute: str = "none", sp: bool = False, seed: int = 0,
                scatter_gather: bool | None = None,
                zero: int = 0, init_fn: Callable[[nn.Module], None] | None = None,
                weights: str | os.PathLike | None = None, costs: str = "measure",
                timeout_s: float = 60.0, device: torch.device | None = None,
                compile: bool = False) -> ParallelModel:
    """Compile ``model`` for tensor × pipeline × data parallelism on this rank.

    ``example_inputs`` is one global batch as ``train_step`` will receive it (every
    rank passes the same batch; each data-parallel rank trains on its rows).
    ``schedule``: gpipe, 1f1b, interleaved, zb-h1, zb-v; ``chunks``: stages per rank.
    ``precision``: fp32, bf16, or fp16 (dynamic loss scaling); both 16-bit modes keep
    fp32 master weights (see ``fxpipe.runtime.precision``). ``recompute``: none,
    selective (attention core) or full (whole layer), per stage (``passes/recompute.py``).
    ``tp``: tensor-parallel size (the automatic pass, ``passes/tensor_parallel``); ``sp``:
    sequence parallelism; ``weights``: a Hugging Face safetensors directory to take the
    parameters from (each rank reads its shards only, ``fxpipe/weights.py``); a model built
    on the meta device is otherwise initialised shard by shard by its own init scheme
    (``fxpipe/init.py``, ``init_fn`` to override; ``seed`` seeds it); ``zero=1``: ZeRO stage 1 over data parallel (``runtime/zero.py``:
    ``parameters()`` then yields this replica's share); ``scatter_gather``: send 1/tp chunks of replicated activations
    between stages (default: on when tp > 1 and sp is off); ``seed``: dropout seed (Megatron's RNG tracker offsets it per
    tp rank inside sharded regions). ``costs``: what the partitioner balances —
    ``"measure"`` (default: the graph's groups timed on the ranks' devices before
    partitioning, cached on disk; ``fxpipe/costs``), ``"model"`` (the CPU preset's
    FLOP/byte estimate) or the path of a saved cost profile. ``compile``: compile each of this rank's stages with
    AOTAutograd + TorchInductor before the first step (one progress line per stage; a stage
    Inductor rejects runs eagerly with a warning; ``runtime/compiled.py``).
    """
    prec = Precision.parse(precision)
    timeout = timedelta(seconds=timeout_s)
    device = init_distributed(timeout, device)
    world = dist.get_world_size()
    dp = resolve_dp(world, tp, pp, dp)
    mesh = Mesh(tp=tp, dp=dp, pp=pp)
    if zero not in (0, 1):
        raise ValueError(f"zero must be 0 (off) or 1 (optimizer state and fp32 masters sharded over "
                         f"data parallel), got {zero}")
    if microbatches < 1:
        raise ValueError(f"microbatches must be >= 1, got {microbatches}")
    example = tuple(example_inputs) if not isinstance(example_inputs, torch.Tensor) else (example_inputs,)
    rows = example[0].shape[0]
    if rows % (dp * microbatches):
        raise ValueError(f"batch of {rows} rows cannot be split into dp·microbatches = {dp}·{microbatches} "
                         f"equal microbatches; use a batch that is a multiple of {dp * microbatches}")
    groups = build_groups(mesh, timeout)

    spec = get_spec(schedule)
    sched = generate(schedule, pp, microbatches, chunks if chunks is not None else spec.default_chunks)
    mb_rows = rows // (dp * microbatches)
    # Low precision: capture a low-precision copy, so every dtype in the plan is the
    # one that runs; the user's fp32 model provides the master weights.
    traced = model if prec is Precision.FP32 else copy.deepcopy(model).to(prec.dtype)
    # A meta-device model (deferred init) is traced with meta inputs of the batch's shapes.
    on_meta = any(t.is_meta for t in model.parameters())
    captured = capture(traced, tuple(t[:mb_rows].to("meta") if on_meta else t[:mb_rows] for t in example), loss_fn)
    # Model FLOPs and size of the whole model (before tensor parallelism shards them).
    canonical = canonicalize_pass(captured)
    tokens = token_inputs(canonical)  # before TP shards the embedding's rows
    check_token_ids(example, tokens)
    whole = total_cost(cost_pass(canonical))
    stats = ModelStats(num_parameters=captured.num_parameters(),
                       flops_per_step=(whole.fwd_flops + whole.bwd_flops) * microbatches * dp)
    program, _ = run_passes(canonical, TPConfig(tp=tp, sp=sp), skip=["canonicalize"])
    program = retarget_device_pass(program, device)
    # Only the ILP and dp partitions balance time; uniform and params ignore it.
    balances_time = sched.num_stages > 1 and Method(partition) in (Method.ILP, Method.DP)
    if balances_time:
        # No single op may outweigh a stage's share (an LM head over a large vocabulary):
        # cut such matmuls into output-feature blocks the partitioner can spread.
        program = split_matmul_pass(program, sched.num_stages)
        # ... and the cross-entropy over them per block: only [tokens] vectors meet.
        program = split_loss_pass(program)
    config = PartitionConfig(num_stages=sched.num_stages, stage_to_rank=sched.stage_ranks,
                             inflight=stage_inflight(sched), method=partition,
                             memory_limit_bytes=None if memory_limit_gb is None
                             else int(memory_limit_gb * 2**30))
    tp_result = program.extra.get("tensor_parallel")
    specs = tp_result.specs if tp_result is not None else {}
    built: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
    rules: list = []

    def local_tensors(names) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
        """This rank's shard of each parameter/buffer in ``names`` at its local shape, on
        ``device``, and its fp32 copy where one was built (the masters under mixed
        precision): read from a Hugging Face directory (fxpipe/weights.py), replayed from
        the model's own init rules (fxpipe/init.py; a meta-device model), or sliced from
        the captured state (ShardSpec index ranges). Built once per name."""
        todo = [n for n in names if n not in built]
        stored = _stored_weights(program, specs, weights) if weights is not None and todo else {}
        if not rules and any(n not in stored and program.state[n].is_meta for n in todo):
            rules.append(record_init(model, init_fn))
        for n in todo:
            f32 = None
            if n in stored:
                f32 = stored[n][0].read(stored[n][1], specs.get(n), groups.tp_rank, torch.float32).to(device)
            elif program.state[n].is_meta:
                f32 = materialize_tensor(rules[0], n, seed, specs.get(n), groups.tp_rank, torch.float32, device)
            elif weights is not None:  # a buffer of a materialised model that the directory does not hold
                f32 = shard_state({n: program.state[n]}, specs, groups.tp_rank)[n].float()
            t = f32.to(program.state[n].dtype) if f32 is not None else \
                shard_state({n: program.state[n]}, specs, groups.tp_rank)[n]
            built[n] = (t.detach().to(device).clone().requires_grad_(program.state[n].requires_grad), f32)
        return {n: built[n] for n in names}

    tp_group = ProcessGroupTP(groups.tp_group)
    rng = DropoutRNG(seed, groups.tp_rank)
    context = (lambda: tp_group_context(tp_group, rng)) if tp > 1 else contextlib.nullcontext
    source = parse_costs(costs)
    if source != "model" and balances_time:
        # Balance measured times (fxpipe/costs): each rank times a share of the graph.
        first_mb = tuple(t[:mb_rows].to(device) for t in example)
        profile, probe, fine = measured_profile(
            program, config, source, device=device, batch=first_mb, mesh=mesh, mesh_groups=groups,
            context=context, state_for=lambda names: {n: t for n, (t, _) in local_tensors(names).items()})
        config = apply_profile(config, profile, probe, fine, sched.splits_backward)
    # Rank 0 solves and everyone takes its answer: a time-limited solver need not
    # return the same assignment on every rank, and ranks must agree exactly.
    result = partition_pass(program, config) if dist.get_rank() == 0 else None
    box = [(dict(result.stages), result.extra["partition"]) if result is not None else None]
    dist.broadcast_object_list(box, src=0)
    assignment, partition_result = box[0]
    # Blocks of a split matmul that landed on one stage become one slice again.
    program = coalesce_blocks_pass(program.replace(stages=assignment))
    assignment = dict(program.stages)
    plan = split_pass(program, assignment, num_stages=sched.num_stages)
    mode = RecomputeMode.parse(recompute)
    if mode is not RecomputeMode.NONE:
        # Per stage, after the split: a layer cut across two stages is recomputed piecewise.
        stages = tuple(dataclasses.replace(s, graph_module=apply_recompute(s.graph_module, program.layers, mode))
                       for s in plan.stages)
        plan = dataclasses.replace(plan, stages=stages)
    lowered = lower(sched)

    my_stages = sched.stages_of_rank(groups.pp_rank)
    names = dict.fromkeys(n for s in my_stages for n in plan.stage_params(s))
    deferred = weights is not None or any(program.state[n].is_meta for n in names)
    mine = local_tensors(names)
    state = {n: t for n, (t, _) in mine.items()}
    built.clear()  # tensors timed by the cost profile and not needed here are dropped
    # The shards are taken: the plan keeps parameter shapes only (meta), so no full copy
    # of the model stays alive in this process (buffers and constants are small).
    kinds = {p.canonical: p.kind for p in program.params}
    plan = dataclasses.replace(plan, program=plan.program.replace(state={
        n: t.to("meta") if kinds.get(n) is ParamKind.PARAMETER else t for n, t in plan.program.state.items()}))
    # ZeRO-1 (runtime/zero.py): each data-parallel replica owns a balanced share of the
    # trainable tensors; only the owner keeps optimizer state and an fp32 master.
    partition = ZeroPartition.build(groups, {n: t for n, t in state.items() if t.requires_grad}) \
        if zero and dp > 1 else None
    master = None
    if prec is not Precision.FP32:
        owned = [n for n, t in state.items() if t.requires_grad and (partition is None or partition.owns(n))]
        if deferred:
            shards32 = {n: mine[n][1] if mine[n][1] is not None else
                        shard_state({n: program.state[n]}, specs, groups.tp_rank)[n].float() for n in owned}
        else:
            originals = dict(model.named_parameters())
            shards32 = shard_state({n: originals[n].detach().float() for n in owned}, specs, groups.tp_rank)
        masters = {n: t.to(device).clone().requires_grad_(True) for n, t in shards32.items()}
        master = MasterWeights(prec, state, masters,
                               LossScaler(**(loss_scaler or {})) if prec is Precision.FP16 else None)
    runners = {s: StageRunner(plan, plan.stages[s], state, loss_scale=1.0 / microbatches, context=context)
               for s in my_stages}
    compiled = _compile_runners(runners, plan, state, groups, context, device) if compile else ()
    value_ids = {n: i for i, n in enumerate(sorted(plan.values))}
    # Scatter-gather (SC21 §4.1): on by default with tp > 1 unless sequence parallel.
    use_sg = tp > 1 and (not sp if scatter_gather is None else scatter_gather)
    transport = Transport(device=device, timeout=timeout, value_ids=value_ids,
                          num_values=max(1, len(value_ids)), scatter_gather=tp_group if use_sg else None)
    executor = PipelineExecutor(plan, lowered, groups.pp_rank, runners, transport, groups.pp_peer)
    holders = {**master.masters, **master.loose} if master else state
    grad_sync = GradSync.build(plan, sched, groups, holders, timeout, like=state, zero=partition)
    pm = ParallelModel(plan, lowered, groups, state, executor, grad_sync, microbatches, device, master,
                       specs)
    pm.model_stats = stats
    pm.partition = partition_result
    pm.compiled_stages = compiled
    pm.token_inputs = tokens
    pm.tp_rng = rng  # the TP dropout streams (Megatron's RNG tracker), e.g. for checkpoints
    return pm

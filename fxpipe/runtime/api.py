"""``fxpipe.parallelize``: compile a model for this rank's place in the mesh and train it.

Every rank runs the same call (launched by torchrun or ``fxpipe run``) and the same
compile pipeline (``fxpipe/compiler.py``); with measured costs each times a share of
the graph and all see every time; global rank 0 solves the partition and broadcasts
the assignment (a time-limited solver need not agree with itself), from which every
rank splits the same plan.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterator, Sequence

import contextlib
import dataclasses
import os

import torch
import torch.distributed as dist
import torch.nn as nn

from fxpipe.compiler import TOKEN_INPUTS, CompileHooks, ModelStats, compile_pipeline
from fxpipe.config import ParallelConfig
from fxpipe.costs import apply_profile, measured_profile
from fxpipe.partition import PartitionResult
from fxpipe.passes.partition import partition_pass
from fxpipe.sharding import shard_state, unshard_state
from fxpipe.pipeline_plan import PipelinePlan
from fxpipe.program import ParamKind
from fxpipe.runtime.executor import PipelineExecutor
from fxpipe.runtime.grad_sync import GradSync
from fxpipe.runtime.launch import init_distributed
from fxpipe.runtime.mesh import Mesh, MeshGroups, build_groups
from fxpipe.runtime.precision import LossScaler, MasterWeights, Precision
from fxpipe.runtime.shards import ShardBuilder
from fxpipe.runtime.stage_runner import StageRunner
from fxpipe.runtime.transport import Transport
from fxpipe.runtime.zero import ZeroPartition
from fxpipe.schedules.ir import ActionKind, Schedule
from fxpipe.schedules.lowering import lower
from fxpipe.tp import DropoutRNG, ProcessGroupTP, tp_group_context
from fxpipe.vocab import TokenInput, check_token_ids


@dataclass(frozen=True)
class StepStats:
    peak_in_flight: int
    """Most (stage, microbatch) activations this rank held at once in the last step."""
    events: tuple
    """(action, start, end) of every action this rank ran in the last step (perf_counter s)."""


class ParallelModel:
    """What ``parallelize`` returns: one rank's share of the model and its schedule."""

    def __init__(self, plan: PipelinePlan, schedule: Schedule, groups: MeshGroups,
                 state: dict[str, torch.Tensor], executor: PipelineExecutor, grad_sync: GradSync,
                 config: ParallelConfig, device: torch.device, *, master: MasterWeights | None = None,
                 specs: dict | None = None, model_stats: ModelStats | None = None,
                 partition: PartitionResult | None = None, compiled_stages: tuple = (),
                 token_inputs: tuple[TokenInput, ...] = (), tp_rng: DropoutRNG | None = None) -> None:
        self.plan, self.schedule, self.groups = plan, schedule, groups
        self.state, self.executor, self.grad_sync = state, executor, grad_sync
        self.config = config
        """The layout this model was compiled for (``dp`` resolved)."""
        self.device = device
        self.master = master
        """Mixed precision: fp32 masters (what the optimizer sees) for ``state``."""
        self.specs = specs or {}
        """Tensor-parallel ShardSpec per sharded parameter (empty without TP)."""
        self.model_stats = model_stats
        self.partition = partition
        """The partitioner's result: per-stage predicted times and memory."""
        self.compiled_stages = compiled_stages
        """``compile=True``: one ``runtime.compiled.StageCompile`` per stage of this rank."""
        self.token_inputs = token_inputs
        """Batch inputs that are token ids, with their vocabulary (``fxpipe/vocab.py``)."""
        self.tp_rng = tp_rng
        """The tensor-parallel dropout streams (Megatron's RNG tracker), saved in checkpoints."""
        self.zero: ZeroPartition | None = grad_sync.zero
        """ZeRO-1: which data-parallel replica owns (steps) each trainable tensor."""
        self.last_step_skipped = False
        """fp16: the last step was dropped for an overflow."""
        self.last_stats: StepStats | None = None
        self._mb_shapes = [s.shape for s in plan.program.input_specs]

    @property
    def num_microbatches(self) -> int:
        return self.config.microbatches

    def close(self) -> None:
        """Release the process groups this model created (tp, dp, pp and tied-weight
        groups). Each gloo group keeps its own polling threads until destroyed, so a
        process that parallelizes many models in turn (a test world, the compatibility
        run) calls this between them. The model cannot train afterwards."""
        mine = [self.groups.tp_group, self.groups.dp_group, self.groups.pp_group]
        mine += [group for _, group in self.grad_sync.tied]
        for group in dict.fromkeys(g for g in mine if g is not None):
            if group is not dist.GroupMember.NON_GROUP_MEMBER and group is not dist.GroupMember.WORLD:
                dist.destroy_process_group(group)

    @property
    def parameter_share(self) -> float:
        """This rank's share of the model's parameters over tensor parallelism (ideal 1/tp;
        pipeline stages divide it further); 1.0 without TP."""
        coverage = getattr(self.plan.program.extra.get("tensor_parallel"), "coverage", None)
        return 1.0 if coverage is None else coverage.share

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


def _compile_runners(runners: dict, plan: PipelinePlan, sched: Schedule, state: dict, groups: MeshGroups,
                     context: Callable, device: torch.device) -> tuple:
    """Compile this rank's stages (``runtime/compiled.py``) and hand them to their runners."""
    from fxpipe.runtime.compiled import compile_stages, example_args

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
    split = {s: len(plan.stages[s].inputs) for s in runners if s in weighed}
    first = groups.tp_rank == 0 and groups.dp_rank == 0  # one progress line per stage
    fns, records = compile_stages(work, context=context, agree=agree, split=split,
                                  log=(lambda line: print(line, flush=True)) if first else None)
    for s, runner in runners.items():
        runner.compiled = fns[s] if fns[s] is not plan.stages[s].graph_module else None
    return tuple(records)


def parallelize(model: nn.Module, config: ParallelConfig | None = None, *,
                example_inputs: Sequence[torch.Tensor],
                loss_fn: Callable[..., torch.Tensor] | None = None, loss_scaler: dict | None = None,
                init_fn: Callable[[nn.Module], None] | None = None,
                weights: str | os.PathLike | None = None, device: torch.device | None = None,
                **layout: Any) -> ParallelModel:
    """Compile ``model`` for tensor × pipeline × data parallelism on this rank.

    The layout is a :class:`fxpipe.ParallelConfig`, given whole (``config``) or as its
    fields by keyword (``tp=2, pp=2, microbatches=8, schedule="interleaved"``; strings
    are parsed into its enums): ``tp``, ``pp``, ``dp`` (default world/(tp·pp)),
    ``microbatches``, ``schedule`` (gpipe, 1f1b, interleaved, zb-h1, zb-v), ``chunks``
    (stages per rank), ``partition``, ``memory_limit_gb``, ``precision`` (fp32, bf16, or
    fp16 with dynamic loss scaling; both 16-bit modes keep fp32 masters,
    ``runtime/precision.py``), ``recompute`` (none, selective, full; per stage,
    ``passes/recompute.py``), ``sp`` (sequence parallelism), ``scatter_gather`` (SC21
    §4.1; default on when tp > 1 and sp is off), ``zero`` (1: ZeRO stage 1 over data
    parallel, ``runtime/zero.py``; ``parameters()`` then yields this replica's share),
    ``costs`` (what the partitioner balances: "measure" — the graph's groups timed on
    the ranks' devices, cached on disk, ``fxpipe/costs`` —, "model" or a profile's path),
    ``seed`` (init and dropout; Megatron's RNG tracker offsets it per tp rank inside
    sharded regions), ``timeout_s``, ``compile`` (each stage compiled by AOTAutograd +
    TorchInductor before the first step; a stage Inductor rejects runs eagerly with a
    warning, ``runtime/compiled.py``).

    ``example_inputs`` is one global batch as ``train_step`` will receive it (every
    rank passes the same batch; each data-parallel rank trains on its rows).
    ``weights``: a Hugging Face safetensors directory to take the parameters from (each
    rank reads its shards only, ``fxpipe/weights.py``); a model built on the meta device
    is otherwise initialised shard by shard by its own init scheme (``fxpipe/init.py``,
    ``init_fn`` to override). The graph is compiled by ``fxpipe/compiler.py``, the same
    pipeline ``fxpipe compile`` runs.
    """
    if config is None:
        config = ParallelConfig(**layout)
    elif layout:
        config = dataclasses.replace(config, **layout)
    timeout = timedelta(seconds=config.timeout_s)
    device = init_distributed(timeout, device)
    config = config.with_world(dist.get_world_size())
    tp, dp, microbatches = config.tp, config.dp, config.microbatches
    mesh = Mesh(tp=tp, dp=dp, pp=config.pp)
    example = tuple(example_inputs) if not isinstance(example_inputs, torch.Tensor) else (example_inputs,)
    rows = example[0].shape[0]
    if rows % (dp * microbatches):
        raise ValueError(f"batch of {rows} rows cannot be split into dp·microbatches = {dp}·{microbatches} "
                         f"equal microbatches; use a batch that is a multiple of {dp * microbatches}")
    groups = build_groups(mesh, timeout)
    mb_rows = rows // (dp * microbatches)
    first_mb = tuple(t[:mb_rows] for t in example)

    tp_group = ProcessGroupTP(groups.tp_group)
    rng = DropoutRNG(config.seed, groups.tp_rank)
    context = (lambda: tp_group_context(tp_group, rng)) if tp > 1 else contextlib.nullcontext
    shards: list[ShardBuilder] = []  # made once the tensor-parallel pass has set the shard specs

    def builder(program) -> ShardBuilder:
        if not shards:
            tp_result = program.extra.get("tensor_parallel")
            shards.append(ShardBuilder(program, tp_result.specs if tp_result is not None else {}, model,
                                       tp_rank=groups.tp_rank, device=device, seed=config.seed,
                                       weights=weights, init_fn=init_fn))
        return shards[0]

    def measure(program, pconfig, ctx):
        # Balance measured times (fxpipe/costs): each rank times a share of the graph.
        profile, probe, fine = measured_profile(
            program, pconfig, config.costs, device=device, batch=tuple(t.to(device) for t in first_mb),
            mesh=mesh, mesh_groups=groups, context=context, state_for=builder(program).tensors)
        return apply_profile(pconfig, profile, probe, fine, ctx.schedule.splits_backward)

    def solve(program, pconfig):
        # Rank 0 solves and everyone takes its answer: a time-limited solver need not
        # return the same assignment on every rank, and ranks must agree exactly.
        solved = partition_pass(program, pconfig) if dist.get_rank() == 0 else None
        box = [(dict(solved.stages), solved.extra["partition"]) if solved is not None else None]
        dist.broadcast_object_list(box, src=0)
        assignment, result = box[0]
        return program.replace(stages=assignment, extra={**program.extra, "partition": result})

    def check(program):
        # Token ids past the vocabulary: refused before costs are measured or solved for.
        check_token_ids(example, program.extra[TOKEN_INPUTS])

    compiled = compile_pipeline(model, first_mb, config, loss_fn=loss_fn, device=device,
                                hooks=CompileHooks(measure=measure, solve=solve, check=check))
    plan, sched = compiled.plan, compiled.schedule
    program = plan.program
    coverage = getattr(program.extra.get("tensor_parallel"), "coverage", None)
    if coverage is not None and not coverage.complete and dist.get_rank() == 0:
        print(coverage.describe(), flush=True)  # never silent (strict_tp=True makes it an error)
    shard_builder = builder(program)
    specs = shard_builder.specs
    lowered = lower(sched)

    my_stages = sched.stages_of_rank(groups.pp_rank)
    names = dict.fromkeys(n for s in my_stages for n in plan.stage_params(s))
    deferred = shard_builder.deferred(names)
    mine = shard_builder.build(names)
    state = {n: t for n, (t, _) in mine.items()}
    shard_builder.forget()  # tensors timed by the cost profile and not needed here are dropped
    # The shards are taken: the plan keeps parameter shapes only (meta), so no full copy
    # of the model stays alive in this process (buffers and constants are small).
    kinds = {p.canonical: p.kind for p in program.params}
    plan = dataclasses.replace(plan, program=plan.program.replace(state={
        n: t.to("meta") if kinds.get(n) is ParamKind.PARAMETER else t for n, t in plan.program.state.items()}))
    # ZeRO-1 (runtime/zero.py): each data-parallel replica owns a balanced share of the
    # trainable tensors; only the owner keeps optimizer state and an fp32 master.
    partition = ZeroPartition.build(groups, {n: t for n, t in state.items() if t.requires_grad}) \
        if config.zero and dp > 1 else None
    master = None
    prec = config.precision
    if prec is not Precision.FP32:
        owned = [n for n, t in state.items() if t.requires_grad and (partition is None or partition.owns(n))]
        if deferred:
            shards32 = {n: mine[n][1] if mine[n][1] is not None else shard_builder.shard(n).float()
                        for n in owned}
        else:
            originals = dict(model.named_parameters())
            shards32 = shard_state({n: originals[n].detach().float() for n in owned}, specs, groups.tp_rank)
        masters = {n: t.to(device).clone().requires_grad_(True) for n, t in shards32.items()}
        master = MasterWeights(prec, state, masters,
                               LossScaler(**(loss_scaler or {})) if prec is Precision.FP16 else None)
    runners = {s: StageRunner(plan, plan.stages[s], state, loss_scale=1.0 / microbatches, context=context)
               for s in my_stages}
    compiled_stages = _compile_runners(runners, plan, sched, state, groups, context, device) if config.compile else ()
    value_ids = {n: i for i, n in enumerate(sorted(plan.values))}
    transport = Transport(device=device, timeout=timeout, value_ids=value_ids, num_values=max(1, len(value_ids)),
                          scatter_gather=tp_group if config.scatter_gather else None)
    executor = PipelineExecutor(plan, lowered, groups.pp_rank, runners, transport, groups.pp_peer)
    holders = {**master.masters, **master.loose} if master else state
    grad_sync = GradSync.build(plan, sched, groups, holders, timeout, like=state, zero=partition)
    return ParallelModel(plan, lowered, groups, state, executor, grad_sync, config, device, master=master,
                         specs=specs, model_stats=compiled.stats, partition=compiled.partition,
                         compiled_stages=compiled_stages, token_inputs=compiled.token_inputs, tp_rng=rng)

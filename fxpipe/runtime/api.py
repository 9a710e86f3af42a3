"""``ParallelModel``: one rank's share of a parallelized model, and its training step.

``fxpipe.parallelize`` (``fxpipe/parallel.py``) compiles the model and
``runtime/build.py`` assembles this from the ``CompiledPipeline``; here are the
parameters (sharded, masters under mixed precision, ZeRO ownership), ``train_step``
over the executor, and the gathers that rebuild full tensors.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist

from fxpipe.ir.artifact import CompiledPipeline
from fxpipe.ir.pass_results import ModelStats, TokenInput
from fxpipe.ir.shard_spec import ShardSpec, unshard_state
from fxpipe.ir.token_inputs import check_token_ids
from fxpipe.partition import PartitionResult
from fxpipe.runtime.executor import PipelineExecutor
from fxpipe.runtime.experts import ExpertGroups, gather_experts, tokens_per_expert
from fxpipe.runtime.grad_sync import GradSync
from fxpipe.runtime.mesh import MeshGroups
from fxpipe.runtime.mixed_precision import MasterWeights
from fxpipe.runtime.param_waits import ParamWaits
from fxpipe.runtime.zero import ZeroPartition
from fxpipe.tp import DropoutRNG


@dataclass(frozen=True)
class StepStats:
    peak_in_flight: int
    """Most (stage, microbatch) activations this rank held at once in the last step."""
    events: tuple
    """(action, start, end) of every action this rank ran in the last step (perf_counter s)."""
    exposed: "ExposedComm | None" = None
    """Time this rank blocked waiting for communication in the last step."""


@dataclass(frozen=True)
class ExposedComm:
    """Communication a step waited for (the rest ran behind compute), seconds."""
    pipeline_s: float
    """Waiting for pipeline receives (activations, gradients, vocabulary passes' transfers)
    and, at the step's end, for its sends."""
    gradients_s: float
    """Waiting for the gradient reduction after the last backward (buckets not yet done,
    tied and row sums, what is reduced after the backward)."""
    parameters_s: float = 0.0
    """ZeRO-1: the owners' parameters broadcast before the first forward."""
    posting_s: float = 0.0
    """Posting the pipeline's sends and receives (``Transport.posted_s``): blocked while
    gloo's transport thread holds the connection."""

    @property
    def total_s(self) -> float:
        return self.pipeline_s + self.gradients_s + self.parameters_s + self.posting_s


@dataclass
class RankParts:
    """What ``build_runtime`` made for this rank; everything else a ``ParallelModel``
    knows it reads off the compiled artifact."""
    groups: MeshGroups
    state: dict[str, torch.Tensor]
    """This rank's parameter shards, buffers and constants by canonical name."""
    executor: PipelineExecutor
    grad_sync: GradSync
    device: torch.device
    specs: dict[str, ShardSpec]
    """What this rank holds of every split parameter (tensor-parallel shards, with its
    pipeline rows and experts folded in; empty when nothing is split)."""
    master: MasterWeights | None = None
    """Mixed precision: fp32 masters (what the optimizer sees) for ``state``."""
    compiled_stages: tuple = ()
    """``inductor=True``: one ``runtime.compiled.StageCompile`` per stage of this rank."""
    tp_rng: DropoutRNG | None = None
    """The tensor-parallel dropout streams (Megatron's RNG tracker), saved in checkpoints."""
    experts: ExpertGroups | None = None
    """Expert parallelism (``runtime/experts.py``): groups, expert parameters, token counts."""
    param_waits: ParamWaits | None = None
    """ZeRO-1: the stages wait for each broadcast parameter before its first reader
    (``runtime/param_waits.py``); None: for all of them before the first forward."""


class ParallelModel:
    """What ``parallelize`` returns: one rank's share of the model and its schedule."""

    def __init__(self, compiled: CompiledPipeline, parts: RankParts) -> None:
        self.compiled = compiled
        """The artifact this rank runs (its parameters as shapes only: the shards are ``state``)."""
        self.plan, self.schedule, self.config = compiled.plan, compiled.actions, compiled.config
        program = compiled.program
        self.model_stats: ModelStats | None = program.model_stats
        self.partition: PartitionResult | None = program.partition
        """The partitioner's result: per-stage predicted times and memory."""
        self.token_inputs: tuple[TokenInput, ...] = program.token_inputs
        """Batch inputs that are token ids, with their vocabulary (``fxpipe/ir/token_inputs.py``)."""
        self.groups, self.state, self.executor = parts.groups, parts.state, parts.executor
        self.grad_sync, self.device, self.specs = parts.grad_sync, parts.device, parts.specs
        self.master, self.compiled_stages = parts.master, parts.compiled_stages
        self.tp_rng, self.experts = parts.tp_rng, parts.experts
        self.zero: ZeroPartition | None = parts.grad_sync.zero
        """ZeRO-1: which data-parallel replica owns (steps) each trainable tensor."""
        self.param_waits = parts.param_waits
        """ZeRO-1: the stages' waits for each broadcast parameter (None: all before the first forward)."""
        self.last_step_skipped = False
        """fp16: the last step was dropped for an overflow."""
        self.closed = False
        """``close()`` released the process groups: nothing collective runs again."""
        self.last_stats: StepStats | None = None
        self._mb_shapes = [s.shape for s in self.plan.program.input_specs]

    @property
    def num_microbatches(self) -> int:
        return self.config.num_microbatches

    def close(self) -> None:
        """Release the process groups this model created (tp, dp, pp and tied-weight
        groups). Each gloo group keeps its own polling threads until destroyed, so a
        process that parallelizes many models in turn (a test world, the compatibility
        run) calls this between them. The model cannot train afterwards; a second call does nothing."""
        if self.closed:
            return
        self.closed = True
        mine = [self.groups.tp_group, self.groups.dp_group, self.groups.pp_group]
        mine += [group for _, group in self.grad_sync.tied]
        mine += [group for _, _, group in self.grad_sync.rows]
        mine += self.experts.process_groups if self.experts is not None else []
        for group in dict.fromkeys(g for g in mine if g is not None):
            if group is not dist.GroupMember.NON_GROUP_MEMBER and group is not dist.GroupMember.WORLD:
                dist.destroy_process_group(group)

    @property
    def parameter_share(self) -> float:
        """This rank's share of the model's parameters over tensor parallelism (ideal 1/tp;
        pipeline stages divide it further); 1.0 without TP."""
        coverage = getattr(self.plan.program.tensor_parallel, "coverage", None)
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
        self._check_open("unshard_tp")
        if self.groups.mesh.tp == 1:
            return local
        shards: list[Any] = [None] * self.groups.mesh.tp
        dist.all_gather_object(shards, local, group=self.groups.tp_group)
        return unshard_state(shards, self.specs)

    def gather_full(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Full tensors of the whole model from every rank's share of them (parameters or
        gradients by canonical name, on CPU): tensor-parallel shards gathered over the
        tp group, then pipeline ranks' tensors and row ranges (``plan.row_shards``)
        over the pp group. Every rank gets everything: for tests and small exports
        (checkpoints and ``export_consolidated`` never gather). Collective."""
        self._check_open("gather_full")
        local = self.unshard_tp(local)
        if self.experts is not None:
            local = gather_experts(local, self.experts)
        rows = {}  # the global rows of each row-split tensor this pp rank holds
        for name in self.plan.row_shards:
            spec = self.specs.get(name)
            if name in local and spec is not None:
                rows[name] = sorted({i for t in range(spec.tp) for i in spec.indices(t)})
                if tuple(local[name].shape) != tuple(spec.full_shape):  # tp=1: still the local rows
                    t = local[name]
                    local[name] = t.new_zeros(spec.full_shape)
                    local[name][torch.tensor(spec.indices(0), dtype=torch.long)] = t[:len(spec.indices(0))]
        gathered: list[Any] = [None] * self.groups.mesh.pp
        dist.all_gather_object(gathered, (local, rows), group=self.groups.pp_group)
        full: dict[str, torch.Tensor] = {}
        for part, held in gathered:
            for n, t in part.items():
                if n not in held:
                    full.setdefault(n, t)
                    continue
                if n not in full:
                    full[n] = torch.zeros_like(t)
                index = torch.tensor(held[n], dtype=torch.long)
                full[n][index] = t[index]
        return full

    def tokens_per_expert(self) -> dict[int, list[int]]:
        """Expert parallelism: MoE layer -> tokens routed to each of its experts over every
        step so far, on the global batch (collective); empty without expert parallelism."""
        self._check_open("tokens_per_expert")
        return tokens_per_expert(self.experts, self.groups.dp_group) if self.experts is not None else {}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter of the model, gathered from all pipeline ranks (on CPU)."""
        return self.gather_full({n: t.detach().cpu() for n, t in self.named_parameters()})

    # ---- training ------------------------------------------------------------------------
    def _microbatches(self, batch: tuple[torch.Tensor, ...]) -> list[tuple[torch.Tensor, ...]]:
        """This data-parallel rank's microbatches of a batch ``_check_batch`` accepted."""
        mesh, m = self.groups.mesh, self.num_microbatches
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
        self._check_open("train_step")
        batch = self._check_batch(batch)
        # One max per token input: an id past the vocabulary is an IndexError at tp=1
        # and silently wrong embeddings under vocabulary-parallel TP.
        check_token_ids(batch, self.token_inputs)
        for t in self.parameters():
            t.grad = None
        if self.master is not None:
            self.master.refresh()
        # ZeRO-1: the owners' parameters, each waited for before the first op that reads it
        # (or all of them before the first forward computes: runtime/param_waits.py).
        waits = self.param_waits
        gather = self.zero.start_broadcast({n: self.state[n] for n in self.zero.owner},
                                           waits.order if waits is not None else ()) \
            if self.zero is not None else None
        if waits is not None:
            waits.pending = gather
        self.executor.before_forward = gather.wait if gather is not None and waits is None else None
        self.grad_sync.start_step()
        if self.master is not None:
            for runner in self.executor.runners.values():
                runner.loss_scale = self.master.loss_scale / self.num_microbatches
        self.executor.run(self._microbatches(batch))
        if gather is not None:  # the rest, and the owners' sends, before the optimizer changes them
            gather.wait()
            if waits is not None:
                waits.pending = None
        # After the schedule, whose transfers name a peer that does not answer; before the
        # gradients are synchronised, so a refused step changes nothing but .grad.
        loss = self._check_batch_and_sum_loss(batch)
        self.grad_sync.sync()
        if self.master is not None:
            # fp16: gradients unscaled, or dropped when any rank overflowed.
            self.last_step_skipped = not self.master.finish()
        self.last_stats = StepStats(self.executor.peak_in_flight, tuple(self.executor.events),
                                    ExposedComm(self.executor.transport.waited_s, self.grad_sync.waited_s,
                                                gather.waited_s if gather is not None else 0.0,
                                                self.executor.transport.posted_s))
        return loss

    def _check_open(self, what: str) -> None:
        if self.closed:
            raise RuntimeError(f"{what} after close(): close() released this model's process groups; "
                               f"parallelize the model again to go on training")

    def _check_batch(self, batch: Any) -> tuple[torch.Tensor, ...]:
        """The batch as a tuple of tensors like the example batch's (types, dtypes, real
        values), or a TypeError naming what differs."""
        if isinstance(batch, torch.Tensor):
            batch = (batch,)
        if not isinstance(batch, (tuple, list)) or not all(isinstance(t, torch.Tensor) for t in batch):
            raise TypeError(f"train_step takes the batch as a tensor or a tuple of tensors, like the example "
                            f"batch; got {type(batch).__name__}"
                            + (f" of {', '.join(type(t).__name__ for t in batch)}" if isinstance(batch, (tuple, list))
                               else ""))
        specs = self.plan.program.input_specs
        if len(batch) != len(specs):
            raise TypeError(f"train_step got {len(batch)} batch tensors, the example batch had {len(specs)}")
        for i, (t, spec) in enumerate(zip(batch, specs)):
            if t.device.type == "meta":
                raise TypeError(f"batch tensor {i} is on the meta device: it has no values to train on")
            if t.dtype != spec.dtype:
                raise TypeError(f"batch tensor {i} has dtype {t.dtype}, the example batch's has {spec.dtype}")
        return tuple(batch)

    def _check_batch_and_sum_loss(self, batch: tuple[torch.Tensor, ...]) -> float:
        """The ranks of one data-parallel replica (its tp and pp ranks) must pass the same
        rows for it: each reads its microbatches from them, and a pipeline whose stages
        saw different rows would train on neither. A digest of this replica's rows per
        rank — each tensor's sum and its sum weighted by position, so a reordering shows
        too — is compared over the world once per step (other replicas' rows may differ:
        a replica never reads them, ``DataStream.global_rows``).

        Returns the step's mean loss over the global batch: the loss sums ride in the same
        gather (each replica's last stage, one TP rank of it), so a step ends with one
        collective, not three — each a few hundred µs to ms of latency on gloo
        (benchmarks/bench_gloo_latency.py), the step's own cost beyond its schedule."""
        world = dist.get_world_size()
        losses = self._loss_sum()
        if world == 1:
            return losses / self.num_microbatches
        dp, mine = self.groups.mesh.dp, self.groups.dp_rank
        rows = [t.chunk(dp)[mine] if t.dim() else t for t in batch]
        digest = torch.stack([torch.tensor(float(mine), dtype=torch.float64),
                              torch.tensor(losses if self.groups.tp_rank == 0 else 0.0, dtype=torch.float64),
                              *(part for t in rows for part in _digest(t))]).to(self.device)
        every = [torch.empty_like(digest) for _ in range(world)]
        dist.all_gather(every, digest)
        by_replica: dict[int, dict[tuple, list[int]]] = {}
        total = 0.0
        for rank, d in enumerate(every):
            values = d.tolist()
            total += values[1]
            by_replica.setdefault(int(values[0]), {}).setdefault(tuple(values[2:]), []).append(rank)
        for replica, groups in sorted(by_replica.items()):
            if len(groups) > 1:
                parts = "; ".join(f"ranks {', '.join(map(str, ranks))} one batch" for ranks in groups.values())
                raise ValueError(f"train_step: the ranks of data-parallel replica {replica} passed {len(groups)} "
                                 f"different batches ({parts}); every rank must pass the same global batch (or at "
                                 f"least the same rows for its replica: each takes its rows and microbatches from "
                                 f"them)")
        return total / (self.num_microbatches * dp)

    def _loss_sum(self) -> float:
        """This rank's microbatch losses summed (the last stage's rank knows them; 0 elsewhere)."""
        runner = self.executor.runners.get(self.plan.num_stages - 1)
        if runner is None:
            return 0.0
        total = float(sum(runner.losses.values()))
        runner.losses.clear()
        return total


def _digest(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum, position-weighted sum) of ``t`` in float64 on the CPU: equal batches give equal
    digests on every rank; different ones almost never do."""
    flat = t.detach().reshape(-1).to("cpu", torch.float64)
    weights = torch.arange(flat.numel(), dtype=torch.float64).remainder_(1009).add_(1)
    return flat.sum(), (flat * weights).sum()

"""``fxpipe.parallelize``: compile a model for this rank's place in the mesh, then run it.

Every rank runs the same call (launched by torchrun or ``fxpipe run``): the compile
pipeline (``fxpipe/compiler/pipeline.py``) with the mesh's two hooks, then the runtime built
from what it returned (``runtime/build.py``)::

    parallelize ─> RankMesh.join ─> compile_pipeline ─> CompiledPipeline ─> build_runtime ─> ParallelModel
                                     (hooks: MeshHooks)                                      .train_step -> actions

The hooks are what make the compile collective: with measured costs each rank times a
share of the graph and all see every time; global rank 0 solves the partition and
broadcasts the assignment (a time-limited solver need not agree with itself), from
which every rank splits the same plan.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from fxpipe.compiler.pipeline import CompileHooks, compile_pipeline
from fxpipe.costs import apply_profile, measured_profile
from fxpipe.ir.artifact import CompiledPipeline
from fxpipe.ir.parallel_config import ParallelConfig
from fxpipe.ir.program import Program
from fxpipe.ir.token_inputs import check_token_ids
from fxpipe.params.rank_state import ShardBuilder
from fxpipe.partition import PartitionError
from fxpipe.planner.layout_price import ranks_at_once
from fxpipe.planner.layout_space import SEARCHED
from fxpipe.planner.resolve import resolve_layout
from fxpipe.runtime.api import ParallelModel
from fxpipe.runtime.build import build_runtime
from fxpipe.runtime.launch import init_distributed, rank0_decides
from fxpipe.runtime.rank_mesh import RankMesh


def parallelize(model: nn.Module, config: ParallelConfig | None = None, *,
                example_inputs: Sequence[torch.Tensor],
                loss_fn: Callable[..., torch.Tensor] | None = None, loss_scaler: dict | None = None,
                init_fn: Callable[[nn.Module], None] | None = None,
                weights: str | os.PathLike | None = None, device: torch.device | None = None,
                **layout: Any) -> ParallelModel:
    """Compile ``model`` for tensor × pipeline × data parallelism on this rank.

    The layout is a :class:`fxpipe.ParallelConfig`, given whole (``config``) or as its
    fields by keyword (``tp=2, pp=2, microbatches=8, schedule="interleaved"``; strings
    are parsed into its enums; each field is documented there). ``example_inputs`` is
    one global batch as ``train_step`` will receive it (every rank passes the same
    batch; each data-parallel rank trains on its rows). ``weights``: a Hugging Face
    safetensors directory to take the parameters from (each rank reads its shards only,
    ``fxpipe/params/hf_weights.py``); a model built on the meta device is otherwise initialised
    shard by shard by its own init scheme (``fxpipe/params/deferred_init.py``, ``init_fn`` to override).
    ``loss_scaler``: ``LossScaler`` arguments under fp16 (``runtime/mixed_precision.py``).
    """
    check_arguments(model, config, example_inputs, loss_fn)
    config, search = choose_layout(model, config, layout, example_inputs, loss_fn, device)  # 1. given or searched
    mesh = RankMesh.join(config, device)                                      # 2. the mesh, dp resolved
    hooks = MeshHooks(mesh, model, example_inputs, weights, init_fn)          # 3. one microbatch to capture
    compiled = compile_pipeline(model, hooks.first_mb, mesh.config, loss_fn=loss_fn,  # 4. compile, collectively
                                device=mesh.device, hooks=hooks.compile_hooks(), layout_search=search)
    mesh = report_and_place_experts(compiled, mesh)                           # 5. what stays whole; experts
    return build_runtime(compiled, mesh, hooks.shards(compiled.program),      # 6. this rank's runtime
                         model=model, loss_scaler=loss_scaler)


def check_arguments(model: Any, config: Any, example_inputs: Any, loss_fn: Any) -> None:
    """``parallelize``'s arguments by type, before anything is captured or joined: a
    TypeError naming the argument and what it accepts."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"parallelize takes the model as a torch.nn.Module, got {type(model).__name__} "
                        f"{getattr(model, '__name__', '')!s}".rstrip() + "; wrap a function in a Module whose "
                        "forward calls it")
    if config is not None and not isinstance(config, ParallelConfig):
        raise TypeError(f"config must be a fxpipe.ParallelConfig or None, got {type(config).__name__} (give the "
                        f"layout's fields as keywords instead: tp=2, pp=2, ...)")
    batch = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else example_inputs
    if not isinstance(batch, (tuple, list)) or not batch or not all(isinstance(t, torch.Tensor) for t in batch):
        raise TypeError(f"example_inputs must be a tensor or a non-empty tuple of tensors (the model's positional "
                        f"inputs, one global batch), got {type(example_inputs).__name__}")
    meta = [i for i, t in enumerate(batch) if t.device.type == "meta"]
    if meta:
        raise TypeError(f"example_inputs[{meta[0]}] is on the meta device: the example batch needs values (the "
                        f"model may be on meta, its batch not)")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable (outputs, *batch) -> loss, or None, got "
                        f"{type(loss_fn).__name__}")


LAYOUT_KEYWORDS = {"microbatches": "num_microbatches", **{f: f for f in SEARCHED}}
"""``parallelize``'s keywords for the fields the layout search decides (``planner/auto_layout.py``)."""
GIVES_A_LAYOUT = frozenset({"tp", "pp", "dp", "num_microbatches", "schedule", "chunks", "vocab_passes"})
"""One of these given is a layout given: no search (the head's blockwise loss, ep and the
memory savers given alone are kept by the search)."""


def choose_layout(model: nn.Module, config: ParallelConfig | None, layout: dict[str, Any],
                  example_inputs: Sequence[torch.Tensor] | torch.Tensor, loss_fn: Callable | None,
                  device: torch.device | None) -> tuple[ParallelConfig, str | None]:
    """The layout given; or, when no layout field is given at all (``parallelize(model,
    example_inputs=batch)``) or some are ``"auto"``, the fastest that fits as the search
    prices it on global rank 0 (the others receive it: one layout on every rank), with
    the search's table (printed by rank 0, kept on the compiled artifact)."""
    auto = {k for k, v in layout.items() if isinstance(v, str) and v == "auto"}
    if not auto and (config is not None or {LAYOUT_KEYWORDS.get(k) for k in layout} & GIVES_A_LAYOUT):
        return (ParallelConfig(**layout) if config is None else dataclasses.replace(config, **layout)), None
    given = {k: v for k, v in layout.items() if k not in auto}
    base = (ParallelConfig(**{k: v for k, v in given.items() if k not in LAYOUT_KEYWORDS}) if config is None
            else dataclasses.replace(config, **{k: v for k, v in given.items() if k not in LAYOUT_KEYWORDS}))
    pinned = {LAYOUT_KEYWORDS[k]: v for k, v in given.items() if k in LAYOUT_KEYWORDS}
    if config is not None:  # a whole config with some fields "auto": the others are pinned
        pinned = {f: getattr(base, f) for f in SEARCHED if f not in {LAYOUT_KEYWORDS[k] for k in auto}} | pinned
    device = init_distributed(timedelta(seconds=base.timeout_s), device)
    world = dist.get_world_size()
    # A pin nothing fits is refused on rank 0 and heard by every rank (runtime/launch.py).
    chosen = resolve_layout(base, pinned, world, lambda: (model, example_inputs, loss_fn),
                            concurrent=ranks_at_once(world, device))
    return chosen.config, chosen.table


def report_and_place_experts(compiled: CompiledPipeline, mesh: RankMesh) -> RankMesh:
    """Never silent: what tensor parallelism left whole and which MoEs stay data-parallel
    (printed once); under ep > 1 the expert groups for the experts the pass found."""
    tp, ep = compiled.program.tensor_parallel, compiled.program.expert_parallel
    if tp is not None and tp.coverage is not None and not tp.coverage.complete and dist.get_rank() == 0:
        print(tp.coverage.describe(), flush=True)  # strict_tp=True makes it an error instead
    if mesh.config.ep == 1:
        return mesh
    if ep.skipped and dist.get_rank() == 0:  # these experts stay on every replica
        print(f"expert parallelism left {len(ep.skipped)} MoE(s) data-parallel: " + "; ".join(ep.skipped), flush=True)
    return mesh.with_experts(ep.expert_params)


def first_microbatch(example: tuple[torch.Tensor, ...], config: ParallelConfig) -> tuple[torch.Tensor, ...]:
    """The rows of one microbatch of one data-parallel replica (what is captured)."""
    rows, dp, m = example[0].shape[0], config.replicas, config.num_microbatches
    if rows % (dp * m):
        raise ValueError(f"batch of {rows} rows cannot be split into dp·microbatches = {dp}·{m} "
                         f"equal microbatches; use a batch that is a multiple of {dp * m}")
    return tuple(t[:rows // (dp * m)] for t in example)


@dataclass
class MeshHooks:
    """The compile pipeline's hooks on a mesh of ranks (``CompileHooks``)."""
    mesh: RankMesh
    model: nn.Module
    example: Sequence[torch.Tensor] | torch.Tensor
    """One global batch, as ``train_step`` will receive it."""
    weights: str | os.PathLike | None
    init_fn: Callable[[nn.Module], None] | None
    _shards: ShardBuilder | None = None

    def __post_init__(self) -> None:
        ex = self.example
        self.example = tuple(ex) if not isinstance(ex, torch.Tensor) else (ex,)
        self.first_mb = first_microbatch(self.example, self.mesh.config)

    def compile_hooks(self) -> CompileHooks:
        return CompileHooks(measure=self.measure, check=self.check, decide=self.decide)

    def shards(self, program: Program) -> ShardBuilder:
        """This rank's parameter builder, made once the tensor-parallel pass has set the
        shard specs, shared by the cost measurement and the runtime."""
        if self._shards is None:
            self._shards = ShardBuilder(program, program.tp_specs, self.model,
                                        tp_rank=self.mesh.groups.tp_rank, device=self.mesh.device,
                                        seed=self.mesh.config.seed, weights=self.weights, init_fn=self.init_fn)
        return self._shards

    def measure(self, program, pconfig, ctx):
        # Balance measured times (fxpipe/costs): each rank times a share of the graph.
        mesh = self.mesh
        profile, probe, fine = measured_profile(
            program, pconfig, mesh.config.costs, device=mesh.device,
            batch=tuple(t.to(mesh.device) for t in self.first_mb), mesh=mesh.groups.mesh,
            mesh_groups=mesh.groups, context=mesh.context, state_for=self.shards(program).tensors)
        return apply_profile(pconfig, profile, probe, fine, ctx.schedule.splits_backward)

    def decide(self, fn):
        # Rank 0 computes and every rank takes its answer: what the ranks must hold
        # identically (the partition: a time-limited solver need not agree with itself;
        # the vocabulary passes' times: one collective order on every rank). A partition
        # refusal is heard by every rank as itself.
        return rank0_decides(fn, as_raised=(PartitionError,))

    def check(self, program):
        # Token ids past the vocabulary: refused before costs are measured or solved for.
        check_token_ids(self.example, program.token_inputs)

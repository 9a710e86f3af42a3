"""The Program: fxpipe's one IR between capture and the pipeline plan.

A Program is an ATen-level ``torch.fx.GraphModule`` whose placeholders are, in
order, every parameter, buffer and lifted constant (named by ``ParamInfo``) and
then the user's batch inputs; its output is the scalar loss (plus any buffer the
model mutates). Around the graph sit the parameter table with tied groups and
the per-node annotations that passes fill in, each a map keyed by node name, and
one typed field per pass result that is not per node.

Passes never mutate a Program they receive: they return a new one (``replace``),
copying the graph first if they rewrite it.
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

import torch
import torch.fx as fx

from fxpipe.base.dtypes import _itemsize
from fxpipe.base.op_cost import NodeCost
from fxpipe.ir.pass_configs import PartitionConfig
from fxpipe.ir.pass_results import BlockwiseLoss, EPResult, MatmulSplit, ModelStats, TokenInput
from fxpipe.ir.shard_spec import ShardSpec
from fxpipe.ir.tp_result import TPResult
from fxpipe.partition.result import PartitionResult


class ParamKind(enum.Enum):
    PARAMETER = "parameter"
    BUFFER = "buffer"
    CONSTANT = "constant"


@dataclass(frozen=True)
class ParamInfo:
    """One parameter, buffer or lifted constant of the captured model."""
    name: str
    """Original fully-qualified name in the user's module (``transformer.wte.weight``)."""
    node: str
    """Name of the placeholder node that carries it in the graph."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: ParamKind
    requires_grad: bool
    persistent: bool = True
    """False for buffers registered with ``persistent=False`` (not in ``state_dict()``)."""
    tied_group: str | None = None
    """Canonical name of the tied group this tensor belongs to (None: not tied).
    The canonical member is the first name in module registration order."""

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)

    @property
    def canonical(self) -> str:
        """The name under which this tensor's storage lives in ``Program.state``."""
        return self.tied_group or self.name


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of a batch input (what ``train_step`` must receive)."""
    shape: tuple[int, ...]
    dtype: torch.dtype

    @staticmethod
    def of(t: torch.Tensor) -> "TensorSpec":
        return TensorSpec(tuple(t.shape), t.dtype)


@dataclass(frozen=True)
class Program:
    graph_module: fx.GraphModule
    params: tuple[ParamInfo, ...]
    """Parameters, buffers and constants in placeholder order."""
    inputs: tuple[str, ...]
    """Placeholder names of the batch inputs, in ``example_inputs`` order."""
    input_specs: tuple[TensorSpec, ...]
    loss_output: int = 0
    """Index of the scalar loss among the graph's outputs."""
    mutated_buffers: tuple[str, ...] = ()
    """Names of buffers the forward writes, in output order before the loss."""
    state: Mapping[str, torch.Tensor] = field(default_factory=dict)
    """Canonical name -> tensor (the user's own parameters and buffers; may be meta)."""
    source: str = ""
    """Class of the captured model, for messages and reports."""
    module_paths: Mapping[str, str] = field(default_factory=dict)
    """Node name -> module path it came from ('' outside any submodule)."""
    layers: Mapping[str, int] = field(default_factory=dict)
    """Node name -> index of the repeated layer it belongs to (absent: not in a layer)."""
    layer_container: str = ""
    """Module path of the repeated-layer container (e.g. ``transformer.h``)."""
    costs: Mapping[str, NodeCost] = field(default_factory=dict)
    stages: Mapping[str, int] = field(default_factory=dict)
    """Node name -> pipeline stage index, filled by the partition pass."""
    size_hints: Mapping[str, int] = field(default_factory=dict)
    """Data-dependent size symbol (``u0``) -> the value it took on the example batch
    (``fxpipe/ir/sizes.py``); a symbol absent here is priced at its upper bound."""

    # ---- results of passes that are not per node: one typed field per pass that writes it
    model_stats: "ModelStats | None" = None
    """Whole-model FLOPs and parameters, counted before tensor parallelism (``model_stats``)."""
    token_inputs: tuple["TokenInput", ...] = ()
    """Batch inputs that are token ids, with their vocabulary (``model_stats``, ``fxpipe/ir/token_inputs.py``)."""
    tensor_parallel: "TPResult | None" = None
    """Shard specs, blocks, collectives and coverage (``tensor_parallel``; None: not sharded)."""
    expert_parallel: "EPResult | None" = None
    """Experts owned per expert-parallel rank and their shard specs (``expert_parallel``)."""
    matmul_splits: tuple["MatmulSplit", ...] = ()
    """Ops cut into output-feature blocks (``split_matmul``; merged by ``coalesce_blocks``)."""
    loss_splits: tuple["BlockwiseLoss", ...] = ()
    """Cross-entropies computed block by block (``split_loss``; merged by ``coalesce_blocks``)."""
    partition_config: "PartitionConfig | None" = None
    """What the partition balances: layout, memory limit, modelled or measured node times
    and link (``measure_costs``)."""
    partition: "PartitionResult | None" = None
    """The solver's result: per-stage times, memory, optimality gap (``partition``)."""

    def replace(self, **changes: Any) -> "Program":
        frozen = {k: MappingProxyType(dict(v)) if isinstance(v, dict) else v
                  for k, v in changes.items()}
        return dataclasses.replace(self, **frozen)

    # ---- queries -----------------------------------------------------------------
    @property
    def graph(self) -> fx.Graph:
        return self.graph_module.graph

    def param(self, name: str) -> ParamInfo:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(name)

    @property
    def tied_groups(self) -> dict[str, tuple[str, ...]]:
        """Canonical name -> every name that shares its storage."""
        groups: dict[str, list[str]] = {}
        for p in self.params:
            if p.tied_group is not None:
                groups.setdefault(p.tied_group, []).append(p.name)
        return {k: tuple(v) for k, v in groups.items()}

    def trainable(self) -> list[ParamInfo]:
        """One entry per distinct trainable tensor (tied groups once, canonical first)."""
        seen: set[str] = set()
        out = []
        for p in self.params:
            if p.kind is ParamKind.PARAMETER and p.requires_grad and p.canonical not in seen:
                seen.add(p.canonical)
                out.append(p)
        return out

    @property
    def tp_specs(self) -> Mapping[str, ShardSpec]:
        """Tensor-parallel ShardSpec per sharded parameter (empty before or without TP)."""
        return self.tensor_parallel.specs if self.tensor_parallel is not None else {}

    def num_parameters(self) -> int:
        return sum(p.numel for p in self.trainable())

    def call_nodes(self) -> list[fx.Node]:
        return [n for n in self.graph.nodes if n.op == "call_function"]

    # ---- execution -----------------------------------------------------------------
    def run(self, state: Mapping[str, torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
        """Run the graph with ``state`` (canonical name -> tensor) and a batch; return the loss.

        Tied names all read their canonical tensor, so autograd accumulates their
        gradients into one leaf, as in the eager model. Buffers the forward writes
        (``mutated_buffers``, graph outputs before the loss) are written back into
        ``state``, as the eager forward would have."""
        if len(inputs) != len(self.inputs):
            raise TypeError(f"{self.source} program takes {len(self.inputs)} batch inputs "
                            f"{self.input_specs}, got {len(inputs)}")
        args = [state[p.canonical] for p in self.params]
        outputs = self.graph_module(*args, *inputs)
        if not isinstance(outputs, (tuple, list)):
            return outputs
        canonical = {p.name: p.canonical for p in self.params}
        with torch.no_grad():
            for name, new in zip(self.mutated_buffers, outputs):
                state[canonical[name]].copy_(new)
        return outputs[self.loss_output]



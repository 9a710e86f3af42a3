"""One capture, every micro-batch size: the programs of a batch's first ``rows`` rows.

The layout search needs the program of one microbatch at every micro-batch size b its
layouts take (five for ``fxpipe run``'s default job). Exporting each is the dearest
thing the search does besides timing (~1.6 CPU s apiece for a 6-layer GPT). So the model
is exported once with its batch dimension dynamic (``torch.export.Dim``): the graph then
reads the batch size with ``sym_size`` and computes its shapes from it. For ``rows`` rows
the graph is copied, its shapes propagated with FakeTensors of that many rows (far
cheaper than tracing the model again) and the size computations folded into the
integers they give — the graph a static capture of ``rows`` rows makes, node for node
(``tests/compiler/test_capture_rows.py`` compares them).

Where the dynamic export does not go through — the model's code fixes the batch size,
a size only the data decides (``ir/sizes.py``), a batch of one row — or a size
computation does not fold, each micro-batch size is captured on its own, as before.
"""
from __future__ import annotations

import operator
from types import SimpleNamespace
from typing import Callable, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.fx.passes.shape_prop import _extract_tensor_metadata
from torch.export.graph_signature import InputKind

from fxpipe.compiler.capture import _LossModule, _model_kwargs, _to_program, capture
from fxpipe.ir.program import Program
from fxpipe.ir.sizes import unbacked_symbols

_SIZE_OPS = {torch.ops.aten.sym_size.int, operator.mul, operator.add, operator.sub, operator.floordiv,
             operator.mod, torch.sym_max, torch.sym_min}
"""Integer ops on the batch size the export records (``x.size(0) * T`` and the like)."""
_ASSERTS = {torch.ops.aten._assert_scalar.default, torch.ops.aten.sym_constrain_range_for_size.default,
            torch.ops.aten.sym_constrain_range.default}
"""Checks on the batch size's range: with a concrete size there is nothing to check."""


class BatchCaptures:
    """``programs(rows)``: the Program of ``batch``'s first ``rows`` rows (module docstring),
    each made once. ``model`` as ``capture_for`` takes it: already in the precision it runs."""

    def __init__(self, model: nn.Module, batch: Sequence[torch.Tensor],
                 loss_fn: Callable[..., torch.Tensor] | None = None) -> None:
        self.model, self.batch, self.loss_fn = model, tuple(batch), loss_fn
        self._exported: torch.export.ExportedProgram | None | bool = False  # False: not tried yet
        self._programs: dict[int, Program] = {}

    def __call__(self, rows: int) -> Program:
        if rows not in self._programs:
            inputs = tuple(t[:rows] for t in self.batch)
            exported = self._export() if rows > 1 else None
            program = None if exported is None else _specialized(self.model, exported, inputs)
            # The dynamic graph must be the static one's but for the sizes: a model that
            # builds its graph differently with a symbolic batch (a mask made another way,
            # a branch on the batch size) is captured per size. The one-row capture is the
            # reference: the search makes it first in any case.
            if program is None or not _same_but_sizes(program, self(1)):
                program = capture(self.model, inputs, self.loss_fn)
            self._programs[rows] = program
        return self._programs[rows]

    def _export(self) -> torch.export.ExportedProgram | None:
        """The export with a dynamic batch dimension (None where it does not go through)."""
        if self._exported is False:
            self._exported = None
            if self.batch[0].shape[0] > 1 and all(t.dim() >= 1 for t in self.batch):
                rows = torch.export.Dim("rows", min=1, max=max(2, self.batch[0].shape[0]))
                wrapper = _LossModule(self.model, self.loss_fn, _model_kwargs(self.model))
                was_training = self.model.training
                self.model.train()
                try:
                    exported = torch.export.export(wrapper, self.batch, dynamic_shapes=(tuple(
                        {0: rows} for _ in self.batch),), strict=False)
                    if not unbacked_symbols(exported.graph_module):
                        self._exported = exported
                except Exception:  # noqa: BLE001 - the model fixes its batch size: capture each size alone
                    pass
                finally:
                    self.model.train(was_training)
        return self._exported


def _specialized(model: nn.Module, exported: torch.export.ExportedProgram,
                 inputs: tuple[torch.Tensor, ...]) -> Program | None:
    """``exported``'s graph at ``inputs``' shapes, its size computations folded; None where
    some shape stays symbolic."""
    graph = fx.Graph()
    out = graph.graph_copy(exported.graph, {})
    graph.output(out)
    gm = fx.GraphModule(exported.graph_module, graph)
    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
    user = iter(inputs)
    args = []
    with mode:
        for node, spec in zip(gm.graph.find_nodes(op="placeholder"), exported.graph_signature.input_specs):
            like = next(user) if spec.kind is InputKind.USER_INPUT else node.meta["val"]
            grad = spec.kind is InputKind.PARAMETER and exported.state_dict[spec.target].requires_grad
            if not all(isinstance(d, int) for d in like.shape):
                return None
            args.append(torch.empty_strided(tuple(like.shape), tuple(like.stride()), dtype=like.dtype,
                                            device=like.device).requires_grad_(grad))
    try:
        FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*args)
    except Exception:  # noqa: BLE001 - a shape the dynamic graph cannot take: capture it alone
        return None
    # What a static capture records beside the values: the inputs' own (FakeTensorProp
    # keeps detached copies, without requires_grad), each value's TensorMetadata, no
    # value on the output.
    for node, arg in zip(gm.graph.find_nodes(op="placeholder"), args):
        node.meta["val"] = arg
    for node, before in zip(gm.graph.nodes, exported.graph.nodes):
        if "tensor_meta" in before.meta and isinstance(node.meta.get("val"), torch.Tensor):
            node.meta["tensor_meta"] = _extract_tensor_metadata(node.meta["val"])._replace(
                requires_grad=before.meta["tensor_meta"].requires_grad)  # as traced, not as detached
        if "val" not in before.meta:
            node.meta.pop("val", None)
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in _ASSERTS and not node.users:
            gm.graph.erase_node(node)
        elif node.target in _SIZE_OPS and isinstance(node.meta.get("val"), int):
            value = node.meta["val"]
            for use in list(node.users):
                use.args = fx.node.map_arg(use.args, lambda n: value if n is node else n)
                use.kwargs = fx.node.map_arg(use.kwargs, lambda n: value if n is node else n)
            gm.graph.erase_node(node)
    if any(_symbolic(n.meta.get("val")) for n in gm.graph.nodes):
        return None
    gm.recompile()
    # ``_to_program`` reads the export's signature, state and constants, and this graph.
    return _to_program(model, SimpleNamespace(graph_signature=exported.graph_signature, graph_module=gm,
                                              state_dict=exported.state_dict, constants=exported.constants), inputs)


def _same_but_sizes(program: Program, reference: Program) -> bool:
    """The same nodes (names, ops, targets, argument structure) as ``reference``, the
    integers in the arguments aside: the sizes are what differs between row counts."""
    nodes, ref = list(program.graph_module.graph.nodes), list(reference.graph_module.graph.nodes)
    return len(nodes) == len(ref) and all(
        (a.name, a.op, a.target) == (b.name, b.op, b.target) and _without_ints(a.args) == _without_ints(b.args)
        and _without_ints(a.kwargs) == _without_ints(b.kwargs) for a, b in zip(nodes, ref))


def _without_ints(args: object) -> object:
    if isinstance(args, (tuple, list)):
        return tuple(_without_ints(a) for a in args)
    if isinstance(args, dict):
        return {k: _without_ints(v) for k, v in args.items()}
    if isinstance(args, fx.Node):
        return args.name
    return int if isinstance(args, int) and not isinstance(args, bool) else args


def _symbolic(val: object) -> bool:
    if isinstance(val, (tuple, list)):
        return any(_symbolic(v) for v in val)
    if isinstance(val, torch.Tensor):
        return any(not isinstance(d, int) for d in val.shape)
    return isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool))

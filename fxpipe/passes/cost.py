"""Cost annotation: FLOPs and bytes per node, from shapes alone.

Every number comes from the FakeTensor shapes export records in ``node.meta["val"]``,
so the pass runs on meta-device captures of paper-scale models.

Conventions (they are the ones of Megatron's model-FLOPs formula,
72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h)), Narayanan et al. SC21 §5.1):
- a matrix multiply of (M×K)·(K×N) costs 2·M·N·K forward; its backward computes
  the input and the weight gradient, 2× the forward;
- fused attention counts its two matmuls, Q·Kᵀ and P·V, over the full s×s score
  matrix (the formula does not halve for causal masking);
- element-wise and reduction ops count one FLOP per output element in
  ``other_flops``; they are memory bound and enter the time model through bytes.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
import torch.fx as fx

from fxpipe.base.dtypes import itemsize
from fxpipe.base.op_cost import NodeCost
from fxpipe.ir.compile_context import CompileContext
from fxpipe.ir.op_tables import VIEW_OPS
from fxpipe.ir.program import ParamKind, Program
from fxpipe.ir.sizes import concrete, numel

aten = torch.ops.aten


def _tensors(val: Any) -> list[torch.Tensor]:
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (tuple, list)):
        return [t for v in val for t in _tensors(v)]
    return []


def _nbytes(val: Any, hints: Mapping[str, int] = {}) -> int:  # noqa: B006 (read only)
    return sum(numel(t, hints) * itemsize(t.dtype) for t in _tensors(val))


def _val(arg: Any) -> Any:
    return arg.meta.get("val") if isinstance(arg, fx.Node) else None


def _matmul_flops(node: fx.Node, hints: Mapping[str, int]) -> int:
    """2·(output elements)·K for linear/mm/bmm/matmul-like ops; K from the weight/right operand."""
    out = node.meta["val"]
    target = node.target
    if target in (aten.addmm.default, aten.baddbmm.default):
        left = _val(node.args[1])
    else:
        left = _val(node.args[0])
    k = concrete(left.shape[-1], hints)
    return 2 * numel(out, hints) * k


def _sdpa_flops(node: fx.Node, hints: Mapping[str, int]) -> int:
    q, k, v = (_val(a) for a in node.args[:3])
    lq, e = concrete(q.shape[-2], hints), concrete(q.shape[-1], hints)
    lk, ev = concrete(k.shape[-2], hints), concrete(v.shape[-1], hints)
    batch = numel(q, hints) // max(lq * e, 1)
    return 2 * batch * lq * lk * e + 2 * batch * lq * lk * ev


_MATMUL: dict[Any, Callable[[fx.Node, Mapping[str, int]], int]] = {
    aten.linear.default: _matmul_flops,
    aten.mm.default: _matmul_flops,
    aten.addmm.default: _matmul_flops,
    aten.bmm.default: _matmul_flops,
    aten.baddbmm.default: _matmul_flops,
    aten.matmul.default: _matmul_flops,
    aten.scaled_dot_product_attention.default: _sdpa_flops,
    aten._scaled_dot_product_flash_attention.default: _sdpa_flops,
    aten._scaled_dot_product_efficient_attention.default: _sdpa_flops,
    aten._scaled_dot_product_flash_attention_for_cpu.default: _sdpa_flops,
}


# Composite ops that materialise an intermediate as large as an input: its write and
# read-back are traffic the op's own inputs and outputs do not show. cross_entropy_loss
# writes the log-softmax of its logits (log_softmax + nll_loss), a [tokens, V] tensor
# as large as the logits themselves.
_INTERMEDIATE = {aten.cross_entropy_loss.default: 0}
"""op -> index of the argument whose size the intermediate has."""


def node_cost(node: fx.Node, hints: Mapping[str, int] = {}  # noqa: B006 (read only)
              ) -> tuple[int, int, int, int, int]:
    """(fwd matmul FLOPs, bwd matmul FLOPs, other FLOPs, out bytes, memory traffic bytes).
    ``hints`` prices data-dependent sizes (``Program.size_hints``, fxpipe/ir/sizes.py)."""
    val = node.meta.get("val")
    out_bytes = _nbytes(val, hints)
    if node.op != "call_function":
        return 0, 0, 0, out_bytes, 0
    if node.target in _MATMUL:
        fwd = _MATMUL[node.target](node, hints)
        traffic = out_bytes + sum(_nbytes(_val(a), hints) for a in node.args[:3])
        return fwd, 2 * fwd, 0, out_bytes, traffic
    if node.target in VIEW_OPS or node.target.__name__ == "getitem" or not _tensors(val):
        return 0, 0, 0, out_bytes, 0
    traffic = out_bytes + sum(_nbytes(_val(a), hints) for a in node.args if isinstance(a, fx.Node))
    if node.target in _INTERMEDIATE:
        traffic += _nbytes(_val(node.args[_INTERMEDIATE[node.target]]), hints)
    other = sum(numel(t, hints) for t in _tensors(val))
    return 0, 0, other, out_bytes, traffic


def cost_pass(program: Program, ctx: CompileContext | None = None) -> Program:
    """Annotate every node with a :class:`NodeCost`; parameters' bytes go to their first reader."""
    param_bytes = {p.node: p.nbytes for p in program.params if p.kind is ParamKind.PARAMETER}
    seen: set[str] = set()
    costs: dict[str, NodeCost] = {}
    for node in program.graph.nodes:
        fwd, bwd, other, out_b, traffic = node_cost(node, program.size_hints)
        owned = 0
        for arg in node.all_input_nodes:
            if arg.name in param_bytes and arg.name not in seen:
                seen.add(arg.name)
                owned += param_bytes[arg.name]
        costs[node.name] = NodeCost(fwd_flops=fwd, bwd_flops=bwd, other_flops=other,
                                    out_bytes=out_b, mem_bytes=traffic, param_bytes=owned)
    return program.replace(costs=costs)


def total_cost(program: Program) -> NodeCost:
    """Sum over all nodes (fields add)."""
    cs = program.costs.values()
    return NodeCost(*(sum(getattr(c, f) for c in cs) for f in NodeCost.__dataclass_fields__))

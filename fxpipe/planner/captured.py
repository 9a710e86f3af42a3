"""The planner's shape read off a captured graph: ``fxpipe plan`` for any model ``fxpipe
run`` takes (registry, ``hf:``, ``zoo:``, ``module:fn``, a model directory).

The model is built on the meta device (no weights) and captured for one sequence; its
graph says what the paper-scale planner prices (``TransformerShape``): the layers
(``Program.layers``, the repeated blocks the capture found), dropout (a dropout op with
p > 0: the planner counts its masks), the hidden size and the
vocabulary (the token embedding's table, ``aten.embedding(weight [V, h], ids)``), the
attention heads (the second dimension of the queries an attention op reads:
``scaled_dot_product_attention``'s, or the scores a softmax normalises, [b, a, s, s])
and the sequence length (the token ids'). The graph's own FLOPs and parameter count are
kept beside the shape's, so a model that is not a GPT stack (gated MLPs, grouped
queries, experts) says how far the planner's formulas are from it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from fxpipe.compiler.pipeline import capture_for
from fxpipe.ir.parallel_config import ParallelConfig
from fxpipe.ir.program import Program
from fxpipe.models.registry import build_workload
from fxpipe.passes.node_cost import cost_pass, total_cost
from fxpipe.planner.shapes import TransformerShape, model_flops_formula

aten = torch.ops.aten
_ATTENTION = {aten.scaled_dot_product_attention.default, aten._scaled_dot_product_flash_attention.default,
              aten._scaled_dot_product_efficient_attention.default,
              aten._scaled_dot_product_flash_attention_for_cpu.default}
_SOFTMAX = {aten._softmax.default, aten.softmax.int, aten._safe_softmax.default}
_DROPOUT = {aten.native_dropout.default, aten.dropout.default}


@dataclass(frozen=True)
class CapturedShape:
    """A captured model as the planner sees it, and how close a GPT stack is to it."""
    shape: TransformerShape
    graph_params: int
    """Parameters the captured graph holds."""
    graph_flops: float
    """Training FLOPs of one sequence by the cost pass over the captured graph."""
    formula_flops: float
    """The same by the SC21 formula on ``shape`` (72·s·l·h²(1 + s/6h + V/12lh))."""
    seconds: float
    """Building and capturing the model."""

    def describe(self) -> str:
        s = self.shape
        return (f"captured {s.name} on meta in {self.seconds:.1f} s: l={s.layers} h={s.hidden} a={s.heads} "
                f"s={s.seq} V={s.vocab}; its graph has {self.graph_params / 1e9:.3g}B parameters "
                f"({self.graph_params / s.num_params:.3f}× a GPT stack of this shape) and "
                f"{self.graph_flops / self.formula_flops:.3f}× the SC21 formula's FLOPs per sequence")


def captured_shape(model: str, *, seq: int | None = None, layers: int | None = None) -> CapturedShape:
    """Build ``model`` on the meta device, capture it for one sequence and read its shape."""
    start = time.perf_counter()
    w = build_workload(model, batch=1, seq=seq, device="meta", layers=layers)
    program = capture_for(w.model, w.example_inputs, ParallelConfig(), w.loss_fn)
    return shape_of(program, model, seconds=time.perf_counter() - start)


def shape_of(program: Program, name: str, *, seconds: float = 0.0) -> CapturedShape:
    """The planner's shape of a captured program (module docstring); a ValueError names
    what the graph lacks."""
    embedding = heads = None
    dropout = False
    for node in program.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in _DROPOUT and len(node.args) > 1 and isinstance(node.args[1], float) and node.args[1] > 0:
            dropout = True  # each dropout keeps a mask: the planner's activation memory counts them
        if node.target is aten.embedding.default and embedding is None:
            embedding = node
        elif heads is None and node.target in _ATTENTION:
            heads = _dim(node.args[0], 1, 4)
        elif heads is None and node.target in _SOFTMAX:
            val = node.args[0].meta.get("val") if hasattr(node.args[0], "meta") else None
            if val is not None and val.dim() == 4 and val.shape[-1] == val.shape[-2]:
                heads = int(val.shape[1])
    if embedding is None:
        raise ValueError(f"{name}: no token embedding (aten.embedding) in the captured graph; the planner "
                         f"prices token models")
    table, ids = embedding.args[0].meta["val"], embedding.args[1].meta["val"]
    if heads is None:
        raise ValueError(f"{name}: no attention in the captured graph (scaled_dot_product_attention, or a "
                         f"softmax over [b, a, s, s] scores); the planner prices transformer stacks")
    layer_ids = set(program.layers.values())
    if not layer_ids:
        raise ValueError(f"{name}: the capture found no repeated layers to stack")
    vocab, hidden = int(table.shape[0]), int(table.shape[1])
    seq = int(ids.shape[-1])
    shape = TransformerShape(name=name, layers=len(layer_ids), hidden=hidden, heads=heads, seq=seq, vocab=vocab,
                             dropout=dropout)
    whole = total_cost(cost_pass(program))
    sequences = int(ids.numel() // seq)
    return CapturedShape(shape=shape, graph_params=program.num_parameters(),
                         graph_flops=(whole.fwd_flops + whole.bwd_flops) / sequences,
                         formula_flops=model_flops_formula(1, seq, len(layer_ids), hidden, vocab),
                         seconds=seconds)


def _dim(node, dim: int, rank: int) -> int | None:
    val = node.meta.get("val") if hasattr(node, "meta") else None
    return int(val.shape[dim]) if val is not None and val.dim() == rank else None

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
kept beside the shape's.

What is priced is the captured model's own layer, not a GPT of its shape: the weight
matrices of one layer as the graph's ``aten.linear`` / ``mm`` nodes read them (grouped
queries' narrower key/value projections, a gated MLP's three matrices, any width), its
vector parameters, whether attention is one ``scaled_dot_product_attention`` call (a
flash kernel: no s×s activation) or an unfused softmax, a separate LM head or a tied one,
learned positions or none, and the real vocabulary. The layers repeat, so a model of more
than ``CAPTURE_LAYERS`` layers is captured with that many and the count extrapolated:
capture time and memory stay bounded whatever the depth (a 10^6-layer config captures
as fast as a 2-layer one). Experts (3-D weights) are not priced here.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from fxpipe.compiler.pipeline import capture_for
from fxpipe.ir.parallel_config import ParallelConfig
from fxpipe.ir.program import Program
from fxpipe.models.registry import build_workload
from fxpipe.passes.cost import cost_pass, total_cost
from fxpipe.models.hf_dir import config_layers, is_model_dir, load_config
from fxpipe.models.registry import GPT_CONFIGS
from fxpipe.planner.graph_layer import kv_heads, read_layer
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
        gqa = f" kv heads {s.kv_heads}" if s.kv_heads and s.kv_heads != s.heads else ""
        mlp = f" {'gated ' if s.gated_mlp else ''}MLP f={s.ffn}"
        attn = "SDPA (flash)" if s.fused_attention else "unfused softmax"
        return (f"captured {s.name} on meta in {self.seconds:.1f} s: l={s.layers} h={s.hidden} a={s.heads}{gqa} "
                f"s={s.seq} V={s.vocab},{mlp}, attention {attn}, head {'tied' if s.tied_head else 'untied'}; "
                f"{self.graph_params / 1e9:.3g}B parameters (the priced shape {s.num_params / 1e9:.3g}B), "
                f"{self.graph_flops / self.formula_flops:.3f}× the FLOPs of a GPT of its l, h, s, V "
                f"(SC21 formula)")


CAPTURE_LAYERS = 2
"""Layers captured of a deeper model: the stack repeats, the rest is extrapolated."""


def model_layers(model: str) -> int | None:
    """The layer count of a registry GPT or a model directory's config without building it
    (None: other kinds, which are small or user code, captured whole)."""
    if model in GPT_CONFIGS:
        return GPT_CONFIGS[model].n_layer
    if is_model_dir(model):
        return config_layers(load_config(model))
    return None


def default_seq(model: str) -> int | None:
    """A model directory's own context (``max_position_embeddings``, at most ``MAX_DEFAULT_SEQ``:
    Llama 3.1's 131072 is a long-context extension, not its training length); None: the
    registry's own."""
    if is_model_dir(model):
        text = load_config(model).get_text_config()
        return min(int(getattr(text, "max_position_embeddings", 0) or 2048), MAX_DEFAULT_SEQ)
    return None


MAX_DEFAULT_SEQ = 8192


def captured_shape(model: str, *, seq: int | None = None, layers: int | None = None) -> CapturedShape:
    """Build ``model`` on the meta device, capture it for one sequence and read its shape
    (at most ``CAPTURE_LAYERS`` of its layers, the count extrapolated)."""
    start = time.perf_counter()
    full = layers or model_layers(model)
    captured = min(full, CAPTURE_LAYERS) if full else None
    w = build_workload(model, batch=1, seq=seq or default_seq(model), device="meta", layers=captured)
    program = capture_for(w.model, w.example_inputs, ParallelConfig(), w.loss_fn)
    return shape_of(program, model, seconds=time.perf_counter() - start, layers=full)


def shape_of(program: Program, name: str, *, seconds: float = 0.0, layers: int | None = None) -> CapturedShape:
    """The planner's shape of a captured program (module docstring); a ValueError names
    what the graph lacks. ``layers``: the model's full depth when fewer were captured."""
    embedding = heads = attention = None
    dropout = False
    for node in program.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in _DROPOUT and len(node.args) > 1 and isinstance(node.args[1], float) and node.args[1] > 0:
            dropout = True  # each dropout keeps a mask: the planner's activation memory counts them
        if node.target is aten.embedding.default and embedding is None:
            embedding = node
        elif heads is None and node.target in _ATTENTION:
            heads, attention = _dim(node.args[0], 1, 4), node
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
    layer = read_layer(program, min(layer_ids), hidden, embedding)
    shape = TransformerShape(name=name, layers=layers or len(layer_ids), hidden=hidden, heads=heads, seq=seq,
                             vocab=vocab, dropout=dropout, fused_attention=attention is not None,
                             kv_heads=kv_heads(attention, layer.linears, hidden, heads), **layer.fields())
    costed = cost_pass(program)
    whole = total_cost(costed)
    sequences = int(ids.numel() // seq)
    # the captured layers' FLOPs and parameters, scaled to the full depth
    extra = shape.layers - len(layer_ids)
    per_layer_flops = sum(c.fwd_flops + c.bwd_flops for n, c in costed.costs.items()
                          if n in costed.layers) / len(layer_ids)
    params = program.num_parameters() + extra * layer.params
    return CapturedShape(shape=shape, graph_params=int(params),
                         graph_flops=(whole.fwd_flops + whole.bwd_flops + extra * per_layer_flops) / sequences,
                         formula_flops=model_flops_formula(1, seq, shape.layers, hidden, vocab),
                         seconds=seconds)


def _dim(node, dim: int, rank: int) -> int | None:
    val = node.meta.get("val") if hasattr(node, "meta") else None
    return int(val.shape[dim]) if val is not None and val.dim() == rank else None

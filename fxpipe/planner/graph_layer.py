"""One captured layer as the planner prices it: its weight matrices, as the graph's matmul
nodes use them, and what the rest of the model adds (a separate LM head, learned positions).

A 2-D parameter read by ``aten.linear`` (or through a transpose) is stored [out, in]; one
read directly by ``mm``/``addmm``/``matmul`` (GPT-2's Conv1D) is [in, out]. From the
matrices of the first captured layer: the MLP's width f is the input of the matrix that
returns to the hidden width from another (the down projection), the MLP is gated when two
matrices (or one fused, 2f wide) go from h to f, and a key/value projection narrower than
h gives grouped queries' kv heads. What no matrix says (norms, biases) is counted as the
layer's vector parameters.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from fxpipe.ir.program import ParamKind, Program

aten = torch.ops.aten
_TRANSPOSED = {aten.t.default, aten.transpose.int, aten.permute.default}
_DIRECT = {aten.mm.default, aten.addmm.default, aten.matmul.default, aten.bmm.default}


@dataclass(frozen=True, kw_only=True)
class LayerRead:
    """One layer's matrices and what they imply, read off the graph."""

    linears: tuple[tuple[int, int], ...]
    """(in, out) features of each weight matrix of the layer, in graph order."""
    vector_params: int
    """The layer's other parameters (norm weights, biases)."""
    ffn_hidden: int | None
    gated_mlp: bool
    tied_head: bool
    """The LM head reads the token embedding's table."""
    position_table: bool
    """Another table outside the layers (learned positions)."""

    @property
    def params(self) -> int:
        return sum(i * o for i, o in self.linears) + self.vector_params

    def fields(self) -> dict:
        """The ``TransformerShape`` fields this read fills."""
        return dict(linears=self.linears, layer_vector_params=self.vector_params, ffn_hidden=self.ffn_hidden,
                    gated_mlp=self.gated_mlp, tied_head=self.tied_head, position_table=self.position_table)


def _orientation(node: fx.Node) -> bool | None:
    """True: the matrix is [out, in]; False: [in, out]; None: no matmul reads it."""
    for user in node.users:
        if user.target is aten.linear.default or user.target in _TRANSPOSED:
            return True
        if user.target in _DIRECT:
            return False
    return None


def read_layer(program: Program, layer_id: int, hidden: int, embedding: fx.Node) -> LayerRead:
    """The matrices of layer ``layer_id`` and the model's tables (module docstring)."""
    info = {p.node: p for p in program.params if p.kind is ParamKind.PARAMETER}
    table = embedding.args[0]
    linears, vectors, others = [], 0, 0
    for node in program.graph.nodes:
        if node.op != "placeholder" or node.name not in info:
            continue
        where = {program.layers.get(u.name) for u in node.users}
        for u in node.users:  # a transpose node may sit outside the layer's tags: look one step on
            where |= {program.layers.get(v.name) for v in u.users} if u.target in _TRANSPOSED else set()
        shape = info[node.name].shape
        if layer_id in where:
            kind = _orientation(node) if len(shape) == 2 else None
            if kind is None:
                vectors += info[node.name].numel
            else:
                linears.append((shape[1], shape[0]) if kind else (shape[0], shape[1]))
        elif not (where - {None}) and len(shape) == 2 and node is not table:
            others += 1  # a separate head, or a learned position table
    down = [i for i, o in linears if o == hidden and i != hidden]
    ffn = down[0] if down else None
    gated = ffn is not None and (sum(1 for i, o in linears if i == hidden and o == ffn) >= 2
                                 or any(i == hidden and o == 2 * ffn for i, o in linears))
    head_reads_table = any(u.target is not aten.embedding.default and program.layers.get(u.name) is None
                           for u in table.users)
    tied = head_reads_table or program_ties(program)
    position = others - (0 if tied else 1) > 0
    return LayerRead(linears=tuple(linears), vector_params=vectors, ffn_hidden=ffn, gated_mlp=gated,
                     tied_head=tied, position_table=position)


def program_ties(program: Program) -> bool:
    """Whether any parameters share storage (the embedding and the head, in a language model)."""
    return any(p.tied_group is not None for p in program.params if p.kind is ParamKind.PARAMETER)


def kv_heads(attention: fx.Node | None, linears: tuple[tuple[int, int], ...], hidden: int, heads: int) -> int:
    """Key/value heads: the keys' second dimension at the attention op when fewer than the
    queries' (SDPA with ``enable_gqa``), else the width of a projection narrower than h over
    the head dimension (the keys repeated before SDPA, as transformers does without it)."""
    val = attention.args[1].meta.get("val") if attention is not None and hasattr(attention.args[1], "meta") else None
    if val is not None and val.dim() == 4 and 0 < int(val.shape[1]) < heads:
        return int(val.shape[1])
    head_dim = hidden // heads
    narrow = [o for i, o in linears if i == hidden and o < hidden and o % head_dim == 0]
    return narrow[0] // head_dim if narrow else heads

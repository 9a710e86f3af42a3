"""Activation recomputation, the regions found: FULL outlines whole layers keeping only
the layer input, SELECTIVE the attention core only (one call even when projections
interleave it), and the edges (no layers, mode names). The rewrite keeping loss and
gradients is test_recompute_rewrite.py; the bytes saved, test_recompute_memory.py.

Run: .venv/bin/python -m pytest tests/passes/test_recompute_regions.py -q
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpipe
from fxpipe.passes.recompute import RecomputeMode, RecomputeWarning, apply_recompute, regions_of
from tests.passes._recompute_programs import CASES, case_program, loss_and_grads, program

SELECTIVE, FULL = RecomputeMode.SELECTIVE, RecomputeMode.FULL
aten = torch.ops.aten


def test_full_regions_are_whole_layers_keeping_only_the_layer_input():
    prog, _ = program("gpt-tiny")
    gm = apply_recompute(prog.graph_module, prog.layers, FULL)
    regions = regions_of(gm)
    assert [r.layer for r in regions] == [0, 1]
    params = {p.node for p in prog.params}
    for r in regions:
        assert set(r.nodes) == {n for n, k in prog.layers.items() if k == r.layer}
        activations = [i for i in r.inputs if i not in params]
        assert len(activations) == 1, f"only the layer input is kept, got {activations}"
    assert [n.name for n in gm.graph.nodes if n.op == "placeholder"] == \
        [n.name for n in prog.graph.nodes if n.op == "placeholder"]


@pytest.mark.parametrize("name,dropout", CASES)
def test_selective_region_is_the_attention_core_only(name, dropout):
    """Between the QKV projections' outputs and the output projection's input: an
    SDPA kernel or the unfused softmax chain, no parameter, no projection."""
    prog, _ = case_program(name, dropout)
    gm = apply_recompute(prog.graph_module, prog.layers, SELECTIVE)
    regions = regions_of(gm)
    assert sorted(r.layer for r in regions) == sorted(set(prog.layers.values()))
    params = {p.node for p in prog.params}
    nodes = {n.name: n for n in prog.graph.nodes}
    kernels = {aten.scaled_dot_product_attention.default, aten.softmax.int, aten._softmax.default}
    for r in regions:
        targets = {nodes[n].target for n in r.nodes}
        assert targets & kernels
        assert not targets & {aten.linear.default, aten.addmm.default, aten.layer_norm.default}
        assert not set(r.inputs) & params
        assert all(nodes[i].target in (aten.linear.default, aten.addmm.default)
                   for i in r.inputs if prog.layers.get(i) == r.layer), "inputs: projection outputs"


# ---- model-agnostic edges ---------------------------------------------------------------------
def test_graph_without_layers_is_left_unchanged_with_a_note():
    lin = torch.nn.Linear(8, 8)
    prog = fxpipe.capture(lin, (torch.randn(4, 8), torch.randn(4, 8)),
                          loss_fn=lambda o, t: ((o - t) ** 2).mean())
    assert not prog.layers
    with pytest.warns(RecomputeWarning, match="no repeated layers"):
        assert apply_recompute(prog.graph_module, prog.layers, FULL) is prog.graph_module


def test_mode_names_and_errors():
    assert RecomputeMode.parse("Selective") is SELECTIVE
    with pytest.raises(ValueError, match="none, selective, full"):
        RecomputeMode.parse("partial")
    with pytest.raises(TypeError, match="RecomputeMode.parse"):
        apply_recompute(program("gpt-tiny")[0].graph_module, {}, "full")


class _TwistedBlock(nn.Module):
    """Attention where a projection reads the core before its kernel, and one takes a
    core value back into the core (as MLA's up-projection): the region must stay a
    single call, so the first is moved after it and the second's source left out."""

    def __init__(self, h: int = 32, n_head: int = 4) -> None:
        super().__init__()
        self.n_head = n_head
        self.q, self.k, self.o, self.side, self.kv_up = (nn.Linear(h, h) for _ in range(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        heads = lambda t: t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        merge = lambda t: t.transpose(1, 2).reshape(B, T, C)  # (B, T, C)
        q = heads(self.q(x))
        side = self.side(merge(q))
        k = heads(self.k(x))
        v = heads(self.kv_up(merge(k * 0.5)))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(merge(y)) + side


class _Twisted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_TwistedBlock() for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_selective_region_stays_one_call_when_projections_interleave_the_core():
    batch = (torch.randn(2, 8, 32), torch.randn(2, 8, 32))
    prog = fxpipe.capture(_Twisted(), batch, loss_fn=lambda o, t: ((o - t) ** 2).mean())
    gm = apply_recompute(prog.graph_module, prog.layers, SELECTIVE)
    regions = regions_of(gm)
    assert [r.layer for r in regions] == [0, 1]
    nodes = {n.name: n for n in prog.graph.nodes}
    for r in regions:
        # k's chain feeds kv_up, whose output re-enters the core: it stays outside.
        assert not any(nodes[n].target == aten.mul.Tensor for n in r.nodes)
        assert any(nodes[n].target == aten.scaled_dot_product_attention.default for n in r.nodes)
    ref_loss, ref_grads = loss_and_grads(prog, batch, prog.graph_module)
    loss, grads = loss_and_grads(prog, batch, gm)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    for k in ref_grads:
        torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-5, atol=1e-7, msg=k)

"""Activation recomputation keeps the loss and every gradient of the unmodified graph:
in one process, on every rank of an emulated tensor-parallel group with TP dropout,
per pipeline stage with a layer cut across two stages (B and zero-bubble I+W), and
through the compile pipeline's pass. The regions are checked in
test_recompute_regions.py; the bytes saved, test_recompute_memory.py.

Run: .venv/bin/python -m pytest tests/passes/test_recompute_rewrite.py -q
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from fxpipe.ir.compile_context import CompileContext
from fxpipe.ir.parallel_config import ParallelConfig
from fxpipe.ir.recompute_region import CheckpointedRegion
from fxpipe.passes.lint import lint_plan
from fxpipe.passes.recompute import RecomputeMode, apply_recompute, recompute_pass, regions_of
from fxpipe.passes.split import split_program
from fxpipe.runtime.stage_runner import StageRunner
from tests.passes._recompute_programs import (CASES, case_program, fresh_args, loss_and_grads, program,
                                              two_stage_plan)
from tests.passes._recompute_tp import loss_and_grads_per_rank, tp_program

SELECTIVE, FULL = RecomputeMode.SELECTIVE, RecomputeMode.FULL
aten = torch.ops.aten
TP = 2


@pytest.mark.parametrize("mode", [SELECTIVE, FULL], ids=lambda m: m.value)
@pytest.mark.parametrize("name,dropout", CASES)
def test_loss_and_gradients_equal_unmodified_graph(name, dropout, mode):
    prog, batch = case_program(name, dropout)
    gm = apply_recompute(prog.graph_module, prog.layers, mode)
    assert regions_of(gm), "something was outlined"
    ref_loss, ref_grads = loss_and_grads(prog, batch, prog.graph_module)
    loss, grads = loss_and_grads(prog, batch, gm)
    if dropout:  # the comparison is only meaningful if the masks are really random
        other, _ = loss_and_grads(prog, batch, prog.graph_module, seed=7)
        assert other != ref_loss
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    assert grads.keys() == ref_grads.keys() and len(grads) == len(prog.trainable())
    for k in ref_grads:  # recomputation reruns the same kernels: equal up to fp32 rounding
        torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-5, atol=1e-7, msg=k)


# ---- tensor parallelism: every rank of an emulated group (threads, tests/passes/_recompute_tp.py) ----
@pytest.mark.parametrize("mode", [SELECTIVE, FULL], ids=lambda m: m.value)
@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_tp_recompute_keeps_loss_and_gradients_with_tp_dropout(sp, mode):
    """Residual-branch dropout p = 0.1 (``fxpipe_tp.dropout``), attention dropout off: the
    emulated ranks share torch's global generator, so SDPA's own dropout is not replayable
    across threads; the TP streams are per rank and must be."""
    prog, batch, _ = tp_program("gpt-tiny", 64, 0.1, tp=TP, sp=sp, attn_dropout=False)
    ref = loss_and_grads_per_rank(prog, batch, prog.graph_module)
    out = loss_and_grads_per_rank(prog, batch, apply_recompute(prog.graph_module, prog.layers, mode))
    for rank, ((loss, grads), (ref_loss, ref_grads)) in enumerate(zip(out, ref)):
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
        assert grads.keys() == ref_grads.keys()
        for k in ref_grads:
            torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-5, atol=1e-7, msg=f"rank {rank}: {k}")


# ---- pipeline stages: a layer cut across two stages, run by the StageRunner ----------------------
def _run_stages(plan, batch, split_backward: bool):
    state = {k: t.detach().clone().requires_grad_(t.requires_grad) for k, t in plan.program.state.items()}
    runners = [StageRunner(plan, st, state) for st in plan.stages]
    torch.manual_seed(5)
    sent = {}
    for r in runners:
        sent.update(r.forward(0, batch, sent))
    grads = {}
    for r in reversed(runners):
        if split_backward:  # zero-bubble I then W: two autograd passes over a retained graph
            grads.update(r.backward_input(0, grads))
            r.backward_weight(0)
        else:
            grads.update(r.backward(0, grads))
    return runners[-1].losses[0], {k: t.grad for k, t in state.items() if t.grad is not None}


@pytest.mark.parametrize("split_backward", [False, True], ids=["B", "I+W"])
@pytest.mark.parametrize("mode", [SELECTIVE, FULL], ids=lambda m: m.value)
def test_per_stage_recompute_with_a_layer_cut_across_stages(mode, split_backward):
    prog, batch = program("gpt-tiny", 0.1)
    sdpa = [n.name for n in prog.graph.nodes if n.target == aten.scaled_dot_product_attention.default]
    plan = two_stage_plan(prog, cut_after=sdpa[1])  # layer 1 is cut right after its attention core
    rewritten = dataclasses.replace(plan, stages=tuple(
        dataclasses.replace(st, graph_module=apply_recompute(st.graph_module, plan.program.layers, mode))
        for st in plan.stages))
    layers_per_stage = [[r.layer for r in regions_of(st.graph_module)] for st in rewritten.stages]
    assert layers_per_stage == ([[0, 1], [1]] if mode is FULL else [[0, 1], []])
    ref_loss, ref_grads = _run_stages(plan, batch, split_backward)
    loss, grads = _run_stages(rewritten, batch, split_backward)
    assert loss == ref_loss
    assert grads.keys() == ref_grads.keys()
    for k in ref_grads:
        torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-5, atol=1e-7, msg=k)


# ---- the pipeline's pass -----------------------------------------------------------------------
def test_recompute_pass_outlines_every_stage_and_keeps_the_loss():
    prog, batch = program("gpt-tiny")
    plan = split_program(prog, {n.name: 0 for n in prog.graph.nodes if n.op == "call_function"}, num_stages=1)
    out = recompute_pass(plan, CompileContext.of(ParallelConfig(recompute="full")))
    lint_plan(out, after="recompute")
    (before,), (after,) = plan.stages, out.stages
    assert len(regions_of(after.graph_module)) == 2
    state, _ = fresh_args(prog, batch)
    assert after.call(state, plan.canonical, batch, {}) == before.call(state, plan.canonical, batch, {})
    assert recompute_pass(plan, CompileContext.of(ParallelConfig())) is plan


# ---- the rerun: once per backward pass, differentiating what that pass asks for --------------------
class _MatmulCount(torch.utils._python_dispatch.TorchDispatchMode):
    """Matrix multiplies dispatched, split by whether a region's body was running."""

    def __init__(self) -> None:
        super().__init__()
        self.inside = 0
        self.counts = {True: 0, False: 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (aten.mm, aten.addmm, aten.bmm):
            self.counts[self.inside > 0] += 1
        return func(*args, **(kwargs or {}))


def _passes(plan, batch):
    """Stage 1's forward, I and W matmul counts (outside, inside the bodies) and body runs."""
    state = {k: t.detach().clone().requires_grad_(t.requires_grad) for k, t in plan.program.state.items()}
    first, second = (StageRunner(plan, st, state) for st in plan.stages)
    sent = first.forward(0, batch, {})
    runs = [0]
    count = _MatmulCount()
    def enter(*_):
        runs[0] += 1
        count.inside += 1

    def leave(*_):
        count.inside -= 1

    for region in (m for m in second.stage.graph_module.modules() if isinstance(m, CheckpointedRegion)):
        region.body.register_forward_pre_hook(enter)
        region.body.register_forward_hook(leave)
    out = {}
    for name, call in (("F", lambda: second.forward(0, batch, sent)), ("I", lambda: second.backward_input(0, {})),
                       ("W", lambda: second.backward_weight(0))):
        before, ran = dict(count.counts), runs[0]
        with count:
            call()
        out[name] = (count.counts[False] - before[False], count.counts[True] - before[True], runs[0] - ran)
    return out


def test_a_recomputed_region_reruns_once_per_pass_and_computes_each_gradient_once():
    """Zero-bubble's I asks the engine for the activations' gradients only: the region's
    rerun must then skip its weight gradients (the same matmuls outside the body as the
    stage without recompute), and W reruns it once more and finishes from I's captured
    gradients (again the stage's own W matmuls). A region that differentiated every input
    in every pass would show I's weight-gradient matmuls here, and one whose W
    differentiated from scratch, the input-side matmuls inside it once more."""
    prog, batch = program("gpt-tiny")
    sdpa = [n.name for n in prog.graph.nodes if n.target == aten.scaled_dot_product_attention.default]
    plan = two_stage_plan(prog, cut_after=sdpa[0])  # stage 1: the rest of layer 0, all of layer 1
    full = dataclasses.replace(plan, stages=(plan.stages[0], dataclasses.replace(
        plan.stages[1], graph_module=apply_recompute(plan.stages[1].graph_module, plan.program.layers, FULL))))
    regions = len(regions_of(full.stages[1].graph_module))
    assert regions == 2
    bare, rec = _passes(plan, batch), _passes(full, batch)
    fwd_inside = rec["F"][1]
    assert fwd_inside > 0 and rec["F"][2] == regions  # the forward runs each body once
    assert rec["I"][2] == regions and rec["I"][1] == fwd_inside  # I: one rerun per region ...
    assert rec["I"][0] == bare["I"][0]  # ... and exactly the input-gradient matmuls of the stage
    assert rec["W"][2] == regions and rec["W"][1] == fwd_inside  # W: one more rerun per region ...
    assert rec["W"][0] == bare["W"][0]  # ... finishing from I's captured gradients: no input-side work again

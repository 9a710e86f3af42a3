"""Zero-bubble I/W split (base/backward_split.py): I then W gives exactly the
gradients of one fused backward, W never redoes I's work, I never touches ``.grad``."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fxpipe.passes.recompute import RecomputeMode
from fxpipe.base.backward_split import BackwardSplit
from fxpipe.runtime.stage_runner import StageRunner
from tests.runtime._stage_plans import stage_plan


class Shared(nn.Module):
    """A weight used twice (scale), a weight used by a view (l1.weight sliced), a
    product of a weight with itself, layer norm's affine pair and a tied pair."""

    def __init__(self):
        super().__init__()
        self.l1, self.ln, self.l2 = nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 16)
        self.scale = nn.Parameter(torch.randn(16))
        self.emb = nn.Embedding(10, 16)
        self.head = nn.Linear(16, 10, bias=False)
        self.head.weight = self.emb.weight  # tied inside one stage

    def forward(self, x, ids):
        h = F.gelu(self.ln(self.l1(x + self.emb(ids))))
        y = self.l2(h) * self.scale + x @ self.l1.weight.t()[:16, :16] * (self.scale * self.scale)
        return y, (self.head(y) ** 2).mean() + (y * self.scale).sum()


class NoInputPath(nn.Module):
    """Parameters only, no received activation: everything is W's."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x, ids):
        out = self.a(torch.ones(4, 8))
        return out, out.sum()


def _grads(model, split):
    torch.manual_seed(1)
    x = torch.randn(4, 16).requires_grad_(True)
    ids = torch.randint(0, 10, (4,))
    for p in model.parameters():
        p.grad = None
    y, loss = model(x, ids)
    gy = torch.randn_like(y)
    if split:
        s = BackwardSplit([y, loss], [gy, None], [x], list(model.parameters()))
        (gx,) = s.backward_input()
        assert all(p.grad is None for p in model.parameters()), "I accumulated a weight gradient"
        s.backward_weight()
    else:
        torch.autograd.backward([y, loss], [gy, torch.ones(())])
        gx = x.grad
    return gx, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("cls", [Shared, NoInputPath])
def test_split_equals_fused_backward(cls):
    torch.manual_seed(0)
    model = cls()
    gx_fused, fused = _grads(model, split=False)
    gx_split, split = _grads(model, split=True)
    if gx_fused is None:
        assert gx_split is None
    else:
        torch.testing.assert_close(gx_split, gx_fused, rtol=0, atol=0)
    assert fused.keys() == split.keys()
    for n in fused:  # same kernels on the same values: bitwise equal up to summation order
        torch.testing.assert_close(split[n], fused[n], rtol=1e-6, atol=1e-7, msg=n)


@pytest.mark.parametrize("name,recompute", [("hf:gpt2", RecomputeMode.NONE), ("hf:llama", RecomputeMode.SELECTIVE),
                                            ("gpt-tiny", RecomputeMode.FULL)])
def test_stage_runner_split_matches_backward(name, recompute):
    """Both stages of a real model, through StageRunner: B versus I + W."""
    w, plan = stage_plan(name, recompute)
    state = {n: t.detach().clone().requires_grad_(t.requires_grad) for n, t in plan.program.state.items()}
    results = {}
    for mode in ("fused", "split"):
        for t in state.values():
            t.grad = None
        runners = [StageRunner(plan, s, state) for s in plan.stages]
        sent = runners[0].forward(0, w.example_inputs, {})
        runners[1].forward(0, w.example_inputs, sent)
        if mode == "fused":
            back = runners[1].backward(0, {})
            runners[0].backward(0, back)
        else:
            back = runners[1].backward_input(0, {})
            runners[0].backward_input(0, back)
            runners[1].backward_weight(0)
            runners[0].backward_weight(0)
        results[mode] = (back, {n: t.grad.clone() for n, t in state.items() if t.grad is not None})
    (b_f, g_f), (b_s, g_s) = results["fused"], results["split"]
    assert b_f.keys() == b_s.keys() and g_f.keys() == g_s.keys() and g_f
    for n in b_f:
        torch.testing.assert_close(b_s[n], b_f[n], rtol=0, atol=0)
    for n in g_f:
        torch.testing.assert_close(g_s[n], g_f[n], rtol=1e-5, atol=1e-7, msg=n)


def test_weight_half_does_not_rerun_input_work():
    """FLOPs: I + W does exactly B's arithmetic (the old W re-walked the input-gradient
    path and did ~1.6x B in all), and W holds the weight-gradient half of it."""
    from torch.utils.flop_counter import FlopCounterMode

    w, plan = stage_plan("hf:gpt2")
    state = {n: t.detach().clone().requires_grad_(t.requires_grad) for n, t in plan.program.state.items()}
    last = StageRunner(plan, plan.stages[1], state)
    sent = StageRunner(plan, plan.stages[0], state).forward(0, w.example_inputs, {})
    flops = {}
    for mode in ("B", "I", "W"):
        if mode != "W":
            last.forward(0, w.example_inputs, sent)
        with FlopCounterMode(display=False) as counter:
            if mode == "B":
                last.backward(0, {})
            elif mode == "I":
                last.backward_input(0, {})
            else:
                last.backward_weight(0)
        flops[mode] = counter.get_total_flops()
    assert flops["B"] > 0 and flops["I"] > 0 and flops["W"] > 0
    assert flops["I"] + flops["W"] == flops["B"]

"""Cost pass: totals against Megatron's closed-form model-FLOPs formula."""
import pytest
import torch

import fxpipe
from fxpipe.models import build_workload
from fxpipe.passes import cost_pass, total_cost
from fxpipe.planner.shapes import model_flops_formula
from fxpipe.passes.cost import node_cost


@pytest.mark.parametrize("name,batch,seq", [("gpt2-small", 2, 256), ("gpt-small", 4, 256)])
def test_gpt_flops_match_formula(name, batch, seq):
    w = build_workload(name, batch=batch, seq=seq, device="meta")
    prog = cost_pass(fxpipe.capture(w.model, w.example_inputs))
    c, cfg = total_cost(prog), w.config
    ref = model_flops_formula(batch, seq, cfg.n_layer, cfg.n_embd, cfg.vocab_size)
    assert abs((c.fwd_flops + c.bwd_flops) / ref - 1) < 0.02
    assert c.bwd_flops == 2 * c.fwd_flops


def test_hf_gpt2_conv1d_flops_match_formula():
    """HF GPT-2 uses Conv1D (addmm) and an unfused attention path; same formula."""
    w = build_workload("hf:gpt2", batch=2, seq=32, device="meta")
    prog = cost_pass(fxpipe.capture(w.model, w.example_inputs, w.loss_fn))
    c = total_cost(prog)
    ref = model_flops_formula(2, 32, 2, 64, 128)
    assert abs((c.fwd_flops + c.bwd_flops) / ref - 1) < 0.02


def test_linear_node_cost_by_hand():
    lin = torch.nn.Linear(32, 48)
    x = torch.randn(3, 5, 32)
    prog = cost_pass(fxpipe.capture(lin, (x, torch.randn(3, 5, 48)),
                                    loss_fn=lambda o, t: ((o - t) ** 2).mean()))
    (node,) = [n for n in prog.call_nodes() if n.target == torch.ops.aten.linear.default]
    fwd, bwd, _, out_bytes, _ = node_cost(node)
    assert fwd == 2 * 3 * 5 * 48 * 32 and bwd == 2 * fwd
    assert out_bytes == 3 * 5 * 48 * 4
    assert prog.costs[node.name].param_bytes == (32 * 48 + 48) * 4
    assert sum(c.param_bytes for c in prog.costs.values()) == (32 * 48 + 48) * 4

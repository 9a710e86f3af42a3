"""Split-matmul pass: exact rewrite, chosen by cost share alone, and it lets the
partitioner balance a model whose LM head outweighs half of it."""
import pytest
import torch
import torch.nn as nn

import fxpipe
from fxpipe.compiler.driver import run_passes
from fxpipe.passes import cost_pass
from fxpipe.passes.assign_stages import PartitionConfig, solve_partition
from fxpipe.passes.split_matmul import BLOCKS_PER_SHARE, MAX_BLOCKS, split_matmuls
from tests.runtime._wide_vocab import workload

aten = torch.ops.aten


def _program(model, batch, loss_fn=None):
    program, _ = run_passes(fxpipe.capture(model, batch, loss_fn))
    return program


def _loss_and_grads(program, batch):
    for t in program.state.values():
        t.grad = None
    loss = program.run(program.state, *batch)
    loss.backward()
    return loss.detach(), {n: t.grad.clone() for n, t in program.state.items() if t.grad is not None}


@pytest.fixture(scope="module")
def wide():
    model, batch, loss_fn = workload(batch=2)
    return _program(model, batch, loss_fn), batch


def test_wide_head_is_cut_exactly(wide):
    program, batch = wide
    split = cost_pass(split_matmuls(program, 2))
    heads = [n for n in split.graph.nodes if n.target is aten.linear.default
             and split.module_paths.get(n.name, "").startswith("lm_head[")]
    # Blocks: ceil(share · BLOCKS_PER_SHARE · S) for the head's share of the matmul FLOPs;
    # each its own key.
    costs = program.costs
    total = sum(c.fwd_flops + c.bwd_flops for c in costs.values())
    head = max((n for n in program.graph.nodes if n.target is aten.linear.default),
               key=lambda n: costs[n.name].fwd_flops)
    share = (costs[head.name].fwd_flops + costs[head.name].bwd_flops) / total
    assert share > 0.5 and len(heads) == min(MAX_BLOCKS, -(-share * BLOCKS_PER_SHARE * 2 // 1))
    assert len({split.module_paths[n.name] for n in heads}) == len(heads)
    loss0, g0 = _loss_and_grads(program, batch)
    loss1, g1 = _loss_and_grads(split, batch)
    torch.testing.assert_close(loss1, loss0, rtol=0, atol=0)
    assert g0.keys() == g1.keys()
    for n in g0:  # only the summation order of dx over blocks differs
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-5, atol=1e-7, msg=n)


def test_small_ops_are_left_alone(wide):
    program, _ = wide
    assert split_matmuls(program, 1) is program  # one stage: nothing to balance
    from fxpipe.models import build_workload
    w = build_workload("hf:gpt2", batch=2, seq=16)
    tiny = _program(w.model, w.example_inputs, w.loss_fn)
    assert split_matmuls(tiny, 2) is tiny  # no matmul above a quarter of the FLOPs


class WideMiddle(nn.Module):
    """Small layers around one projection that holds ~90% of the FLOPs."""

    def __init__(self):
        super().__init__()
        self.small = nn.ModuleList(nn.Linear(256, 256) for _ in range(4))
        self.big = nn.Linear(256, 8192)

    def forward(self, x):
        for layer in self.small:
            x = torch.tanh(layer(x))
        return self.big(x).square().mean()


def test_blocks_let_the_partition_balance():
    """With the projection whole, one stage holds most of the work; cut, the ILP spreads it."""
    torch.manual_seed(0)
    program = _program(WideMiddle(), (torch.randn(256, 256),))
    config = PartitionConfig(num_stages=2, stage_to_rank=(0, 1), inflight=(2, 1))
    _, whole = solve_partition(program, config)
    split = cost_pass(split_matmuls(program, 2))
    assignment, cut = solve_partition(split, config)
    assert whole.balance_ratio > 1.6
    assert cut.balance_ratio < 1.25
    blocks = {assignment[n.name] for n in split.graph.nodes if n.target is aten.linear.default
              and split.module_paths.get(n.name, "").startswith("big[")}
    assert blocks == {0, 1}  # the projection's blocks run on both stages


class Conv1DHead(nn.Module):
    """Conv1D-style layers (weight [in, out], addmm) with a wide output and a bias."""

    def __init__(self):
        super().__init__()
        self.w1, self.b1 = nn.Parameter(torch.randn(16, 16) * 0.1), nn.Parameter(torch.zeros(16))
        self.w2, self.b2 = nn.Parameter(torch.randn(16, 1000) * 0.1), nn.Parameter(torch.randn(1000) * 0.1)

    def forward(self, x, y):
        h = torch.tanh(torch.addmm(self.b1, x, self.w1))
        return nn.functional.cross_entropy(torch.addmm(self.b2, h, self.w2), y)


def test_addmm_with_bias_is_cut_exactly():
    torch.manual_seed(0)
    batch = (torch.randn(8, 16), torch.randint(0, 1000, (8,)))
    program = _program(Conv1DHead(), batch)
    split = cost_pass(split_matmuls(program, 2))
    assert sum(1 for n in split.graph.nodes if n.target is aten.addmm.default) > 2
    loss0, g0 = _loss_and_grads(program, batch)
    loss1, g1 = _loss_and_grads(split, batch)
    torch.testing.assert_close(loss1, loss0, rtol=1e-6, atol=1e-7)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-5, atol=1e-7, msg=n)

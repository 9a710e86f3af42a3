"""Blockwise cross-entropy: the rewrite equals the whole-vocabulary loss (value and
gradients), no node reads all of the logits, and losses it does not cover are left alone."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fxpipe.passes import lint_program
from fxpipe.passes.split_loss import blockwise_loss
from fxpipe.passes.split_matmul import split_matmuls
from tests.passes._split_loss_cases import Head, LOSSES, V, _batch, _loss_and_grads, _program, _shifted

aten = torch.ops.aten


class ScaledHead(Head):
    """A per-class scale and a bias of their own after the head: parameters [V] each
    block reads its rows of."""

    def __init__(self, bias=False):
        super().__init__(bias)
        self.scale, self.out_bias = nn.Parameter(1 + torch.rand(V)), nn.Parameter(torch.randn(V) * 0.1)

    def forward(self, x):
        return self.out_bias + super().forward(x) * self.scale


@pytest.mark.parametrize("name, bias, head", [(n, False, Head) for n in LOSSES] +
                         [("softcap-temperature-view", True, Head), ("mean", False, ScaledHead)])
def test_blockwise_loss_is_exact(name, bias, head):
    loss_fn, ignored = LOSSES[name]
    program = _program(loss_fn, ignored, bias, head)
    blocked = blockwise_loss(split_matmuls(program, 2))
    lint_program(blocked, after="split_loss")
    (rewrite,) = blocked.loss_splits
    assert len(rewrite.blocks) == len(blocked.matmul_splits[0].blocks) > 2
    batch = _batch(ignored)
    loss0, g0 = _loss_and_grads(program, batch)
    loss1, g1 = _loss_and_grads(blocked, batch)
    torch.testing.assert_close(loss1, loss0, rtol=1e-6, atol=1e-6)
    assert g0.keys() == g1.keys()
    for n in g0:  # fp32 round-off of another summation order, relative to the gradient's scale
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-5, atol=1e-6 * float(g0[n].abs().max()), msg=n)


def test_no_node_reads_the_whole_vocabulary():
    blocked = blockwise_loss(split_matmuls(_program(LOSSES["mean"][0]), 2))
    for node in blocked.graph.nodes:
        if node.op != "call_function":
            continue
        assert node.target is not aten.cat.default
        for v in (node.meta["val"], *(a.meta["val"] for a in node.all_input_nodes if a.op == "call_function")):
            # only the head's weight is [V, H]; activations are [.., block] or [tokens]
            assert not (isinstance(v, torch.Tensor) and v.dim() and v.shape[-1] == V), node.format_node()
    # Each block's loss share is keyed like its matmul, so coarsening keeps them together.
    (rewrite,) = blocked.loss_splits
    for block in rewrite.blocks:
        assert {blocked.module_paths[n] for n in block.nodes} == {blocked.module_paths[block.logits]}


def test_other_losses_are_left_alone():
    smoothed = split_matmuls(_program(lambda out, y: F.cross_entropy(*_shifted(out, y), label_smoothing=0.1)), 2)
    assert blockwise_loss(smoothed) is smoothed
    weighted = split_matmuls(_program(lambda out, y: F.cross_entropy(*_shifted(out, y), weight=torch.ones(V))), 2)
    assert blockwise_loss(weighted) is weighted

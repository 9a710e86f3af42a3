"""The split-loss tests' model, batch and losses, shared with the coalesced-block tests."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
import fxpipe
from fxpipe.compiler.driver import run_passes


V, H = 1000, 16

class Head(nn.Module):
    """A small body and a wide LM head: the head is cut into blocks at pp=2."""

    def __init__(self, bias=False):
        super().__init__()
        self.body = nn.Linear(H, H)
        self.head = nn.Linear(H, V, bias=bias)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))  # (B, s, V)

def _shifted(logits, y):
    """Hugging Face's convention: position t predicts t+1; logits up-cast to fp32."""
    return logits[:, :-1].reshape(-1, V).float(), y[:, 1:].reshape(-1)

# name -> (loss_fn, the ignore_index two of the batch's targets hold)
LOSSES = {
    "mean": (lambda out, y: F.cross_entropy(*_shifted(out, y)), -100),
    # an ignore_index inside the vocabulary: it falls in one block and must still not count
    "sum-ignore-5": (lambda out, y: F.cross_entropy(*_shifted(out, y), reduction="sum", ignore_index=5), 5),
    "none": (lambda out, y: F.cross_entropy(*_shifted(out, y), reduction="none").square().mean(), -100),
    "log_softmax-nll": (lambda out, y: F.nll_loss(F.log_softmax(_shifted(out, y)[0], -1), _shifted(out, y)[1]),
                        -100),
    # element-wise ops of each logit (Gemma 2's softcap, a temperature) replayed per block;
    # the loss on a contiguous view
    "softcap-temperature-view": (lambda out, y: F.cross_entropy(
        (torch.tanh(out / 30.0) * 30.0 / 0.7)[:, :-1].contiguous().view(-1, V), y[:, 1:].contiguous().view(-1)), -100),
}

def _batch(ignored=-100):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 9, H, generator=g)
    y = torch.randint(0, V, (2, 9), generator=g)
    y[0, 3] = y[1, 5] = ignored
    return x, y

def _program(loss_fn, ignored=-100, bias=False, head=Head):
    torch.manual_seed(0)
    program, _ = run_passes(fxpipe.capture(head(bias), _batch(ignored), loss_fn))
    return program

def _loss_and_grads(program, batch):
    for t in program.state.values():
        t.grad = None
    loss = program.run(program.state, *batch)
    loss.backward()
    return loss.detach(), {n: t.grad.clone() for n, t in program.state.items() if t.grad is not None}

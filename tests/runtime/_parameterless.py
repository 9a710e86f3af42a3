"""A model whose middle third computes without parameters (importable by spawned ranks):
three equal parameter-free blocks between two small linears, so a 3-stage pipeline
balanced on time gives its middle rank no trainable parameter."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class MiddleWithoutParameters(nn.Module):
    def __init__(self, width: int = 16, blocks: int = 3) -> None:
        super().__init__()
        self.first, self.last = nn.Linear(width, width), nn.Linear(width, 4)
        self.blocks = blocks

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        for _ in range(self.blocks):  # parameter-free work: attention of the rows on themselves
            h = torch.softmax(h @ h.transpose(-1, -2) / h.shape[-1] ** 0.5, dim=-1) @ h
            h = torch.tanh(h)
        return F.cross_entropy(self.last(h).flatten(0, 1), y.flatten())


def build(batch: int = 6, seq: int = 64):
    torch.manual_seed(0)
    x = torch.randn(batch, seq, 16)
    y = torch.randint(0, 4, (batch, seq))
    return MiddleWithoutParameters(), (x, y), None


def train_each_rank(rank: int, world: int) -> dict:
    """pp=3 on the model above: what this rank holds, what it was warned, whether a flat
    AdamW refuses it, and the losses of two steps with a parameter-group AdamW."""
    import warnings

    from fxpipe.parallel import parallelize

    model, batch, _ = build()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = parallelize(model, example_inputs=batch, pp=3, microbatches=3, schedule="1f1b", costs="model")
    said = [str(w.message) for w in caught if "holds no trainable parameter" in str(w.message)]
    try:
        torch.optim.AdamW(pm.parameters(), lr=1e-2)
        flat = "accepted"
    except ValueError as exc:
        flat = str(exc)
    opt = torch.optim.AdamW([{"params": list(pm.parameters())}], lr=1e-2)
    losses = []
    for _ in range(2):
        losses.append(pm.train_step(batch))
        opt.step()
        opt.zero_grad()
    names = [n for n, _ in pm.named_parameters()]
    pm.close()
    return dict(names=names, said=said, flat=flat, losses=losses)


def reference_losses(steps: int = 2) -> list[float]:
    """The same two steps in one process."""
    model, (x, y), _ = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = []
    for _ in range(steps):
        loss = model(x, y)
        out.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    return out

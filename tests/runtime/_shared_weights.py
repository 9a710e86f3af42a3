"""A tiny model that applies one Linear twice, at its start and at its end.

A pipeline cut puts the two uses on different stages, so each stage's copy gets a
partial gradient that the runtime must sum (as for tied embeddings). Loaded by
name, ``tests.runtime._shared_weights:workload``, like any user model.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, WIDTH, LAYERS = 64, 32, 4


class ReusedLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.shared = nn.Linear(WIDTH, WIDTH)
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.shared(self.embed(ids)))
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        x = torch.tanh(self.shared(x))  # the same weight again, stages later
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def workload(batch: int = 8, seq: int = 16):
    torch.manual_seed(0)
    model = ReusedLinear()
    ids = torch.randint(0, VOCAB, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    return model, (ids[:, :-1].contiguous(), ids[:, 1:].contiguous())

"""Gloo cases for the hand-written models of tests/passes/_inplace_models.py (run in workers)."""
from __future__ import annotations

import torch

from tests.passes._inplace_models import LOCAL_MODELS

STEPS = 2
MICROBATCHES = 2


def reference(name: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, SGD: per-step losses and first-step gradients."""
    w = LOCAL_MODELS[name]()
    opt = torch.optim.SGD(w.model.parameters(), lr=0.1)
    losses, grads = [], {}
    for step in range(STEPS):
        opt.zero_grad()
        loss = w.model(*w.example_inputs)
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in w.model.named_parameters()}
        opt.step()
        losses.append(loss.item())
    return losses, grads


def train_local(rank: int, world: int, cases: list[dict]) -> list[dict]:
    from fxpipe.runtime.api import parallelize

    out = []
    for case in cases:
        w = LOCAL_MODELS[case["model"]]()
        pm = parallelize(w.model, pp=case.get("pp", 1), tp=case.get("tp", 1),
                         microbatches=MICROBATCHES, schedule=case.get("schedule", "1f1b"),
                         example_inputs=w.example_inputs, costs=case.get("costs", "model"))
        opt = torch.optim.SGD(pm.parameters(), lr=0.1)
        losses, grads = [], {}
        for step in range(STEPS):
            losses.append(pm.train_step(w.example_inputs))
            if step == 0:
                grads = pm.unshard_tp({n: t.grad.clone() for n, t in pm.named_parameters()})
            opt.step()
        out.append(dict(case=case, losses=losses, grads=grads))
    return out

"""Retarget the device constants export recorded while tracing.

Factory ops traced on one device keep it as a keyword (``aten.arange(..., device=cpu)``
for position ids, ``aten.ones(..., device=cpu)`` for masks). A graph captured on the
CPU and run on ``cuda:3`` would mix devices, so every such keyword is rewritten to
the device the stage runs on.
"""
from __future__ import annotations

import copy

import torch

from fxpipe.program import Program


def retarget_device_pass(program: Program, device: torch.device) -> Program:
    device = torch.device(device)
    gm = copy.deepcopy(program.graph_module)
    changed = 0
    for node in gm.graph.nodes:
        dev = node.kwargs.get("device")
        if isinstance(dev, torch.device) and dev != device:
            node.update_kwarg("device", device)
            changed += 1
    if not changed:
        return program
    gm.recompile()
    return program.replace(graph_module=gm)

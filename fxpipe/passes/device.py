"""Retarget the device constants export recorded while tracing.

Factory ops traced on one device keep it as an argument (``aten.arange(...,
device=cpu)`` for position ids, ``aten.to.device(x, cpu, ...)``, an autocast region's
device type). A graph captured on the CPU (or on the meta device, for deferred
initialisation) and run on ``cuda:3`` would mix devices, so every such argument —
in the graph and in higher-order ops' subgraphs — is rewritten to the device the
stage runs on.
"""
from __future__ import annotations

import copy

import torch

from fxpipe.ir.program import Program


def retarget_device_pass(program: Program, device: torch.device) -> Program:
    device = torch.device(device)
    gm = copy.deepcopy(program.graph_module)
    changed = 0
    # Subgraphs too: higher-order ops (autocast / grad-mode regions, e.g. a rotary
    # embedding computed with autocast off) keep their bodies as child GraphModules.
    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        count = 0
        for node in module.graph.nodes:
            # Keyword (``device=``) or positional (``aten.to.device(x, device, dtype)``).
            swapped = [0]

            def swap(a):
                if isinstance(a, torch.device) and a != device:
                    swapped[0] += 1
                    return device
                return a
            node.args = torch.fx.node.map_aggregate(node.args, swap)
            node.kwargs = torch.fx.node.map_aggregate(node.kwargs, swap)
            count += swapped[0]
            # An autocast region records the device *type* it was traced on.
            if node.target is torch.ops.higher_order.wrap_with_autocast and node.args \
                    and isinstance(node.args[0], str) and node.args[0] != device.type:
                node.args = (device.type, *node.args[1:])
                count += 1
        if count:
            module.recompile()
            changed += count
    if not changed:
        return program
    return program.replace(graph_module=gm)

"""Retarget the device constants export recorded while tracing.

Factory ops traced on one device keep it as an argument (``aten.arange(...,
device=cpu)`` for position ids, ``aten.to.device(x, cpu, ...)``, an autocast region's
device type). A graph captured on the CPU (or on the meta device, for deferred
initialisation) and run on ``cuda:3`` would mix devices, so every such argument —
in the graph and in higher-order ops' subgraphs — is rewritten to the device the
stage runs on.

Code that branches on the device while it is traced keeps the branch of the device it
was traced on: a model captured on meta (deferred initialisation) takes its GPU branch,
e.g. ``torch.histc`` of integer expert ids counting tokens per expert, which the CPU
kernel does not implement. For a CPU stage such a histc counts the ids as float32
(exact below 2^24 per bin) and casts the counts back: the values the other branch
computes.
"""
from __future__ import annotations

import copy

import torch

from fxpipe.base.op_cost import NodeCost
from fxpipe.ir.compile_context import CompileContext
from fxpipe.ir.program import Program

aten = torch.ops.aten
_FLOAT_HISTC_ONLY = ("cpu", "mps")
"""Devices whose histc kernel takes floating-point input only."""


def _float_histc(graph: torch.fx.Graph, costs: dict[str, NodeCost]) -> int:
    """Every histc of an integer tensor counts it as float32 and casts back (module docstring)."""
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.histc.default:
            continue
        x, out = node.args[0], node.meta.get("val")
        val = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
        if val is None or val.dtype.is_floating_point:
            continue
        with graph.inserting_before(node):
            as_float = graph.call_function(aten._to_copy.default, (x,), {"dtype": torch.float32})
        node.args = (as_float, *node.args[1:])
        with graph.inserting_after(node):
            back = graph.call_function(aten._to_copy.default, (node,), {"dtype": val.dtype})
        node.replace_all_uses_with(back, delete_user_cb=lambda user: user is not back)
        as_float.meta["val"] = val.to(torch.float32)
        if out is not None:
            back.meta["val"], node.meta["val"] = out, out.to(torch.float32)
        for new, like in ((as_float, val), (back, out)):
            size = like.numel() * 4 if like is not None else 0
            costs[new.name] = NodeCost(fwd_flops=0, bwd_flops=0, other_flops=0, out_bytes=size, mem_bytes=2 * size,
                                       param_bytes=0)
        count += 1
    return count


def device_pass(program: Program, ctx: CompileContext) -> Program:
    """Device constants captured on cpu/meta -> the device the stages run on (``ctx.device``)."""
    return retarget_device(program, ctx.device)


def retarget_device(program: Program, device: torch.device) -> Program:
    """The rewrite itself, for any device (``causality`` reads a meta capture on the cpu)."""
    device = torch.device(device)
    if not _retargets(program.graph_module, device):
        return program  # what the rewrite below returns then, without copying the graph first
    gm = copy.deepcopy(program.graph_module)
    costs = dict(program.costs)
    changed = _float_histc(gm.graph, costs) if device.type in _FLOAT_HISTC_ONLY else 0
    if changed:
        gm.recompile()
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
    return program.replace(graph_module=gm, costs=costs)


def _retargets(gm: torch.fx.GraphModule, device: torch.device) -> bool:
    """Whether ``retarget_device`` changes anything in ``gm``: an integer histc on a device
    that counts floats only, a device argument other than ``device``, an autocast region
    of another device type. Read-only: the search's prefixes (``planner/layout_costs.py``)
    mostly run on the device they were captured on, and copying the graph (its FakeTensor
    values too) costs more than the pass."""
    def other(a) -> bool:
        found = [False]

        def look(x):
            found[0] |= isinstance(x, torch.device) and x != device
            return x
        torch.fx.node.map_aggregate(a, look)
        return found[0]

    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            if module is gm and device.type in _FLOAT_HISTC_ONLY and node.target is aten.histc.default:
                x = node.args[0]
                val = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
                if val is not None and not val.dtype.is_floating_point:
                    return True
            if other(node.args) or other(node.kwargs):
                return True
            if node.target is torch.ops.higher_order.wrap_with_autocast and node.args \
                    and isinstance(node.args[0], str) and node.args[0] != device.type:
                return True
    return False

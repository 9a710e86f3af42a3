"""Grad-mode and autocast regions opened for the TP pass, and autocast closed again after.

torch.export records ``torch.no_grad()`` / ``torch.set_grad_enabled`` and
``torch.autocast`` blocks inside forward as higher-order ops
(``wrap_with_set_grad_enabled`` / ``wrap_with_autocast``: a call with the block's graph
as a submodule). To the channel rules such a call is one opaque op. Both modes are
properties of each op in the block, not of the block as a whole, so a block may be
inlined and cut into smaller blocks of the same mode without changing what it computes:

- ``set_grad_enabled(True)``: inlined as is (training runs with grad enabled);
- ``set_grad_enabled(False)``: inlined with its floating-point results detached, so no
  gradient flows back through the block, as in no-grad mode: the same values, the same
  gradients. Its floating-point inputs are detached too, except the parameters and
  buffers it reads (graph placeholders): what depends only on activations records no
  autograd graph, and a weight read in the block stays a plain projection to the channel
  rules (its block records a graph the detached result drops at once). An input the
  block returns untouched keeps its gradient (no-grad mode returns it as is). A no-grad
  block holding a grad-enabled block stays closed (the inner block's gradient would be
  cut);
- ``autocast``: inlined with the mode written into each op's meta (``MODE``), and after
  the rewrite every maximal run of consecutive ops of one mode is wrapped again
  (``close_regions``): a run of consecutive nodes of a topological order is convex, so
  it can be one call. Ops the rewrite adds (collectives) run outside autocast, which
  does not touch them anyway. Disabled autocast is inlined as is.

Nothing else changes: torch.export's own passes (``replace_set_grad_with_hop_pass``,
``replace_autocast_with_hop_pass``) go the other way, from ops to regions; their
``node_inline_`` takes ``call_module`` nodes only.
"""
from __future__ import annotations

import copy
import operator
from contextlib import ExitStack

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from fxpipe.ir.program import Program
from fxpipe.ir.subgraph import boundary
from fxpipe.passes.canonicalize import _ASSERTS  # dropped from the bodies as from the graph

aten = torch.ops.aten
SET_GRAD = torch.ops.higher_order.wrap_with_set_grad_enabled
AUTOCAST = torch.ops.higher_order.wrap_with_autocast
MODE = "fxpipe_autocast"
"""Node meta key: the autocast arguments (device_type, dtype, enabled, cache_enabled) of
every autocast block the op ran inside, outermost first."""
_STEM = "autocast_region"



def _body(gm: fx.GraphModule, node: fx.Node) -> tuple[fx.GraphModule, tuple]:
    """The region's graph and the operands its placeholders take."""
    first = 1 if node.target is SET_GRAD else 4
    return getattr(gm, node.args[first].target), node.args[first + 1:]


def _enables_grad(gm: fx.GraphModule) -> bool:
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in (SET_GRAD, AUTOCAST):
            sub, _ = _body(gm, node)
            if (node.target is SET_GRAD and node.args[0]) or _enables_grad(sub):
                return True
    return False


def _may_open(gm: fx.GraphModule, node: fx.Node) -> bool:
    if node.op != "call_function" or node.target not in (SET_GRAD, AUTOCAST):
        return False
    if not all(u.target is operator.getitem for u in node.users):
        return False
    if node.target is SET_GRAD and not node.args[0]:
        return not _enables_grad(_body(gm, node)[0])
    return True


def _is_float(node: fx.Node) -> bool:
    v = node.meta.get("val")
    return isinstance(v, torch.Tensor) and v.dtype.is_floating_point


def _fresh_attr(gm: fx.GraphModule, stem: str) -> str:
    i = 0
    while hasattr(gm, f"{stem}_{i}"):
        i += 1
    return f"{stem}_{i}"


def _inline(gm: fx.GraphModule, hop: fx.Node, paths: dict[str, str], layers: dict[str, int]) -> None:
    graph = gm.graph
    sub, operands = _body(gm, hop)
    no_grad = hop.target is SET_GRAD and not hop.args[0]
    stack = tuple(hop.meta.get(MODE, ()))
    if hop.target is AUTOCAST and hop.args[2]:
        stack += (tuple(hop.args[:4]),)
    here, layer = paths.get(hop.name, ""), layers.get(hop.name)
    outer = list((hop.meta.get("nn_module_stack") or {"": ("", None)}).values())[-1][0]

    def place(new: fx.Node, old: fx.Node) -> None:
        if stack:
            new.meta[MODE] = stack
        # The body's own module path, relative to the region's, when export kept it.
        inner = list((old.meta.get("nn_module_stack") or {"": ("", None)}).values())[-1][0]
        paths[new.name] = here + inner[len(outer):] if inner.startswith(outer) and inner else here
        if layer is not None:
            layers[new.name] = layer

    env: dict[fx.Node, fx.Node] = {}
    passed: dict[fx.Node, fx.Node] = {}
    with graph.inserting_before(hop):
        for ph, value in zip((n for n in sub.graph.nodes if n.op == "placeholder"), operands):
            passed[ph] = value
            env[ph] = value
            if no_grad and isinstance(value, fx.Node) and _is_float(value) and value.op != "placeholder":
                env[ph] = graph.call_function(aten.detach.default, (value,))
                env[ph].meta["val"] = value.meta["val"]
                place(env[ph], hop)
        for node in sub.graph.nodes:
            if node.op in ("placeholder", "output") or node.target in _ASSERTS:
                continue
            if node.op == "get_attr":  # a nested region's graph (or a constant): to the parent
                name = _fresh_attr(gm, node.target)
                setattr(gm, name, getattr(sub, node.target))
                env[node] = graph.get_attr(name)
                env[node].meta = copy.copy(node.meta)
                continue
            env[node] = graph.node_copy(node, lambda a: env[a])
            place(env[node], node)
        (out,) = [n for n in sub.graph.nodes if n.op == "output"]
        results = [passed.get(r, env.get(r)) for r in out.args[0]]
        for i, r in enumerate(out.args[0]):
            if no_grad and r not in passed and _is_float(results[i]):
                results[i] = graph.call_function(aten.detach.default, (results[i],))
                results[i].meta["val"] = r.meta["val"]
                place(results[i], hop)
    attr = hop.args[1 if hop.target is SET_GRAD else 4]
    for user in list(hop.users):
        user.replace_all_uses_with(results[user.args[1]])
        graph.erase_node(user)
    graph.erase_node(hop)
    if not attr.users:
        graph.erase_node(attr)


def open_regions(program: Program) -> Program:
    """``program`` with every region the module docstring allows inlined (itself when none)."""
    gm = program.graph_module
    if not any(_may_open(gm, n) for n in gm.graph.nodes):
        return program
    gm = copy.deepcopy(gm)
    paths, layers = dict(program.module_paths), dict(program.layers)
    while (hop := next((n for n in gm.graph.nodes if _may_open(gm, n)), None)) is not None:
        _inline(gm, hop, paths, layers)
    for name, child in list(gm.named_children()):
        if isinstance(child, fx.GraphModule) and not any(
                n.op == "get_attr" and n.target == name for n in gm.graph.nodes):
            delattr(gm, name)
    gm.recompile()
    live = {n.name for n in gm.graph.nodes}
    return program.replace(graph_module=gm, module_paths={k: v for k, v in paths.items() if k in live},
                           layers={k: v for k, v in layers.items() if k in live})


def close_regions(gm: fx.GraphModule, paths: dict[str, str], layers: dict[str, int]) -> None:
    """Wrap every maximal run of consecutive ops of one autocast mode in its region call,
    innermost modes first (an outer run then holds the inner calls whole)."""
    if not any(MODE in n.meta for n in gm.graph.nodes):
        return
    while depth := max((len(n.meta.get(MODE, ())) for n in gm.graph.nodes), default=0):
        run: list[fx.Node] = []
        for node in list(gm.graph.nodes):
            if node.op == "get_attr":
                continue  # no inputs: never breaks a run
            mode = node.meta.get(MODE, ()) if node.op == "call_function" else ()
            if run and mode != run[0].meta[MODE]:
                _outline(gm, run, paths, layers)
                run = []
            if len(mode) == depth:
                run.append(node)
    gm.recompile()
    live = {n.name for n in gm.graph.nodes}
    for table in (paths, layers):
        for name in [k for k in table if k not in live]:
            del table[name]


def _outline(gm: fx.GraphModule, run: list[fx.Node], paths: dict[str, str], layers: dict[str, int]) -> None:
    members = set(run)
    inputs, outputs = boundary(run)
    root = torch.nn.Module()
    body = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for a in inputs:
        if a.op == "get_attr":  # a nested region's graph: held by this region's module
            setattr(root, a.target, getattr(gm, a.target))
            env[a] = body.get_attr(a.target)
        else:
            env[a] = body.placeholder(a.name)
        env[a].meta = copy.copy(a.meta)
    for node in run:
        env[node] = body.node_copy(node, lambda a: env[a])
        del env[node].meta[MODE]
    body.output(tuple(env[o] for o in outputs))
    mode = run[0].meta[MODE]
    name = _fresh_attr(gm, _STEM)
    gm.add_submodule(name, fx.GraphModule(root, body))
    with gm.graph.inserting_before(run[0]):
        attr = gm.graph.get_attr(name)
        call = gm.graph.call_function(AUTOCAST, (*mode[-1], attr, *(a for a in inputs if a.op != "get_attr")))
        results = [gm.graph.call_function(operator.getitem, (call, i)) for i in range(len(outputs))]
    for new, like in [(attr, run[0]), (call, run[0]), *zip(results, outputs)]:
        if new in results:
            new.meta = copy.copy(like.meta)
        new.meta.pop(MODE, None)
        if len(mode) > 1:
            new.meta[MODE] = mode[:-1]
        paths[new.name] = paths.get(like.name, "")
        if like.name in layers:
            layers[new.name] = layers[like.name]
    for old, new in zip(outputs, results):
        old.replace_all_uses_with(new, delete_user_cb=lambda u: u not in members)
    for node in reversed(run):
        gm.graph.erase_node(node)
    for a in inputs:
        if a.op == "get_attr" and not a.users:
            gm.graph.erase_node(a)
            delattr(gm, a.target)


def refresh(gm: fx.GraphModule, outer: tuple = ()) -> None:
    """Shapes inside the region calls ``close_regions`` made, from their operands' shapes
    (the parent's propagation runs each call as one op), under the call's own modes."""
    for call in gm.graph.nodes:
        if call.target is not AUTOCAST or not call.args[4].target.startswith(_STEM):
            continue
        sub, values = getattr(gm, call.args[4].target), [a.meta.get("val") for a in call.args[5:]]
        fake = detect_fake_mode([v for v in values if isinstance(v, torch.Tensor)])
        if fake is None:
            continue
        modes = (*outer, tuple(call.args[:4]))
        with ExitStack() as stack:
            for m in modes:
                stack.enter_context(torch.autocast(*m))
            FakeTensorProp(sub, fake).propagate_dont_convert_inputs(*values)
        refresh(sub, modes)

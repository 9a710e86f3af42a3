"""Expert parallelism: every grouped MoE's experts owned by the ranks of an expert group.

Found from the graph's structure alone (no module or parameter name is read): a
group of grouped matmuls (``aten._grouped_mm`` or an op with its schema, as Hugging
Face's ``grouped_mm_fallback``) that share one offsets tensor ``offs`` (E,) and read
stacked (E, ., .) parameters. Between the first one's input ``x`` (tokens sorted by
expert, one row per routed token) and the last one's output, the experts' code is
row-wise (grouped matmuls, pointwise ops, slices along features), so it runs
unchanged on any rows with their ``offs``. The pass wraps that region:

    x, offs ──ep_dispatch──> the rank's experts' rows from every rank ──region (E/ep
    stacked experts)──> ep_combine ──> one output row per input row, in this rank's order

Routing (router, top-k, sort, counts) before it and the weighted combine after it
stay as they are, replicated on every rank of the group. Each rank holds experts
``[r·E/ep, (r+1)·E/ep)`` of every stack (``ShardKind.EXPERTS`` specs, per expert-
parallel rank). A MoE written otherwise (a loop over expert modules, a selected
expert of a stack, a dense bmm over all experts) is left data-parallel, with the reason.
"""
from __future__ import annotations

import copy
import operator

import torch
import torch.fx as fx

from fxpipe.ep.dispatch import ep_combine, ep_dispatch
from fxpipe.ir.compile_context import CompileContext
from fxpipe.ir.pass_configs import EPConfig
from fxpipe.ir.pass_results import EPResult, ExpertLayer
from fxpipe.ir.program import ParamKind, Program
from fxpipe.ir.shard_spec import ShardKind, ShardSpec
from fxpipe.passes.tensor_parallel.graph_ops import SPLITS, TRANSPOSES, arg, is_grouped_mm, is_pointwise, shape

aten = torch.ops.aten
_ROW_WISE = frozenset({aten.slice.Tensor, aten.narrow.default, *SPLITS})  # along features only


def _stacked_param(node: object, params: dict[str, str]) -> str | None:
    """The placeholder whose (E, ., .) stack ``node`` is, read through transposes of dims >= 1."""
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in TRANSPOSES:
        if node.target is aten.transpose.int and 0 in (node.args[1] % 3, node.args[2] % 3):
            return None
        if node.target is not aten.transpose.int:
            return None
        node = node.args[0]
    return node.name if isinstance(node, fx.Node) and node.name in params else None


def _feature_dim(n: fx.Node) -> bool:
    """Whether a slice / narrow / split / chunk cuts along a dim other than the rows."""
    index = 1 if n.target in (aten.slice.Tensor, aten.narrow.default) else 2
    return arg(n, index, "dim", 0) % len(shape(n.args[0])) != 0


def _region(first: fx.Node, last: fx.Node, x: fx.Node) -> list[fx.Node]:
    """Nodes that read ``x`` (directly or not) and feed ``last``, in graph order."""
    down, todo = set(), [x]
    while todo:
        for user in todo.pop().users:
            if user not in down:
                down.add(user)
                todo.append(user)
    up, todo = {last}, [last]
    while todo:
        for parent in todo.pop().all_input_nodes:
            if parent in down and parent not in up:
                up.add(parent)
                todo.append(parent)
    return [n for n in first.graph.nodes if n in up]


def _why_not(mms: list[fx.Node], region: list[fx.Node], x: fx.Node, offs: fx.Node, stacks: set[str],
             params: dict[str, str], experts: int) -> str | None:
    """Why this region cannot run on other ranks' rows (None: it can)."""
    rows = shape(x)[0]
    inside = set(region)
    for n in region:
        if n.op != "call_function":
            return f"{n.name} is not an op"
        if not (n in mms or is_pointwise(n.target) or n.target is operator.getitem or
                (n.target in _ROW_WISE and _feature_dim(n))):
            return f"{n.name} ({n.target}) is not row-wise"
        if n is not region[-1] and n not in mms and any(u not in inside for u in n.users):
            return f"{n.name} is read outside the experts"
        if n in mms and shape(n)[0] != rows:
            return f"{n.name} changes the number of rows"
    for name in stacks:
        node = next(p for p in x.graph.nodes if p.name == name)
        if shape(node)[0] != experts:
            return f"{params[name]} has {shape(node)[0]} experts, the offsets {experts}"
        readers = [u for u in node.users]
        while readers:
            u = readers.pop()
            if u.target in TRANSPOSES:
                readers.extend(u.users)
            elif u not in mms:
                return f"{params[name]} is read outside the grouped matmuls ({u.name})"
    return None


def _rows_alike(region: list[fx.Node], x: fx.Node, offs: fx.Node, params: dict[str, str]) -> list[fx.Node]:
    """Values from outside the region with a row per row of ``x`` (gpt-oss's per-expert
    biases gathered per token): dispatched with ``x``, the same route."""
    inside, rows, out = set(region), shape(x)[0], []
    for n in region:
        for parent in n.all_input_nodes:
            if parent in inside or parent is x or parent is offs or parent in out or parent.op != "call_function" \
                    or _stacked_param(parent, params) is not None:
                continue  # a parameter or buffer whose first size happens to equal the rows is not moved
            value = parent.meta.get("val")
            if isinstance(value, torch.Tensor) and value.ndim and shape(parent)[0] == rows:
                out.append(parent)
    return out


def _grouped_mms(graph: fx.Graph, params: dict[str, str]) -> dict[fx.Node, list[fx.Node]]:
    """Each MoE's grouped matmuls over stacked (E, ., .) weights, by the offsets they share."""
    groups: dict[fx.Node, list[fx.Node]] = {}
    for n in graph.nodes:
        if n.op == "call_function" and is_grouped_mm(n) and _stacked_param(n.args[1], params) is not None:
            groups.setdefault(n.args[2], []).append(n)
    return groups


def grouped_experts(program: Program) -> tuple[int, ...]:
    """Experts of each grouped MoE, in graph order: the MoEs ``shard_experts`` may
    own over ep ranks (empty: none; whether each can be is its own check)."""
    params = {p.node: p.canonical for p in program.params if p.kind is ParamKind.PARAMETER}
    return tuple(shape(offs)[0] for offs in _grouped_mms(program.graph, params))


def expert_parallel_pass(program: Program, ctx: CompileContext) -> Program:
    """``config.ep > 1``: every grouped MoE's experts owned by ep ranks (``shard_experts``);
    a model with none that can be is refused, rather than trained with ep ignored."""
    if ctx.config.ep == 1:
        return program
    out = shard_experts(program, ctx.expert_parallel)
    if not out.expert_parallel.layers:
        why = "; ".join(out.expert_parallel.skipped) or "no grouped matmul over stacked (E, ., .) weights"
        raise ValueError(f"ep={ctx.config.ep} but no MoE in the model can be expert-parallel ({why}); "
                         f"use ep=1 (expert parallelism needs experts as stacked weights run by grouped_mm)")
    return out


def shard_experts(program: Program, config: EPConfig) -> Program:
    """Wrap every grouped MoE's experts in dispatch / combine over ``config.ep`` ranks
    (see the module docstring); the result is ``program.expert_parallel``."""
    if config.ep == 1:
        return program
    gm = copy.deepcopy(program.graph_module)
    params = {p.node: p.canonical for p in program.params if p.kind is ParamKind.PARAMETER}
    groups = _grouped_mms(gm.graph, params)
    layers, specs, skipped = [], {}, []
    for offs, mms in groups.items():
        first, last, x = mms[0], mms[-1], mms[0].args[0]
        experts = shape(offs)[0]
        stacks = {_stacked_param(m.args[1], params) for m in mms}
        region = _region(first, last, x)
        why = _why_not(mms, region, x, offs, stacks, params, experts)
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        if why is None and order[offs] > order[region[0]]:
            why = f"the offsets {offs.name} are computed after the experts start ({region[0].name})"
        if why is None and experts % config.ep:
            divisors = [d for d in range(1, config.dp + 1) if config.dp % d == 0 and experts % d == 0]
            raise ValueError(f"{experts} experts do not split over ep={config.ep} ranks "
                             f"({', '.join(sorted(params[s] for s in stacks))}): choose ep among {divisors}")
        if why is not None:
            skipped.append(f"{last.name}: {why}")
            continue
        layer = len(layers)
        # Dispatch where the region starts: everything it moves must be computed by then.
        alike = _rows_alike(region, x, offs, params)
        if any(order[a] > order[region[0]] for a in alike):
            skipped.append(f"{last.name}: a value with a row per token is computed after the experts start")
            continue
        with gm.graph.inserting_before(region[0]):
            sent = gm.graph.call_function(ep_dispatch, (x, offs, layer, *alike))
            rows, offs_local, route, *moved = (gm.graph.call_function(operator.getitem, (sent, i))
                                               for i in range(3 + len(alike)))
        swap = {x: rows, offs: offs_local, **dict(zip(alike, moved))}
        for before, after in swap.items():
            if before is not offs:  # rows moved keep their meta (a data-dependent count either way)
                after.meta["val"] = before.meta.get("val")
        for n in region:
            n.args = tuple(swap.get(a, a) if isinstance(a, fx.Node) else a for a in n.args)
        with gm.graph.inserting_after(last):
            back = gm.graph.call_function(ep_combine, (last, route))
        back.meta["val"] = last.meta.get("val")
        last.replace_all_uses_with(back, delete_user_cb=lambda u: u is not back)
        per_rank = experts // config.ep
        for stack in sorted(stacks):
            info = next(p for p in program.params if p.node == stack)
            full = tuple(info.shape)
            specs[info.canonical] = ShardSpec(
                name=info.canonical, kind=ShardKind.EXPERTS, full_shape=full, local_shape=(per_rank, *full[1:]),
                dim=0, ranges=tuple(((r * per_rank, (r + 1) * per_rank),) for r in range(config.ep)),
                members=tuple(p.name for p in program.params if p.canonical == info.canonical),
                reason=f"experts of MoE layer {layer}, {per_rank} per expert-parallel rank")
        layers.append(ExpertLayer(layer, experts, tuple(sorted(params[s] for s in stacks)), sent.name))
    gm.graph.lint()
    gm.recompile()
    result = EPResult(config.ep, tuple(layers), specs, tuple(skipped))
    return program.replace(graph_module=gm, expert_parallel=result)

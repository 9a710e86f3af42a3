"""Stage construction: cut a stage-annotated Program into one GraphModule per stage.

Rules (docs/ARCHITECTURE.md, "Conventions"):
- a value that depends only on batch inputs, buffers and constants (position ids,
  causal masks, rotary tables) is recomputed in every stage that needs it, never sent;
  every rank can read the batch;
- any other value produced in stage a and read in stage b > a becomes an output of
  a and an input of b, sent directly (skip connections included);
- ``getitem`` on a multi-output op stays with its producer, so only tensors cross;
- parameters are placeholders of every stage that reads them; a tied group or a
  parameter read by several stages (one module applied in several places) is
  reported in ``PipelinePlan.tied_stages`` for gradient sync;
- the loss is the last stage's final output;
- the graph is functional (``passes/functionalize.py``); a node that still writes in
  place would be lost by a stage built from data edges, so it is refused by name. A
  buffer the forward writes (``Program.mutated_buffers``) is written back by every
  stage that holds it: each recomputes the new value when it depends only on
  batch, buffers and constants, else the one stage that computes it must be the
  only one holding the buffer.
"""
from __future__ import annotations

import operator
from typing import Mapping

import torch
import torch.fx as fx
from torch.fx import _lazy_graph_module

from fxpipe.ir.compile_context import CompileContext
from fxpipe.ir.program import ParamKind, Program, TensorSpec
from fxpipe.ir.sizes import is_dynamic
from fxpipe.ir.stage_plan import PipelinePlan, Stage, StageValue
from fxpipe.passes.aliasing import mutated_args


def _is_random(node: fx.Node) -> bool:
    tags = getattr(node.target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags


def side_values(program: Program) -> set[str]:
    """Nodes computable from batch inputs, buffers and constants alone (deterministically)."""
    free = set(program.inputs)
    free |= {p.node for p in program.params if p.kind is not ParamKind.PARAMETER}
    for node in program.graph.nodes:
        if node.op == "get_attr":
            free.add(node.name)
        elif node.op == "call_function" and not _is_random(node) and \
                all(a.name in free for a in node.all_input_nodes):
            free.add(node.name)
    return free


def _layout(t: torch.Tensor) -> tuple[int, ...] | None:
    """The strides of a non-row-major value (None if contiguous, or broadcast: a stride
    of 0 cannot be written into). Ops such as attention give outputs in their inputs'
    layout, and a later ``view`` in the graph may rely on it, so slices of a fused
    projection keep their gaps too."""
    if t.is_contiguous() or t.numel() <= 1:
        return None
    if any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape)):
        return None
    return tuple(t.stride())


def normalize_assignment(program: Program, assignment: Mapping[str, int]) -> dict[str, int]:
    """Move tuple projections next to their producer; check stages are ordered."""
    stage = dict(assignment)
    for node in program.graph.nodes:
        if node.op == "call_function" and node.target is operator.getitem:
            src = node.args[0]
            if src.name in stage:
                stage[node.name] = stage[src.name]
    for node in program.graph.nodes:
        if node.name not in stage:
            continue
        for user in node.users:
            if user.name in stage and stage[user.name] < stage[node.name]:
                raise ValueError(f"assignment is not ordered: {node.name} (stage {stage[node.name]}) "
                                 f"feeds {user.name} (stage {stage[user.name]})")
    return stage


def split_pass(program: Program, ctx: CompileContext) -> PipelinePlan:
    """The partitioned Program -> one GraphModule per stage of ``ctx.schedule`` (``split_program``)."""
    return split_program(program, num_stages=ctx.schedule.num_stages)


def split_program(program: Program, assignment: Mapping[str, int] | None = None,
                  num_stages: int | None = None) -> PipelinePlan:
    """Build the :class:`PipelinePlan`. ``assignment`` defaults to ``program.stages``."""
    assignment = normalize_assignment(program, assignment if assignment is not None else program.stages)
    num_stages = num_stages or (max(assignment.values()) + 1 if assignment else 1)
    graph = program.graph
    by_name = {n.name: n for n in graph.nodes}
    side = side_values(program)
    param_by_node = {p.node: p for p in program.params}
    batch_index = {name: i for i, name in enumerate(program.inputs)}
    output_node = next(n for n in graph.nodes if n.op == "output")
    outs = output_node.args[0]
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    writes = [n for n in graph.nodes if mutated_args(n)]
    if writes:
        raise ValueError(f"{program.source}'s graph still writes in place ({', '.join(f'{n.name}: {n.target}' for n in writes[:3])}); "
                         f"stages are built from data edges and would lose the write — capture "
                         f"functionalizes every in-place op (fxpipe/passes/functionalize.py)")
    loss_node = outs[program.loss_output]
    node_of = {p.name: p.node for p in program.params}
    updates = {node_of[b]: outs[i] for i, b in enumerate(program.mutated_buffers)}

    compute = [n for n in graph.nodes if n.op == "call_function" and n.name not in side]
    missing = [n.name for n in compute if n.name not in assignment]
    if missing:
        raise ValueError(f"{len(missing)} nodes have no stage, e.g. {missing[:3]}")
    if assignment.get(loss_node.name, num_stages - 1) != num_stages - 1:
        raise ValueError(f"the loss must be computed on the last stage ({num_stages - 1}), "
                         f"assignment puts it on {assignment[loss_node.name]}")

    # Which values cross which boundaries.
    consumers: dict[str, set[int]] = {}
    for node in compute:
        k = assignment[node.name]
        for arg in node.all_input_nodes:
            if arg.name in side or arg.op == "placeholder":
                continue
            if assignment[arg.name] != k:
                consumers.setdefault(arg.name, set()).add(k)
    values: dict[str, StageValue] = {}
    for name, cons in consumers.items():
        node = by_name[name]
        t = node.meta["val"]
        if is_dynamic(t):
            raise ValueError(
                f"{name} ({node.target}, shape {tuple(t.shape)}) would cross from stage "
                f"{assignment[name]} to {sorted(cons)}, but its size depends on the data; pipeline "
                f"transfers need static shapes — cut before its producer or after the op that "
                f"gives a fixed shape again (e.g. the index_add / scatter that combines routed "
                f"tokens)")
        assert isinstance(t, torch.Tensor), f"only tensors cross stages, {name} is {type(t)}"
        values[name] = StageValue(name=name, producer=assignment[name], consumers=tuple(sorted(cons)),
                                  spec=TensorSpec(tuple(t.shape), t.dtype),
                                  requires_grad=bool(t.requires_grad) or t.dtype.is_floating_point,
                                  tp_replicated=bool(node.meta.get("fxpipe_tp_replicated", False)),
                                  stride=_layout(t))

    stages = []
    param_stages: dict[str, list[int]] = {}
    writers = _buffer_writers(program, compute, assignment, side, updates, num_stages)
    for k in range(num_stages):
        mine = [n for n in compute if assignment[n.name] == k]
        stage, used_params = _build_stage(program, k, mine, side, values, param_by_node, batch_index,
                                          loss_node if k == num_stages - 1 else None,
                                          writers[k])
        stages.append(stage)
        for p in used_params:
            param_stages.setdefault(p, []).append(k)
    # A trainable tensor read by several stages gets a partial gradient on each, to be
    # summed by the runtime: tied names (embedding / LM head), and equally one module
    # applied in several places (weights shared across layers, a recurrent block).
    trainable = {p.canonical for p in program.trainable()}
    tied = {g: tuple(param_stages.get(g, ())) for g in program.tied_groups}
    tied.update({g: tuple(s) for g, s in param_stages.items() if len(s) > 1 and g in trainable})
    annotated = program.replace(stages={n.name: assignment[n.name] for n in compute})
    return PipelinePlan(program=annotated, stages=tuple(stages), values=values,
                        tied_stages=tied, param_stages={k: tuple(v) for k, v in param_stages.items()})


def _buffer_writers(program: Program, compute: list[fx.Node], assignment: Mapping[str, int],
                    side: set[str], updates: Mapping[str, fx.Node],
                    num_stages: int) -> list[dict[str, fx.Node]]:
    """Per stage: buffer placeholder -> the new value it writes back after its forward.

    Every stage that reads a buffer holds a copy, and each copy must see the write. A new
    value computed from batch, buffers and constants alone is recomputed by every holder
    (by the last stage when nobody else reads the buffer); one computed from parameters
    or activations exists on one stage only, which must then be the only holder."""
    writers: list[dict[str, fx.Node]] = [{} for _ in range(num_stages)]
    if not updates:
        return writers
    holders: dict[str, set[int]] = {}
    for node in compute:
        stack, seen = list(node.all_input_nodes), set()
        while stack:  # the node's inputs, through the side values it recomputes
            a = stack.pop()
            if a.name in seen:
                continue
            seen.add(a.name)
            if a.op == "placeholder":
                holders.setdefault(a.name, set()).add(assignment[node.name])
            elif a.name in side:
                stack.extend(a.all_input_nodes)
    for buf, new in updates.items():
        held = holders.get(buf, set())
        if new.name in side or new.op == "placeholder":
            for k in held or {num_stages - 1}:
                writers[k][buf] = new
            continue
        k = assignment[new.name]
        if held - {k}:
            raise ValueError(
                f"{program.source} writes buffer {buf} in forward with a value computed on stage {k} "
                f"from parameters or activations, but stage(s) {sorted(held - {k})} also read it; "
                f"pipeline stages cannot share such state — use pp=1")
        writers[k][buf] = new
    return writers


def _build_stage(program: Program, k: int, mine: list[fx.Node], side: set[str],
                 values: Mapping[str, StageValue], param_by_node, batch_index,
                 loss_node: fx.Node | None, updates: Mapping[str, fx.Node]) -> tuple[Stage, list[str]]:
    """Copy stage k's nodes (plus the side values they need) into a fresh graph."""
    src = program.graph
    by_name = {n.name: n for n in src.nodes}
    mine_names = {n.name for n in mine}
    # Side values this stage needs, transitively (its buffer writes' new values too).
    need: set[str] = set()
    stack = [a for n in mine for a in n.all_input_nodes if a.name in side]
    stack += [v for v in updates.values() if v.name in side]
    while stack:
        a = stack.pop()
        if a.name in need:
            continue
        need.add(a.name)
        stack.extend(a.all_input_nodes)
    received = [v for v in values.values() if k in v.consumers]
    received_names = {v.name for v in received}

    g = fx.Graph()
    env: dict[str, fx.Node] = {}
    params, batch, used_canonical = [], [], []
    # Placeholders in a fixed order: params, batch inputs, received values.
    for node in src.nodes:
        if node.op != "placeholder":
            continue
        used = any(u.name in mine_names or u.name in need for u in node.users) or node.name in updates
        if not used:
            continue
        if node.name in param_by_node:
            p = param_by_node[node.name]
            env[node.name] = g.placeholder(node.name)
            env[node.name].meta = dict(node.meta)
            params.append(p.name)
            if p.kind is ParamKind.PARAMETER:
                used_canonical.append(p.canonical)
    for node in src.nodes:
        if node.op == "placeholder" and node.name in batch_index and \
                any(u.name in mine_names or u.name in need for u in node.users):
            env[node.name] = g.placeholder(node.name)
            env[node.name].meta = dict(node.meta)
            batch.append(batch_index[node.name])
    for v in received:
        ph = g.placeholder(f"recv_{v.name}")
        ph.meta = dict(by_name[v.name].meta)
        env[v.name] = ph
    for node in src.nodes:
        if node.op in ("placeholder", "output") or node.name in received_names:
            continue
        if node.name in mine_names or node.name in need:
            env[node.name] = g.node_copy(node, lambda a: env[a.name])
    sent = [v.name for v in values.values() if v.producer == k]
    results = [env[name] for name in sent]
    results += [env[v.name] for v in updates.values()]
    if loss_node is not None:
        results.append(env[loss_node.name])
    g.output(tuple(results))
    g.eliminate_dead_code()
    # Its Python code is generated when the stage first runs (or is printed): the layout
    # search compiles many layouts only to price them, and code generation is a tenth
    # of a compile.
    with _lazy_graph_module._use_lazy_graph_module(True):
        gm = _lazy_graph_module._make_graph_module(program.graph_module, g)
    stage = Stage(index=k, graph_module=gm, params=tuple(params), batch_inputs=tuple(batch),
                  inputs=tuple(v.name for v in received), outputs=tuple(sent),
                  is_last=loss_node is not None, num_nodes=len(mine),
                  buffer_updates=tuple(param_by_node[b].name for b in updates))
    return stage, list(dict.fromkeys(used_canonical))

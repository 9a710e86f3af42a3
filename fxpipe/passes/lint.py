"""Invariants every Program and every stage graph satisfy between passes (debug mode).

The driver lints whatever a pass returns: a Program (``lint_program``), or a
``PipelinePlan`` (``lint_plan``: the Program it was cut from, then each stage's
graph and the graphs outlined inside it, e.g. the recompute pass's regions).
"""
from __future__ import annotations

import torch.fx as fx

from fxpipe.ir.program import ParamKind, Program
from fxpipe.ir.stage_plan import PipelinePlan
from fxpipe.passes.aliasing import mutated_args


class ProgramInvariantError(AssertionError):
    """A pass left the Program inconsistent; the message names the pass."""


def lint_program(program: Program, *, after: str) -> None:
    def fail(msg: str) -> None:
        raise ProgramInvariantError(f"after pass {after!r}: {msg}")

    try:
        program.graph.lint()
    except Exception as exc:  # fx raises RuntimeError for malformed graphs
        fail(f"graph lint failed: {exc}")
    nodes = {n.name: n for n in program.graph.nodes}
    placeholders = [n.name for n in program.graph.nodes if n.op == "placeholder"]
    expected = [p.node for p in program.params] + list(program.inputs)
    if placeholders != expected:
        fail(f"placeholders {placeholders} do not match params + inputs {expected}")
    if len(program.inputs) != len(program.input_specs):
        fail("one TensorSpec per batch input")
    for name in (*program.costs, *program.stages, *program.module_paths, *program.layers):
        if name not in nodes:
            fail(f"annotation for node {name!r}, which is not in the graph")
    for canonical, names in program.tied_groups.items():
        shapes = {program.param(n).shape for n in names}
        if len(shapes) != 1 or canonical not in names:
            fail(f"tied group {canonical} has members {names} with shapes {shapes}")
    for p in program.params:
        if p.canonical not in program.state:
            fail(f"no tensor in state for {p.name} (canonical {p.canonical})")
        if p.requires_grad and p.kind is not ParamKind.PARAMETER:
            fail(f"{p.name} is a {p.kind.value} but requires grad")
    outputs = [n for n in program.graph.nodes if n.op == "output"]
    if len(outputs) != 1:
        fail(f"{len(outputs)} output nodes")
    writes = [f"{n.name} ({n.target})" for n in program.graph.nodes if mutated_args(n)]
    if writes:  # every pass may assume a functional graph (passes/functionalize.py)
        fail(f"in-place ops in the graph: {', '.join(writes[:5])}")
    if len(program.mutated_buffers) > program.loss_output:
        fail(f"{len(program.mutated_buffers)} buffer writes but the loss is output {program.loss_output}")


def lint_plan(plan: PipelinePlan, *, after: str) -> None:
    """``lint_program`` on the plan's Program, then every stage's graphs: fx's own lint,
    placeholders and outputs as ``Stage`` declares them, no in-place op, and values
    that go from their producer to their consumers."""
    lint_program(plan.program, after=after)

    def fail(stage: int, msg: str) -> None:
        raise ProgramInvariantError(f"after pass {after!r}: stage {stage}: {msg}")

    for st in plan.stages:
        for name, gm in st.graph_module.named_modules():
            if not isinstance(gm, fx.GraphModule):
                continue
            try:
                gm.graph.lint()
            except Exception as exc:  # fx raises RuntimeError for malformed graphs
                fail(st.index, f"graph {name or '(stage)'} lint failed: {exc}")
            writes = [f"{n.name} ({n.target})" for n in gm.graph.nodes if mutated_args(n)]
            if writes:
                fail(st.index, f"in-place ops in graph {name or '(stage)'}: {', '.join(writes[:5])}")
        nodes = list(st.graph_module.graph.nodes)
        placeholders = [n for n in nodes if n.op == "placeholder"]
        expected = len(st.params) + len(st.batch_inputs) + len(st.inputs) + len(st.lookups)
        if len(placeholders) != expected:
            fail(st.index, f"{len(placeholders)} placeholders, Stage declares {expected} "
                           f"(params + batch inputs + received values + vocabulary lookups)")
        (out,) = [n for n in nodes if n.op == "output"]
        results = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
        returned = len(st.outputs) + len(st.buffer_updates) + int(st.is_last)
        if len(results) != returned:
            fail(st.index, f"returns {len(results)} values, Stage declares {returned} "
                           f"(sent values + buffer updates + loss)")
        for v in st.inputs:
            if v not in plan.values or st.index not in plan.values[v].consumers:
                fail(st.index, f"receives {v!r}, which no stage sends to it")
        for v in st.outputs:
            if v not in plan.values or plan.values[v].producer != st.index:
                fail(st.index, f"sends {v!r}, which the plan says another stage produces")

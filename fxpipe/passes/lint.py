"""Invariants every Program satisfies between passes (checked in debug mode)."""
from __future__ import annotations

from fxpipe.passes.functionalize import mutated_args
from fxpipe.program import ParamKind, Program


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

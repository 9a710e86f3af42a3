"""The pass driver: runs an ordered list of passes.

A pass is a plain function ``name_pass(ir, ctx) -> ir`` (``compiler/pass_list.py``). The driver
runs them in order, can skip one by name, times each, and in debug mode lints
every graph a pass returns and checks the Program's invariants after every pass —
after the split, every stage graph and the regions outlined in it — naming the
pass that broke them. The list is ``compiler/pass_list.py``'s: by default the graph
passes every layout needs (``DEFAULT_PASSES``); the compile pipeline
(``compiler/pipeline.py``) runs the whole ``PIPELINE`` through this same driver, the
last steps of which turn the Program into a ``PipelinePlan``.
"""
from __future__ import annotations

import time
from typing import Any, Iterable, Sequence

from fxpipe.compiler.pass_list import DEFAULT_PASSES, PassSpec, pass_names
from fxpipe.ir.artifact import PassTiming
from fxpipe.ir.compile_context import CompileContext
from fxpipe.ir.pass_configs import TPConfig
from fxpipe.ir.program import Program
from fxpipe.passes.lint import lint_plan, lint_program


def _lint(obj: Any, after: str) -> None:
    """Lint what a pass returned: a Program, or a PipelinePlan with every stage graph."""
    if isinstance(obj, Program):
        lint_program(obj, after=after)
    else:
        lint_plan(obj, after=after)


def _size(obj: Any) -> int:
    if isinstance(obj, Program):
        return len(obj.graph.nodes)
    return sum(len(s.graph_module.graph.nodes) for s in obj.stages)  # a PipelinePlan


def run_passes(program: Program, ctx: CompileContext | TPConfig | None = None, *,
               passes: Sequence[PassSpec] = DEFAULT_PASSES, skip: Iterable[str] = (),
               debug: bool = False) -> tuple[Any, list[PassTiming]]:
    """Run ``passes`` in order, except those named in ``skip``; return the result and timings.
    ``ctx``: the compile pipeline's context; the default graph passes also run on a
    ``TPConfig`` alone, or on nothing (tp=1)."""
    skip = set(skip)
    unknown = skip - set(pass_names(passes))
    if unknown:
        raise ValueError(f"cannot skip unknown pass(es) {sorted(unknown)}; "
                         f"passes are: {', '.join(pass_names(passes))}")
    if debug:
        lint_program(program, after="capture")
    timings = []
    for spec in passes:
        if spec.name in skip:
            continue
        start = time.perf_counter()
        program = spec.fn(program, ctx)
        elapsed = time.perf_counter() - start
        if debug:
            _lint(program, spec.name)
        timings.append(PassTiming(spec.name, elapsed, _size(program)))
    return program, timings

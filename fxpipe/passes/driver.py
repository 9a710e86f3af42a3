"""The pass driver: one ordered list of passes, each with the reason it is there.

A pass is a plain function ``name_pass(program, config) -> program``. The driver
runs them in order, can skip one by name, times each, and in debug mode lints
every graph a pass returns and checks the Program's invariants after every pass —
after the split, every stage graph and the regions outlined in it — naming the
pass that broke them. ``DEFAULT_PASSES`` are the graph passes every layout needs; the
whole compile pipeline (``fxpipe/compiler/pipeline.py``) runs them and then the pipeline's
own steps through this same driver — the last of which turn the Program into a
``PipelinePlan``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from fxpipe.ir.artifact import PassTiming
from fxpipe.ir.program import Program
from fxpipe.passes.canonicalize import canonicalize_pass
from fxpipe.passes.lint import lint_plan, lint_program
from fxpipe.passes.node_cost import cost_pass
from fxpipe.passes.tensor_parallel import tensor_parallel_pass

PassFn = Callable[[Any, object], Any]
"""Program -> Program, except the pipeline's last steps (split: Program -> PipelinePlan)."""


@dataclass(frozen=True)
class PassSpec:
    name: str
    fn: PassFn
    why: str


# The order matters; each line says why the pass is where it is.
DEFAULT_PASSES: tuple[PassSpec, ...] = (
    PassSpec("canonicalize", canonicalize_pass,
             "drop export's runtime asserts and dead values so later passes see computation only"),
    PassSpec("tensor_parallel", tensor_parallel_pass,
             "find Megatron column/row blocks and shard them (config.tp > 1); before cost, so "
             "costs are per rank"),
    PassSpec("cost", cost_pass,
             "FLOPs and bytes per node from shapes; last, so it prices the graph as rewritten"),
)


def pass_names(passes: Sequence[PassSpec] = DEFAULT_PASSES) -> list[str]:
    return [p.name for p in passes]


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


def run_passes(program: Program, config: object = None, *,
               passes: Sequence[PassSpec] = DEFAULT_PASSES, skip: Iterable[str] = (),
               debug: bool = False) -> tuple[Any, list[PassTiming]]:
    """Run ``passes`` in order, except those named in ``skip``; return the result and timings."""
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
        program = spec.fn(program, config)
        elapsed = time.perf_counter() - start
        if debug:
            _lint(program, spec.name)
        timings.append(PassTiming(spec.name, elapsed, _size(program)))
    return program, timings

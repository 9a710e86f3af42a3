"""``tensor_parallel_pass``: Megatron-style TP found and applied by the compiler.

The steps, each in its own module, are listed in the package's ``__init__``:
regions opened, the graph's facts found (``GraphFacts``), the layout search
(provenance, then assign / plan / placement until every layout is expressible),
coverage, sequence parallelism, the rewrite.

Requires: a captured (canonicalized) Program with FakeTensor shapes in
``meta["val"]``. Ensures: parameters carry their local shapes; ``Program.state``
still holds the *full* tensors (the runtime shards them with ``shard_state``);
``program.tensor_parallel`` is a :class:`TPResult`.
"""
from __future__ import annotations

import dataclasses
import math

from fxpipe.ir.compile_context import CompileContext
from fxpipe.ir.pass_configs import TPConfig, tp_config_of
from fxpipe.ir.program import ParamKind, Program
from fxpipe.ir.sizes import carry_hints
from fxpipe.ir.tp_result import CollectiveKind, TPResult
from fxpipe.passes.tensor_parallel import graph_ops as G
from fxpipe.passes.tensor_parallel.coverage import measure_coverage
from fxpipe.passes.tensor_parallel.placement import blocks
from fxpipe.passes.tensor_parallel.plan_record import Conversion, GraphFacts, TPPlan
from fxpipe.passes.tensor_parallel.reading_search import search
from fxpipe.passes.tensor_parallel.regions import open_regions
from fxpipe.passes.tensor_parallel.rewrite import rewrite
from fxpipe.passes.tensor_parallel.sequence import plan_sequence_parallel


def tensor_parallel_pass(program: Program, ctx: CompileContext | TPConfig | None = None) -> Program:
    """Shard ``program`` for ``tp`` ranks (see the module docstring).

    ``ctx``: the pipeline's ``CompileContext`` (its ``tensor_parallel`` TPConfig), or, used
    on its own, a :class:`TPConfig`; tp=1 returns the program unchanged::

        prog = tensor_parallel_pass(canonicalize_pass(capture(model, batch)), TPConfig(tp=2))
        specs = prog.tensor_parallel.specs
        with tp_group_context(group):
            loss = prog.run(shard_state(prog.state, specs, group.rank), *batch)
    """
    cfg = tp_config_of(ctx)
    if cfg.tp == 1:
        return program
    if program.tensor_parallel is not None:
        raise ValueError(f"{program.source} is already tensor-parallel "
                         f"(tp={program.tensor_parallel.config.tp}); run the pass once, on the captured program")
    program = open_regions(program)  # grad-mode / autocast blocks: not walls (regions.py)
    graph = program.graph
    weights = {p.node for p in program.params if p.kind is not ParamKind.CONSTANT}

    def describe(node: str) -> str:
        path = program.module_paths.get(node) or node
        layer = program.layers.get(node)
        return path if layer is None else f"layer {layer} ({path})"

    facts = GraphFacts(program, projections=G.find_projections(graph, weights),
                       embeddings=G.token_embeddings(graph, weights, set(program.inputs)),
                       grad=frozenset(G.grad_carrying(graph, {p.node for p in program.params if p.requires_grad})),
                       tp=cfg.tp, describe=describe)
    grad = facts.grad
    found = search(facts)
    prov, asg, plan, specs = found.prov, found.asg, found.plan, found.specs
    coverage = measure_coverage(program, specs, cfg.tp)
    if cfg.strict and not coverage.complete:
        raise ValueError(f"strict_tp: {coverage.describe()}; drop strict_tp to train with them "
                         f"replicated (correct, more memory per rank)")
    if cfg.sp:
        reduce_kind, seq_dim = plan_sequence_parallel(program, plan, grad)
    else:
        reduce_kind, seq_dim = _plain_tp(plan, grad), None
    local = {p.node: specs[p.canonical].local_shape for p in program.params}
    out = rewrite(program, plan, reduce_kind, local)
    vocab = next(iter(plan.vocab_ce.values()), None)
    result = TPResult(cfg, specs, blocks(program, prov, asg, plan), tuple(out.sites), vocab,
                      None if vocab is None else math.ceil(vocab / cfg.tp) * cfg.tp, seq_dim, coverage)
    return program.replace(
        graph_module=out.graph_module,
        params=tuple(dataclasses.replace(p, shape=local[p.node]) for p in program.params),
        module_paths=out.module_paths, layers=out.layers, costs={},
        size_hints=carry_hints(program.graph, out.graph_module.graph, program.size_hints),
        tensor_parallel=result)


def _plain_tp(plan: TPPlan, grad: set[str]) -> dict[str, Conversion]:
    """Without sp: f before every column-parallel input whose gradient flows, g after
    every partial sum (Shoeybi et al. 2019 §3: 2 all-reduces forward, 2 backward per layer)."""
    for consumer, producer in plan.column_inputs:
        if producer in grad:
            plan.conversions[(consumer, producer)] = [Conversion(CollectiveKind.F)]
    return {sink: Conversion(CollectiveKind.G) for sink in plan.partial}


__all__ = ["TPConfig", "tensor_parallel_pass"]

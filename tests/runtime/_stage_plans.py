"""A stage plan built by hand, for the tests of the backward split and of the compiled stages."""
from __future__ import annotations

import fxpipe
from fxpipe.models import build_workload
from fxpipe.compiler.driver import run_passes
from fxpipe.passes.assign_stages import PartitionConfig, assign_stages
from fxpipe.passes.recompute import RecomputeMode, apply_recompute
from fxpipe.passes.split import split_program


def stage_plan(name, recompute=RecomputeMode.NONE):
    w = build_workload(name, batch=2, seq=16, layers=4)
    prog, _ = run_passes(fxpipe.capture(w.model, w.example_inputs, w.loss_fn))
    cfg = PartitionConfig(num_stages=2, stage_to_rank=(0, 1), inflight=(2, 1), method="uniform")
    plan = split_program(assign_stages(prog, cfg), num_stages=2)
    if recompute is not RecomputeMode.NONE:
        import dataclasses
        plan = dataclasses.replace(plan, stages=tuple(
            dataclasses.replace(s, graph_module=apply_recompute(s.graph_module, prog.layers, recompute))
            for s in plan.stages))
    return w, plan

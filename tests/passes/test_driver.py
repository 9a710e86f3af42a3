import pytest

import fxpipe
from fxpipe.models import build_workload
from fxpipe.compiler.driver import run_passes
from fxpipe.compiler.pass_list import DEFAULT_PASSES, PassSpec, pass_names
from fxpipe.passes import ProgramInvariantError


@pytest.fixture(scope="module")
def program():
    w = build_workload("gpt-tiny")
    return fxpipe.capture(w.model, w.example_inputs), w


def test_runs_in_order_with_timings(program):
    prog, w = program
    out, timings = run_passes(prog, debug=True)
    assert [t.name for t in timings] == pass_names()
    assert all(t.seconds >= 0 for t in timings)
    assert out.costs and not prog.costs, "passes return a new Program; the input is untouched"
    assert out.run(out.state, *w.example_inputs).item() == pytest.approx(
        prog.run(prog.state, *w.example_inputs).item(), abs=1e-6)


def test_skip_by_name(program):
    out, timings = run_passes(program[0], skip=["cost"])
    assert "cost" not in [t.name for t in timings] and not out.costs


def test_unknown_skip_lists_valid_names(program):
    with pytest.raises(ValueError, match="canonicalize, causal_mask, tensor_parallel, grouped_attention, cost"):
        run_passes(program[0], skip=["nope"])


def test_debug_lint_names_the_breaking_pass(program):
    def bad_pass(prog, config):
        return prog.replace(stages={"no_such_node": 0})

    passes = (*DEFAULT_PASSES, PassSpec("bad", bad_pass, "breaks an invariant on purpose"))
    with pytest.raises(ProgramInvariantError, match="after pass 'bad'.*no_such_node"):
        run_passes(program[0], passes=passes, debug=True)
    run_passes(program[0], passes=passes, debug=False)  # not checked without debug


def test_debug_lint_checks_every_stage_graph(program):
    """A pass that returns a PipelinePlan has its stage graphs linted, not only the
    Program they were cut from (the recompute pass rewrites stage graphs only)."""
    import copy
    import dataclasses

    import torch

    from fxpipe.passes.assign_stages import PartitionConfig, assign_stages
    from fxpipe.passes.split import split_program

    costed, _ = run_passes(program[0])
    parted = assign_stages(costed, PartitionConfig(num_stages=2, stage_to_rank=(0, 1), inflight=(2, 1),
                                                    method="uniform"))
    plan = split_program(parted, num_stages=2)

    def write_in_place(prog, config):  # a stage-graph rewrite that leaves an in-place op behind
        gm = copy.deepcopy(plan.stages[1].graph_module)
        first = next(n for n in gm.graph.nodes if n.op == "call_function"
                     and isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].is_floating_point())
        with gm.graph.inserting_after(first):
            gm.graph.call_function(torch.ops.aten.relu_.default, (first,))
        gm.recompile()
        stages = (plan.stages[0], dataclasses.replace(plan.stages[1], graph_module=gm))
        return dataclasses.replace(plan, stages=stages)

    passes = (PassSpec("fine", lambda prog, config: plan, "a plan as split makes it"),)
    run_passes(program[0], passes=passes, debug=True)
    passes += (PassSpec("bad", write_in_place, "breaks a stage graph on purpose"),)
    with pytest.raises(ProgramInvariantError, match="after pass 'bad': stage 1: in-place ops.*relu_"):
        run_passes(program[0], passes=passes, debug=True)

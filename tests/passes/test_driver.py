import pytest

import fxpipe
from fxpipe.models import build_workload
from fxpipe.passes import DEFAULT_PASSES, PassSpec, ProgramInvariantError, pass_names, run_passes


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
    with pytest.raises(ValueError, match="canonicalize, tensor_parallel, cost"):
        run_passes(program[0], skip=["nope"])


def test_debug_lint_names_the_breaking_pass(program):
    def bad_pass(prog, config):
        return prog.replace(stages={"no_such_node": 0})

    passes = (*DEFAULT_PASSES, PassSpec("bad", bad_pass, "breaks an invariant on purpose"))
    with pytest.raises(ProgramInvariantError, match="after pass 'bad'.*no_such_node"):
        run_passes(program[0], passes=passes, debug=True)
    run_passes(program[0], passes=passes, debug=False)  # not checked without debug

"""A timed group's time is its ops', net of what calling a stage costs whatever it computes
(``fxpipe/costs/measure.py``: the runtime pays that once per action, and the price adds it
once per action; counted in every group, a stage of many small groups was priced at 1.7×
what it runs in)."""
import math

import pytest
import torch

import fxpipe
import fxpipe.costs.measure as measure
from fxpipe.compiler.pipeline import run_passes
from fxpipe.costs import measured_profile, probe_groups
from fxpipe.ir.pass_configs import PartitionConfig
from fxpipe.models.registry import build_workload
from fxpipe.passes.split import split_program

CPU = torch.device("cpu")
CONFIG = PartitionConfig(num_stages=2, stage_to_rank=(0, 1), inflight=(2, 1))


@pytest.fixture(scope="module")
def tiny():
    w = build_workload("gpt-tiny", batch=2, seq=16, layers=2)
    return w, run_passes(fxpipe.capture(w.model, w.example_inputs, w.loss_fn))[0]


class _Ticks:
    """A clock that moves one millisecond at every reading: every interval ``time_groups``
    records between two readings is exactly 1 ms."""

    def __init__(self, device, cpu_time=False):
        self.now = 0.0

    def __call__(self):
        self.now += 1e-3
        return self.now


def test_each_group_is_timed_net_of_the_runners_fixed_cost(tiny, tmp_path, monkeypatch):
    w, program = tiny
    monkeypatch.setenv("FXPIPE_CACHE_DIR", str(tmp_path))
    fixed = (2e-4, 3e-4, 1e-4, 9.9999e-4)
    monkeypatch.setattr(measure, "_Clock", _Ticks)
    monkeypatch.setattr(measure, "runner_fixed_cost", lambda *a, **k: fixed)
    state_for = lambda names: {n: program.state[n].detach().clone().requires_grad_(program.state[n].requires_grad)  # noqa: E731
                               for n in names}
    profile, probe, _ = measured_profile(program, CONFIG, "measure", device=CPU, state_for=state_for,
                                         batch=w.example_inputs, repeats=1)
    expected = tuple(max(measure.MIN_GROUP_S, 1e-3 - f) for f in fixed)
    assert len(profile.groups) == len(probe.members) > 1
    for row in profile.groups:
        assert all(math.isclose(a, b, rel_tol=1e-9) for a, b in zip(row, expected)), (row, expected)
    assert expected[3] == measure.MIN_GROUP_S  # a group cheaper than the fixed cost is never free


def test_the_fixed_cost_is_a_null_stage_run_as_groups_are(tiny):
    _, program = tiny
    _, probe = probe_groups(program, CONFIG)
    timed = program.replace(stages=probe.expand(list(range(len(probe.members)))))
    plan = split_program(timed, dict(timed.stages), num_stages=len(probe.members))
    null = measure._null_plan(plan)
    assert len(null.stages) == 1 and null.stages[0].params == () and null.vocab_head is None
    assert null.stage_params(0) == ()
    costs = measure.runner_fixed_cost(plan, torch.device("cpu"), repeats=3)
    assert len(costs) == len(measure.PHASES)
    assert all(math.isfinite(c) and c > 0 for c in costs), costs


def test_group_times_are_shifted_to_sum_to_the_graph_run_whole():
    """Closed form: one shift per phase, the same for every group, floored at MIN_GROUP_S,
    and the sum equal to the whole graph's time."""
    rows = {0: (4e-4, 9e-4), 1: (1e-4, 2e-4), 2: (3e-5, 5e-4)}
    whole = (3.5e-4, 1.3e-3)
    fitted = measure.fit_to_whole(rows, whole)
    for p, w in enumerate(whole):
        assert math.isclose(sum(r[p] for r in fitted.values()), w, rel_tol=1e-9)
    # Forward: the 30 us group is floored; the other two give up the rest equally.
    d = (4e-4 + 1e-4 - (3.5e-4 - measure.MIN_GROUP_S)) / 2
    assert fitted[2][0] == measure.MIN_GROUP_S
    assert math.isclose(fitted[0][0], 4e-4 - d) and math.isclose(fitted[1][0], 1e-4 - d)
    # Backward: no group floored, each less the same (sum - whole) / 3.
    d = (9e-4 + 2e-4 + 5e-4 - 1.3e-3) / 3
    assert all(math.isclose(fitted[g][1], rows[g][1] - d) for g in rows)
    # A graph that costs more whole than its groups: each group takes an equal share more.
    up = measure.fit_to_whole({0: (1e-4,), 1: (2e-4,)}, (5e-4,))
    assert math.isclose(up[0][0], 2e-4) and math.isclose(up[1][0], 3e-4)


def test_local_timing_adds_up_to_the_graph_run_whole(tiny, monkeypatch):
    """measure_locally times the graph once more as one stage and its groups sum to that:
    with a clock where every timed call takes 1 ms, the groups' forward times sum to one
    call's 1 ms less the fixed cost, not to 1 ms per group."""
    from fxpipe.costs.local import measure_locally

    w, program = tiny
    fixed = (2e-4, 3e-4, 1e-4, 5e-5)
    monkeypatch.setattr(measure, "_Clock", _Ticks)
    monkeypatch.setattr(measure, "runner_fixed_cost", lambda *a, **k: fixed)
    state_for = lambda names: {n: program.state[n].detach().clone().requires_grad_(program.state[n].requires_grad)  # noqa: E731
                               for n in names}
    times = measure_locally(program, CONFIG, w.example_inputs, state_for, tp=1, repeats=1)
    for phase in (0, 1):
        total = sum(t[phase] for t in times.fused.values())
        assert math.isclose(total, 1e-3 - fixed[phase], rel_tol=1e-6), (phase, total)


def test_a_shape_is_timed_whole_only_where_its_calls_are_a_visible_share():
    """The whole graph is timed again only where the groups' calls (the null stage's cost
    each) exceed CALLS_MATTER of the shape's forward + backward."""
    from fxpipe.costs.local import CALLS_MATTER, _calls_matter

    fixed = (3e-5, 4e-5, 0.0, 0.0)
    small = {g: (2e-5, 3e-5, 0.0, 0.0) for g in range(50)}  # calls 3.5 ms, work 2.5 ms
    large = {g: (8e-3, 1.6e-2, 0.0, 0.0) for g in range(50)}  # calls 3.5 ms, work 1.2 s
    assert _calls_matter(small, fixed) and not _calls_matter(large, fixed)
    edge = 50 * 7e-5 / CALLS_MATTER / 50  # per-group work at which the share is exactly CALLS_MATTER
    assert not _calls_matter({g: (edge / 1.98, edge / 1.98, 0.0, 0.0) for g in range(50)}, fixed)
    assert _calls_matter({g: (edge / 2.2, edge / 2.2, 0.0, 0.0) for g in range(50)}, fixed)

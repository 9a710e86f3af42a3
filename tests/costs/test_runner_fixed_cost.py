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

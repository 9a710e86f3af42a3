"""How many times ``time_groups`` repeats a shape (``fxpipe/costs/measure.py``): the layout
search stops once two recorded rounds agree (``steady``), and times a third where one
round is out of line, so the median leaves the outlier out."""
import pytest
import torch

import fxpipe
import fxpipe.costs.measure as measure
from fxpipe.compiler.pipeline import run_passes
from fxpipe.costs import probe_groups
from fxpipe.ir.pass_configs import PartitionConfig
from fxpipe.models.registry import build_workload
from fxpipe.passes.split import split_program

CONFIG = PartitionConfig(num_stages=2, stage_to_rank=(0, 1), inflight=(2, 1))


@pytest.fixture(scope="module")
def timed_plan():
    """gpt-tiny's probe groups, one stage each, its state and batch."""
    w = build_workload("gpt-tiny", batch=2, seq=16, layers=2)
    program = run_passes(fxpipe.capture(w.model, w.example_inputs, w.loss_fn))[0]
    _, probe = probe_groups(program, CONFIG)
    timed = program.replace(stages=probe.expand(list(range(len(probe.members)))))
    plan = split_program(timed, dict(timed.stages), num_stages=len(probe.members))
    state = {n: t.detach().clone().requires_grad_(t.requires_grad) for n, t in program.state.items()}
    return plan, state, w.example_inputs


class _Clock:
    """Moves one millisecond at every reading, and ``spike`` seconds more at the readings
    listed in ``at`` (counted over the whole test): a round that holds such a reading is
    out of line with the others."""
    at: set[int] = set()
    spike = 0.0

    last: "_Clock | None" = None

    def __init__(self, device, cpu_time=False):
        self.now, self.reads = 0.0, 0
        _Clock.last = self

    def __call__(self):
        self.reads += 1
        self.now += 1e-3 + (self.spike if self.reads in self.at else 0.0)
        return self.now


def _rounds(plan, state, batch, monkeypatch, *, steady, spike_at=(), warmup=1, enough_s=None):
    """How many rounds ``time_groups`` recorded, and its result."""
    monkeypatch.setattr(measure, "_Clock", _Clock)
    monkeypatch.setattr(measure, "runner_fixed_cost", lambda *a, **k: (0.0,) * 4)
    monkeypatch.setattr(_Clock, "at", set(spike_at))
    monkeypatch.setattr(_Clock, "spike", 0.5)
    said = []
    out = measure.time_groups(plan, range(len(plan.stages)), state, batch, torch.device("cpu"), repeats=3,
                              warmup=warmup, steady=steady, enough_s=enough_s, progress=said.append)
    return len(said), out


def test_two_rounds_that_agree_end_the_timing(timed_plan, monkeypatch):
    assert _rounds(*timed_plan, monkeypatch, steady=None)[0] == 3  # off: every repeat
    rounds, out = _rounds(*timed_plan, monkeypatch, steady=0.05)
    assert rounds == 2
    # Every interval is 1 ms: so is every group's median.
    assert all(t == pytest.approx(1e-3) for row in out.values() for t in row)


def test_a_round_out_of_line_is_outvoted_by_a_third(timed_plan, monkeypatch):
    # Every round reads the clock equally often: a warm-up and three rounds, without
    # ``steady``, give how often.
    assert _rounds(*timed_plan, monkeypatch, steady=None)[0] == 3
    per_round = _Clock.last.reads // 4
    # The spike lands inside the first recorded round's first action.
    rounds, out = _rounds(*timed_plan, monkeypatch, steady=0.05, spike_at=(per_round + 3,))
    assert rounds == 3
    # The spiked sample is one of three of its group and phase: every median is 1 ms.
    assert all(t == pytest.approx(1e-3) for row in out.values() for t in row)


def test_without_a_warm_up_a_slow_first_round_is_dropped(timed_plan, monkeypatch):
    assert _rounds(*timed_plan, monkeypatch, steady=None)[0] == 3
    per_round = _Clock.last.reads // 4
    # Every reading of the first round is 0.5 s late: all its samples are slow. The
    # timing budget is spent after it, but without a warm-up the first round alone never
    # ends the timing: a second is timed, and the first, out of line with it, is dropped
    # (kept, each median would be the mean of a slow and a clean sample).
    spiked = range(2, per_round + 1)
    rounds, out = _rounds(*timed_plan, monkeypatch, steady=0.05, warmup=0, enough_s=1e-9, spike_at=spiked)
    assert rounds == 2
    assert all(t == pytest.approx(1e-3) for row in out.values() for t in row)

"""Closed-form in-flight counts and the large-m extrapolation, against the simulator."""
import numpy as np
import pytest

from fxpipe.planner import ScheduleKind
from fxpipe.planner.pipeline_time import in_flight, simulate_pipeline
from fxpipe.schedules import StageDurations, generate, simulate


@pytest.mark.parametrize("kind,v", [(ScheduleKind.ONE_F_ONE_B, 1), (ScheduleKind.ZB_H1, 1),
                                    (ScheduleKind.INTERLEAVED, 2), (ScheduleKind.INTERLEAVED, 3)])
def test_in_flight_matches_simulator(kind, v):
    for p in range(1, 7):
        for m in range(1, 15):
            sim = simulate(generate(kind.value, p, m, v)).peak_in_flight
            assert in_flight(kind, p, m, v) == sim, (p, m)


def _durations(S, rng, spread):
    f = rng.uniform(1 - spread, 1 + spread, S)
    b = 2 * f * rng.uniform(1 - spread / 2, 1 + spread / 2, S)
    return StageDurations(forward=f, backward=b, weight=0.45 * b)


@pytest.mark.parametrize("kind,p,v,tol", [(ScheduleKind.ONE_F_ONE_B, 8, 1, 1e-9),
                                          (ScheduleKind.ZB_H1, 6, 1, 1e-9),
                                          (ScheduleKind.INTERLEAVED, 4, 2, 0.02)])
def test_extrapolation_matches_direct_simulation(kind, p, v, tol):
    rng = np.random.default_rng(1)
    d = _durations(p * v, rng, 0.5)
    for m in (4 * p, 5 * p + 3, 7 * p):
        got = simulate_pipeline(kind, p, m, v, d, budget=1)  # force the extrapolation
        assert len(got.simulated) == 2 and max(got.simulated) < m
        direct = simulate(generate(kind.value, p, m, v), d)
        assert got.makespan == pytest.approx(direct.makespan, rel=tol)
        assert got.busy == pytest.approx(direct.busy, rel=1e-9)


def test_interleaved_extrapolation_is_exact_for_near_equal_stages():
    p, v = 8, 2
    f = np.ones(p * v)
    f[0], f[-1] = 1.1, 1.3  # embedding and head make the ends heavier
    d = StageDurations(forward=f, backward=2 * f, weight=f)
    got = simulate_pipeline(ScheduleKind.INTERLEAVED, p, 10 * p, v, d, budget=1)
    direct = simulate(generate("interleaved", p, 10 * p, v), d)
    assert got.makespan == pytest.approx(direct.makespan, rel=1e-9)

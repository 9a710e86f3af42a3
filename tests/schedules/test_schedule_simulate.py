"""The simulator on hand-computed cases, its inputs and errors, and the Timeline."""
import dataclasses

import pytest

from fxpipe.schedules import (
    Action, ScheduleError, StageDurations, Timeline, generate, lower, simulate,
)


def events(result, rank):
    return [(str(e.action), e.start, e.end) for e in result.timeline.events(rank)]


def test_two_ranks_one_microbatch_by_hand():
    # F=1, B=2, latency 0.5: 0F0 [0,1] -> 1F0 [1.5,2.5] -> 1B0 [2.5,4.5] -> 0B0 [5,7].
    r = simulate(generate("1f1b", 2, 1), StageDurations.uniform(2, 1.0, 2.0), p2p_latency=0.5)
    assert events(r, 0) == [("0F0", 0.0, 1.0), ("0B0", 5.0, 7.0)]
    assert events(r, 1) == [("1F0", 1.5, 2.5), ("1B0", 2.5, 4.5)]
    assert r.makespan == 7.0
    assert r.busy == (3.0, 3.0)
    assert r.bubble_fraction == (4 / 7, 4 / 7)
    assert r.bubble_ratio == (4 / 3, 4 / 3)
    assert r.peak_in_flight == (1, 1)


def test_comm_entries_span_the_transfer():
    r = simulate(lower(generate("1f1b", 2, 1)), StageDurations.uniform(2, 1.0, 2.0), p2p_latency=0.5)
    assert events(r, 0) == [("0F0", 0.0, 1.0), ("0SEND_F0", 1.0, 1.5), ("0RECV_B0", 4.5, 5.0), ("0B0", 5.0, 7.0)]
    assert ("1RECV_F0", 1.0, 1.5) in events(r, 1) and ("1SEND_B0", 4.5, 5.0) in events(r, 1)


def test_per_stage_durations():
    # A slow last stage sets the pace of GPipe: makespan = sum(F) + (m-1) F_max + ...
    d = StageDurations(forward=(1.0, 3.0), backward=(2.0, 6.0), weight=(1.0, 3.0))
    r = simulate(generate("gpipe", 2, 2), d)
    assert events(r, 1) == [("1F0", 1.0, 4.0), ("1F1", 4.0, 7.0), ("1B0", 7.0, 13.0), ("1B1", 13.0, 19.0)]
    assert events(r, 0)[-1] == ("0B1", 19.0, 21.0)


def test_split_backward_uses_b_minus_w_for_i():
    d = StageDurations.uniform(1, forward=1.0, backward=3.0, weight=1.0)
    r = simulate(generate("zb-h1", 1, 1), d)
    assert events(r, 0) == [("0F0", 0.0, 1.0), ("0I0", 1.0, 3.0), ("0W0", 3.0, 4.0)]


def test_duration_errors():
    with pytest.raises(ValueError, match="weight must not exceed backward"):
        StageDurations.uniform(2, 1.0, 1.0, weight=2.0)
    with pytest.raises(ValueError, match="got 1 per-stage durations for 2 stages"):
        StageDurations(forward=(1.0, 1.0), backward=(1.0,), weight=(0.5, 0.5))
    with pytest.raises(ValueError, match=">= 0"):
        StageDurations.uniform(2, -1.0)
    with pytest.raises(ValueError, match="durations cover 4 stages but the schedule has 8"):
        simulate(generate("interleaved", 4, 4, 2), StageDurations.uniform(4))
    with pytest.raises(ValueError, match="p2p_latency"):
        simulate(generate("1f1b", 2, 2), p2p_latency=-1.0)


def test_result_is_frozen():
    r = simulate(generate("1f1b", 2, 2))
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.makespan = 0.0


def test_deadlock_raises_with_grid():
    s = generate("1f1b", 2, 2)
    bad = s.with_actions([s.actions[0], (Action.parse("1B0"),) + s.actions[1][:1] + s.actions[1][2:]])
    with pytest.raises(ScheduleError, match="deadlock") as err:
        simulate(bad)
    assert ">1B0<" in str(err.value)


def test_missing_action_raises():
    s = generate("zb-h1", 2, 2)  # nothing waits for a W, so dropping one is no deadlock
    assert str(s.actions[1][-1]) == "1W1"
    with pytest.raises(ScheduleError, match="incomplete"):
        simulate(s.with_actions([s.actions[0], s.actions[1][:-1]]))
    # Dropping a B instead starves its upstream rank.
    s = generate("1f1b", 2, 2)
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(s.with_actions([s.actions[0], s.actions[1][:-1]]))


def test_timeline_metrics_match_simresult():
    # A measured timeline (built from events) gets the same numbers.
    r = simulate(lower(generate("interleaved", 4, 8, 2)), p2p_latency=0.1)
    measured = Timeline.from_events(
        [[(e.action, e.start + 10.0, e.end + 10.0) for e in r.timeline.events(k)] for k in range(4)],
        num_chunks=2, unit="ms",
    )
    assert measured.makespan == pytest.approx(r.makespan)
    assert measured.busy() == pytest.approx(r.busy)
    assert measured.bubble_fraction() == pytest.approx(r.bubble_fraction)
    assert measured.bubble_ratio() == pytest.approx(r.bubble_ratio)
    assert measured.peak_in_flight() == r.peak_in_flight
    assert measured.peak_activation() == pytest.approx(r.peak_activation)


def test_timeline_peak_counts_until_w():
    r = simulate(generate("zb-h1", 2, 4))
    assert r.timeline.peak_in_flight() == r.peak_in_flight == (2, 2)


def test_durations_need_one_value_per_stage():
    with pytest.raises(TypeError, match="use StageDurations.uniform"):
        StageDurations(forward=1.0, backward=(2.0,), weight=(1.0,))
    d = StageDurations(forward=[1, 2], backward=(2, 4), weight=(1, 1))
    assert d.forward == (1.0, 2.0) and d.num_stages == 2

"""Hypothesis properties of generators + simulator against closed forms
(SC21 §2.2), and validity of every generated schedule.

Conventions: durations are per stage (per chunk); "unit" means T_F = T_B = 1
(and for split schedules T_F = T_I = T_W = 1, i.e. B = 2, W = 1). We compare
``bubble_ratio`` (idle / compute per rank, Megatron SC21's convention) with
(p-1)/m and (p-1)/(v*m), ``bubble_fraction`` (idle / makespan, the GPipe
paper's) with (p-1)/(m+p-1), and idle time in time units with the
zero-bubble paper's (p-1)(T_F + T_B - T_W). Every check is exact (integer
arithmetic in floats), on every rank.
"""
from hypothesis import given, settings
from hypothesis import strategies as st

from fxpipe.schedules import StageDurations, generate, lower, simulate, validate

PROPS = settings(max_examples=60, deadline=None)
ps = st.integers(1, 16)
ms = st.integers(1, 64)
vs = st.integers(1, 4)


def unit(sched, backward=1.0, weight=None):
    return StageDurations.uniform(sched.num_stages, forward=1.0, backward=backward, weight=weight)


def close(a, b):
    return abs(a - b) <= 1e-9 * max(1.0, abs(b))


@PROPS
@given(p=ps, m=ms, backward=st.sampled_from([1.0, 2.0]))
def test_gpipe_and_1f1b_bubble(p, m, backward):
    for name in ("gpipe", "1f1b"):
        s = generate(name, p, m)
        r = simulate(s, unit(s, backward))
        assert all(close(x, (p - 1) / m) for x in r.bubble_ratio), (name, r.bubble_ratio)
        assert all(close(x, (p - 1) / (m + p - 1)) for x in r.bubble_fraction)
        assert close(r.makespan, (m + p - 1) * (1.0 + backward))


@PROPS
@given(p=ps, m=ms)
def test_peak_in_flight_1f1b_and_gpipe(p, m):
    r = simulate(generate("1f1b", p, m))
    assert r.peak_in_flight == tuple(min(p - rank, m) for rank in range(p))
    assert simulate(generate("gpipe", p, m)).peak_in_flight == (m,) * p


@PROPS
@given(p=ps, k=st.integers(1, 4), v=vs, backward=st.sampled_from([1.0, 2.0]))
def test_interleaved_bubble_m_multiple_of_p(p, k, v, backward):
    m = k * p  # Megatron's case
    s = generate("interleaved", p, m, v)
    r = simulate(s, unit(s, backward))
    assert all(close(x, (p - 1) / (v * m)) for x in r.bubble_ratio), r.bubble_ratio


@PROPS
@given(p=ps, m=ms, v=vs)
def test_interleaved_bubble_any_m(p, m, v):
    """Outside Megatron's m % p == 0 we check our own closed forms: with
    groups of >= p microbatches (m >= p) the bubble is still (p-1)/(v*m);
    for m < p every chunk boundary also waits p-m slots for the wrap-around,
    giving ((p-1) + (v-1)(p-m)) / (v*m)."""
    s = generate("interleaved", p, m, v)
    r = simulate(s, unit(s))
    want = (p - 1) / (v * m) if m >= p else ((p - 1) + (v - 1) * (p - m)) / (v * m)
    assert all(close(x, want) for x in r.bubble_ratio), (r.bubble_ratio, want)


@PROPS
@given(p=st.integers(2, 16), k=st.integers(2, 4), v=st.integers(2, 4))
def test_interleaved_memory(p, k, v):
    """Peak in flight = warmup + 1 chunk-microbatches; on rank 0 that is
    p + (p-1)/v stage-microbatches, (1 + (p-1)/(p*v)) x 1F1B's p
    (Korthikanti et al. 2022, their m = our v)."""
    m = k * p
    r = simulate(generate("interleaved", p, m, v))
    assert r.peak_in_flight == tuple(min((v - 1) * p + 2 * (p - 1 - q) + 1, m * v) for q in range(p))
    assert close(r.peak_activation[0], p * (1 + (p - 1) / (p * v)))


@PROPS
@given(p=ps, m=ms)
def test_zb_h1_bubble_and_memory(p, m):
    s = generate("zb-h1", p, m)
    r = simulate(s, unit(s, backward=2.0, weight=1.0))  # T_F = T_I = T_W = 1
    busy = 3.0 * m
    assert all(close(b, busy) for b in r.busy)
    if m >= p:
        # (p-1)(T_F + T_I - T_W) idle per rank: a third of 1F1B's (p-1)(T_F + T_I + T_W).
        assert all(close(r.makespan - b, (p - 1) * (1 + 1 - 1)) for b in r.busy)
        one_f_one_b = simulate(generate("1f1b", p, m), unit(s, backward=2.0))
        assert all(close(3 * (r.makespan - b), one_f_one_b.makespan - b) for b in r.busy)
    else:
        assert close(r.makespan, (m + p - 1) * 2 + 1)
    assert r.peak_in_flight == (min(p, m),) * p


@PROPS
@given(p=ps, m=ms)
def test_zb_v_bubble_and_memory(p, m):
    s = generate("zb-v", p, m)
    r = simulate(s, unit(s, backward=2.0, weight=1.0))
    if m >= 2 * p - 1:
        assert all(close(r.makespan - b, p - 1) for b in r.busy)  # only the forward fill
    assert all(k <= 2 * p for k in r.peak_in_flight)
    assert max(r.peak_in_flight) == 2 * min(m, p)
    assert max(r.peak_activation) == min(m, p)


@PROPS
@given(name=st.sampled_from(["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"]), p=ps, m=ms, v=vs)
def test_every_generated_schedule_is_valid(name, p, m, v):
    chunks = {"interleaved": v, "zb-v": 2}.get(name, 1)
    s = generate(name, p, m, chunks)
    validate(s)
    low = lower(s)
    validate(low)
    assert low.compute_only().actions == s.actions


@PROPS
@given(p=ps, m=ms, latency=st.sampled_from([0.0, 0.25, 1.5]))
def test_gpipe_latency(p, m, latency):
    # Each of the (p-1) hops down and back up adds the latency once.
    s = generate("gpipe", p, m)
    r = simulate(s, unit(s, backward=2.0), p2p_latency=latency)
    assert close(r.makespan, 3.0 * (m + p - 1) + 2 * (p - 1) * latency)

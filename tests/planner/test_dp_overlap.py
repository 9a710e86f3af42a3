"""The exposed part of the bucketed data-parallel reduction (planner/dp_overlap.py)
against its closed forms: n equal buckets of c seconds, final every B/n of a backward B."""
import pytest

from fxpipe.planner.dp_overlap import exposed_reduction_s

MB = 2**20


def linear(seconds_per_mb: float, latency: float = 0.0):
    return lambda nbytes: latency + seconds_per_mb * nbytes / MB


def test_no_overlap_exposes_the_whole_reduction():
    assert exposed_reduction_s(100 * MB, 5.0, linear(0.01), bucket_mb=0) == pytest.approx(1.0)


def test_a_fast_link_exposes_only_the_last_bucket():
    # 4 buckets of 25 MB, 0.25 s each, final every 1 s: each done before the next is final.
    assert exposed_reduction_s(100 * MB, 4.0, linear(0.01), bucket_mb=25) == pytest.approx(0.25)


def test_a_slow_link_exposes_what_outlasts_the_backward():
    # 4 buckets of 1 s, final every 0.25 s: the link is busy from 0.25 s on, done at 4.25 s,
    # R − B + B/n = 4 − 1 + 0.25 exposed.
    assert exposed_reduction_s(100 * MB, 1.0, linear(0.04), bucket_mb=25) == pytest.approx(3.25)


def test_smaller_buckets_hide_more_but_pay_latency():
    fast = linear(0.01, latency=0.001)
    exposed = [exposed_reduction_s(100 * MB, 4.0, fast, bucket_mb=b) for b in (100, 25, 5)]
    assert exposed[0] == pytest.approx(1.001)  # one bucket: final only when the backward ends
    assert exposed[0] > exposed[1] > exposed[2] == pytest.approx(0.051)
    # Latency dominates tiny buckets: 10,000 of 10 KB cost more than they hide.
    assert exposed_reduction_s(100 * MB, 4.0, fast, bucket_mb=0.01) > exposed[2]


def test_nothing_to_reduce():
    assert exposed_reduction_s(0, 1.0, linear(1.0)) == 0.0

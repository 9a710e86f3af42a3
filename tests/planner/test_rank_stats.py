"""The benchmark's rank statistics (benchmarks/rank_stats.py) against closed forms:
Spearman's 1 − 6Σd²/(n(n²−1)) without ties, Kendall's (C − D)/pairs, τ-b's tie correction."""
from __future__ import annotations

import itertools
import math

import pytest

from benchmarks.rank_stats import average_ranks, kendall_tau_b, median_relative_error, spearman


def test_rank_statistics_match_their_closed_forms():
    for perm in itertools.permutations(range(5)):
        a, b = list(range(5)), list(perm)
        d2 = sum((x - y) ** 2 for x, y in zip(a, b))
        assert spearman(a, b) == pytest.approx(1 - 6 * d2 / (5 * 24))
        pairs = list(itertools.combinations(range(5), 2))
        c = sum((b[i] < b[j]) for i, j in pairs)
        assert kendall_tau_b(a, b) == pytest.approx((c - (len(pairs) - c)) / len(pairs))
    assert spearman([1, 2, 3], [30, 20, 10]) == pytest.approx(-1.0)
    # Ties: a's pair (1, 2) is tied; C = 5, D = 0: τ-b = 5 / sqrt(6 · 5).
    assert kendall_tau_b([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(5 / math.sqrt(30))
    assert average_ranks([10, 20, 20, 5]) == [2.0, 3.5, 3.5, 1.0]
    assert median_relative_error([1.1, 2.0, 2.7], [1.0, 2.0, 3.0]) == pytest.approx(0.1)

"""Rank agreement of predictions with measurements, without scipy: Spearman's ρ and
Kendall's τ-b (ties handled as scipy.stats handles them: average ranks for ρ, τ-b's
tie correction for τ), and the median relative error. Used by bench_auto_layout.py."""
from __future__ import annotations

import math
import statistics
from typing import Sequence


def average_ranks(xs: Sequence[float]) -> list[float]:
    """Ranks 1..n, tied values sharing the mean of the ranks they span."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    ranks = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Pearson's correlation of the average ranks (nan with fewer than 2 or a constant side)."""
    if len(a) != len(b):
        raise ValueError("spearman needs two sequences of one length")
    ra, rb = average_ranks(a), average_ranks(b)
    n = len(a)
    if n < 2:
        return math.nan
    ma, mb = sum(ra) / n, sum(rb) / n
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va, vb = sum((x - ma) ** 2 for x in ra), sum((y - mb) ** 2 for y in rb)
    return cov / math.sqrt(va * vb) if va > 0 and vb > 0 else math.nan


def kendall_tau_b(a: Sequence[float], b: Sequence[float]) -> float:
    """(concordant − discordant) / sqrt((n0 − ties in a)(n0 − ties in b)) over all pairs."""
    if len(a) != len(b):
        raise ValueError("kendall needs two sequences of one length")
    concordant = discordant = ties_a = ties_b = 0
    n = len(a)
    for i in range(n):
        for j in range(i + 1, n):
            da, db = a[i] - a[j], b[i] - b[j]
            if da == 0 and db == 0:
                continue  # tied in both: in neither count nor either correction's pairs
            if da == 0:
                ties_a += 1
            elif db == 0:
                ties_b += 1
            elif (da > 0) == (db > 0):
                concordant += 1
            else:
                discordant += 1
    denom = math.sqrt((concordant + discordant + ties_a) * (concordant + discordant + ties_b))
    return (concordant - discordant) / denom if denom > 0 else math.nan


def median_relative_error(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """Median of |predicted − measured| / measured."""
    return statistics.median(abs(p - m) / m for p, m in zip(predicted, measured))

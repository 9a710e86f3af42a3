"""The layout search's budget (``planner/auto_layout.py``, ``SearchBudget``): a bounded
number of layouts priced, what it left unpriced counted and said, and never fewer than
one priced (a search always answers); a search cut short is not cached."""
from __future__ import annotations

import pytest

from fxpipe.ir.parallel_config import ParallelConfig
from fxpipe.models.registry import build_workload
from fxpipe.planner.auto_layout import SearchBudget, search_layout
from fxpipe.planner.layout_space import candidate_layouts


@pytest.fixture(scope="module")
def tiny():
    return build_workload("gpt-tiny", batch=2, seq=8)


@pytest.mark.parametrize("budget", [SearchBudget(max_layouts=2), SearchBudget(max_layouts=2000, seconds=0.0)],
                         ids=["two-layouts", "no-seconds"])
def test_the_budget_bounds_the_layouts_priced_and_says_what_it_left(tiny, tmp_path, monkeypatch, budget):
    monkeypatch.setenv("FXPIPE_CACHE_DIR", str(tmp_path))
    base = ParallelConfig(costs="model", hardware="cpu")
    pinned = {"num_microbatches": 2}
    total = len(list(candidate_layouts(2, 2, base, pinned)))  # every layout of 2 ranks on 2 rows, m = 2
    found = search_layout(tiny.model, tiny.example_inputs, 2, loss_fn=tiny.loss_fn, base=base, concurrent=1,
                          pinned=pinned, exhaustive=True, budget=budget, cache=True)
    tried = len(found.ranked) + len(found.refused)
    assert found.stopped == "budget" and 1 <= tried <= budget.max_layouts and tried < total, (tried, total)
    assert found.pruned == total - tried > 0
    assert f"{found.pruned} layouts not priced: the search's budget ran out" in found.table()
    assert not any((tmp_path / "layouts").glob("*.json")), "a search cut short is cached"

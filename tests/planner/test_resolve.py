"""The one entry to a run's layout (fxpipe/planner/resolve.py): a layout given comes back
untouched; a searched one is the search's choice on the searched fields and the caller's
base on every other field, with the search's table printed and returned."""
from __future__ import annotations

import pytest

from fxpipe.ir.parallel_config import ParallelConfig
from fxpipe.models.registry import build_workload
from fxpipe.planner.auto_layout import search_layout
from fxpipe.planner.layout_space import SEARCHED
from fxpipe.planner.resolve import ResolvedLayout, resolve_layout


@pytest.fixture(scope="module")
def tiny():
    return build_workload("gpt-tiny", batch=8, seq=16)


def test_a_layout_given_is_returned_as_given_and_nothing_is_built():
    base = ParallelConfig(tp=2, pp=2, microbatches=4, seed=3)
    chosen = resolve_layout(base, None, 4, lambda: pytest.fail("a layout given builds no workload"))
    assert chosen == ResolvedLayout(base) and chosen.table is None


@pytest.mark.slow
def test_a_searched_layout_is_the_searchs_choice_over_the_callers_base(tiny, capsys):
    base = ParallelConfig(costs="model", seed=7)
    pinned = {"pp": 2}
    chosen = resolve_layout(base, pinned, 2, lambda: (tiny.model, tiny.example_inputs, tiny.loss_fn))
    # The reference: the search itself, on the cost model (the same prices every call).
    found = search_layout(tiny.model, tiny.example_inputs, 2, loss_fn=tiny.loss_fn, base=base, pinned=pinned)
    assert {f: getattr(chosen.config, f) for f in SEARCHED} == {f: getattr(found.chosen.config, f) for f in SEARCHED}
    assert chosen.config.pp == 2 and chosen.config.seed == 7 and chosen.config.costs == "model"
    # The same table but for the seconds the search took (its first line).
    assert chosen.table.splitlines()[1:] == found.table().splitlines()[1:]
    assert chosen.table in capsys.readouterr().out
    config = chosen.config
    assert chosen.microbatch_rows(8) * config.replicas * config.num_microbatches == 8

"""The search's pruning and its cache (planner/layout_bound.py, planner/layout_cache.py):
the bound never above the price of any layout, the pruned search's choice the
exhaustive one's, a cached search read back as written, and a bad cache ignored."""
from __future__ import annotations

import json
import statistics

import pytest

from fxpipe.ir.parallel_config import ParallelConfig
from fxpipe.models.registry import build_workload
from fxpipe.planner import layout_cache
from fxpipe.planner.auto_layout import _bounds, search_layout
from fxpipe.planner.layout_space import candidate_layouts
from fxpipe.planner.layout_costs import CaptureCosts
from fxpipe.planner.layout_price import describe


@pytest.fixture(scope="module")
def tiny():
    return build_workload("gpt-tiny", batch=2, seq=8)


M2 = {"num_microbatches": 2}


@pytest.fixture(scope="module")
def exhaustive(tiny):
    # Two ranks sharing one core: the concurrency term of the bound is exercised too. Two
    # microbatches: every schedule and head mode of pp = 2, and tp = 2 (16 layouts).
    base = ParallelConfig(costs="model", hardware="cpu")
    return base, search_layout(tiny.model, tiny.example_inputs, 2, loss_fn=tiny.loss_fn, base=base,
                               exhaustive=True, concurrent=1, pinned=M2)


def test_the_bound_is_below_every_layouts_price(tiny, exhaustive):
    base, found = exhaustive
    costs = CaptureCosts(tiny.model, tuple(tiny.example_inputs), base, tiny.loss_fn, False, None)
    candidates = list(candidate_layouts(2, 2, base, M2))
    bounds = _bounds(candidates, 2, costs, frozenset(), None, 1, [])
    priced = {describe(p.config): p.step_s for p in found.ranked}
    pairs = [(bounds[i], priced[describe(c)]) for i, c in enumerate(candidates) if describe(c) in priced]
    assert len(pairs) == len(found.ranked) > 10
    assert all(0 < b <= s * (1 + 1e-12) for b, s in pairs)
    # Not vacuous: the bound separates layouts (some bounds exceed the best price), and it
    # is most of a layout's price (what it leaves out here is the LM head, the bubble and
    # the transfers beyond one value per boundary). On this overhead-bound model the
    # per-kernel costs every layout pays alike are most of each price, so fewer bounds
    # clear the best price than on a real job (``fxpipe run``'s default search skips 183
    # to 204 of its 222 layouts).
    assert sum(b > found.chosen.step_s for b, _ in pairs) >= 1
    assert statistics.median(b / s for b, s in pairs) > 0.5


def test_the_pruned_search_chooses_what_pricing_every_layout_chooses(tiny, exhaustive):
    base, found = exhaustive
    pruned = search_layout(tiny.model, tiny.example_inputs, 2, loss_fn=tiny.loss_fn, base=base, concurrent=1,
                           pinned=M2)
    assert pruned.chosen == found.chosen  # config, step, memory: the same layout priced the same
    assert pruned.pruned > 0 and pruned.stopped == "bound"
    assert len(pruned.ranked) < len(found.ranked)
    assert "layouts not priced: their lower bound exceeds the best price" in pruned.table()


def test_a_search_is_cached_and_a_bad_cache_is_ignored(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("FXPIPE_CACHE_DIR", str(tmp_path))
    base = ParallelConfig(costs="model", hardware="cpu")
    pp1 = {"pp": 1}  # the few layouts without a pipeline: the cache is what is tested
    search = lambda: search_layout(tiny.model, tiny.example_inputs, 2, loss_fn=tiny.loss_fn,  # noqa: E731
                                   base=base, cache=True, pinned=pp1)
    first = search()
    files = list((tmp_path / "layouts").glob("*.json"))
    assert len(files) == 1 and not first.cached
    again = search()
    assert again.cached and again.chosen == first.chosen
    assert [p.step_s for p in again.ranked] == [p.step_s for p in first.ranked[:len(again.ranked)]]
    assert "layout search cached" in again.table()
    body = json.loads(files[0].read_text())
    key, text = body["key"], files[0].read_text()
    # Another pin, another world: another key (another file).
    program = CaptureCosts(tiny.model, tuple(tiny.example_inputs), base, tiny.loss_fn, False, None).program(1)
    batch = [(t.shape, str(t.dtype)) for t in tiny.example_inputs]
    same = layout_cache.search_key(program, batch, 2, base, pp1, None, None)
    assert same == key
    assert layout_cache.search_key(program, batch, 2, base, {"pp": 2}, None, None) != key
    assert layout_cache.search_key(program, batch, 4, base, pp1, None, None) != key

    def rejected(content: str, why: str) -> None:
        files[0].write_text(content)
        with pytest.warns(UserWarning, match=why):
            assert layout_cache.load(files[0], key, base) is None

    tampered = json.loads(text)
    tampered["rows"][0]["layout"]["tp"] = 2
    rejected(json.dumps(tampered), "digest does not match")
    digest = lambda b: {**b, "digest": layout_cache._digest(b)}  # noqa: E731 - a forger's valid digest
    bad = {k: v for k, v in json.loads(text).items() if k != "digest"}
    bad["rows"][0]["layout"]["tp"] = "2"
    rejected(json.dumps(digest(bad)), "not a small non-negative integer")
    bad = {k: v for k, v in json.loads(text).items() if k != "digest"}
    bad["rows"][0]["layout"]["schedule"] = "no-such-schedule"
    rejected(json.dumps(digest(bad)), "ignoring the layout search cache")
    other = {k: v for k, v in json.loads(text).items() if k != "digest"}
    other["key"] = {**key, "world": 4}
    rejected(json.dumps(digest(other)), "written for another search")
    rejected("\x80 not json", "ignoring the layout search cache")
    files[0].write_text(text)
    assert layout_cache.load(files[0], key, base) is not None  # the file as written still reads

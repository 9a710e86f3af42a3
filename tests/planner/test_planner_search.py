"""The search against brute force, its rules, and its speed at paper scale."""
import itertools
import time

import pytest

from fxpipe.base.hardware import Hardware
from fxpipe.passes.recompute import RecomputeMode
from fxpipe.planner import (LayerBalance, CandidateLayout, PlannerOptions, ScheduleKind, TransformerShape,
                            enumerate_layouts, plan, predict, shape_from_registry)
from fxpipe.planner.stages import split_layers
from fxpipe.base.hardware import A100

SMALL = TransformerShape(name="small", layers=6, hidden=1024, heads=8, seq=1024, vocab=32000)
# A100 with 3 GiB so that memory prunes part of the space.
TIGHT = Hardware(**{**A100.__dict__, "memory_bytes": 3 * 2**30})


def _brute_force(shape, gpus, B, opts):
    """Independent enumeration with plain loops; every layout predicted."""
    out = []
    for t, p in itertools.product(range(1, gpus + 1), repeat=2):
        if gpus % (t * p) or shape.heads % t or p > shape.layers:
            continue
        d = gpus // (t * p)
        if B % d:
            continue
        for b in range(1, min(B // d, opts.max_micro_batch) + 1):
            if (B // d) % b:
                continue
            m = B // (d * b)
            for kind, v, rc in itertools.product(opts.schedules, range(1, opts.max_chunks + 1), RecomputeMode):
                if (kind is ScheduleKind.INTERLEAVED) != (v > 1) or p * v > shape.layers:
                    continue
                if p == 1 and kind is not ScheduleKind.ONE_F_ONE_B:
                    continue
                cfg = CandidateLayout(tp=t, pp=p, dp=d, micro_batch=b, num_microbatches=m, chunks=v,
                                     schedule=kind, recompute=rc)
                out.append(predict(shape, cfg, opts))
    return out


def test_search_equals_brute_force_and_respects_rules():
    opts = PlannerOptions(hardware=TIGHT, max_chunks=3, max_micro_batch=4)
    brute = _brute_force(SMALL, 8, 16, opts)
    assert {p.config for p in brute} == set(enumerate_layouts(SMALL, 8, 16, opts))
    fitting = [p for p in brute if p.fits]
    assert 0 < len(fitting) < len(brute)  # memory prunes some
    result = plan(SMALL, 8, 16, opts, top=5)
    best = min(p.iteration_s for p in fitting)
    assert result.predictions[0].iteration_s == pytest.approx(best)
    ranked = sorted(p.iteration_s for p in fitting)[:5]
    assert [p.iteration_s for p in result.predictions] == pytest.approx(ranked)
    assert result.simulated < result.fitting  # the bound pruned
    for pred in result.predictions:
        c = pred.config
        assert c.gpus == 8 and c.global_batch == 16 and SMALL.heads % c.tp == 0
        assert c.pp * c.chunks <= SMALL.layers and pred.fits
        assert pred.memory.total <= TIGHT.usable_memory_bytes
        assert sum(pred.breakdown.values()) == pytest.approx(pred.iteration_s)
    exhaustive = plan(SMALL, 8, 16, opts, top=5, exhaustive=True)
    assert [p.config for p in exhaustive.predictions] == [p.config for p in result.predictions]


def test_megatron_balance_needs_divisible_layers():
    opts = PlannerOptions(balance=LayerBalance.MEGATRON)
    layouts = enumerate_layouts(SMALL, 8, 16, opts)
    assert layouts and all(SMALL.layers % (c.pp * c.chunks) == 0 for c in layouts)
    assert any(SMALL.layers % c.pp for c in enumerate_layouts(SMALL, 8, 16, PlannerOptions()))


def test_greedy_split_is_optimal_for_identical_layers():
    for extra in [(0.0, 0.0, 0.0, 2.5), (1.2, 0.0, 0.0, 0.7), (0.0,) * 4]:
        got = split_layers(11, 4, LayerBalance.FXPIPE, extra, 1.0)
        assert sum(got) == 11 and min(got) >= 1
        worst = max(e + c for e, c in zip(extra, got))
        best = min(max(e + c for e, c in zip(extra, split))
                   for split in itertools.product(range(1, 9), repeat=4) if sum(split) == 11)
        assert worst == pytest.approx(best)
    with pytest.raises(ValueError, match="l % \\(p·v\\)"):
        split_layers(10, 4, LayerBalance.MEGATRON, (0.0,) * 4, 1.0)


def test_nothing_fits_names_the_smallest_need():
    tiny = Hardware(**{**A100.__dict__, "memory_bytes": 2**20})
    with pytest.raises(ValueError, match="smallest needs"):
        plan(SMALL, 8, 16, PlannerOptions(hardware=tiny))


def test_gpt_1t_on_3072_gpus_in_seconds():
    # CPU time of this process: the shared 2-core CI machine's wall clock depends on its load
    start = time.process_time()
    result = plan(shape_from_registry("gpt-1t"), 3072, 3072, PlannerOptions(), top=3)
    assert time.process_time() - start < 10
    best = result.predictions[0]
    assert best.config.gpus == 3072 and best.fits
    assert 0.3 < best.percent_of_peak / 100 < 0.7

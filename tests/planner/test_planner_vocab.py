"""The planner's vocabulary passes (``VocabPasses``) against a hand-built simulation, the
memory closed form V·h/(t·p) per rank, the schedules' action lists and the search."""
import argparse
import dataclasses
import json

import numpy as np
import pytest

from fxpipe.base.hardware import A100, Hardware
from fxpipe.planner import (CandidateLayout, Component, PlannerOptions, ScheduleKind, TransformerShape, VocabPasses,
                            plan, predict, shape_from_registry)
from fxpipe.cli.plan import add_plan_arguments, run_plan
from fxpipe.planner.options import LayerBalance
from fxpipe.planner.layer_cost import CostModel
from fxpipe.planner.pipeline_time import vocab_in_flight
from fxpipe.planner.predict import rank_memory
from fxpipe.planner.stages import plan_stages
from fxpipe.base.recompute_mode import RecomputeMode
from fxpipe.schedules import StageDurations, add_vocab_passes, generate, simulate, split_output_layer
from fxpipe.schedules.generators.interleaved import microbatch_groups
from fxpipe.schedules.actions import ActionKind

SHAPE = TransformerShape(name="x", layers=8, hidden=512, heads=8, seq=512, vocab=50257, dropout=False)
# A Gemma-sized vocabulary (256k rows) on a 1.5B-parameter stack: the head is ~10 layers' work.
BIG_VOCAB = TransformerShape(name="big-vocab", layers=18, hidden=2048, heads=8, seq=2048, vocab=256000)
KINDS = [(ScheduleKind.ONE_F_ONE_B, 1), (ScheduleKind.INTERLEAVED, 2), (ScheduleKind.ZB_H1, 1)]


def _pipelined(nbytes, size, link):
    """A ring broadcast or reduce in one node: the whole tensor over each link, n-1 hops."""
    return nbytes / link.collective_bw + (size - 1) * link.collective_latency


def _all_gather(nbytes, size, link):
    """A ring all-gather of ``nbytes`` from each rank in one node: n-1 hops of one rank's
    part each."""
    return (size - 1) * (nbytes / link.collective_bw + link.collective_latency)


@pytest.mark.parametrize("kind,v", KINDS)
def test_step_time_equals_a_direct_simulation(kind, v):
    t, p, b, m = 2, 4, 1, 8  # t·p = 8: one node
    cfg = CandidateLayout(tp=t, pp=p, dp=1, micro_batch=b, num_microbatches=m, chunks=v, schedule=kind,
                          recompute=RecomputeMode.NONE, vocab_passes=True)
    opts = PlannerOptions()
    model = CostModel(SHAPE, opts)
    stages = plan_stages(model, cfg)
    out = model.output_layer(t, b)
    # the partition's view: the output layer on the last stage; split_output_layer takes it off
    f, bw, w = stages.forward.copy(), stages.backward.copy(), stages.weight.copy()
    f[-1], bw[-1], w[-1] = f[-1] + out.forward_s, bw[-1] + out.backward_s, w[-1] + out.weight
    durations = split_output_layer(StageDurations(forward=f, backward=bw, weight=w), p,
                                   forward=out.forward_s, backward=out.backward_s, weight=out.weight)
    link, n, d = A100.intra_node, b * SHAPE.seq, opts.dtype_bytes
    bcast = _pipelined(d * n * SHAPE.hidden + 8 * n, p, link)  # input and int64 targets in one buffer
    # every block's max, sum-exp and target logit (3 × fp32) gathered: over pp, then TP
    stats = sum(_all_gather(12 * n, size, link) for size in (p, t))
    reduce = _pipelined(d * n * SHAPE.hidden, p, link)
    direct = simulate(add_vocab_passes(generate(kind.value, p, m, v)), durations,
                      collective_latency=(bcast, stats, reduce))
    pred = predict(SHAPE, cfg, opts, model)
    assert pred.makespan_s == pytest.approx(direct.makespan, rel=1e-9)
    assert pred.pipeline.busy == pytest.approx(direct.busy, rel=1e-9)
    # iteration: the last rank to finish, plus the first microbatch's lookup part (b·s·h, point to
    # point; later ones are sent ahead), plus its Adam step; d = 1 and no tied copy: no all-reduce
    lookup = d * n * SHAPE.hidden / link.p2p_bw + link.p2p_latency
    params = stages.ranks(stages.params)
    ends = [float(e.max()) + lookup + A100.memory_s(params[r] * opts.optimizer_bytes_per_param, 4)
            for r, e in enumerate(direct.timeline.end)]
    assert pred.iteration_s == pytest.approx(max(ends), rel=1e-9)
    assert Component.DP_SYNC not in pred.breakdown
    assert pred.breakdown[Component.VOCAB_LOOKUP] == pytest.approx(lookup)
    assert sum(pred.breakdown.values()) == pytest.approx(pred.iteration_s)


@pytest.mark.parametrize("t,p", [(1, 2), (2, 4)])
def test_every_rank_holds_its_rows_of_the_tied_table(t, p):
    shape, b, m = SHAPE, 2, 8
    opts = PlannerOptions(balance=LayerBalance.MEGATRON)  # the same layers per stage either way
    h, s = shape.hidden, shape.seq
    vp = shape.padded_vocab(t)
    layer = 12 * h * h / t + 7 * h / t + 6 * h
    on, off = (predict(shape, CandidateLayout(tp=t, pp=p, dp=1, micro_batch=b, num_microbatches=m,
                                              vocab_passes=x), opts) for x in (True, False))
    model = CostModel(shape, opts)
    stages = plan_stages(model, on.config)
    flight = on.pipeline.in_flight
    mem_on = rank_memory(model, on.config, stages, flight)
    mem_off = rank_memory(model, off.config, plan_stages(model, off.config), flight)
    for r in range(p):
        rows = vp * h / (t * p)  # V·h/(t·p): the head's and the tied embedding's rows, held once
        expect = (shape.layers // p) * layer + rows + (s * h if r == 0 else 0) + (2 * h if r == p - 1 else 0)
        assert mem_on[r].params == pytest.approx(expect, rel=1e-12)
        assert mem_on[r].state_bytes == pytest.approx(18 * expect, rel=1e-12)
        # without the passes: the whole (TP-split) table on the first rank and a tied copy on the last
        ends = (r == 0) + (r == p - 1)
        assert mem_off[r].params - mem_on[r].params == pytest.approx(ends * vp * h / t - rows, rel=1e-9)
    # 1F1B: one block between S and T on every rank (its input copy and V/(t·p) fp32 logits);
    # every rank its lookup parts in flight (b·s·h each: the first stage's p microbatches and two
    # sent ahead), the last only the final norm's input instead of the head's inputs and logits
    block = 2 * s * b * h + 4 * s * b * vp / (t * p)
    parts = min(p + 2, m)
    extra = [block + 2 * parts * b * s * h
             - (2 * s * b * h + 4 * s * b * vp / t if r == p - 1 else 0) for r in range(p)]
    assert [x.activation_bytes - y.activation_bytes for x, y in zip(mem_on, mem_off)] == pytest.approx(extra)


def _held(schedule, rank):
    held = peak = 0
    for a in schedule.actions[rank]:
        held += (a.kind is ActionKind.S) - (a.kind is ActionKind.T)
        peak = max(peak, held)
    return peak


def test_blocks_held_between_s_and_t_match_the_schedules():
    for kind, v in KINDS + [(ScheduleKind.INTERLEAVED, 3)]:
        for p in (2, 3, 4):
            for m in range(1, 3 * p + 2):
                sched = add_vocab_passes(generate(kind.value, p, m, v))
                held = [_held(sched, r) for r in range(p)]
                bound = vocab_in_flight(kind, p, m, v)
                assert max(held) <= bound, (kind, p, m, v)
                if v == 1 or len({len(g) for g in microbatch_groups(p, m)}) == 1:
                    assert held == [bound] * p, (kind, p, m, v)


def test_pp1_is_refused_and_not_searched():
    with pytest.raises(ValueError, match="pp=1.*use pp >= 2"):
        CandidateLayout(tp=1, pp=1, dp=1, micro_batch=1, num_microbatches=1, vocab_passes=True)
    with pytest.raises(ValueError, match="vocabulary passes need p >= 2.*--vocab-passes off"):
        plan(SHAPE, 1, 8, PlannerOptions(vocab_passes=VocabPasses.ON))


def test_search_equals_brute_force_with_both_variants():
    tight = Hardware(**{**A100.__dict__, "memory_bytes": 3 * 2**30})
    opts = PlannerOptions(hardware=tight, max_chunks=2, max_micro_batch=2, vocab_passes=VocabPasses.SEARCH)
    fast = plan(SHAPE, 8, 16, opts, top=6)
    brute = plan(SHAPE, 8, 16, opts, top=6, exhaustive=True)
    assert [p.config for p in fast.predictions] == [p.config for p in brute.predictions]
    assert fast.simulated < brute.simulated
    configs = [p.config for p in brute.predictions]
    assert any(c.vocab_passes for c in configs) or all(c.pp == 1 for c in configs)


def _twin(pred, shape, opts):
    return predict(shape, dataclasses.replace(pred.config, vocab_passes=not pred.config.vocab_passes), opts)


def test_a_large_vocabulary_prefers_vocabulary_passes():
    """256k rows: the head is a large share of the last stage, so the best layout runs the
    passes; its twin with the head on the last stage is slower, with that rank the busiest."""
    hw = Hardware(**{**A100.__dict__, "memory_bytes": 24 * 2**30})  # too small for p = 1
    opts = PlannerOptions(hardware=hw, vocab_passes=VocabPasses.SEARCH)
    best = plan(BIG_VOCAB, 8, 64, opts, top=3).predictions[0]
    c = best.config
    assert c.vocab_passes and c.pp >= 2
    twin = _twin(best, BIG_VOCAB, opts)
    assert twin.iteration_s > best.iteration_s
    out = plan_stages(CostModel(BIG_VOCAB, opts), c).output
    last = twin.stages.rank_busy()[c.pp - 1]
    assert (out.forward_s + out.backward_s) > 0.3 * last  # the head's share of the twin's last rank
    assert int(np.argmax(twin.pipeline.busy)) == c.pp - 1
    spread = [max(x.pipeline.busy) / min(x.pipeline.busy) for x in (best, twin)]
    assert spread[0] < spread[1]


def test_a_small_head_keeps_it_on_the_last_stage(capsys, tmp_path):
    """gpt-18b (V=51200, h=6144): the head is a fraction of one layer; the passes' collectives
    and lookups cost more than they balance. Through the CLI: the table's vocab column."""
    out = tmp_path / "plan.json"
    p = argparse.ArgumentParser()
    add_plan_arguments(p)
    args = p.parse_args(["--model", "gpt-18b", "--gpus", "256", "--global-batch", "1024", "--top", "8",
                         "--vocab-passes", "search", "--schedules", "1f1b,zb-h1", "--json", str(out),
                         "--dropout", "on", "--no-sp", "--zero", "0",  # as PlannerOptions() below
                         "--unfused-attention"])  # the registry's shape: the paper's kernels
    assert run_plan(args) == 0
    text = capsys.readouterr().out
    assert text.startswith("fxpipe plan: captured gpt-18b on meta")  # the shape read off its graph
    assert " vocab " in text.splitlines()[2]
    rows = json.loads(out.read_text())
    assert rows[0]["vocab_passes"] is False and any(r["vocab_passes"] for r in rows)
    shape = shape_from_registry("gpt-18b")
    opts = PlannerOptions()
    cfg = CandidateLayout(**{k: rows[0][k] for k in ("tp", "pp", "dp", "micro_batch")},
                          num_microbatches=rows[0]["microbatches"], schedule=ScheduleKind(rows[0]["schedule"]),
                          recompute=RecomputeMode(rows[0]["recompute"]))
    out_layer = CostModel(shape, opts).output_layer(cfg.tp, cfg.micro_batch)
    stages = plan_stages(CostModel(shape, opts), cfg)
    assert out_layer.forward_s + out_layer.backward_s < 0.1 * stages.rank_busy()[cfg.pp - 1]

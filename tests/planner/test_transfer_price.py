"""What a pipeline rank spends besides its stages (``planner/transfer_price.py``): its
transfers' own CPU time, counted against the stage plan the runtime runs, and the
row-split embedding lookups it does for other ranks, read off that plan — also for a
layout the search compiled only to the partition."""
import dataclasses

import pytest
import torch

from fxpipe.base.hardware import get_hardware
from fxpipe.compiler.pipeline import capture_for, compile_program
from fxpipe.ir.parallel_config import ParallelConfig
from fxpipe.models.registry import build_workload
from fxpipe.planner import layout_price
from fxpipe.planner.layout_costs import CaptureCosts
from fxpipe.planner.transfer_price import LookupWork, lookup_work, transfer_counts, with_transfers
from fxpipe.schedules.simulate import StageDurations

LAYOUTS = [dict(pp=2, schedule="1f1b"), dict(pp=2, schedule="interleaved"), dict(pp=4, schedule="gpipe")]


def _compiled(layout):
    w = build_workload("gpt-tiny", batch=8, seq=16, layers=4)
    config = ParallelConfig(microbatches=4, costs="model", **layout).with_world(layout["pp"])
    program = capture_for(w.model, tuple(t[:2] for t in w.example_inputs), config, w.loss_fn)
    return program, config, compile_program(program, config)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda d: f"pp{d['pp']}-{d['schedule']}")
def test_transfers_are_counted_as_the_plan_sends_them(layout):
    _, _, compiled = _compiled(layout)
    plan, rank = compiled.plan, compiled.schedule.stage_to_rank
    n = len(plan.stages)
    # The runtime (runtime/executor.py) posts one transfer per (value, consuming stage) whose
    # producer runs on another rank, at both ends; backward, for values with gradients.
    fwd, bwd = [0] * n, [0] * n
    for value in plan.values.values():
        if value.producer < 0:
            continue
        for c in value.consumers:
            if rank(c) != rank(value.producer):
                for s in (value.producer, c):
                    fwd[s] += 1
                    bwd[s] += value.requires_grad
    assert sum(fwd) > 0
    assert transfer_counts(compiled.program, rank, n) == (fwd, bwd)


def test_a_tied_head_on_the_last_rank_makes_it_look_up_every_row():
    """gpt-tiny's head is tied to its embedding and sits whole on the last rank at pp = 2:
    that rank holds the table and looks every microbatch's ids up for the first rank."""
    _, _, compiled = _compiled(dict(pp=2, schedule="1f1b"))
    (work,) = lookup_work(compiled.plan, compiled.schedule.stage_to_rank, 2)
    rows = compiled.plan.row_shards[compiled.plan.lookups[0].table]
    assert rows.ranks[0] == () and rows.ranks[1] == ((0, rows.rows),)  # the plan: rank 1 holds every row
    assert work.consumer == 0 and work.table_rows == rows.rows and work.rows == (0, rows.rows)
    assert work.tokens == 2 * 16 and work.hidden == 64 and work.dtype == torch.float32


def test_the_search_reads_the_lookups_of_a_layout_compiled_to_the_partition():
    program, config, compiled = _compiled(dict(pp=2, schedule="1f1b"))
    w = build_workload("gpt-tiny", batch=8, seq=16, layers=4)
    costs = CaptureCosts(w.model, w.example_inputs, ParallelConfig(), w.loss_fn, measure=False, threads=1)
    partial = compile_program(program, config, until="coalesce_blocks")
    assert partial.plan is None
    assert costs.lookups(partial) == lookup_work(compiled.plan, compiled.schedule.stage_to_rank, 2)
    assert costs.lookups(partial) is costs.lookups(partial)  # once per partition


def test_each_rank_pays_its_transfers_and_its_parts_per_microbatch():
    hw = dataclasses.replace(get_hardware("cpu"), transfer_cpu_s=1e-4)
    d = StageDurations(forward=(1.0, 2.0, 3.0), backward=(2.0, 4.0, 6.0), weight=(1.0, 2.0, 3.0))
    counts = ([1, 2, 1], [1, 2, 0])
    work = LookupWork(tokens=8, table_rows=10, hidden=4, dtype=torch.float32, consumer=0, rows=(4, 0, 6))
    parts = {work.part_key(4): (0.01, 0.02), work.part_key(6): (0.03, 0.05)}
    out = with_transfers(d, counts, (0, 1, 2), [work], parts, hw)
    # Rank 0 consumes: its own part and one transfer each way per other owner (rank 2);
    # rank 1 holds no rows: nothing; rank 2: its part and its two transfers.
    assert out.forward == pytest.approx((1.0 + 1e-4 + 0.01 + 1e-4, 2.0 + 2e-4, 3.0 + 1e-4 + 0.03 + 1e-4))
    assert out.backward == pytest.approx((2.0 + 1e-4 + 0.02 + 1e-4, 4.0 + 2e-4, 6.0 + 0.05 + 1e-4))
    assert out.weight == d.weight  # gradients travel in the input-gradient half


def test_the_price_carries_them():
    _, _, compiled = _compiled(dict(pp=2, schedule="gpipe"))
    hw = get_hardware("cpu")
    base = layout_price.price(compiled, dataclasses.replace(hw, transfer_cpu_s=0.0), lookups=())
    posted = layout_price.price(compiled, dataclasses.replace(hw, transfer_cpu_s=1e-3), lookups=())
    looked = layout_price.price(compiled, dataclasses.replace(hw, transfer_cpu_s=0.0))
    assert posted.step_s > base.step_s and looked.step_s > base.step_s

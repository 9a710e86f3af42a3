"""The layout search on the captured program (fxpipe/planner/auto_layout.py): its
enumeration against a count by hand, its pricing against the simulator, pins and
memory limits respected, a refusal with the numbers, and ``parallelize`` with no layout
arguments training exactly, the same layout on every rank."""
from __future__ import annotations

import pytest
import torch

from fxpipe.compiler.pipeline import capture_for, compile_program
from fxpipe.ir.parallel_config import ParallelConfig
from fxpipe.models.registry import build_workload
from fxpipe.planner.auto_layout import search_layout
from fxpipe.planner.layout_space import PIPELINE_SCHEDULES, candidate_layouts
from fxpipe.planner.layout_price import price
from fxpipe.planner.search import divisors
from fxpipe.schedules.registry import ScheduleKind
from fxpipe.schedules.simulate import StageDurations, simulate
from tests.runtime._cases import reference, train, workload
from tests.runtime._dist import run_world


@pytest.fixture(scope="module")
def tiny():
    return build_workload("gpt-tiny", batch=8, seq=16)


def test_enumeration_counts_every_layout_by_hand():
    rows, world = 8, 4
    got = list(candidate_layouts(world, rows, ParallelConfig()))
    expected = 0
    for tp in divisors(world):
        for pp in divisors(world // tp):
            dp = world // (tp * pp)
            if rows % dp == 0:
                ms = len(divisors(rows // dp))
                expected += ms * (len(PIPELINE_SCHEDULES) * 3 if pp > 1 else 1)
    # (tp, pp, dp): (1,1,4) 2 m's; (1,2,2) 3 m's × 5 schedules × head whole, blockwise loss or
    # vocab passes; (1,4,1) 4 × 15; (2,1,2) 3; (2,2,1) 4 × 15; (4,1,1) 4: 2 + 45 + 60 + 3 + 60 + 4.
    assert len(got) == expected == 174
    assert all(c.tp * c.pp * c.dp == world and rows % (c.dp * c.num_microbatches) == 0 for c in got)
    assert not any((c.vocab_passes or c.split_loss) and c.pp < 2 for c in got)
    assert not any(c.vocab_passes and c.split_loss for c in got)
    assert len({(c.tp, c.pp, c.dp, c.num_microbatches, c.schedule, c.chunks, c.vocab_passes, c.split_loss)
                for c in got}) == len(got)
    pinned = list(candidate_layouts(world, rows, ParallelConfig(), {"pp": 2, "schedule": "zb-v"}))
    assert pinned and all(c.pp == 2 and c.schedule is ScheduleKind.ZB_V and c.chunks == 2 for c in pinned)


def test_price_is_the_simulated_step_of_the_partitions_stage_times(tiny):
    config = ParallelConfig(pp=2, dp=1, microbatches=4, schedule="1f1b", partition="dp", costs="model")
    program = capture_for(tiny.model, tuple(t[:2] for t in tiny.example_inputs), config, tiny.loss_fn)
    compiled = compile_program(program, config)
    priced = price(compiled)
    stages = compiled.program.partition.stages
    durations = StageDurations(forward=tuple(c.fwd_s for c in stages), backward=tuple(c.bwd_s for c in stages),
                               weight=tuple(c.bwd_s / 2 for c in stages))
    bare = simulate(compiled.schedule, durations).makespan
    # A pipeline step lasts at least its busiest stage's m·(F+B) and at most the stages one
    # after another; transfers come on top (dp = 1: no all-reduce).
    busy = [4 * (f + b) for f, b in zip(durations.forward, durations.backward)]
    assert max(busy) <= bare <= sum(busy) + 1e-12
    assert priced.allreduce_s == 0 and bare <= priced.step_s <= bare + 16 * priced.step_s / 4
    assert priced.memory_bytes == max(compiled.program.partition.rank_memory_bytes)


def test_search_returns_the_fastest_fitting_layout_and_honours_pins(tiny):
    # The cost model, so that two searches price a layout alike (timing has noise).
    base = ParallelConfig(costs="model")
    batch = tuple(t[:4] for t in tiny.example_inputs)
    found = search_layout(tiny.model, batch, 2, loss_fn=tiny.loss_fn, base=base, exhaustive=True)
    steps = [p.step_s for p in found.ranked]
    assert found.chosen is found.ranked[0] and steps == sorted(steps) and len(found.ranked) > 20
    assert "->" in found.table() and "faster than" in found.table()
    pinned = search_layout(tiny.model, batch, 2, loss_fn=tiny.loss_fn, base=base,
                           pinned={"pp": 2, "schedule": "interleaved"})
    assert all(p.config.pp == 2 and p.config.schedule is ScheduleKind.INTERLEAVED for p in pinned.ranked)
    # A memory limit between the smallest and the largest rank's need: nothing over it is chosen.
    needs = sorted(p.memory_bytes for p in found.ranked)
    limit = needs[len(needs) // 2]
    capped = search_layout(tiny.model, batch, 2, loss_fn=tiny.loss_fn,
                           base=ParallelConfig(costs="model", memory_limit_gb=limit / 2**30), exhaustive=True)
    assert all(p.memory_bytes <= limit for p in capped.ranked)
    assert any("over the limit" in why for _, why in capped.refused)
    # Every layout that fitted is still there; ZeRO-1 may make more of them fit.
    fitting = {p.describe(): p.step_s for p in found.ranked if p.memory_bytes <= limit}
    assert fitting.items() <= {p.describe(): p.step_s for p in capped.ranked}.items()
    assert capped.chosen.step_s == min(p.step_s for p in capped.ranked) <= min(fitting.values())


def test_a_pin_nothing_fits_is_refused_with_the_numbers(tiny):
    with pytest.raises(ValueError, match=r"no layout of 2 ranks with pp=2, schedule=1f1b fits 1e-06 GiB per rank; "
                                         r"the smallest needs 0\.000[1-9]\d* GiB: raise memory_limit_gb to 0\.000[1-9]"):
        # Every layout is tried with each memory saver too: few of them, on the cost model.
        search_layout(tiny.model, tuple(t[:4] for t in tiny.example_inputs), 2, loss_fn=tiny.loss_fn,
                      pinned={"pp": 2, "schedule": "1f1b"}, base=ParallelConfig(memory_limit_gb=1e-6, costs="model"))
    with pytest.raises(ValueError, match=r"no layout of 2 ranks honours dp=3"):
        search_layout(tiny.model, tiny.example_inputs, 2, loss_fn=tiny.loss_fn, pinned={"dp": 3})
    with pytest.raises(ValueError, match=r"the layout search decides .*\['seed'\]"):
        search_layout(tiny.model, tiny.example_inputs, 2, pinned={"seed": 1})


def _auto(rank, world, name):
    from fxpipe.parallel import parallelize

    w = workload(name)
    pm = parallelize(w.model, example_inputs=w.example_inputs, loss_fn=w.loss_fn, costs="model")
    losses, grads, _ = train(pm, w)
    layout = {f: getattr(pm.config, f) for f in ("tp", "pp", "dp", "num_microbatches", "schedule", "chunks",
                                                  "vocab_passes")}
    out = dict(losses=losses, grads=grads, layout=layout, table=pm.compiled.layout_search)
    pm.close()
    return out


@pytest.mark.slow
def test_parallelize_without_a_layout_trains_exactly_on_the_searched_one():
    name = "gpt-tiny"
    ranks = run_world(2, _auto, name)
    assert ranks[0]["layout"] == ranks[1]["layout"]  # decided once, on every rank
    assert ranks[0]["table"] and ranks[0]["table"] == ranks[1]["table"]
    losses, _, grads = reference(name)
    for r in ranks:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(losses), rtol=1e-5, atol=1e-6)
    for n, g in grads.items():
        torch.testing.assert_close(ranks[0]["grads"][n], g, rtol=1e-4, atol=1e-6, msg=n)


def test_action_overhead_lengthens_every_action_once():
    from fxpipe.planner.layout_price import with_action_overhead
    from fxpipe.schedules.registry import generate

    o, m = 0.25, 4
    one = with_action_overhead(StageDurations.uniform(1), o, split=False)
    # One stage: nothing overlaps, m forwards and m backwards each o longer.
    assert simulate(generate("1f1b", 1, m), one).makespan == pytest.approx(m * (1 + 2 + 2 * o))
    split = with_action_overhead(StageDurations.uniform(2), o, split=True)
    # Split backward: I and W are separate actions, each o longer (B = I + W).
    assert split.weight == (1 + o,) * 2 and split.backward == (2 + 2 * o,) * 2
    base = simulate(generate("zb-h1", 2, m), StageDurations.uniform(2)).busy
    assert simulate(generate("zb-h1", 2, m), split).busy == pytest.approx([b + 3 * m * o for b in base])


def test_fxpipe_compile_prints_the_search_and_compiles_its_choice(capsys):
    from fxpipe.cli import main

    argv = ["compile", "--model", "gpt-tiny", "--batch", "8", "--seq", "16", "--costs", "model", "--world", "2"]
    assert main(argv + ["--pp", "2", "--schedule", "zb-h1"]) == 0
    out = capsys.readouterr().out
    # pp=2 zb-h1: m in 1, 2, 4, 8 × head whole, blockwise loss or vocabulary passes
    assert "layout search over 12 layouts of 2 ranks" in out
    chosen = [line for line in out.splitlines() if line.startswith("->")][0]
    assert "pp=2" in chosen and "zb-h1" in chosen
    assert "pipeline     pp=2 chunks=1 schedule=zb-h1" in out  # the choice is what was compiled


def test_tensor_parallel_collectives_are_priced_as_rings_on_the_link():
    from fxpipe.base.hardware import CPU
    from fxpipe.planner.layout_price import tp_collective_times

    w = build_workload("hf:llama", batch=2, seq=16)
    config = ParallelConfig(tp=2, costs="model", partition="dp")
    program = compile_program(capture_for(w.model, w.example_inputs, config, w.loss_fn), config).program
    names = [n.target._schema.name.split("::")[1] for n in program.graph.nodes
             if n.op == "call_function" and getattr(n.target, "namespace", None) == "fxpipe_tp"]
    hidden = 2 * 16 * w.model.config.hidden_size * 4  # one [b, s, h] fp32 activation
    ring = 2 * (1 / 2) * hidden / CPU.intra_node.collective_bw + 2 * CPU.intra_node.collective_latency
    fwd, bwd = tp_collective_times(program, 2, CPU, 1)
    # Megatron's f and g: g (reduce_from_tp) all-reduces forward, f (copy_to_tp) backward; the
    # vocabulary-parallel embedding's partial rows all-reduce forward like a g.
    assert names.count("copy_to_tp") >= 2 * w.model.config.num_hidden_layers
    assert bwd[0] == pytest.approx(names.count("copy_to_tp") * ring)
    losses = [n for n in program.graph.nodes if getattr(n.target, "namespace", None) == "fxpipe_tp"
              and n.target._schema.name.endswith("vocab_parallel_cross_entropy")]
    tokens = 2 * 15  # the causal LM loss predicts tokens 1..15 of each of the 2 rows
    assert [tuple(n.args[0].meta["val"].shape[:-1]) for n in losses] in ([(tokens,)], [(2, 15)])
    tokens_ring = 2 * (1 / 2) * tokens * 4 / CPU.intra_node.collective_bw + 2 * CPU.intra_node.collective_latency
    g = names.count("reduce_from_tp") + names.count("vocab_parallel_embedding")
    assert fwd[0] == pytest.approx(g * ring + 3 * names.count("vocab_parallel_cross_entropy") * tokens_ring)
    assert tp_collective_times(program, 1, CPU, 1) == ([0.0], [0.0])


@pytest.mark.parametrize("bad", [float("nan"), -1e-3, 1e300])
def test_a_profile_with_a_bad_action_overhead_is_refused(bad):
    from fxpipe.base.hardware import CPU, Hardware

    data = CPU.to_dict() | {"action_overhead_s": bad}
    with pytest.raises(ValueError, match=r"action_overhead_s must be in \[0, 1\) seconds"):
        Hardware.from_dict(data)
    assert Hardware.from_dict(CPU.to_dict() | {"action_overhead_s": 2.4e-4}).action_overhead_s == 2.4e-4

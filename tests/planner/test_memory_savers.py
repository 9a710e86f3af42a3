"""What the layout search does where memory is short (fxpipe/planner/layout_space.py's
``memory_savers``) and with experts: recompute priced by the partition against the saved
bytes autograd really keeps, the ladder of ZeRO-1 / SP / recompute under a memory limit,
expert parallelism as a layout of MoE graphs with its all-to-alls and its smaller
all-reduce, and the CPU ranks that share a machine's cores."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from fxpipe.base.recompute_mode import RecomputeMode
from fxpipe.compiler.pipeline import capture_for, compile_program
from fxpipe.costs.saved_activations import measure_saved
from fxpipe.ir.parallel_config import ParallelConfig
from fxpipe.models.registry import build_workload
from fxpipe.passes.assign_stages import build_problem_graph
from fxpipe.passes.recompute import apply_recompute, find_regions
from fxpipe.planner.auto_layout import search_layout
from fxpipe.planner.layout_space import candidate_layouts, memory_savers
from fxpipe.planner.layout_price import ep_collective_times, local_world, price


@pytest.fixture(scope="module")
def tiny():
    return build_workload("gpt-tiny", batch=4, seq=16)


def _graph_program(w):
    config = ParallelConfig(costs="model")
    return compile_program(capture_for(w.model, w.example_inputs, config, w.loss_fn), config, until="cost").program


def test_recompute_priced_as_the_bytes_autograd_keeps_and_the_forward_run_again(tiny):
    program = _graph_program(tiny)
    args = [program.state[p.canonical].detach().requires_grad_(True) for p in program.params] + list(
        tiny.example_inputs)
    base = ParallelConfig(costs="model")
    predicted, measured, bwd = {}, {}, {}
    for mode in RecomputeMode:
        pconfig = dataclasses.replace(base.partition_config(base.schedule_ir()), recompute=mode)
        g = build_problem_graph(program, pconfig)
        predicted[mode] = sum(d["act_bytes"] for _, d in g.nodes(data=True))
        bwd[mode] = sum(d["bwd"] for _, d in g.nodes(data=True))
        torch.manual_seed(0)
        measured[mode] = sum(measure_saved(apply_recompute(program.graph_module, program.layers, mode), args,
                                           program.layers).by_layer.values())
    none, sel, full = RecomputeMode.NONE, RecomputeMode.SELECTIVE, RecomputeMode.FULL
    assert predicted[none] > predicted[sel] > predicted[full]
    assert measured[none] > measured[sel] > measured[full]
    # What full recompute saves, predicted against autograd's count: the same share within 10 points.
    assert 1 - predicted[full] / predicted[none] == pytest.approx(1 - measured[full] / measured[none], abs=0.10)
    # Backward runs every recomputed node's forward again, and nothing else.
    g = build_problem_graph(program, base.partition_config(base.schedule_ir()))
    again = {m: sum(g.nodes[n.name]["fwd"] for _, nodes in find_regions(program.graph_module, program.layers, m)
                    for n in nodes) for m in (sel, full)}
    for m in (sel, full):
        assert bwd[m] - bwd[none] == pytest.approx(again[m], rel=1e-9) and again[m] > 0


def test_memory_savers_are_tried_cheapest_first_and_keep_what_is_fixed():
    config = ParallelConfig(tp=2, pp=1, dp=2, costs="model")
    got = [(c.zero, c.sp, c.recompute) for c in memory_savers(config, frozenset())]
    assert got == [(0, False, RecomputeMode.NONE), (1, False, RecomputeMode.NONE), (1, True, RecomputeMode.NONE),
                   (1, True, RecomputeMode.SELECTIVE), (1, True, RecomputeMode.FULL)]
    assert [c.recompute for c in memory_savers(ParallelConfig(tp=1, pp=2, dp=1), frozenset({"recompute"}))] == [
        RecomputeMode.NONE]
    assert [(c.zero, c.sp) for c in memory_savers(ParallelConfig(tp=1, pp=1, dp=2, ep=2), frozenset())] == [(0, False)]


def test_a_layout_over_the_limit_is_taken_with_recompute_and_refused_when_recompute_is_pinned_off(tiny):
    layout = dict(tp=1, pp=2, dp=1, num_microbatches=4, schedule="1f1b", split_loss=False, vocab_passes=False)
    plain = search_layout(tiny.model, tiny.example_inputs, 2, loss_fn=tiny.loss_fn, pinned=layout,
                          base=ParallelConfig(costs="model")).chosen
    limit_gb = 0.97 * plain.memory_bytes / 2**30
    found = search_layout(tiny.model, tiny.example_inputs, 2, loss_fn=tiny.loss_fn, pinned=layout,
                          base=ParallelConfig(costs="model", memory_limit_gb=limit_gb))
    chosen = found.chosen
    assert chosen.config.recompute is not RecomputeMode.NONE and chosen.memory_bytes <= limit_gb * 2**30
    assert chosen.step_s > plain.step_s  # recompute costs time: it is only taken where memory needs it
    assert any("over the limit" in why for name, why in found.refused if "recompute" not in name)
    with pytest.raises(ValueError, match=r"fits .* GiB per rank; the smallest needs"):
        search_layout(tiny.model, tiny.example_inputs, 2, loss_fn=tiny.loss_fn, pinned={**layout, "recompute": "none"},
                      base=ParallelConfig(costs="model", memory_limit_gb=limit_gb))


def _moe(rows=8):
    from tests.runtime._ep_cases import model_and_batch

    return model_and_batch(rows)


def test_expert_parallelism_is_a_layout_of_moe_graphs_only(tiny):
    model, batch = _moe()
    found = search_layout(model, batch, 2, base=ParallelConfig(costs="model"), pinned={"pp": 1}, exhaustive=True)
    by_name = {p.describe(): p for p in found.ranked}
    with_ep, without = by_name["tp=1 pp=1 dp=2 m=1 ep=2"], by_name["tp=1 pp=1 dp=2 m=1"]
    # E/ep experts per rank: less state and a smaller all-reduce; the dispatch's all-to-alls on top.
    assert with_ep.memory_bytes < without.memory_bytes and with_ep.allreduce_s < without.allreduce_s
    config = dataclasses.replace(with_ep.config, partition="dp")
    compiled = compile_program(capture_for(model, tuple(t[:4] for t in batch), config), config)
    fwd, bwd = ep_collective_times(compiled.program, compiled.program.partition_config.hardware, 1, 1)
    assert fwd[0] > 0 and bwd[0] == fwd[0]
    assert price(compiled).allreduce_s == pytest.approx(with_ep.allreduce_s)
    assert not any(c.ep > 1 for c in candidate_layouts(4, 8, ParallelConfig()))  # no experts, no ep
    assert {c.ep for c in candidate_layouts(4, 8, ParallelConfig(), experts=(8,)) if c.dp == 4} == {1, 2, 4}
    assert {c.ep for c in candidate_layouts(4, 8, ParallelConfig(), experts=(6,)) if c.dp == 4} == {1, 2}


def test_cpu_ranks_share_each_machines_cores(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert local_world(4) == (2, None)  # 4 ranks × 2 threads: every rank has its cores
    assert local_world(16) == (1, 8)  # 16 ranks on 8 cores: 8 at once
    assert local_world(32, per_node=16) == (1, 16)  # two such machines: 8 at once on each

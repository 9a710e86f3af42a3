"""What the layout search shares between shapes (fxpipe/planner/layout_costs.py): the passes
before tensor parallelism run once per micro-batch size and the device pass copies no graph
it leaves as it is — each prefix and each price is the one a compile of its own capture makes."""
import dataclasses

import networkx as nx
import pytest
import torch

from fxpipe.compiler.pipeline import capture_for, compile_program
from fxpipe.ir.parallel_config import ParallelConfig
from fxpipe.models.registry import build_workload
from fxpipe.passes.assign_stages import build_problem_graph
from fxpipe.passes.device import retarget_device
from fxpipe.planner.layout_costs import PREFIX_END, CaptureCosts
from fxpipe.planner.layout_price import price
from tests._shared import node_value


def _assert_same(alone, shared):
    assert shared.graph_module.code == alone.graph_module.code
    for a, b in zip(alone.graph.nodes, shared.graph.nodes, strict=True):
        assert (b.name, b.target, b.args, b.kwargs) == (a.name, a.target, a.args, a.kwargs) or \
            str((b.args, b.kwargs)) == str((a.args, a.kwargs)), a.name
        assert node_value(b.meta.get("val")) == node_value(a.meta.get("val")), a.name
    for field in ("params", "inputs", "module_paths", "layers", "costs", "model_stats", "token_inputs"):
        assert getattr(shared, field) == getattr(alone, field), field
    assert shared.tp_specs == alone.tp_specs


@pytest.fixture(scope="module")
def tiny():
    return build_workload("gpt-tiny", batch=8, seq=16)


def test_each_prefix_is_the_compile_of_its_own_capture(tiny):
    base = ParallelConfig(costs="model", hardware="cpu")
    costs = CaptureCosts(tiny.model, tiny.example_inputs, base, tiny.loss_fn, measure=False, threads=None)
    # Every tp at one row count, then the other order: the shared passes ran for the first config only.
    for tp, pp, dp, m, rows in ((1, 2, 1, 2, 4), (2, 1, 1, 2, 4), (2, 2, 1, 4, 2), (1, 1, 2, 1, 2), (2, 1, 1, 8, 1)):
        config = dataclasses.replace(base, tp=tp, pp=pp, dp=dp, num_microbatches=m, partition="dp")
        alone = compile_program(capture_for(tiny.model, tuple(t[:rows] for t in tiny.example_inputs), config,
                                            tiny.loss_fn), config, until=PREFIX_END).program
        _assert_same(alone, costs.prefix(config, rows))
        assert costs.prefix(config, rows).model_stats.flops_per_step == alone.model_stats.flops_per_step
        # and the layout priced from it
        compiled = costs.compile(config, rows)
        whole = compile_program(capture_for(tiny.model, tuple(t[:rows] for t in tiny.example_inputs), config,
                                            tiny.loss_fn), config)
        # As the search prices it: the row-split lookups a partial compile does not carry
        # read off its partition's plan (CaptureCosts.lookups), the whole compile's off its own.
        searched = price(compiled, lookups=costs.lookups(compiled))
        assert searched.step_s == price(whole).step_s
        assert searched.memory_bytes == price(whole).memory_bytes
    assert sorted(costs.canonicals) == [1, 2, 4]


def test_the_device_pass_copies_only_what_it_changes(tiny):
    program = capture_for(tiny.model, tiny.example_inputs, ParallelConfig(), tiny.loss_fn)
    assert any(isinstance(a, torch.device) for n in program.graph.nodes for a in n.kwargs.values())  # arange's
    assert retarget_device(program, torch.device("cpu")) is program  # captured on the cpu: nothing to change
    moved = retarget_device(program, torch.device("meta"))
    assert moved is not program
    devices = [a for n in moved.graph.nodes for a in n.kwargs.values() if isinstance(a, torch.device)]
    assert devices and all(d == torch.device("meta") for d in devices)
    # the captured graph itself is left as it was
    assert all(a == torch.device("cpu") for n in program.graph.nodes for a in n.kwargs.values()
               if isinstance(a, torch.device))


def test_the_bound_and_the_timing_read_one_problem_graph_per_shape(tiny):
    base = ParallelConfig(hardware="cpu")
    costs = CaptureCosts(tiny.model, tiny.example_inputs, base, tiny.loss_fn, measure=True, threads=1)
    for tp, rows in ((2, 4), (1, 2)):
        config = dataclasses.replace(base, tp=tp, pp=2, num_microbatches=8 // rows, partition="dp")
        costs.work(config, rows)
        program = costs.prefix(config, rows)
        built = costs.fines[id(program.graph_module)]
        assert len(built) == 1  # the timing's probe groups were cut from the bound's graph
        pconfig, fine = built[0]
        fresh = build_problem_graph(program, pconfig)
        assert nx.utils.graphs_equal(fine, fresh) and list(fine.nodes) == list(fresh.nodes)
        assert costs.timed[(tp, False, rows)] is not None

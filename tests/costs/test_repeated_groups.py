"""The layout search times each repeated probe group once (fxpipe/costs/local.py's
``repeated_groups``): groups that share a representative run the same ops on the same
shapes, a group of another width is never taken for one it does not match, and a stack
of identical layers is timed about one layer's worth."""
from __future__ import annotations

import torch
import torch.nn as nn

from fxpipe.compiler.pipeline import capture_for, compile_program
from fxpipe.costs import probe_groups
from fxpipe.costs.local import repeated_groups
from fxpipe.ir.parallel_config import ParallelConfig


class Stack(nn.Module):
    """Four blocks of width 32, then one of width 48: the last block's ops match none."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32))
                                    for _ in range(4))
        self.wide = nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x + self.wide(x)


def _program():
    config = ParallelConfig(costs="model")
    batch = (torch.randn(8, 32), torch.randn(8, 32))
    program = capture_for(Stack(), batch, config, nn.functional.mse_loss)
    return compile_program(program, config, until="cost").program, config


def _signature(program, names):
    """What the kernels see, written out independently: each node's op and output shape."""
    nodes = {n.name: n for n in program.graph.nodes}
    shape = lambda v: tuple(v.shape) if isinstance(v, torch.Tensor) else tuple(shape(x) for x in v)  # noqa: E731
    return [(str(nodes[n].target), shape(nodes[n].meta["val"])) for n in names]


def test_shared_groups_run_the_same_ops_on_the_same_shapes():
    program, config = _program()
    ctx_config = config.partition_config(config.schedule_ir())
    _fine, probe = probe_groups(program, ctx_config)
    same = repeated_groups(program, probe.members)
    assert len(same) == len(probe.members)
    assert all(same[g] <= g and same[same[g]] == same[g] for g in range(len(same)))
    for g, rep in enumerate(same):
        if rep != g:
            assert _signature(program, probe.members[g]) == _signature(program, probe.members[rep])
    shared = sum(rep != g for g, rep in enumerate(same))
    assert shared > 0, same  # four identical blocks: some of their groups are timed once
    # No group that reads the 48-wide weights shares a representative with a 32-wide one.
    wide = {g for g, names in enumerate(probe.members)
            if any("48" in str(s) for _t, s in _signature(program, names))}
    assert wide and all(same[g] in wide for g in wide)


def test_a_graph_with_data_dependent_sizes_is_timed_not_modelled():
    """An MoE's routed token counts are data-dependent sizes (SymInts) in the captured
    graph; the search must still time its groups. Before, ``repeated_groups`` failed to
    hash them and the whole shape silently fell back to the cost model (which put an MoE
    at a fraction of what it runs in)."""
    from fxpipe.models.registry import build_workload
    from fxpipe.planner.layout_costs import CaptureCosts

    w = build_workload("zoo:moe", batch=4, seq=16, seed=0)
    costs = CaptureCosts(w.model, w.example_inputs, ParallelConfig(), w.loss_fn, measure=True, threads=1)
    config = ParallelConfig(pp=2, num_microbatches=2).with_world(2)
    program = costs.prefix(config, 2)
    symbolic = [n.name for n in program.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)
                and not all(isinstance(d, int) for d in n.meta["val"].shape)]
    assert symbolic, "the MoE's routed sizes are data-dependent in its graph"
    timed = costs._timed(config, 2)
    assert costs.notes == [] and timed is not None, costs.notes
    # The experts' matmuls run on the routed rows: each has a measured time of its own.
    experts = [n.name for n in program.graph.nodes if n.name in symbolic and "linear" in str(n.target)]
    assert experts and all(timed.fused[n][0] > 0 for n in experts), experts

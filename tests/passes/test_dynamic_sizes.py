"""Data-dependent sizes (a dropless MoE's routed tokens) through cost, partition and split."""
from __future__ import annotations

import functools

import pytest
import torch

import fxpipe
from fxpipe.compiler.driver import run_passes
from fxpipe.passes.assign_stages import PartitionConfig, assign_stages
from fxpipe.passes.split import split_program
from fxpipe.compiler.compile_report import compile_summary
from fxpipe.ir.sizes import is_dynamic, unbacked_symbols
from tests.passes._inplace_models import DroplessMoE, batch


def _moe(device="cpu"):
    torch.manual_seed(0)
    with torch.device(device):
        model = DroplessMoE(layers=2)
    idx, tgt = batch(b=2)
    return model, (idx.to(device), tgt.to(device))


@functools.lru_cache(maxsize=None)
def _captured_moe():
    """(model, batch, capture, compiled program) of the CPU MoE, shared by the tests below:
    exporting its data-dependent routing is the slow part, and neither capture nor the
    passes change what they are given (each test only reads them)."""
    model, inputs = _moe()
    prog = fxpipe.capture(model, inputs)
    return model, inputs, prog, run_passes(prog)[0]


def _tokens_per_expert(model: DroplessMoE, idx: torch.Tensor) -> list[int]:
    """Routed-token counts computed from the eager model's own router, independently."""
    counts = []
    x = model.wte(idx)
    for blk in model.h:
        x = x + blk.attn(blk.ln1(x))
        flat = blk.ln2(x).reshape(-1, x.shape[-1])
        chosen = blk.moe.router(flat).softmax(-1).topk(blk.moe.top_k, dim=-1).indices
        counts += [int((chosen == e).sum()) for e in range(len(blk.moe.up))]
        x = x + blk.moe(blk.ln2(x))
    return counts


def test_sizes_are_those_of_the_example_batch():
    model, inputs, prog, passed = _captured_moe()
    symbols = unbacked_symbols(prog.graph_module)
    assert len(symbols) >= 8  # one routed-token count per expert and layer at least
    with torch.no_grad():
        expected = _tokens_per_expert(model, inputs[0])
    # Each expert's count is a size hint (torch.where gives one symbol per call).
    assert sorted(expected) == sorted(prog.size_hints[s] for s in symbols[:len(expected)])
    assert "priced at the example batch's sizes" in compile_summary(passed)


def test_meta_capture_prices_sizes_at_their_upper_bound():
    model, inputs = _moe("meta")
    prog = fxpipe.capture(model, inputs)
    assert prog.size_hints == {}
    prog, _ = run_passes(prog)  # the cost pass used to raise GuardOnDataDependentSymNode
    tokens = inputs[0].numel()
    routed = [n for n in prog.call_nodes() if n.target == torch.ops.aten.index.Tensor
              and is_dynamic(n.meta["val"]) and n.meta["val"].dim() == 2]  # flat[token]
    assert len(routed) == 2 * 4
    for n in routed:  # tokens x top_k rows: the bound of torch.where over that mask
        assert prog.costs[n.name].out_bytes == tokens * 2 * 32 * 4
    assert "upper bounds" in compile_summary(prog)


@pytest.mark.parametrize("stages", [2, 4])
def test_partition_never_cuts_a_data_dependent_value(stages):
    prog = _captured_moe()[3]
    cfg = PartitionConfig(num_stages=stages, stage_to_rank=tuple(range(stages)),
                          inflight=(1,) * stages, method="ilp")  # cuts inside layers too
    plan = split_program(assign_stages(prog, cfg), num_stages=stages)
    by_name = {n.name: n for n in prog.graph.nodes}
    assert not [v for v in plan.values if is_dynamic(by_name[v].meta["val"])]


def test_a_cut_through_a_data_dependent_value_is_refused_by_name():
    prog = _captured_moe()[3]
    nodes = prog.call_nodes()
    cut = next(i for i, n in enumerate(nodes)
               if is_dynamic(n.meta.get("val")) and n.target == torch.ops.aten.index.Tensor)
    stages = {n.name: int(i > cut) for i, n in enumerate(nodes)}
    with pytest.raises(ValueError, match=rf"{nodes[cut].name} .* size depends on the data"):
        split_program(prog, stages, num_stages=2)


def test_coarsening_keeps_a_pinned_value_with_its_readers_and_whats_between():
    import networkx as nx

    from fxpipe.partition import coarsen

    # a -> b(pinned) -> c -> e, b -> d -> e, e -> f: b's readers are c and d; e is not one.
    g = nx.DiGraph([("a", "b"), ("b", "c"), ("c", "e"), ("b", "d"), ("d", "e"), ("e", "f")])
    for n in g:
        g.nodes[n].update(fwd=1.0, bwd=2.0, pinned=n == "b")
    c = coarsen(g, max_groups=10)  # no merging needed except the pinned one
    assert c.group_of["b"] == c.group_of["c"] == c.group_of["d"]
    assert len({c.group_of[n] for n in "aef"} | {c.group_of["b"]}) == 4
    # A reader reached through another path pulls that path in too (the group stays convex).
    g2 = nx.DiGraph([("b", "x"), ("x", "y"), ("b", "y"), ("y", "z")])
    for n in g2:
        g2.nodes[n].update(fwd=1.0, bwd=1.0, pinned=n == "b")
    c2 = coarsen(g2, max_groups=10)
    assert c2.group_of["b"] == c2.group_of["x"] == c2.group_of["y"] != c2.group_of["z"]
    assert nx.is_directed_acyclic_graph(c2.graph)



def test_a_complex_value_is_pinned_inside_its_stage():
    """Rotary written with complex numbers: the transports send real tensors, so a complex
    value is pinned like a data-dependent one (coarsen keeps it with its readers), and no
    cut at 2 or 4 stages sends one."""
    from fxpipe.models import build_workload
    from fxpipe.passes.assign_stages import build_problem_graph

    w = build_workload("zoo:complex-rope", batch=2, seq=16, layers=2)
    prog, _ = run_passes(fxpipe.capture(w.model, w.example_inputs, w.loss_fn))
    by_name = {n.name: n for n in prog.graph.nodes}
    complex_nodes = {n for n, node in by_name.items() if isinstance(node.meta.get("val"), torch.Tensor)
                     and node.meta["val"].dtype.is_complex}
    assert complex_nodes, "the model computes in complex numbers"
    for stages in (2, 4):
        cfg = PartitionConfig(num_stages=stages, stage_to_rank=tuple(range(stages)),
                              inflight=(1,) * stages, method="ilp")
        graph = build_problem_graph(prog, cfg)
        assert {n for n in complex_nodes if n in graph} <= {n for n, a in graph.nodes(data=True) if a.get("pinned")}
        plan = split_program(assign_stages(prog, cfg), num_stages=stages)
        assert not [v for v in plan.values if by_name[v].meta["val"].dtype.is_complex]

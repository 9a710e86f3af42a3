"""The rewritten graph's values, kept from the capture where a node is unchanged
(passes/tensor_parallel/shapes.py), equal a propagation of every node afresh."""
import pytest
import torch
import torch.fx as fx

from fxpipe.passes.tensor_parallel.shapes import refresh_shapes
from tests.passes.tensor_parallel._tp_helpers import compile_tp


def _metadata(value):
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.stride(), value.dtype, value.storage_offset())
    if isinstance(value, (list, tuple)):
        return tuple(_metadata(v) for v in value)
    return value if isinstance(value, (int, float, bool)) else type(value).__name__


@pytest.mark.parametrize("name,tp,sp", [("gpt-tiny", 2, False), ("hf:llama", 2, True), ("hf:gpt2", 4, False),
                                        ("zoo:moe", 2, False), ("zoo:autocast", 2, False)])
def test_values_kept_from_the_capture_equal_a_fresh_propagation(name, tp, sp):
    base, program, _ = compile_tp(name, tp, sp)
    gm = program.graph_module
    captured = {n.name: n.meta.get("val") for n in base.graph.nodes}
    kept = [n.name for n in gm.graph.nodes if n.op == "call_function" and n.meta.get("val") is not None
            and n.meta["val"] is captured.get(n.name)]
    assert len(kept) > 10  # the residual stream, its norms, the loss: the capture's values
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    fresh = fx.GraphModule(gm, graph)
    local = {n.name: tuple(n.meta["val"].shape) for n in gm.graph.nodes if n.op == "placeholder"}
    refresh_shapes(fresh, local)  # no captured graph: every node propagated
    for before, after in zip(gm.graph.nodes, fresh.graph.nodes):
        assert before.name == after.name
        assert _metadata(before.meta.get("val")) == _metadata(after.meta.get("val")), before.name

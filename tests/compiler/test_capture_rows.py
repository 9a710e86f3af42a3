"""One export for every micro-batch size (compiler/capture_rows.py): the program it makes
for ``rows`` rows is the one a static capture of those rows makes, node for node."""
import pytest
import torch
import torch.nn as nn

from fxpipe.compiler import capture_rows
from fxpipe.compiler.capture import capture
from fxpipe.compiler.capture_rows import BatchCaptures
from fxpipe.models import build_workload
from tests._shared import node_value

_PROGRAM_FIELDS = ("params", "inputs", "input_specs", "loss_output", "mutated_buffers", "module_paths", "layers",
                   "layer_container", "size_hints", "source")


def _assert_same(static, derived):
    assert derived.graph_module.code == static.graph_module.code
    for a, b in zip(static.graph_module.graph.nodes, derived.graph_module.graph.nodes, strict=True):
        assert (b.name, b.target) == (a.name, a.target)
        assert node_value(b.meta.get("val")) == node_value(a.meta.get("val")), a.name
        assert set(b.meta) == set(a.meta), a.name
        assert repr(b.meta.get("tensor_meta")) == repr(a.meta.get("tensor_meta")), a.name
    for field in _PROGRAM_FIELDS:
        assert getattr(derived, field) == getattr(static, field), field
    assert derived.state.keys() == static.state.keys()


@pytest.mark.parametrize("name", ["gpt-tiny", "gpt-small", "hf:llama"])
def test_each_row_count_is_the_static_capture(name):
    w = build_workload(name, batch=4, seq=16)
    captures = BatchCaptures(w.model, w.example_inputs, w.loss_fn)
    for rows in (1, 3, 2, 4):
        _assert_same(capture(w.model, tuple(t[:rows] for t in w.example_inputs), w.loss_fn), captures(rows))


def test_gpt_sizes_are_derived_from_the_one_export(monkeypatch):
    w = build_workload("gpt-tiny", batch=4, seq=16)
    captures = BatchCaptures(w.model, w.example_inputs, w.loss_fn)
    static = []
    monkeypatch.setattr(capture_rows, "capture", lambda model, inputs, loss_fn: static.append(
        inputs[0].shape[0]) or capture(model, inputs, loss_fn))
    derived = captures(3)
    captures(2)
    assert static == [1], "only the one-row reference is captured alone; 3 and 2 rows come from the export"
    assert derived.graph_module is not captures._export().graph_module
    # The batch dimension of the dynamic export is gone: every size is the static one.
    views = [n for n in derived.graph_module.graph.nodes if n.target is torch.ops.aten.view.default]
    assert views and all(isinstance(d, int) for n in views for d in n.args[1])
    assert any(n.args[1][0] == 3 for n in views)


class _FixedBatch(nn.Module):
    """A model whose code fixes the batch size (a view to the example's rows)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).view(4, -1).sum()


def test_a_model_that_fixes_its_batch_is_captured_per_size():
    model = _FixedBatch()
    captures = BatchCaptures(model, (torch.randn(4, 8),))
    assert captures._export() is None  # the export refuses a dynamic batch: no derived sizes
    program = captures(4)
    assert program.graph_module.code == capture(model, (torch.randn(4, 8),)).graph_module.code
    x = torch.randn(4, 8)
    assert torch.allclose(program.run(program.state, x), model(x))

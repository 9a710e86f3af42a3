"""Functionalization after capture: no in-place op survives, and the graph computes
exactly what eager does (losses and gradients bit for bit, buffers written back)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fxpipe
from fxpipe.compiler.capture import CaptureError
from fxpipe.passes.aliasing import mutated_args
from tests.passes._inplace_models import SlidingWindowGPT, batch


def _writes(gm: torch.fx.GraphModule) -> list[str]:
    found = [n.name for n in gm.graph.nodes if mutated_args(n)]
    for sub in gm.children():
        if isinstance(sub, torch.fx.GraphModule):
            found += _writes(sub)
    return found


def _raw_writes(model: nn.Module, inputs) -> list[str]:
    """In-place nodes of torch.export's training IR, before fxpipe functionalizes."""
    return _writes(torch.export.export(model, inputs, strict=False).graph_module)


def _check_exact(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> fxpipe.Program:
    """The captured program's loss and gradients equal eager's bit for bit."""
    prog = fxpipe.capture(model, inputs)
    assert _writes(prog.graph_module) == []
    state = {k: t.detach().clone().requires_grad_(t.requires_grad) for k, t in prog.state.items()}
    xs = tuple(x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs)
    loss = prog.run(state, *xs)
    loss.backward()
    model.zero_grad()
    ys = tuple(x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs)
    ref = model(*ys)
    ref.backward()
    assert loss.item() == ref.item()
    for name, p in model.named_parameters():
        if p.grad is not None:
            assert torch.equal(state[name].grad, p.grad), name
    for x, y in zip(xs, ys):
        if y.grad is not None:
            assert torch.equal(x.grad, y.grad)
    return prog


def test_sliding_window_gpt_is_exact_and_functional():
    torch.manual_seed(0)
    model, inputs = SlidingWindowGPT(), batch()
    raw = _raw_writes(model, inputs)
    assert len(raw) >= 4 * 4, raw  # fill_, masked_fill_, copy_ (setitem), mul_ per layer
    _check_exact(model, inputs)


class _Write(nn.Module):
    """One in-place pattern applied to an activation that requires grad."""

    def __init__(self, fn) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x).clone()
        out = self.fn(h)
        h = h if out is None else out
        return (h * torch.arange(h.numel(), dtype=h.dtype).view_as(h)).sum()


def _index_put(h):
    h[torch.tensor([0, 2])] = 1.0


def _index_add(h):
    idx = torch.nonzero(h[:, 0] > 0).squeeze(1)  # a data-dependent number of rows
    h.index_add_(0, idx, h[idx] * 2)


PATTERNS = {
    "slice": lambda h: h[:, 1:4].fill_(0.5),
    "slice_of_slice": lambda h: h[1:, :][:, ::2].mul_(3.0),
    "select": lambda h: h[1].add_(1.0),
    "setitem": lambda h: h.__setitem__((slice(None), 0), 2.0),
    "setitem_from_activation": lambda h: h.__setitem__((slice(None), 0), h[:, 1] * 2),
    "setitem_broadcast_and_cast": lambda h: h.__setitem__(
        (slice(1, 3), slice(None)), (h[0] * 3).double()),
    "transpose": lambda h: h.t()[2].sub_(1.0),
    "permute_view": lambda h: h.view(4, 2, 3).permute(2, 0, 1)[1].div_(2.0),
    # Outputs of multi-view ops cannot be written when they require grad (eager refuses),
    # so these write into a mask that does not.
    "split": lambda h: (lambda m: (m.split(2, dim=1)[1].fill_(1.0), h * m)[1])(torch.zeros_like(h)),
    "unbind": lambda h: (lambda m: (m.unbind(0)[3].fill_(2.0), h * m)[1])(torch.ones_like(h)),
    "diagonal": lambda h: h[:, :4].diagonal().fill_(7.0),
    "masked_fill": lambda h: h.masked_fill_(h > 0.2, 0.0),
    "index_put": _index_put,
    "index_add": _index_add,
    "two_views_then_read_old_view": lambda h: (lambda v: (h[0].fill_(1.0), v * 2)[1])(h[:, 0]),
    # A literal tensor is a lifted constant copied fresh each call: writing it is fine.
    "literal": lambda h: (lambda t: (t.mul_(2.0), t.__setitem__(0, 5.0), h * t)[2])(
        torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])),
    "dtype_kept": lambda h: h.add_(torch.ones(6, dtype=torch.float64)),
}


@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_every_write_pattern_is_functional_and_exact(pattern):
    torch.manual_seed(1)
    model = _Write(PATTERNS[pattern])
    x = torch.randn(4, 6)
    assert _raw_writes(model, (x,)), "the pattern is an in-place op in the training IR"
    _check_exact(model, (x,))


class _GradModes(nn.Module):
    """A no_grad statistic written in place and an autocast region."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            scale = x.abs().amax(dim=-1, keepdim=True)
            scale.clamp_(min=0.5)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = self.lin(x)
        return (y.float() / scale).pow(2).mean()


def test_grad_mode_regions_keep_their_meaning():
    torch.manual_seed(2)
    _check_exact(_GradModes(), (torch.randn(3, 8),))


class _Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(()))
        self.register_buffer("ema", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        with torch.no_grad():  # a running statistic, written inside a region
            self.ema[1:].mul_(0.9).add_(x.mean(0)[1:] * 0.1)
        return self.lin(x).sum() * self.calls + (x * self.ema).sum()


def test_buffer_writes_become_outputs_written_back():
    model = _Counter()
    x = torch.randn(2, 4)
    prog = fxpipe.capture(model, (x,))
    assert set(prog.mutated_buffers) == {"calls", "ema"}
    assert _writes(prog.graph_module) == []
    state = {k: t.detach().clone() for k, t in prog.state.items()}
    for t in (state["calls"], state["ema"], model.calls, model.ema):
        t.zero_()
    for _ in range(3):
        assert prog.run(state, x).item() == model(x).item()
    assert state["calls"].item() == model.calls.item() == 3
    assert torch.equal(state["ema"], model.ema) and model.ema[1:].abs().sum() > 0


class _WritesParam(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.w.mul_(0.5)
        return (x * self.w).sum()


def test_a_write_into_a_parameter_is_refused_naming_it():
    with pytest.raises(CaptureError, match=r"writes in place into w, a parameter.*mul_"):
        fxpipe.capture(_WritesParam(), (torch.randn(4),))


class _WritesExpanded(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = torch.zeros(1, 4)
        big = base.expand(3, 4)
        big[0].add_(x[0])  # a write through a broadcast view
        return (base * x).sum()


def test_a_write_through_a_view_without_inverse_is_refused():
    with pytest.raises(CaptureError, match=r"expand"):
        fxpipe.capture(_WritesExpanded(), (torch.randn(3, 4),))


def _with_a_write(prog: fxpipe.Program) -> fxpipe.Program:
    """The program with one in-place op put back, as a careless pass might."""
    import copy

    gm = copy.deepcopy(prog.graph_module)
    node = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.linear.default)
    with gm.graph.inserting_after(node):
        gm.graph.call_function(torch.ops.aten.mul_.Tensor, (node, 2.0))
    gm.recompile()
    return prog.replace(graph_module=gm)


def test_lint_and_split_refuse_an_in_place_op_by_name():
    from fxpipe.passes import lint_program
    from fxpipe.passes.lint import ProgramInvariantError
    from fxpipe.passes.split import split_program

    torch.manual_seed(0)
    prog = fxpipe.capture(_Write(PATTERNS["slice"]), (torch.randn(4, 6),))
    lint_program(prog, after="capture")
    bad = _with_a_write(prog)
    with pytest.raises(ProgramInvariantError, match=r"in-place ops in the graph: mul_"):
        lint_program(bad, after="careless")
    stages = {n.name: 0 for n in bad.call_nodes()}
    with pytest.raises(ValueError, match=r"still writes in place \(mul_"):
        split_program(bad, stages, num_stages=1)


def test_every_pass_keeps_the_graph_functional():
    from fxpipe.compiler.driver import run_passes

    torch.manual_seed(0)
    model, inputs = SlidingWindowGPT(), batch()
    run_passes(fxpipe.capture(model, inputs), debug=True)  # lints after every pass

"""Capture: the captured program computes exactly what the eager model computes."""
import pytest
import torch
import torch.nn as nn

import fxpipe
from fxpipe.compiler.capture import CaptureError
from fxpipe.models import build_workload
from fxpipe.ir.program import ParamKind

from tests._shared import FIVE_MODELS


def _eager_loss(w):
    if w.loss_fn is not None:
        return w.loss_fn(w.model(*w.example_inputs[:-1]), w.example_inputs[-1])
    return w.model(*w.example_inputs)


@pytest.fixture(scope="module", params=FIVE_MODELS)
def captured(request):
    w = build_workload(request.param, batch=2, seq=16)
    return w, fxpipe.capture(w.model, w.example_inputs, w.loss_fn)


def test_loss_and_every_gradient_match_eager(captured):
    w, prog = captured
    state = {k: v.detach().clone().requires_grad_(v.requires_grad) for k, v in prog.state.items()}
    loss = prog.run(state, *w.example_inputs)
    loss.backward()
    w.model.zero_grad(set_to_none=True)
    ref = _eager_loss(w)
    ref.backward()
    assert abs(loss.item() - ref.item()) <= 1e-6 * max(1.0, abs(ref.item()))
    names = dict(w.model.named_parameters())
    assert names, "model has parameters"
    for name, p in names.items():
        torch.testing.assert_close(state[name].grad, p.grad, atol=1e-6, rtol=1e-6,
                                   msg=lambda m: f"{name}: {m}")


def test_parameters_keep_their_original_names(captured):
    w, prog = captured
    captured_names = {p.name for p in prog.params if p.kind is ParamKind.PARAMETER}
    eager_names = {n for n, _ in w.model.named_parameters(remove_duplicate=False)}
    assert captured_names <= eager_names
    # Every distinct trainable tensor is present once.
    assert {p.canonical for p in prog.trainable()} == {n for n, _ in w.model.named_parameters()}
    assert prog.num_parameters() == sum(p.numel() for p in w.model.parameters())


def test_layers_found_from_structure(captured):
    w, prog = captured
    assert sorted(set(prog.layers.values())) == [0, 1]
    # Every node of a layer comes from a module under the container.
    for node, layer in prog.layers.items():
        assert prog.module_paths[node].startswith(f"{prog.layer_container}.{layer}")


def test_tied_embedding_is_one_group():
    w = build_workload("gpt-tiny")
    prog = fxpipe.capture(w.model, w.example_inputs)
    assert prog.tied_groups == {"transformer.wte.weight": ("transformer.wte.weight", "lm_head.weight")}
    assert len(prog.trainable()) == len(list(w.model.parameters()))


def test_capture_on_meta_allocates_nothing():
    w = build_workload("gpt2-small", batch=1, seq=128, device="meta", layers=2)
    prog = fxpipe.capture(w.model, w.example_inputs)
    assert all(t.device.type == "meta" for t in prog.state.values())
    assert prog.num_parameters() == w.config.num_params - (1024 - 128) * 0  # positions table kept


class _Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if y.sum() > 0:  # control flow on a tensor value
            return y.pow(2).mean()
        return y.mean()


def test_untraceable_model_names_class_and_line():
    with pytest.raises(CaptureError) as info:
        fxpipe.capture(_Branchy(), (torch.randn(2, 4),))
    msg = str(info.value)
    assert "_Branchy" in msg
    assert "test_capture.py" in msg and "if y.sum() > 0" in msg
    assert "torch.cond" in msg


def test_wrong_input_type_is_a_clear_error():
    w = build_workload("gpt-tiny")
    with pytest.raises(TypeError, match=r"example_inputs\[1\] is a list"):
        fxpipe.capture(w.model, (w.example_inputs[0], [1, 2, 3]))


def test_wrong_input_shape_is_a_clear_error():
    w = build_workload("gpt-tiny")
    bad = torch.zeros(2, 500, dtype=torch.long)  # longer than block_size
    with pytest.raises(CaptureError, match=r"GPT.*\n.*at: .*gpt.py.*\n.*try: check that example_inputs \(\(2, 500\)"):
        fxpipe.capture(w.model, (bad, bad))


def test_model_output_that_is_not_a_loss_needs_loss_fn():
    w = build_workload("hf:gpt2")
    with pytest.raises(TypeError, match="loss_fn"):
        fxpipe.capture(w.model, (w.example_inputs[0],))


def test_model_without_transformer_layers_captures():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    prog = fxpipe.capture(model, (x, y), loss_fn=lambda out, t: ((out - t) ** 2).mean())
    ref = ((model(x) - y) ** 2).mean()
    assert torch.allclose(prog.run(prog.state, x, y), ref)
    # nn.Sequential children are indexed, so they read as "layers"; a plain module has none.
    plain = nn.Linear(8, 1)
    prog2 = fxpipe.capture(plain, (x, torch.randn(4, 1)), loss_fn=lambda o, t: ((o - t) ** 2).mean())
    assert prog2.layers == {} and prog2.layer_container == ""


def test_buffers_record_persistence():
    class WithBuffers(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("scale", torch.ones(4))
            self.register_buffer("cache", torch.ones(4), persistent=False)

        def forward(self, x):
            return (self.lin(x) * self.scale * self.cache).sum()

    prog = fxpipe.capture(WithBuffers(), (torch.randn(2, 4),))
    assert {p.name: p.persistent for p in prog.params if p.kind is ParamKind.BUFFER} == \
        {"scale": True, "cache": False}
    from fxpipe.checkpoint.dcp import state_dict_names
    assert set(state_dict_names(prog)) == set(WithBuffers().state_dict())

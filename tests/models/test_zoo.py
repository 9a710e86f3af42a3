"""The zoo beyond transformers (fxpipe/models/zoo): every model captures, the captured
graph computes eager's loss and gradients, and still holds the feature the model is
in the zoo for (so a torch upgrade that captures it differently is noticed)."""
import pytest
import torch

import fxpipe
from fxpipe.compiler.pipeline import compile_program
from fxpipe.ir.parallel_config import ParallelConfig
from fxpipe.models import build_workload
from fxpipe.models.zoo import ZOO
from fxpipe.models.zoo.swa_gpt import sliding_window_mask
from fxpipe.passes.aliasing import mutated_args

# What each model's captured graph must contain. Capture functionalizes: the in-place
# writes of swa-gpt (fill_ on a view, masked_fill_, index_put_) and moe (index_add_)
# are there as their out-of-place forms, the view's write as a slice_scatter.
FEATURES = {
    "swa-gpt": {"aten.fill.Scalar", "aten.slice_scatter.default", "aten.masked_fill.Scalar",
                "aten.index_put.default"},
    "moe": {"aten.where.default", "aten.index_add.default"},
    "autocast": {"wrap_with_autocast", "wrap_with_set_grad_enabled"},
    "complex-rope": {"aten.view_as_complex.default", "aten.view_as_real.default"},
    "fused-mqa": {"aten.einsum.default", "aten.split_with_sizes.default"},
    "norm-rms": {"aten.linalg_vector_norm.default"},
    "llama3": {"aten.repeat_interleave.self_int", "aten.scaled_dot_product_attention.default"},
    "torchtune-llama": {"aten.scaled_dot_product_attention.default"},
    # the identity autograd wrappers (view_as), the sliced sequence's flattened logits, the
    # prompt's targets set to -100
    "biased-head": {"aten.view_as.default", "aten.flatten.using_ints", "aten.where.ScalarSelf"},
}


def _zoo_name(key):
    if not ZOO[key].available:  # an optional extra, e.g. pip install 'fxpipe[torchtune]'
        pytest.skip(f"zoo:{key} needs {ZOO[key].requires}")
    return f"zoo:{key}"


@pytest.fixture(scope="module", params=list(ZOO))
def captured(request):
    w = build_workload(_zoo_name(request.param), batch=2, seq=16)
    return request.param, w, fxpipe.capture(w.model, w.example_inputs, w.loss_fn)


def test_every_zoo_model_has_a_feature_check():
    assert set(FEATURES) == set(ZOO)


def test_captured_loss_and_gradients_equal_eager(captured):
    _, w, prog = captured
    state = {k: v.detach().clone().requires_grad_(v.requires_grad) for k, v in prog.state.items()}
    loss = prog.run(state, *w.example_inputs)
    loss.backward()
    w.model.zero_grad(set_to_none=True)
    ref = w.loss_fn(w.model(w.example_inputs[0]), w.example_inputs[1])
    ref.backward()
    assert 5.0 < ref.item() < 6.0  # ~ln(256): a freshly initialised model, not NaN or saturated
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    for name, p in w.model.named_parameters():
        torch.testing.assert_close(state[name].grad, p.grad, atol=1e-6, rtol=1e-6,
                                   msg=lambda m: f"{name}: {m}")


def test_captured_graph_keeps_the_feature(captured):
    name, _, prog = captured
    ops = {str(n.target) for n in prog.graph_module.graph.nodes if n.op == "call_function"}
    assert FEATURES[name] <= ops, sorted(ops)
    assert not [n.name for n in prog.graph_module.graph.nodes if mutated_args(n)]


def test_vocabulary_passes_take_every_head(captured):
    """Every zoo model's LM head is cut into blocks for the vocabulary passes at pp=2,
    whatever sits between it and the loss (swa-gpt's softcap, biased-head's bias, scale
    and sliced loss). Loss and gradients against one process: each form in
    tests/passes/test_vocab_head_forms.py, zoo:biased-head in the equivalence world of 2."""
    name, _, prog = captured
    config = ParallelConfig(pp=2, microbatches=2, costs="model", vocab_passes=True).with_world(2)
    head = compile_program(prog, config, until="vocab_rows").plan.vocab_head
    assert head is not None and head.blocks == ((0, 128), (128, 256)), name
    assert (head.bias is not None) == (name == "biased-head")


def test_sliding_window_mask_against_brute_force():
    T, window, sinks = 9, 3, 2
    want = torch.tensor([[not (j <= i and (i - j < window or j < sinks)) for j in range(T)]
                         for i in range(T)])
    assert torch.equal(sliding_window_mask(T, window, sinks, torch.device("cpu")), want)


def test_moe_routes_every_token_to_top_k_experts():
    """Dropless: the MoE block equals the dense sum over each token's top-2 experts."""
    w = build_workload("zoo:moe", batch=2, seq=8)
    moe = w.model.blocks[0].moe
    x = torch.randn(2, 8, 64)
    probs = torch.softmax(moe.router(x), -1)
    top, idx = probs.topk(2, dim=-1)  # (B, T, 2)
    dense = torch.stack([e(x) for e in moe.experts], dim=-2)  # (B, T, E, C): every expert, every token
    picked = dense.gather(-2, idx[..., None].expand(-1, -1, -1, 64))  # (B, T, 2, C)
    want = (picked * (top / top.sum(-1, keepdim=True))[..., None]).sum(-2)
    torch.testing.assert_close(moe(x), want, rtol=1e-5, atol=1e-6)

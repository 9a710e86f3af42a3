"""The causal-mask pass: a constant mask that is exactly the causal pattern becomes SDPA's
``is_causal``; every other mask stays.

The reference is the captured graph before the pass: the rewritten graph gives the same
loss and the same gradient of every parameter."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpipe
from fxpipe.compiler.driver import run_passes
from fxpipe.passes.causal_mask import causal_mask_pass

SDPA = torch.ops.aten.scaled_dot_product_attention.default


class _Attention(nn.Module):
    """Two attention layers whose mask is built as ``kind`` says."""

    def __init__(self, kind: str, vocab: int = 64, width: int = 32, heads: int = 2):
        super().__init__()
        self.kind, self.heads = kind, heads
        self.emb = nn.Embedding(vocab, width)
        self.qkv = nn.ModuleList(nn.Linear(width, 3 * width) for _ in range(2))
        self.out = nn.Linear(width, vocab)
        self.register_buffer("tril", torch.ones(16, 16, dtype=torch.bool).tril(), persistent=False)

    def _mask(self, ids: torch.Tensor) -> torch.Tensor:
        s = ids.shape[1]
        pos = torch.arange(s, device=ids.device)
        causal = pos[None, :] <= pos[:, None]
        if self.kind == "arange":  # transformers' traced mask, in short
            return causal[None, None].expand(ids.shape[0], 1, s, s)
        if self.kind == "additive":
            return torch.full((s, s), float("-inf"), device=ids.device).triu(1)
        if self.kind == "window":  # sliding window of 4: not causal's pattern
            return causal & (pos[:, None] - pos[None, :] < 4)
        if self.kind == "padding":  # reads the batch
            return causal[None, None] & (ids != 0)[:, None, None, :]
        return self.tril[:s, :s]  # a buffer: state, not a constant of the graph

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        b, s, w = x.shape
        mask = self._mask(ids)
        for qkv in self.qkv:
            q, k, v = (t.view(b, s, self.heads, w // self.heads).transpose(1, 2) for t in qkv(x).chunk(3, dim=-1))
            x = x + F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, s, w)
        return self.out(x)


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def _captured(kind: str):
    torch.manual_seed(0)
    ids = torch.randint(1, 64, (2, 17))
    ids[0, 3] = 0  # a "padding" token, so the padding mask is not all True
    batch = (ids[:, :-1], ids[:, 1:])
    return fxpipe.capture(_Attention(kind), batch, _loss), batch


def _loss_and_grads(program, batch):
    state = {k: v.detach().clone().requires_grad_(v.is_floating_point()) for k, v in program.state.items()}
    loss = program.run(state, *batch)
    loss.backward()
    return loss.detach(), {k: v.grad for k, v in state.items() if v.grad is not None}


def _calls(program):
    return [n for n in program.graph.nodes if n.op == "call_function" and n.target is SDPA]


@pytest.mark.parametrize("kind", ["arange", "additive"])
def test_a_constant_causal_mask_becomes_is_causal(kind):
    program, batch = _captured(kind)
    before, _ = run_passes(program, skip=["causal_mask"])
    after, _ = run_passes(program)
    calls = _calls(after)
    assert len(calls) == 2
    for n in calls:
        assert n.kwargs.get("is_causal") is True and len(n.args) == 3 and "attn_mask" not in n.kwargs
    assert not {"aten.arange.default", "aten.full.default"} & {str(n.target) for n in after.graph.nodes}
    loss_ref, grads_ref = _loss_and_grads(before, batch)
    loss, grads = _loss_and_grads(after, batch)
    assert loss.item() == pytest.approx(loss_ref.item(), abs=1e-6)
    assert grads.keys() == grads_ref.keys() and len(grads) == sum(p.kind.value == "parameter" for p in program.params)
    for name in grads:
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("kind", ["window", "padding", "buffer"])
def test_other_masks_are_kept(kind):
    """A sliding window is constant but not causal's pattern; a padding mask reads the
    batch; a buffer is state the user may change: each keeps its mask."""
    program, _ = _captured(kind)
    canonical, _ = run_passes(program, skip=["causal_mask", "cost"])
    assert causal_mask_pass(canonical) is canonical
    assert all(len(n.args) > 3 or "attn_mask" in n.kwargs for n in _calls(canonical))


def test_transformers_traced_mask_becomes_is_causal():
    """Llama as transformers builds it: traced, its mask is and-ed from aranges and packed-
    sequence ids; the pass proves it causal, and the loss and gradients stay."""
    pytest.importorskip("transformers")
    from fxpipe.models.hf import _llama
    from fxpipe.models.losses import causal_lm_loss

    torch.manual_seed(0)
    ids = torch.randint(0, 128, (2, 16))
    program = fxpipe.capture(_llama(layers=2, hidden=64, heads=4, vocab=128, seq=16), (ids, ids.clone()), causal_lm_loss)
    before, _ = run_passes(program, skip=["causal_mask"])
    after, _ = run_passes(program)
    assert all(len(n.args) > 3 or "attn_mask" in n.kwargs for n in _calls(before))  # traced with a mask
    assert [n.kwargs.get("is_causal") for n in _calls(after)] == [True, True]
    assert len(after.graph.nodes) < len(before.graph.nodes)
    loss_ref, grads_ref = _loss_and_grads(before, (ids, ids.clone()))
    loss, grads = _loss_and_grads(after, (ids, ids.clone()))
    assert loss.item() == pytest.approx(loss_ref.item(), abs=1e-6)
    for name in grads_ref:
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=1e-5, atol=1e-6, msg=name)

"""The grouped-attention pass: repeated keys and values read by SDPA itself.

The reference is the captured graph before the pass (and so the eager model): the
rewritten graph gives the same loss and the same gradient of every parameter, and only
the interleaved repeats (head i of the queries reading kv head i // r) are rewritten."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpipe
from fxpipe.compiler.driver import run_passes
from fxpipe.ir.compile_context import CompileContext
from fxpipe.ir.parallel_config import ParallelConfig
from fxpipe.passes.grouped_attention import grouped_attention_pass

SDPA = torch.ops.aten.scaled_dot_product_attention.default


class _GQA(nn.Module):
    """Two layers of attention with 4 query and 2 kv heads, the kv heads repeated as
    ``spelling`` says, and a tied head."""

    def __init__(self, spelling: str, mask: bool, vocab: int = 64, width: int = 32, heads: int = 4, kv: int = 2):
        super().__init__()
        self.spelling, self.mask, self.heads, self.kv = spelling, mask, heads, kv
        self.emb = nn.Embedding(vocab, width)
        self.q = nn.ModuleList(nn.Linear(width, width) for _ in range(2))
        self.kv_proj = nn.ModuleList(nn.Linear(width, 2 * width * kv // heads) for _ in range(2))
        self.o = nn.ModuleList(nn.Linear(width, width) for _ in range(2))

    def _repeat(self, x: torch.Tensor) -> torch.Tensor:
        b, kv, s, d = x.shape
        r = self.heads // kv
        if self.spelling == "expand":  # transformers' repeat_kv
            return x[:, :, None, :, :].expand(b, kv, r, s, d).reshape(b, kv * r, s, d)
        if self.spelling == "repeat_interleave":
            return x.repeat_interleave(r, dim=1)
        return x.repeat(1, r, 1, 1)  # tiled: query head i reads kv head i % kv, not i // r

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        b, s, w = x.shape
        d = w // self.heads
        for q_proj, kv_proj, o in zip(self.q, self.kv_proj, self.o):
            q = q_proj(x).view(b, s, self.heads, d).transpose(1, 2)
            k, v = kv_proj(x).view(b, s, 2 * self.kv, d).transpose(1, 2).chunk(2, dim=1)
            if self.mask:
                causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
                y = F.scaled_dot_product_attention(q, self._repeat(k), self._repeat(v), attn_mask=causal)
            else:
                y = F.scaled_dot_product_attention(q, self._repeat(k), self._repeat(v), is_causal=True)
            x = x + o(y.transpose(1, 2).reshape(b, s, w))
        return x @ self.emb.weight.t()


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def _loss_and_grads(program, batch):
    state = {k: v.detach().clone().requires_grad_(v.is_floating_point()) for k, v in program.state.items()}
    loss = program.run(state, *batch)
    loss.backward()
    return loss.detach(), {k: v.grad for k, v in state.items() if v.grad is not None}


def _captured(spelling: str, mask: bool):
    torch.manual_seed(0)
    model = _GQA(spelling, mask)
    ids = torch.randint(0, 64, (2, 17))
    batch = (ids[:, :-1], ids[:, 1:])
    return fxpipe.capture(model, batch, _loss), batch


@pytest.mark.parametrize("mask", [False, True], ids=["is_causal", "bool-mask"])
@pytest.mark.parametrize("spelling", ["expand", "repeat_interleave"])
def test_interleaved_repeats_become_enable_gqa_with_equal_loss_and_gradients(spelling, mask):
    program, batch = _captured(spelling, mask)
    before, _ = run_passes(program, skip=["grouped_attention"])
    after, _ = run_passes(program)
    calls = [n for n in after.graph.nodes if n.op == "call_function" and n.target is SDPA]
    assert len(calls) == 2 and all(n.kwargs.get("enable_gqa") for n in calls)
    for n in calls:  # the keys and values are the two kv heads themselves, no repeat left
        assert [tuple(a.meta["val"].shape) for a in n.args[1:3]] == [(2, 2, 16, 8)] * 2
    targets = {str(n.target) for n in after.graph.nodes if n.op == "call_function"}
    assert not targets & {"aten.expand.default", "aten.repeat_interleave.self_int"}
    assert sum(c.mem_bytes for c in after.costs.values()) < sum(c.mem_bytes for c in before.costs.values())
    loss_ref, grads_ref = _loss_and_grads(before, batch)
    loss, grads = _loss_and_grads(after, batch)
    assert loss.item() == pytest.approx(loss_ref.item(), abs=1e-6)
    assert grads.keys() == grads_ref.keys() and len(grads) == len(program.params)
    for name in grads:
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=1e-5, atol=1e-6, msg=name)


def test_a_tiled_repeat_is_left_alone():
    """``repeat(1, r, 1, 1)`` pairs query head i with kv head i % kv: not what enable_gqa
    computes, so the graph keeps it (and the pass returns the Program itself)."""
    program, _ = _captured("tiled", mask=False)
    canonical, _ = run_passes(program, skip=["grouped_attention", "cost"])
    assert grouped_attention_pass(canonical) is canonical


def test_kept_on_cuda():
    """On CUDA the kernels that take enable_gqa depend on dtype and mask (the pass's
    docstring): a graph compiled for a CUDA device keeps the repeat."""
    program, _ = _captured("expand", mask=False)
    canonical, _ = run_passes(program, skip=["grouped_attention", "cost"])
    ctx = CompileContext.of(ParallelConfig(), device="cuda")
    assert grouped_attention_pass(canonical, ctx) is canonical
    assert grouped_attention_pass(canonical, CompileContext.of(ParallelConfig())) is not canonical

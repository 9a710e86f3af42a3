"""The gradient invariant of the tensor-parallel pass on attention/MLP variants written
here as plain modules (no model or module name matters to the pass).

Each variant runs at tp=2 and tp=4 in the in-process emulation: the loss and every
gradient (reassembled from the ranks' shards; replicated ones checked equal across
ranks by ``run_tp``) must equal one process's. Before the invariant, fused
multi-query attention had an exact first-step loss but wrong K/V weight gradients.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpipe
from fxpipe.passes import canonicalize_pass
from fxpipe.passes.tensor_parallel import ShardKind, TPConfig, tensor_parallel_pass
from fxpipe.passes.tensor_parallel import placement
from fxpipe.ir.shard_spec import ShardSpec
from tests.passes.tensor_parallel._tp_helpers import reference, run_tp

H, HEADS, V, T = 32, 4, 64, 8


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-b, a], dim=-1) * sin


class FusedAttention(nn.Module):
    """One fused QKV linear with ``kv`` key/value heads (1: multi-query), optional
    rotary on the first ``rotary`` dims of each head."""

    def __init__(self, kv: int, rotary: int = 0):
        super().__init__()
        self.kv, self.hd, self.rotary = kv, H // HEADS, rotary
        self.qkv = nn.Linear(H, (HEADS + 2 * kv) * self.hd)
        self.o = nn.Linear(H, H)
        if rotary:
            inv = 1.0 / (10000 ** (torch.arange(0, rotary, 2).float() / rotary))
            ang = torch.outer(torch.arange(T).float(), inv)
            self.register_buffer("cos", torch.cat([ang, ang], -1).cos(), persistent=False)
            self.register_buffer("sin", torch.cat([ang, ang], -1).sin(), persistent=False)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).split([HEADS * self.hd, self.kv * self.hd, self.kv * self.hd], dim=-1)
        q = q.view(b, t, HEADS, self.hd).transpose(1, 2)
        k = k.view(b, t, self.kv, self.hd).transpose(1, 2)
        v = v.view(b, t, self.kv, self.hd).transpose(1, 2)
        if self.rotary:  # partial rotary: the first dims of each head rotate, the rest pass
            r = self.rotary
            q = torch.cat([_rotate(q[..., :r], self.cos, self.sin), q[..., r:]], dim=-1)
            k = torch.cat([_rotate(k[..., :r], self.cos, self.sin), k[..., r:]], dim=-1)
        rep = HEADS // self.kv  # Hugging Face's repeat_kv: expand + reshape
        k = k[:, :, None].expand(b, self.kv, rep, t, self.hd).reshape(b, HEADS, t, self.hd)
        v = v[:, :, None].expand(b, self.kv, rep, t, self.hd).reshape(b, HEADS, t, self.hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, H))


class MLP(nn.Module):
    def __init__(self, shared_bias: bool = False):
        super().__init__()
        self.up = nn.Linear(H, 4 * H, bias=not shared_bias)
        self.gate = nn.Linear(H, 4 * H, bias=not shared_bias)
        self.down = nn.Linear(4 * H, H)
        # One bias parameter added to two projections' outputs.
        self.bias = nn.Parameter(torch.randn(4 * H) * 0.1) if shared_bias else None

    def forward(self, x):
        up, gate = self.up(x), self.gate(x)
        if self.bias is not None:
            up, gate = up + self.bias, gate + self.bias
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, kv: int, parallel: bool, rotary: int, shared_bias: bool):
        super().__init__()
        self.parallel = parallel
        self.ln1, self.ln2 = nn.LayerNorm(H), nn.LayerNorm(H)
        self.attn, self.mlp = FusedAttention(kv, rotary), MLP(shared_bias)

    def forward(self, x):
        if self.parallel:  # GPT-J / NeoX: attention and MLP read the same input
            return x + self.attn(self.ln1(x)) + self.mlp(self.ln2(x))
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self, kv=HEADS, parallel=False, rotary=0, shared_bias=False, layers=2):
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.blocks = nn.ModuleList([Block(kv, parallel, rotary, shared_bias) for _ in range(layers)])
        self.norm, self.head = nn.LayerNorm(H), nn.Linear(H, V, bias=False)

    def forward(self, x, y):
        z = self.emb(x)
        for blk in self.blocks:
            z = blk(z)
        return F.cross_entropy(self.head(self.norm(z)).flatten(0, 1), y.flatten())


VARIANTS = {
    "fused-mqa": dict(kv=1),
    "fused-gqa2": dict(kv=2),
    "fused-mha": dict(kv=HEADS),
    "parallel-block-mqa": dict(kv=1, parallel=True),
    "parallel-block": dict(parallel=True),
    "shared-bias": dict(shared_bias=True),
    "partial-rotary-gqa2": dict(kv=2, rotary=4),
}


def _program(variant: str):
    torch.manual_seed(0)
    model = TinyLM(**VARIANTS[variant])
    g = torch.Generator().manual_seed(1)
    batch = (torch.randint(0, V, (2, T), generator=g), torch.randint(0, V, (2, T), generator=g))
    return canonicalize_pass(fxpipe.capture(model, batch)), batch


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_loss_and_every_gradient_equal_one_process(variant, tp):
    program, batch = _program(variant)
    loss, grads = reference(program, batch)
    sharded = tensor_parallel_pass(program, TPConfig(tp=tp))
    losses, tp_grads = run_tp(sharded, program.state, batch, tp)
    for rank_loss in losses:
        torch.testing.assert_close(rank_loss, loss, rtol=1e-6, atol=1e-6)
    assert set(tp_grads) == set(grads)
    for name, g in grads.items():
        torch.testing.assert_close(tp_grads[name], g, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    specs = sharded.tensor_parallel.specs
    assert any(s.kind is not ShardKind.REPLICATED for s in specs.values()), "something is split"


def test_fused_projection_with_shared_kv_channels_holds_a_block_of_them_per_rank():
    """Multi-query: the query rows split by heads, the shared k/v rows a block per rank
    (all-gathered after the projection), so no row is held twice and every gradient is
    whole on its one holder (the loss and gradients: the equivalence test above)."""
    program, _ = _program("fused-mqa")
    specs = tensor_parallel_pass(program, TPConfig(tp=2)).tensor_parallel.specs
    spec, hd = specs["blocks.0.attn.qkv.weight"], H // HEADS
    assert spec.kind is ShardKind.COLUMN and spec.local_shape == (H // 2 + hd, H), spec
    assert spec.indices(0) == [*range(H // 2), *range(H, H + hd)]
    assert spec.indices(1) == [*range(H // 2, H), *range(H + hd, H + 2 * hd)]
    assert specs["blocks.0.mlp.up.weight"].kind is ShardKind.COLUMN, "the MLP is still split"


def test_invariant_rejects_overlapping_shards():
    """A spec that gives one index to two ranks (what the fused-MQA split used to be)."""
    bad = ShardSpec("w", ShardKind.COLUMN, (6, 4), (4, 4), dim=0, ranges=(((0, 2), (4, 6)), ((2, 6),)))
    with pytest.raises(ValueError, match=r"cannot prove w's gradient correct: its column shards overlap at \[4, 5\]"):
        placement.check_gradient_invariant({"w": bad}, str)
    hole = ShardSpec("w", ShardKind.ROW, (4, 6), (4, 2), dim=1, ranges=(((0, 2),), ((4, 6),)))
    with pytest.raises(ValueError, match=r"row shards miss \[2, 3\]"):
        placement.check_gradient_invariant({"w": hole}, str)


def test_invariant_catches_the_old_fused_mqa_split(monkeypatch):
    """Had the column placement given the shared k/v rows to every rank, the invariant
    would fail the compile instead of training with partial K/V gradients."""
    program, _ = _program("fused-mqa")
    old_column = placement._Specs.column

    def old_split(self, name):
        # Re-run the placement's column logic with the shared-channel refusal removed.
        proj = self.plan.column[name]
        first, count = self.prov.sources[name]
        ids = np.arange(first, first + count)
        own = self.asg.owner(ids)
        held = [np.flatnonzero((own == r) | (own == placement.ALL)) for r in range(self.tp)]
        ranges = tuple(placement.ranges_of(h) for h in held)
        if (own == placement.ALL).all():
            return old_column(self, name)
        prop = placement._Proposal(ShardKind.COLUMN, proj.out_dim, ranges, len(held[0]), "old", name)
        self.propose(proj.weight, prop)
        if proj.bias is not None:
            self.propose(proj.bias, placement._Proposal(ShardKind.COLUMN, 0, ranges, len(held[0]), "old", name))

    monkeypatch.setattr(placement._Specs, "column", old_split)
    with pytest.raises(ValueError, match="cannot prove blocks.0.attn.qkv.(weight|bias)'s gradient correct"):
        tensor_parallel_pass(program, TPConfig(tp=2))

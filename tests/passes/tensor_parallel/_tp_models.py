"""Small models the TP rule tests share: a language-model frame, a written-out RMSNorm, expert and attention forms."""
from __future__ import annotations
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class _GQAAttention(nn.Module):
    """Grouped-query attention left to the kernel (enable_gqa=True)."""

    def __init__(self, h=32, heads=4, kv=2):
        super().__init__()
        self.heads, self.kv, self.d = heads, kv, h // heads
        self.emb = nn.Embedding(64, h)
        self.q = nn.Linear(h, h)
        self.kv_proj = nn.Linear(h, 2 * kv * self.d)
        self.o = nn.Linear(h, h)
        self.head = nn.Linear(h, 64)

    def forward(self, ids):
        x = self.emb(ids)
        B, T, _ = x.shape
        q = self.q(x).view(B, T, self.heads, self.d).transpose(1, 2)
        k, v = self.kv_proj(x).view(B, T, 2 * self.kv, self.d).transpose(1, 2).split(self.kv, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.head(x + self.o(y.transpose(1, 2).reshape(B, T, -1)))


V, T, H, HEADS = 64, 8, 32, 4

D = H // HEADS

class _LM(nn.Module):
    """Embedding, one attention block (``attend``), an MLP, a head."""

    def __init__(self):
        super().__init__()
        self.emb, self.ln1, self.ln2 = nn.Embedding(V, H), nn.LayerNorm(H), nn.LayerNorm(H)
        self.o = nn.Linear(H, H)
        self.up, self.down = nn.Linear(H, 4 * H), nn.Linear(4 * H, H)
        self.head = nn.Linear(H, V, bias=False)

    def forward(self, ids, targets):
        x = self.emb(ids)
        B = x.shape[0]
        y = self.attend(self.ln1(x))  # (B, nh, T, hd)
        x = x + self.o(y.transpose(1, 2).reshape(B, T, H))
        x = x + self.down(F.gelu(self.up(self.ln2(x))))
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())

class _RMSNorm(nn.Module):  # written out, as Hugging Face models do: a mean over channels
    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(n))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))

class _Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(H, 2 * H, bias=False), nn.Linear(H, 2 * H, bias=False), \
            nn.Linear(2 * H, H, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))

class ExpertModules(_LM):
    """A dropless mixture of experts held as separate modules (Mixtral before stacked
    weights): a replicated router (softmax, top-2), every token to its experts, token
    counts decided by the data; attention is plain SDPA."""

    def __init__(self, experts=4):
        super().__init__()
        self.qkv, self.router = nn.Linear(H, 3 * H), nn.Linear(H, experts, bias=False)
        self.experts = nn.ModuleList(_Expert() for _ in range(experts))
        self.up = self.down = None

    def attend(self, x):
        B = x.shape[0]
        q, k, v = self.qkv(x).view(B, T, 3, HEADS, D).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def forward(self, ids, targets):
        x = self.emb(ids)
        B = x.shape[0]
        x = x + self.o(self.attend(self.ln1(x)).transpose(1, 2).reshape(B, T, H))
        h = self.ln2(x).reshape(B * T, H)
        weights, chosen = self.router(h).softmax(-1).topk(2, dim=-1)
        moe = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            moe = moe.index_add(0, token, expert(h[token]) * weights[token, slot, None])
        x = x + moe.view(B, T, H)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


E, I = 4, 2 * H  # experts, expert FFN size

def _route(router, h):
    """Softmax top-2 routing, tokens sorted by expert (as Hugging Face's grouped path)."""
    weights, chosen = router(h).softmax(-1).topk(2, dim=-1)
    order = chosen.flatten().argsort(stable=True)
    counts = torch.histc(chosen.flatten().float(), bins=E, min=0, max=E - 1).long()
    return weights.flatten()[order], order // 2, order, counts

class StackedExperts(ExpertModules):
    """Stacked (E, 2I, H) / (E, H, I) expert weights. ``form``: 'grouped' (Hugging Face's
    grouped_mm over sorted tokens, gate/up interleaved as gpt-oss's, read through a
    transpose), 'bmm' (Llama 4: every expert sees every token), 'select' (JetMoE: one
    expert's matrix picked from the stack)."""

    def __init__(self, form):
        super().__init__(E)
        self.form, self.experts = form, None
        self.gate_up = nn.Parameter(torch.randn(E, 2 * I, H) / math.sqrt(H))
        self.down_w = nn.Parameter(torch.randn(E, H, I) / math.sqrt(I))

    def moe(self, h):
        if self.form == "bmm":
            probs = self.router(h).softmax(-1)  # (N, E): dense, every expert weighted
            x = h.expand(E, *h.shape)
            gate, up = torch.bmm(x, self.gate_up.transpose(1, 2)).chunk(2, dim=-1)
            out = torch.bmm(F.silu(gate) * up, self.down_w.transpose(1, 2))
            return (out * probs.T[:, :, None]).sum(0)
        weights, token, order, counts = _route(self.router, h)
        x = h[token]
        if self.form == "grouped":
            offs = counts.cumsum(0).to(torch.int32)
            fused = torch.ops.transformers.grouped_mm_fallback(x, self.gate_up.transpose(1, 2), offs)
            act = F.silu(fused[:, ::2]) * fused[:, 1::2]
            out = torch.ops.transformers.grouped_mm_fallback(act, self.down_w.transpose(1, 2), offs)
        else:
            pieces = []
            for e, part in enumerate(x.split(counts.tolist())):
                gate, up = F.linear(part, self.gate_up[e]).chunk(2, dim=-1)
                pieces.append(F.linear(F.silu(gate) * up, self.down_w[e]))
            out = torch.cat(pieces)
        return torch.zeros_like(h).index_add(0, token, out * weights[:, None])

    def forward(self, ids, targets):
        x = self.emb(ids)
        B = x.shape[0]
        x = x + self.o(self.attend(self.ln1(x)).transpose(1, 2).reshape(B, T, H))
        x = x + self.moe(self.ln2(x).reshape(B * T, H)).view(B, T, H)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())

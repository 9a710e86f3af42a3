"""A GPT whose feed-forward is a hand-written dropless mixture of experts.

Top-2 of 4 experts per token, routed the way most code outside transformers does it:
``torch.where(chosen == e)`` lists each expert's tokens (a data-dependent count: an
unbacked size in the captured graph), the expert runs on exactly those rows, and
``index_add_`` scatters its weighted output back. No capacity factor, no dropped
tokens (Gale et al. 2022, "MegaBlocks", §3 for why dropless).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    vocab_size: int = 256
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    n_experts: int = 4
    top_k: int = 2
    expert_hidden: int = 64


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Expert(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w_in = nn.Linear(dim, hidden, bias=False)
        self.w_out = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_out(F.silu(self.w_in(x)))


class DroplessMoE(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.top_k = cfg.top_k
        self.router = nn.Linear(cfg.n_embd, cfg.n_experts, bias=False)
        self.experts = nn.ModuleList(Expert(cfg.n_embd, cfg.expert_hidden) for _ in range(cfg.n_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        x = x.reshape(B * T, C)  # (N, C)
        probs = F.softmax(self.router(x), dim=-1)  # (N, E)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)  # (N, k)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)  # (n_e,) each; n_e known only at run time
            y = expert(x[token]) * weights[token, slot].unsqueeze(-1)  # (n_e, C)
            out.index_add_(0, token, y)
        return out.view(B, T, C)


class Block(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.norm_1 = RMSNorm(cfg.n_embd)
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=False)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.norm_2 = RMSNorm(cfg.n_embd)
        self.moe = DroplessMoE(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.norm_1(x)).view(B, T, 3, self.n_head, C // self.n_head).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True)  # (B, nh, T, hs)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.moe(self.norm_2(x))


class MoEGPT(nn.Module):
    """``forward(idx) -> logits`` (B, T, V); learned positions, untied head."""

    def __init__(self, cfg: MoEConfig, block_size: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos = nn.Embedding(block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build(layers: int, seq: int) -> nn.Module:
    return MoEGPT(MoEConfig(n_layer=layers), block_size=max(64, seq))

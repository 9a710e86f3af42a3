"""A decoder whose RMSNorm is written with ``torch.norm``, as many research code bases do:
``x / (‖x‖₂ · d^-½ + eps) · g`` (Zhang & Sennrich 2019, eq. 4: RMS(x) = ‖x‖₂ / √d).

The same norm serves the residual stream and a QK-norm over the queries (and keys) of
all heads, applied before they are cut into heads (OLMo 2's layout, Team OLMo 2024,
§3.2): under tensor parallelism that norm's statistic spans channels split by heads.
Scores are scaled, masked and soft-maxed as matmuls; the MLP is GELU. Positions are
learned.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True, kw_only=True)
class NormRMSConfig:
    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    ffn_hidden: int = 256
    max_seq_len: int = 64
    eps: float = 1e-8


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.scale, self.eps = dim ** -0.5, eps
        self.g = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / (x.norm(2, dim=-1, keepdim=True) * self.scale + self.eps) * self.g


class Attention(nn.Module):
    def __init__(self, cfg: NormRMSConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.dim // cfg.n_heads
        self.to_q = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.to_k = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.to_v = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.q_norm, self.k_norm = RMSNorm(cfg.dim, cfg.eps), RMSNorm(cfg.dim, cfg.eps)
        self.to_out = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k = self.q_norm(self.to_q(x)), self.k_norm(self.to_k(x))  # (B, T, C): all heads normalised
        q, k, v = (t.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
                   for t in (q, k, self.to_v(x)))  # (B, nh, T, hs)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim) + mask  # (B, nh, T, T)
        out = scores.softmax(dim=-1) @ v  # (B, nh, T, hs)
        return self.to_out(out.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, cfg: NormRMSConfig) -> None:
        super().__init__()
        self.attn_norm, self.ff_norm = RMSNorm(cfg.dim, cfg.eps), RMSNorm(cfg.dim, cfg.eps)
        self.attn = Attention(cfg)
        self.ff_in = nn.Linear(cfg.dim, cfg.ffn_hidden)
        self.ff_out = nn.Linear(cfg.ffn_hidden, cfg.dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), mask)
        return x + self.ff_out(F.gelu(self.ff_in(self.ff_norm(x))))


class NormRMS(nn.Module):
    """``forward(tokens) -> logits`` (B, T, V)."""

    def __init__(self, cfg: NormRMSConfig) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        T = tokens.shape[1]
        h = self.tok_emb(tokens) + self.pos_emb(torch.arange(T, device=tokens.device))  # (B, T, C)
        mask = torch.full((T, T), float("-inf"), device=tokens.device).triu(1)  # (T, T)
        for block in self.blocks:
            h = block(h, mask)
        return self.head(self.norm(h))


def build(layers: int, seq: int) -> nn.Module:
    return NormRMS(NormRMSConfig(n_layers=layers, max_seq_len=max(64, seq)))

"""A Llama-1-style model with rotary embeddings as complex numbers (the layout of Meta's
reference code): the rotation table is ``torch.polar(1, θ·t)``, a complex64 tensor kept
as a plain attribute (neither parameter nor buffer: export lifts it as a constant), and
q/k pairs are rotated by ``view_as_complex`` → complex multiply → ``view_as_real``
(Su et al. 2021, "RoFormer", eq. 34). Attention adds an explicit causal mask to the
scores; the FFN is SwiGLU (Shazeer 2020).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True, kw_only=True)
class ComplexRopeConfig:
    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    ffn_hidden: int = 128
    max_seq_len: int = 64
    theta: float = 10000.0
    norm_eps: float = 1e-5


def rotation_table(head_dim: int, end: int, theta: float) -> torch.Tensor:
    """(end, head_dim / 2) complex64: e^{i·t·θ^(-2j/d)}."""
    freqs = theta ** (-torch.arange(0, head_dim, 2).float() / head_dim)  # (d/2,)
    angles = torch.outer(torch.arange(end).float(), freqs)  # (end, d/2)
    return torch.polar(torch.ones_like(angles), angles)


def rotate(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """x (B, T, nh, hs) real -> rotated, same shape and dtype."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))  # (B, T, nh, hs/2)
    rotated = pairs * table.view(1, x.shape[1], 1, pairs.shape[-1])
    return torch.view_as_real(rotated).flatten(3).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, cfg: ComplexRopeConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, table: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim)  # (B, T, nh, hs)
        k = self.wk(x).view(B, T, self.n_heads, self.head_dim)
        v = self.wv(x).view(B, T, self.n_heads, self.head_dim)
        q, k = rotate(q, table), rotate(k, table)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, nh, T, hs)
        scores = q @ k.transpose(2, 3) / math.sqrt(self.head_dim) + mask  # (B, nh, T, T)
        out = F.softmax(scores.float(), dim=-1).type_as(q) @ v  # (B, nh, T, hs)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: ComplexRopeConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ComplexRopeConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, table: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), table, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """``forward(tokens) -> logits`` (B, T, V)."""

    def __init__(self, cfg: ComplexRopeConfig) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        # A plain attribute, as in the reference code: not in state_dict, not a buffer.
        self.freqs_cis = rotation_table(cfg.dim // cfg.n_heads, cfg.max_seq_len, cfg.theta)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        T = tokens.shape[1]
        h = self.tok_embeddings(tokens)  # (B, T, dim)
        table = self.freqs_cis.to(h.device)[:T]  # (T, hs/2) complex
        mask = torch.full((T, T), float("-inf"), device=tokens.device).triu(1)  # (T, T)
        for layer in self.layers:
            h = layer(h, table, mask)
        return self.output(self.norm(h)).float()


def build(layers: int, seq: int) -> nn.Module:
    return Transformer(ComplexRopeConfig(n_layers=layers, max_seq_len=max(64, seq)))

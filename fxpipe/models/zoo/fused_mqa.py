"""A PaLM-style parallel block with multi-query attention, written with ``einsum``.

One matrix projects the normalised input to the queries of every head, the single
key/value head all heads share (multi-query attention, Shazeer 2019) and the SwiGLU
MLP's gate and up channels: ``q, kv, ff = self.fused(x).split([...], -1)`` (Chowdhery
et al. 2022, "PaLM", §2: parallel layers, multi-query attention). Attention is two
einsums over the shared head, ``'bhqd,bkd->bhqk'`` and ``'bhqk,bkd->bhqd'``, as
hand-written MQA code spells it; attention and MLP outputs are added to the residual
side by side. Positions are learned.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True, kw_only=True)
class FusedMQAConfig:
    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    ffn_hidden: int = 128
    max_seq_len: int = 64


class ParallelBlock(nn.Module):
    def __init__(self, cfg: FusedMQAConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.dim // cfg.n_heads
        self.sizes = [cfg.dim, 2 * self.head_dim, 2 * cfg.ffn_hidden]  # q | k, v | gate, up
        self.norm = nn.LayerNorm(cfg.dim)
        self.fused = nn.Linear(cfg.dim, sum(self.sizes), bias=False)
        self.attn_out = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.ff_out = nn.Linear(cfg.ffn_hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, kv, ff = self.fused(self.norm(x)).split(self.sizes, dim=-1)
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k, v = kv.chunk(2, dim=-1)  # (B, T, hs) each: one head, shared by all
        scores = torch.einsum("bhqd,bkd->bhqk", q, k) / math.sqrt(self.head_dim)  # (B, nh, T, T)
        attn = scores.masked_fill(mask, float("-inf")).softmax(dim=-1)
        out = torch.einsum("bhqk,bkd->bhqd", attn, v).transpose(1, 2).reshape(B, T, C)  # (B, T, C)
        gate, up = ff.chunk(2, dim=-1)  # (B, T, ffn) each
        return x + self.attn_out(out) + self.ff_out(F.silu(gate) * up)


class FusedMQA(nn.Module):
    """``forward(tokens) -> logits`` (B, T, V)."""

    def __init__(self, cfg: FusedMQAConfig) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.dim)
        self.blocks = nn.ModuleList(ParallelBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        T = tokens.shape[1]
        h = self.tok_emb(tokens) + self.pos_emb(torch.arange(T, device=tokens.device))  # (B, T, C)
        mask = torch.ones(T, T, dtype=torch.bool, device=tokens.device).triu(1)  # True: masked
        for block in self.blocks:
            h = block(h, mask)
        return self.head(self.norm(h))


def build(layers: int, seq: int) -> nn.Module:
    return FusedMQA(FusedMQAConfig(n_layers=layers, max_seq_len=max(64, seq)))

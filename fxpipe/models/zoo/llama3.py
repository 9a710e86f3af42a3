"""A Llama-3-style decoder in plain PyTorch, and torchtune's own builder when installed.

``Llama3`` has what torchtune's ``llama3_2`` component builder makes: grouped-query
attention (4 query heads over 2 key/value heads), RMSNorm, a SwiGLU MLP, an output
projection tied to the embedding, and a RoPE module of its own that rotates
interleaved (even, odd) channel pairs with cos/sin tables cached as buffers
(Su et al. 2021, eq. 34, in real arithmetic). ``torchtune_llama`` builds the real
thing from torchtune's builders (``pip install 'fxpipe[torchtune]'``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True, kw_only=True)
class Llama3Config:
    vocab_size: int = 256
    embed_dim: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_dim: int = 128
    max_seq_len: int = 64
    rope_base: float = 500_000.0
    norm_eps: float = 1e-5


class RotaryPositionalEmbeddings(nn.Module):
    """x (B, T, nh, hs) -> x with each (2j, 2j+1) pair rotated by t·base^(-2j/hs)."""

    def __init__(self, head_dim: int, max_seq_len: int, base: float) -> None:
        super().__init__()
        freqs = base ** (-torch.arange(0, head_dim, 2).float() / head_dim)  # (hs/2,)
        angles = torch.outer(torch.arange(max_seq_len).float(), freqs)  # (S, hs/2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[1]
        cos = self.cos[:T].view(1, T, 1, -1)  # (1, T, 1, hs/2)
        sin = self.sin[:T].view(1, T, 1, -1)
        even, odd = x.unflatten(-1, (-1, 2)).unbind(-1)  # (B, T, nh, hs/2) each
        return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.scale


class GroupedQueryAttention(nn.Module):
    def __init__(self, cfg: Llama3Config, rope: RotaryPositionalEmbeddings) -> None:
        super().__init__()
        self.nh, self.nkv = cfg.num_heads, cfg.num_kv_heads
        self.hs = cfg.embed_dim // cfg.num_heads
        self.q_proj = nn.Linear(cfg.embed_dim, self.nh * self.hs, bias=False)
        self.k_proj = nn.Linear(cfg.embed_dim, self.nkv * self.hs, bias=False)
        self.v_proj = nn.Linear(cfg.embed_dim, self.nkv * self.hs, bias=False)
        self.output_proj = nn.Linear(self.nh * self.hs, cfg.embed_dim, bias=False)
        self.rope = rope  # one module shared by every layer, as torchtune does

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.rope(self.q_proj(x).view(B, T, self.nh, self.hs)).transpose(1, 2)  # (B, nh, T, hs)
        k = self.rope(self.k_proj(x).view(B, T, self.nkv, self.hs)).transpose(1, 2)  # (B, nkv, T, hs)
        v = self.v_proj(x).view(B, T, self.nkv, self.hs).transpose(1, 2)  # (B, nkv, T, hs)
        group = self.nh // self.nkv  # query heads per key/value head
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.output_proj(y.transpose(1, 2).reshape(B, T, -1))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)  # gate
        self.w3 = nn.Linear(dim, hidden, bias=False)  # up
        self.w2 = nn.Linear(hidden, dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Llama3Config, rope: RotaryPositionalEmbeddings) -> None:
        super().__init__()
        self.sa_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps)
        self.attn = GroupedQueryAttention(cfg, rope)
        self.mlp_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.embed_dim, cfg.intermediate_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(self.sa_norm(x))
        return h + self.mlp(self.mlp_norm(h))


class Llama3(nn.Module):
    """``forward(tokens) -> logits`` (B, T, V); the output projection is the embedding."""

    def __init__(self, cfg: Llama3Config) -> None:
        super().__init__()
        rope = RotaryPositionalEmbeddings(cfg.embed_dim // cfg.num_heads, cfg.max_seq_len, cfg.rope_base)
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.embed_dim)
        self.layers = nn.ModuleList(DecoderLayer(cfg, rope) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.embed_dim, cfg.norm_eps)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)  # (B, T, C)
        for layer in self.layers:
            h = layer(h)
        return F.linear(self.norm(h), self.tok_embeddings.weight)  # (B, T, V)


def build(layers: int, seq: int) -> nn.Module:
    return Llama3(Llama3Config(num_layers=layers, max_seq_len=max(64, seq)))


def torchtune_llama(layers: int, seq: int) -> nn.Module:
    """torchtune's ``llama3_2`` builder at the same tiny size."""
    try:
        from torchtune.models.llama3_2 import llama3_2
    except ImportError as exc:
        raise ImportError("zoo:torchtune-llama needs torchtune: pip install 'fxpipe[torchtune]' "
                          f"({type(exc).__name__}: {exc})") from exc
    cfg = Llama3Config(num_layers=layers, max_seq_len=max(64, seq))
    model = llama3_2(vocab_size=cfg.vocab_size, num_layers=cfg.num_layers, num_heads=cfg.num_heads,
                     num_kv_heads=cfg.num_kv_heads, embed_dim=cfg.embed_dim,
                     max_seq_len=cfg.max_seq_len, intermediate_dim=cfg.intermediate_dim,
                     rope_base=int(cfg.rope_base), norm_eps=cfg.norm_eps, tie_word_embeddings=True)
    # The builders leave nn.Embedding at N(0, 1), which, tied to the output, gives logits
    # of ±60 (a checkpoint would replace them): initialise like the reference, std 0.02.
    for p in model.parameters():
        if p.dim() == 2:
            nn.init.normal_(p, std=0.02)
    return model

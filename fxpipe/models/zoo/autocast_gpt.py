"""A GPT that switches precision and gradient mode inside its own forward.

Two things users put in forward that a capture must record as regions, not ignore:

- ``torch.autocast`` (bf16; on CPU too): the attention core runs its two matmuls in
  bfloat16 and its softmax in fp32, and hands fp32 back to the residual stream, as
  hand-written mixed-precision attention does;
- ``torch.no_grad()``: the final norm's scale is a statistic computed without
  gradient (a stop-gradient RMS norm): the backward treats it as a constant.

Everything else is fp32. Both regions work per sequence (per token for the norm): no
bf16 result sums over the batch, so splitting the batch into microbatches leaves their
results bit for bit the same (a bf16 weight gradient, a sum over every token, would not
be: its rounding depends on how the batch is split).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True, kw_only=True)
class AutocastConfig:
    vocab_size: int = 256
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64


class Attention(nn.Module):
    def __init__(self, cfg: AutocastConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        # No q/k/v biases (as Llama): a key bias's true gradient is 0 (softmax ignores
        # it), so what it gets is rounding noise, and bf16 noise is large enough for
        # AdamW to turn into lr-sized steps that no two evaluation orders share.
        self.q = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.k = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.v = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.o = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (lin(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for lin in (self.q, self.k, self.v))  # (B, nh, T, hs) each
        future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            att = (q @ k.transpose(-2, -1)) * (C // self.n_head) ** -0.5  # (B, nh, T, T) bf16
            att = att.float().masked_fill(future, float("-inf")).softmax(-1)  # fp32
            y = att @ v  # (B, nh, T, hs) bf16
        return self.o(y.float().transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg: AutocastConfig) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.down = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class StopGradRMSNorm(nn.Module):
    """x · w / rms(x), with rms(x) computed under no_grad (no gradient through it)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            inv_rms = x.pow(2).mean(-1, keepdim=True).add_(self.eps).rsqrt_()  # (B, T, 1)
        return x * inv_rms * self.weight


class Block(nn.Module):
    def __init__(self, cfg: AutocastConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class AutocastGPT(nn.Module):
    """``forward(idx) -> logits`` (B, T, V)."""

    def __init__(self, cfg: AutocastConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = StopGradRMSNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.norm(x))


def build(layers: int, seq: int) -> nn.Module:
    return AutocastGPT(AutocastConfig(n_layer=layers, block_size=max(64, seq)))

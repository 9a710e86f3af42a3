"""A nanoGPT-style GPT as users write it: sliding-window attention with its mask built
in place, and logit softcapping (``tanh(x / c) · c``, Gemma 2) on scores and logits.

The in-place ops are the point of this model. ``fill_`` on a view and ``masked_fill_``
build the window mask, ``att[:, :, mask] = -inf`` (``index_put_``) applies it and
``div_`` starts the softcap. In torch.export's training IR a mutation is a node whose
result nobody reads — the next op reads the mutated tensor's node — so a compiler that
follows data dependencies alone drops it: the attention then sees the whole past.
The (tied) head's weight is read through ``.to(x.dtype)`` under the final softcap, the way
speedrun-style training scripts write their head.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True, kw_only=True)
class SWAConfig:
    vocab_size: int = 256
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    window: int = 4
    """Each token attends to itself and the ``window - 1`` tokens before it ..."""
    sinks: int = 1
    """... and to the first ``sinks`` tokens (attention sinks, Xiao et al. 2023)."""
    attn_softcap: float = 5.0
    final_softcap: float = 10.0


def sliding_window_mask(T: int, window: int, sinks: int, device: torch.device) -> torch.Tensor:
    """(T, T) bool, True where query i may *not* attend key j."""
    mask = torch.ones(T, T, dtype=torch.bool, device=device).triu(1)  # the future
    too_far = torch.ones(T, T, dtype=torch.bool, device=device).tril(-window)
    too_far[:, :sinks].fill_(False)  # sinks stay visible: in place, on a view
    mask.masked_fill_(too_far, True)  # in place; the result is not used, `mask` is
    return mask


class SlidingWindowAttention(nn.Module):
    def __init__(self, cfg: SWAConfig) -> None:
        super().__init__()
        self.n_head, self.softcap = cfg.n_head, cfg.attn_softcap
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        hs = C // self.n_head
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))  # (B, nh, T, T)
        att = torch.tanh(att.div_(self.softcap)) * self.softcap
        att[:, :, mask] = float("-inf")  # x[idx] = v: index_put_ in place
        y = F.softmax(att, dim=-1) @ v  # (B, nh, T, hs)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, cfg: SWAConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = SlidingWindowAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), mask)
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x))))


class SWAGPT(nn.Module):
    """``forward(idx) -> logits`` (B, T, V), softcapped."""

    def __init__(self, cfg: SWAConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight  # tied, as nanoGPT
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        mask = sliding_window_mask(T, self.cfg.window, self.cfg.sinks, idx.device)
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)  # (B, T, C)
        for block in self.h:
            x = block(x, mask)
        x = self.ln_f(x)
        # the head's weight read through a cast to the activations' dtype, as speedrun-style
        # training scripts write it (the vocabulary passes and the TP pass see through it)
        logits = F.linear(x, self.lm_head.weight.to(x.dtype))  # (B, T, V)
        c = self.cfg.final_softcap
        return torch.tanh(logits / c) * c


def build(layers: int, seq: int) -> nn.Module:
    return SWAGPT(SWAConfig(n_layer=layers, block_size=max(64, seq)))

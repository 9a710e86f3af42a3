"""A GPT whose output layer is written the ways training code writes it, not the plain
``linear(x, W) → cross_entropy``:

- the LM head has a bias (``nn.Linear(d, V, bias=True)``, as GPT-J's), untied;
- it is wrapped in Megatron's model-parallel region helpers at tensor-parallel size 1
  (``copy_to_tensor_model_parallel_region`` / ``gather_from_...``): identity autograd
  functions, which export as ``x.view_as(x)``;
- its logits are multiplied by a logit scale (Cohere's Command-R, ``logit_scale``);
- the loss (``prompt_masked_loss``) takes labels aligned with the inputs, slices the
  sequence (``logits[:, :-1]`` against ``labels[:, 1:]``), ignores the prompt's
  targets (-100, Hugging Face's convention for instruction tuning) and asks for one
  loss per token on a flattened view, which it reduces with a loss mask over the
  padding after each document (Megatron's ``loss_mask``).

Each of these sits between the head and the cross-entropy, where the vocabulary
passes must still find the head (``passes/vocab_head.py``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True, kw_only=True)
class BiasedHeadConfig:
    vocab_size: int = 256
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    logit_scale: float = 0.5
    prompt: int = 3
    """The first ``prompt`` targets of every row are the prompt's: not trained on."""
    padding: int = 2
    """The last ``padding`` targets of every row are padding: masked out of the loss."""


class _Region(torch.autograd.Function):
    """Megatron's copy-to / gather-from model-parallel region at one rank: the forward
    and the backward are the identity (``x.view_as(x)``: an autograd function must not
    return its input as is)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


class Block(nn.Module):
    def __init__(self, cfg: BiasedHeadConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.ln_1, self.ln_2 = nn.LayerNorm(cfg.n_embd), nn.LayerNorm(cfg.n_embd)
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.attn_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        x = x + self.attn_proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x))))


class BiasedHeadGPT(nn.Module):
    """``forward(idx) -> logits`` (B, T, V), scaled; pair with ``prompt_masked_loss``."""

    def __init__(self, cfg: BiasedHeadConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=True)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)
        nn.init.normal_(self.lm_head.bias, std=0.02)  # not zero: its gradient must reach every row

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))  # (B, T, C)
        for block in self.h:
            x = block(x)
        logits = _Region.apply(self.lm_head(_Region.apply(self.ln_f(x))))  # (B, T, V)
        return logits * self.cfg.logit_scale


def prompt_masked_loss(logits: torch.Tensor, labels: torch.Tensor, prompt: int = BiasedHeadConfig.prompt,
                       padding: int = BiasedHeadConfig.padding) -> torch.Tensor:
    """Next-token cross-entropy on labels aligned with the inputs (Hugging Face's
    convention): position t predicts label t+1; the first ``prompt`` targets of every row
    are ignored (-100) and the last ``padding`` masked out of the per-token losses. Every
    row keeps as many targets, so the mean over a microbatch's targets averages to the
    batch's."""
    target = labels[:, 1:]
    pos = torch.arange(target.shape[1], device=target.device)
    target = torch.where(pos < prompt, -100, target)  # (B, T-1)
    losses = F.cross_entropy(logits[:, :-1].flatten(0, 1), target.flatten(0, 1), reduction="none")  # (B·(T-1),)
    loss_mask = ((target != -100) & (pos < target.shape[1] - padding)).float()  # (B, T-1)
    return torch.sum(losses * loss_mask.flatten()) / loss_mask.sum()


def build(layers: int, seq: int) -> nn.Module:
    return BiasedHeadGPT(BiasedHeadConfig(n_layer=layers, block_size=max(64, seq)))

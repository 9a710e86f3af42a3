"""Small causal LMs written the way users write them outside Hugging Face transformers,
each with a pattern the captured training IR keeps as an in-place op or a data-dependent
shape. Used by the functionalization and stage-equality tests."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

V, D, T = 64, 32, 16


class _Attn(nn.Module):
    """Causal attention with a sliding window whose mask is built in place, and
    softcapped scores (tanh(x / c) * c)."""

    def __init__(self, window: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)
        self.window = window

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 4, c // 4).permute(2, 0, 3, 1, 4).unbind(0)
        att = (q @ k.transpose(-1, -2)) / (c // 4) ** 0.5
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        mask[2:, :1].fill_(True)                       # write through a view of a view
        far = torch.ones(t, t, dtype=torch.bool, device=x.device).tril(-self.window)
        mask.masked_fill_(far, True)                   # write into the base
        att = att.masked_fill(mask, float("-inf"))
        att = torch.tanh(att / 30.0) * 30.0
        y = att.softmax(-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class _Block(nn.Module):
    def __init__(self, window: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = _Attn(window)
        self.fc, self.out = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        h = F.gelu(self.fc(self.ln2(x)))
        h[..., :2] = 0.0                               # setitem on an activation (copy_ on a view)
        h.mul_(1.5)                                    # in place on an activation
        return x + self.out(h)


class SlidingWindowGPT(nn.Module):
    def __init__(self, layers: int = 4, window: int = 4) -> None:
        super().__init__()
        self.wte = nn.Embedding(V, D)
        self.h = nn.ModuleList(_Block(window) for _ in range(layers))
        self.ln = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        for blk in self.h:
            x = blk(x)
        logits = self.head(self.ln(x))
        logits = 15.0 * torch.tanh(logits / 15.0)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class _Experts(nn.Module):
    """Dropless mixture of experts, routed with ``torch.where`` on the router's top-k:
    each expert runs on exactly the tokens sent to it (a data-dependent count), and the
    results are summed back with ``index_add_``."""

    def __init__(self, experts: int = 4, top_k: int = 2) -> None:
        super().__init__()
        self.router = nn.Linear(D, experts, bias=False)
        self.up = nn.ModuleList(nn.Linear(D, 2 * D) for _ in range(experts))
        self.down = nn.ModuleList(nn.Linear(2 * D, D) for _ in range(experts))
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        flat = x.reshape(b * t, c)
        weights, chosen = self.router(flat).softmax(-1).topk(self.top_k, dim=-1)
        out = torch.zeros_like(flat)
        for e, (up, down) in enumerate(zip(self.up, self.down)):
            token, slot = torch.where(chosen == e)
            y = down(F.gelu(up(flat[token]))) * weights[token, slot].unsqueeze(-1)
            out.index_add_(0, token, y)
        return out.view(b, t, c)


class _MoEBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = _Attn(window=T)
        self.moe = _Experts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.moe(self.ln2(x))


class DroplessMoE(nn.Module):
    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        self.wte = nn.Embedding(V, D)
        self.h = nn.ModuleList(_MoEBlock() for _ in range(layers))
        self.ln = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self.steps.add_(1)  # a counter the forward writes (read by no one else)
        x = self.wte(idx)
        for blk in self.h:
            x = blk(x)
        return F.cross_entropy(self.head(self.ln(x)).flatten(0, 1), targets.flatten())


def batch(seed: int = 0, b: int = 2, t: int = T) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (b, t), generator=g), torch.randint(0, V, (b, t), generator=g)


class _Workload:
    """What the stage tests need of a registry workload: model, batch, loss_fn."""

    def __init__(self, model: nn.Module, example_inputs: tuple[torch.Tensor, ...]) -> None:
        self.model, self.example_inputs, self.loss_fn = model, example_inputs, None


def _sliding_window() -> _Workload:
    torch.manual_seed(0)
    return _Workload(SlidingWindowGPT(), batch(b=4))


def _moe() -> _Workload:
    torch.manual_seed(0)
    return _Workload(DroplessMoE(), batch(b=4))


LOCAL_MODELS = {"local:sliding-window": _sliding_window, "local:dropless-moe": _moe}

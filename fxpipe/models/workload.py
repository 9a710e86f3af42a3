"""``Workload``: a model with its example batch and loss, what every model source builds
(registry names, Hugging Face directories, zoo models, a user's ``module:function``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

from fxpipe.models.gpt import GPTConfig


@dataclass(frozen=True)
class Workload:
    """What capture needs: the model, one batch as ``train_step`` will see it, the loss."""
    model: nn.Module
    example_inputs: tuple[Any, ...]
    loss_fn: Callable[..., torch.Tensor] | None = None
    config: GPTConfig | None = None
    """The GPT shape when known (FLOPs formulas, planner); None for HF or user models."""
    vocab_size: int | None = None
    """Token ids must be below this (None: unknown, e.g. a user model)."""
    labels_shifted: bool = True
    """True: the batch is (inputs, next tokens) — nanoGPT's convention; False: (inputs,
    labels aligned with inputs) — Hugging Face's, where the loss shifts."""

    def batch_from_tokens(self, tokens: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """A training batch from (B, s+1) token windows, in this model's convention. Ids
        outside the vocabulary are refused, never clamped (that trains on other data)."""
        if self.vocab_size is not None and tokens.numel() and tokens.device.type != "meta":
            top = int(tokens.max())
            if top >= self.vocab_size:
                raise ValueError(f"token id {top} is outside the model's vocabulary of {self.vocab_size}; "
                                 f"give the model a vocabulary of at least {top + 1}")
        x = tokens[:, :-1].contiguous()
        return (x, tokens[:, 1:].contiguous()) if self.labels_shifted else (x, x.clone())


def _token_batch(batch: int, seq: int, vocab: int, device: torch.device | str,
                 seed: int) -> torch.Tensor:
    if torch.device(device).type == "meta":
        return torch.empty(batch, seq, dtype=torch.long, device="meta")
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=gen).to(device)

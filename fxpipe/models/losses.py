"""Loss functions for ``capture(..., loss_fn=...)``: ``loss_fn(model_output, target)``."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def logits_of(output: object) -> torch.Tensor:
    """The logits in a model's output: a tensor, a tuple/list whose first item is
    the logits, or an object with a ``logits`` attribute (Hugging Face ModelOutput)."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(
        f"cannot find logits in a model output of type {type(output).__name__}; "
        f"return a tensor, a tuple starting with the logits, or an object with .logits")


def causal_lm_loss(output: object, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy with Hugging Face's label convention: ``labels`` are
    aligned with the inputs and shifted here (position t predicts token t+1)."""
    logits = logits_of(output)
    shifted = logits[:, :-1, :]
    target = labels[:, 1:]
    return F.cross_entropy(shifted.reshape(-1, shifted.size(-1)), target.reshape(-1))


def next_token_loss(output: object, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy where ``targets`` already hold the next tokens (nanoGPT convention)."""
    logits = logits_of(output)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

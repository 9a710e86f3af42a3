"""Models written outside Hugging Face transformers, as users bring them.

Each is a small fp32 model (vocabulary 256, hidden 64, 4 heads, no dropout) that
returns logits; the registry pairs it with ``next_token_loss``. They exist to test
fxpipe on code it was not shaped around: in-place mask building, data-dependent
routing, autocast and no-grad regions, complex arithmetic, another project's
builders. ``zoo:<name>`` in ``build_workload`` / ``--model``.
A model with a loss of its own (``ZooModel.loss``: a head and loss written as training
code writes them) is paired with that loss instead.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from fxpipe.models.zoo import autocast_gpt, biased_head, complex_rope, fused_mqa, llama3, moe, norm_rms, swa_gpt

VOCAB = 256


@dataclass(frozen=True)
class ZooModel:
    build: Callable[[int, int], nn.Module]
    """``build(layers, seq) -> nn.Module`` with ``forward(tokens) -> logits``."""
    feature: str
    """What the model is in the zoo for (one line)."""
    bf16_rtol: float | None = None
    """For a model that computes in bf16 somewhere: how closely any other evaluation
    order can match it, relative to a tensor's largest value. A different fp32 rounding
    before a cast to bf16 (tensor parallelism splits a matmul's output) can move a bf16
    result by one ulp (2^-8) and that difference propagates; None: an fp32 model, held
    to fp32 tolerances."""
    requires: str | None = None
    """An optional package the builder imports (an extra of fxpipe's), or None."""
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    """The model's own loss ``loss(logits, labels)`` on labels aligned with the inputs
    (Hugging Face's convention: it shifts them itself); None: ``next_token_loss`` on
    targets already shifted (nanoGPT's)."""

    @property
    def available(self) -> bool:
        """Buildable here: its optional package, if any, is installed."""
        return self.requires is None or importlib.util.find_spec(self.requires) is not None


ZOO: dict[str, ZooModel] = {
    "swa-gpt": ZooModel(swa_gpt.build, "sliding-window mask built in place, softcapping, a head read through a cast"),
    "moe": ZooModel(moe.build, "dropless top-2 MoE: torch.where routing, index_add_"),
    "autocast": ZooModel(autocast_gpt.build, "bf16 autocast and no_grad regions in forward",
                         bf16_rtol=1e-2),
    "complex-rope": ZooModel(complex_rope.build, "Llama-1 reference rotary: polar, view_as_complex"),
    "fused-mqa": ZooModel(fused_mqa.build, "one q | shared k/v head | MLP projection, einsum attention"),
    "norm-rms": ZooModel(norm_rms.build, "RMSNorm as x / ||x||·√d (torch.norm), QK-norm over all heads"),
    "llama3": ZooModel(llama3.build, "Llama-3 in plain PyTorch: GQA, RMSNorm, SwiGLU, own RoPE"),
    "torchtune-llama": ZooModel(llama3.torchtune_llama, "torchtune's llama3_2 builder",
                                requires="torchtune"),
    "biased-head": ZooModel(biased_head.build, "LM head with bias, identity autograd wrappers, logit scale; "
                            "loss on the sliced sequence: prompt targets -100, padding under a loss mask",
                            loss=biased_head.prompt_masked_loss),
}

"""Models written outside Hugging Face transformers, as users bring them.

Each is a small fp32 model (vocabulary 256, hidden 64, 4 heads, no dropout) that
returns logits; the registry pairs it with ``next_token_loss``. They exist to test
fxpipe on code it was not shaped around: in-place mask building, data-dependent
routing, autocast and no-grad regions, complex arithmetic, another project's
builders. ``zoo:<name>`` in ``build_workload`` / ``--model``.
"""
from __future__ import annotations

from typing import Callable

import torch.nn as nn

from fxpipe.models.zoo import autocast_gpt, complex_rope, llama3, moe, swa_gpt

VOCAB = 256

ZOO: dict[str, Callable[[int, int], nn.Module]] = {
    "swa-gpt": swa_gpt.build,  # sliding-window mask built in place, softcapping
    "moe": moe.build,  # dropless top-2 MoE: torch.where routing, index_add_
    "autocast": autocast_gpt.build,  # bf16 autocast and no_grad regions in forward
    "complex-rope": complex_rope.build,  # Llama-1 reference: polar / view_as_complex
    "llama3": llama3.build,  # Llama-3 in plain PyTorch (GQA, RMSNorm, SwiGLU, own RoPE)
    "torchtune-llama": llama3.torchtune_llama,  # torchtune's llama3_2 builder (optional)
}
"""name -> ``build(layers, seq) -> nn.Module`` (``forward(tokens) -> logits``)."""

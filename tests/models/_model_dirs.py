"""Model directories written by transformers for the tests: a small Mixtral saved with its weights."""
from __future__ import annotations

import torch


def _mixtral_dir(path):
    import transformers

    cfg = transformers.MixtralConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, num_key_value_heads=2,
                                     intermediate_size=48, vocab_size=128, max_position_embeddings=64,
                                     num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(cfg).save_pretrained(path)
    return str(path)

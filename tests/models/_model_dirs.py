"""Model directories written by transformers for the tests: a one-layer Llama config (fields
overridable), a Mixtral saved with its weights (two sizes)."""
from __future__ import annotations

import json
from pathlib import Path

import torch


def _mixtral_dir(path):
    import transformers

    cfg = transformers.MixtralConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, num_key_value_heads=2,
                                     intermediate_size=48, vocab_size=128, max_position_embeddings=64,
                                     num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(cfg).save_pretrained(path)
    return str(path)


def llama_config(path: Path, **extra) -> Path:
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    transformers.LlamaConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, num_key_value_heads=2,
                             intermediate_size=64, vocab_size=300, max_position_embeddings=64).save_pretrained(path)
    doc = json.loads((path / "config.json").read_text())
    doc.update(extra)
    (path / "config.json").write_text(json.dumps(doc))
    return path


def mixtral_64_dir(path: Path) -> Path:
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                     intermediate_size=96, vocab_size=256, max_position_embeddings=64,
                                     num_local_experts=4, num_experts_per_tok=2)
    transformers.MixtralForCausalLM(cfg).save_pretrained(path)
    return path

"""Tiny Hugging Face causal LMs built from configs in code (no download).

These are test and demo subjects: fxpipe captures them unmodified. The sizes are
small enough for CPU tests but keep every structural feature that matters to the
passes (fused or interleaved QKV, grouped-query attention, rotary, tied heads).
"""
from __future__ import annotations

from typing import Any, Callable

import torch.nn as nn


def _require_transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "Hugging Face models need the 'hf' extra: pip install 'fxpipe[hf]'") from exc
    transformers.logging.set_verbosity_error()
    return transformers


def _gpt2(layers: int, hidden: int, heads: int, vocab: int, seq: int) -> nn.Module:
    t = _require_transformers()
    cfg = t.GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=vocab,
                       n_positions=seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                       bos_token_id=0, eos_token_id=0)
    return t.GPT2LMHeadModel(cfg)


def _llama(layers: int, hidden: int, heads: int, vocab: int, seq: int) -> nn.Module:
    t = _require_transformers()
    # Grouped-query attention: half as many key/value heads as query heads.
    cfg = t.LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                        num_key_value_heads=max(1, heads // 2), intermediate_size=hidden * 2 + hidden // 2,
                        vocab_size=vocab, max_position_embeddings=seq, attention_dropout=0.0,
                        bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return t.LlamaForCausalLM(cfg)


def _gpt_neox(layers: int, hidden: int, heads: int, vocab: int, seq: int) -> nn.Module:
    t = _require_transformers()
    cfg = t.GPTNeoXConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                          intermediate_size=hidden * 4, vocab_size=vocab, max_position_embeddings=seq,
                          attention_dropout=0.0, hidden_dropout=0.0, bos_token_id=0, eos_token_id=0)
    return t.GPTNeoXForCausalLM(cfg)


def _opt(layers: int, hidden: int, heads: int, vocab: int, seq: int) -> nn.Module:
    t = _require_transformers()
    cfg = t.OPTConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                      ffn_dim=hidden * 4, vocab_size=vocab, max_position_embeddings=seq,
                      word_embed_proj_dim=hidden, dropout=0.0, attention_dropout=0.0,
                      bos_token_id=0, eos_token_id=0, pad_token_id=1)
    return t.OPTForCausalLM(cfg)


HF_FAMILIES: dict[str, Callable[..., nn.Module]] = {
    "gpt2": _gpt2,
    "llama": _llama,
    "gpt_neox": _gpt_neox,
    "opt": _opt,
}

"""Tiny causal LMs of every Hugging Face family the installed transformers can build,
and fxpipe's zoo of models written outside transformers (``zoo:<name>``).

Used by ``compat.py`` (the compatibility matrix) and its smoke test. A family is a
``model_type`` of transformers' causal-LM auto mapping. Its tiny config is the
family's default config with the usual size fields shrunk (2 layers, hidden 64,
4 heads, 2 key/value heads, vocabulary 256) and every dropout at 0. Overrides are
keyed on config *fields*, never on the family, so a new family with familiar field
names needs no entry here; ``FIELD_FIXUPS`` lists the few fields whose defaults
only make sense at full size.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from fxpipe.models.losses import causal_lm_loss

BATCH, SEQ, VOCAB = 4, 16, 256
MAX_PARAMS = 5_000_000
"""A config still above this after shrinking kept a full-size part we do not know
how to shrink (a vision tower, an audio codec): not attempted, with the count."""

# Size fields, by name, wherever a config has them (attribute aliases included).
SIZES: dict[str, Any] = {
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers",
                     "encoder_layers", "num_decoder_layers"), 2),
    **dict.fromkeys(("hidden_size", "n_embd", "d_model", "dim", "embed_dim", "word_embed_proj_dim"), 64),
    **dict.fromkeys(("num_attention_heads", "n_head", "num_heads", "decoder_attention_heads",
                     "encoder_attention_heads", "n_heads"), 4),
    **dict.fromkeys(("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num"), 2),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "n_inner", "decoder_ffn_dim", "encoder_ffn_dim",
                     "ffn_hidden_size", "d_ff", "d_inner"), 128),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size",
                     "expert_intermediate_size"), 32),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "top_k", "num_selected_experts"), 2),
    "head_dim": 16,
    "vocab_size": VOCAB,
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len"), 64),
}
# Fields whose full-size defaults are inconsistent with the sizes above.
FIELD_FIXUPS: dict[str, Any] = {
    "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "n_shared_experts": 1,
    "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
    "v_head_dim": 16, "partial_rotary_factor": None, "rotary_dim": 8, "rotary_emb_base": None,
    "sliding_window": 8, "attention_window_size": 8, "num_key_value_groups": None,
    "tie_word_embeddings": None, "use_cache": False, "num_nextn_predict_layers": 0,
}
_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id",
              "sep_token_id", "cls_token_id", "mask_token_id")


@dataclass
class Family:
    """One attempted family: its tiny model, one batch and the loss."""
    model_type: str
    model: nn.Module
    batch: tuple[torch.Tensor, torch.Tensor]
    num_params: int
    loss_fn: Any = causal_lm_loss


class NotBuildable(Exception):
    """The family cannot be built offline as a tiny text model (the message says why)."""


def _transformers() -> Any:
    import transformers
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    return transformers


def family_names() -> list[str]:
    """Every ``model_type`` with a causal-LM head in the installed transformers."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def zoo_names() -> list[str]:
    """The models of ``fxpipe/models/zoo``, as ``zoo:<name>``."""
    from fxpipe.models.zoo import ZOO
    return [f"zoo:{k}" for k in ZOO]


def is_zoo(name: str) -> bool:
    return name.startswith("zoo:")


def grad_rtol(name: str, default: float) -> float:
    """The gradient tolerance a row is held to: ``default`` (fp32), or a zoo model's
    own bf16 tolerance when it computes in bf16 somewhere."""
    if is_zoo(name):
        from fxpipe.models.zoo import ZOO
        return ZOO[name[4:]].bf16_rtol or default
    return default


def _dropout_field(name: str, value: Any) -> bool:
    # Jitter (random noise on router logits or inputs) is dropout's kind: training-mode
    # randomness that no two runs share.
    return isinstance(value, float) and ("dropout" in name or "pdrop" in name or "jitter" in name
                                         or name.endswith("drop_prob") or name == "drop_path_rate")


def tiny_config(model_type: str) -> Any:
    """The family's default config, shrunk; raises NotBuildable when it cannot be made."""
    t = _transformers()
    try:
        default = t.AutoConfig.for_model(model_type)
    except Exception as exc:
        raise NotBuildable(f"no default config: {type(exc).__name__}: {_first_line(exc)}") from exc
    fields = set(default.to_dict()) | set(getattr(default, "attribute_map", {}))
    kwargs = {k: v for k, v in SIZES.items() if k in fields}
    for k, v in FIELD_FIXUPS.items():
        if k in fields and getattr(default, k, None) is not None and v is not None:
            kwargs[k] = v
    if getattr(default, "qk_rope_head_dim", None):
        kwargs["head_dim"] = kwargs["qk_rope_head_dim"]  # latent attention: rotary on head_dim
    if getattr(default, "kv_lora_rank", None) and "num_key_value_heads" in kwargs:
        # Latent attention expands k/v to every head: fewer kv heads would be grouped twice.
        kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]
    if "num_key_value_heads" in fields and getattr(default, "num_key_value_heads", None) is None:
        kwargs.pop("num_key_value_heads", None)  # a family without GQA: keep multi-head
    for k, v in default.to_dict().items():
        if _dropout_field(k, v):
            kwargs[k] = 0.0
        if k in _TOKEN_IDS and isinstance(v, int) and v >= VOCAB:
            kwargs[k] = VOCAB - 1
    # Per-layer lists sized for the default depth must match 2 layers.
    depth = getattr(default, "num_hidden_layers", None)
    for k, v in default.to_dict().items():
        if isinstance(v, list) and depth and len(v) == depth and depth != 2 and k not in kwargs:
            kwargs[k] = v[:2]
    try:
        return t.AutoConfig.for_model(model_type, **kwargs)
    except Exception as exc:
        raise NotBuildable(f"tiny config rejected: {type(exc).__name__}: {_first_line(exc)}") from exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else "")[:160]


def build(model_type: str, seed: int = 0, attn: str = "sdpa") -> Family:
    """The tiny fp32 model (deterministic in ``seed``) and one batch of token ids."""
    if is_zoo(model_type):
        return _build_zoo(model_type, seed)
    t = _transformers()
    cfg = tiny_config(model_type)
    try:
        with torch.device("meta"):
            probe = t.AutoModelForCausalLM.from_config(cfg)
    except Exception as exc:
        raise NotBuildable(f"from_config failed: {type(exc).__name__}: {_first_line(exc)}") from exc
    count = sum(p.numel() for p in probe.parameters())
    if count > MAX_PARAMS:
        raise NotBuildable(f"{count / 1e6:.1f}M parameters after shrinking (a part without the usual "
                           f"size fields)")
    torch.manual_seed(seed)
    try:
        model = t.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn,
                                                   torch_dtype=torch.float32)
    except Exception:
        torch.manual_seed(seed)  # families without SDPA support run eager attention
        model = t.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager",
                                                   torch_dtype=torch.float32)
    model = model.float().train()
    gen = torch.Generator().manual_seed(seed)
    vocab = min(VOCAB, getattr(cfg, "vocab_size", VOCAB) or VOCAB)
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=gen)
    return Family(model_type, model, (ids, ids.clone()), count)


def _build_zoo(name: str, seed: int) -> Family:
    """A zoo model at the matrix's size: 2 layers, BATCH × SEQ tokens, vocabulary 256."""
    from fxpipe.models import build_workload
    try:
        w = build_workload(name, batch=BATCH, seq=SEQ, layers=2, seed=seed)
    except ImportError as exc:  # an optional package (torchtune) is not installed
        raise NotBuildable(f"{type(exc).__name__}: {_first_line(exc)}") from exc
    w.model.train()
    return Family(name, w.model, w.example_inputs, sum(p.numel() for p in w.model.parameters()),
                  w.loss_fn)


def eager_loss(fam: Family, model: nn.Module | None = None) -> torch.Tensor:
    model = model if model is not None else fam.model
    return fam.loss_fn(model(fam.batch[0]), fam.batch[1])


def reference(model_type: str, lr: float, steps: int = 2) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, plain SGD: each step's loss and the first step's gradients."""
    fam = build(model_type)
    opt = torch.optim.SGD(fam.model.parameters(), lr=lr)
    losses, grads = [], {}
    for step in range(steps):
        opt.zero_grad()
        loss = eager_loss(fam)
        loss.backward()
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in fam.model.named_parameters()
                     if p.grad is not None}
        opt.step()
        losses.append(float(loss))
    return losses, grads

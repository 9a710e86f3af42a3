"""Models by name, for the CLI, tests and benchmarks.

``build_workload("gpt-tiny", batch=2, seq=32)`` returns the model, one example
batch and the loss function — exactly what ``fxpipe.capture`` and
``fxpipe.parallelize`` take. Names:

- fxpipe's own GPT (``fxpipe/models/gpt.py``) at several sizes: ``gpt-tiny``,
  ``gpt-small``, ``gpt2-small``, ``gpt2-medium``, ``gpt3-175b``;
- tiny Hugging Face families built from configs in code: ``hf:gpt2``,
  ``hf:llama``, ``hf:gpt_neox``, ``hf:opt``;
- models written outside transformers (``fxpipe/models/zoo``): ``zoo:swa-gpt``,
  ``zoo:moe``, ``zoo:autocast``, ``zoo:complex-rope``, ``zoo:fused-mqa``, ``zoo:norm-rms``,
  ``zoo:llama3``, ``zoo:biased-head``, ``zoo:torchtune-llama`` (needs torchtune);
- ``package.module:function`` — a user function returning ``(model, batch)`` or
  ``(model, batch, loss_fn)``;
- a Hugging Face model directory (``config.json``), built on the meta device
  (``fxpipe/models/hf_dir.py``).
"""
from __future__ import annotations

import importlib

import torch
import torch.nn as nn

from fxpipe.models.gpt import GPT, GPTConfig
from fxpipe.models.hf import HF_FAMILIES
from fxpipe.models.hf_dir import dir_workload, is_model_dir
from fxpipe.models.losses import causal_lm_loss, next_token_loss
from fxpipe.models.workload import Workload, _token_batch
from fxpipe.models.zoo import VOCAB as ZOO_VOCAB, ZOO

GPT_CONFIGS: dict[str, GPTConfig] = {
    "gpt-tiny": GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64),
    # 8 heads of width 8: the smallest GPT that tp=8 can shard (`fxpipe run --tp 8 --pp 4`).
    "gpt-nano": GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=8, n_embd=64),
    "gpt-small": GPTConfig(vocab_size=256, block_size=256, n_layer=6, n_head=8, n_embd=256),
    "gpt2-small": GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": GPTConfig(vocab_size=50257, block_size=1024, n_layer=24, n_head=16, n_embd=1024),
    "gpt3-175b": GPTConfig(vocab_size=51200, block_size=2048, n_layer=96, n_head=96, n_embd=12288),
    # The SC21 paper's Table 1 (Narayanan et al. 2021): heads, hidden, layers; V=51200, s=2048.
    **{name: GPTConfig(vocab_size=51200, block_size=2048, n_layer=l, n_head=a, n_embd=h)
       for name, a, h, l in (("gpt-1.7b", 24, 2304, 24), ("gpt-3.6b", 32, 3072, 30),
                             ("gpt-7.5b", 32, 4096, 36), ("gpt-18b", 48, 6144, 40),
                             ("gpt-39b", 64, 8192, 48), ("gpt-76b", 80, 10240, 60),
                             ("gpt-145b", 96, 12288, 80), ("gpt-310b", 128, 16384, 96),
                             ("gpt-530b", 128, 20480, 105), ("gpt-1t", 160, 25600, 128))},
}

HF_TINY = dict(layers=2, hidden=64, heads=4, vocab=128, seq=64)


META_ABOVE_PARAMS = 3e8
"""Registry GPTs larger than this are built on the meta device by default (``build_device``)."""


def build_device(name: str) -> str:
    """Where ``fxpipe run`` and ``fxpipe compile`` build the named model: on the meta
    device (no weights allocated; a rank then makes only its own shards) for Hugging Face
    model directories and registry GPTs above ~300M parameters, else on the CPU."""
    if is_model_dir(name):
        return "meta"
    cfg = GPT_CONFIGS.get(name)
    return "meta" if cfg is not None and cfg.num_params > META_ABOVE_PARAMS else "cpu"


def model_names() -> list[str]:
    """Every name ``build_workload`` can build here (a zoo model whose optional package
    is missing is left out; building it says which extra to install)."""
    return [*GPT_CONFIGS, *(f"hf:{k}" for k in HF_FAMILIES),
            *(f"zoo:{k}" for k, m in ZOO.items() if m.available)]


def build_workload(name: str, *, batch: int = 2, seq: int | None = None,
                   device: torch.device | str = "cpu", seed: int = 0,
                   layers: int | None = None) -> Workload:
    """Build a named model and an example batch of ``batch`` sequences of ``seq`` tokens.

    ``device="meta"`` builds without allocating weights (paper-scale shapes).
    ``layers`` overrides the layer count of a named GPT/HF shape.
    """
    if name in GPT_CONFIGS:
        cfg = GPT_CONFIGS[name]
        if layers is not None or (seq is not None and seq > cfg.block_size):
            cfg = GPTConfig(**{**cfg.__dict__, "n_layer": layers or cfg.n_layer,
                               "block_size": max(cfg.block_size, seq or 0)})
        seq = seq or cfg.block_size
        torch.manual_seed(seed)
        with torch.device(device):
            model = GPT(cfg)
        x = _token_batch(batch, seq + 1, cfg.vocab_size, device, seed)
        # nanoGPT convention: the targets are the inputs shifted by one token.
        return Workload(model, (x[:, :-1].contiguous(), x[:, 1:].contiguous()), None, cfg,
                        vocab_size=cfg.vocab_size)
    if name.startswith("hf:"):
        family = name[3:]
        if family not in HF_FAMILIES:
            raise ValueError(f"unknown Hugging Face family {family!r}; valid: "
                             + ", ".join(f"hf:{k}" for k in HF_FAMILIES))
        dims = dict(HF_TINY)
        if layers is not None:
            dims["layers"] = layers
        seq = seq or 16
        dims["seq"] = max(dims["seq"], seq)
        torch.manual_seed(seed)
        with torch.device(device):
            model = HF_FAMILIES[family](**dims)
        ids = _token_batch(batch, seq, dims["vocab"], device, seed)
        return Workload(model, (ids, ids.clone()), causal_lm_loss, None, vocab_size=dims["vocab"],
                        labels_shifted=False)
    if name.startswith("zoo:"):
        return _zoo_workload(name, batch, seq or 16, device, seed, layers or 2)
    if is_model_dir(name):  # a Hugging Face model directory (fxpipe/models/hf_dir.py)
        return dir_workload(name, batch=batch, seq=seq or 128, device=device, seed=seed, layers=layers)
    if ":" in name:
        return _user_workload(name)
    raise ValueError(f"unknown model {name!r}; valid names: {', '.join(model_names())}, "
                     f"or 'package.module:function' returning (model, batch[, loss_fn])")


def _zoo_workload(name: str, batch: int, seq: int, device: torch.device | str, seed: int,
                  layers: int) -> Workload:
    if name[4:] not in ZOO:
        raise ValueError(f"unknown zoo model {name!r}; valid: " + ", ".join(f"zoo:{k}" for k in ZOO))
    zoo = ZOO[name[4:]]
    torch.manual_seed(seed)
    with torch.device(device):
        model = zoo.build(layers, seq)
    if zoo.loss is not None:  # its own loss shifts labels aligned with the inputs (Hugging Face's convention)
        ids = _token_batch(batch, seq, ZOO_VOCAB, device, seed)
        return Workload(model, (ids, ids.clone()), zoo.loss, None, vocab_size=ZOO_VOCAB, labels_shifted=False)
    x = _token_batch(batch, seq + 1, ZOO_VOCAB, device, seed)
    # nanoGPT convention: the targets are the inputs shifted by one token.
    return Workload(model, (x[:, :-1].contiguous(), x[:, 1:].contiguous()), next_token_loss, None,
                    vocab_size=ZOO_VOCAB)


def _user_workload(spec: str) -> Workload:
    module_name, _, fn_name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), fn_name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load model function {spec!r}: {exc}") from exc
    result = fn()
    if not isinstance(result, tuple) or len(result) not in (2, 3):
        raise TypeError(f"{spec} must return (model, batch) or (model, batch, loss_fn), "
                        f"got {type(result).__name__}")
    model, batch, *rest = result
    batch = batch if isinstance(batch, tuple) else (batch,)
    if not isinstance(model, nn.Module):
        raise TypeError(f"{spec} must return (model, batch[, loss_fn]) with an nn.Module first, "
                        f"got {type(model).__name__}")
    if not batch or not all(isinstance(t, torch.Tensor) for t in batch):
        raise TypeError(f"{spec}: the batch must be a tensor or a non-empty tuple of tensors, got "
                        f"({', '.join(type(t).__name__ for t in batch)})")
    if rest and rest[0] is not None and not callable(rest[0]):
        raise TypeError(f"{spec}: loss_fn must be callable, got {type(rest[0]).__name__}")
    return Workload(model, batch, rest[0] if rest else None, None)

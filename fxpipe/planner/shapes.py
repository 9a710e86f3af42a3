"""Transformer shapes the planner prices, and the SC21 paper's FLOPs formulas."""
from __future__ import annotations

from dataclasses import dataclass

from fxpipe.base.recompute_mode import RecomputeMode
from fxpipe.models.registry import GPT_CONFIGS


@dataclass(frozen=True, kw_only=True)
class TransformerShape:
    """A GPT-style stack of identical layers (MLP hidden 4h), embedding and a tied LM head."""

    name: str
    """Registry name or a label."""
    layers: int
    """Transformer layers l."""
    hidden: int
    """Hidden size h."""
    heads: int
    """Attention heads a."""
    seq: int
    """Sequence length s."""
    vocab: int
    """Vocabulary size V (unpadded; the cost model pads it to a multiple of 128·t as Megatron)."""
    dropout: bool = True
    """Dropout after attention, projections and embeddings (the paper's setting; each keeps
    a 1-byte mask). fxpipe's own GPT defaults to dropout 0."""
    causal: bool = True
    """Causal (GPT) or bidirectional (BERT) attention. No formula changes: the paper counts
    the whole s×s score matrix either way."""

    def __post_init__(self) -> None:
        for f in ("layers", "hidden", "heads", "seq", "vocab"):
            if getattr(self, f) < 1:
                raise ValueError(f"{self.name}: {f} must be >= 1, got {getattr(self, f)}")
        if self.hidden % self.heads:
            raise ValueError(f"{self.name}: hidden {self.hidden} is not divisible by heads {self.heads}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def num_params(self) -> int:
        """l(12h² + 13h) + Vh + sh + 2h (Narayanan et al. SC21, appendix; LM head tied to the embedding)."""
        h, l = self.hidden, self.layers
        return l * (12 * h * h + 13 * h) + self.vocab * h + self.seq * h + 2 * h

    def padded_vocab(self, tp: int) -> int:
        """Megatron pads V to a multiple of 128·t so every TP rank owns an equal slice."""
        unit = 128 * tp
        return -(-self.vocab // unit) * unit

    def layer_params_per_gpu(self, tp: int) -> float:
        """One layer's parameters on one TP rank: the QKV and first MLP weights and biases
        and the output-projection and second MLP weights are split (12h²/t + 7h/t); the two
        row-parallel biases and two LayerNorms are replicated (6h)."""
        h = self.hidden
        return 12 * h * h / tp + 7 * h / tp + 6 * h


def shape_from_registry(name: str, *, seq: int | None = None) -> TransformerShape:
    """The planner's view of a GPT in ``fxpipe.models.registry.GPT_CONFIGS``."""

    if name not in GPT_CONFIGS:
        raise ValueError(f"unknown model {name!r} for the planner; valid: {', '.join(GPT_CONFIGS)}")
    cfg = GPT_CONFIGS[name]
    return TransformerShape(name=name, layers=cfg.n_layer, hidden=cfg.n_embd, heads=cfg.n_head,
                            seq=seq or cfg.block_size, vocab=cfg.vocab_size)


def model_flops(shape: TransformerShape, global_batch: int, recompute: RecomputeMode) -> float:
    """FLOPs of one iteration as the SC21 paper counts them (§5.1), recomputation included.

    Per layer and sequence the forward is 24sh² + 4s²h (the matmuls; attention over the
    full s×s), the backward twice that, and the logits 2shV forward, 4shV backward:
    - full recompute (the paper's Table 1 formula): one extra layer forward,
      96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h));
    - none (Megatron's logged formula): 72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h));
    - selective (our derivation, same counting): only the attention core's 4s²h is rerun,
      72·B·s·l·h²·(1 + 2s/(9h) + V/(12·l·h)).
    """
    return model_flops_formula(global_batch, shape.seq, shape.layers, shape.hidden, shape.vocab, recompute)


def model_flops_formula(B: int, s: int, l: int, h: int, V: int,  # noqa: E741 (the paper's symbols)
                        recompute: RecomputeMode = RecomputeMode.NONE) -> float:
    """``model_flops`` from the five numbers alone: batch B, sequence s, layers l, hidden h,
    vocabulary V (the one copy of the formula; the cost pass's totals are tested against it)."""
    if recompute is RecomputeMode.FULL:
        return 96.0 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
    if recompute is RecomputeMode.SELECTIVE:
        return 72.0 * B * s * l * h * h * (1 + 2 * s / (9 * h) + V / (12 * l * h))
    return 72.0 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))

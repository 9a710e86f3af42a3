"""Transformer shapes the planner prices, and the SC21 paper's FLOPs formulas."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

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
    kv_heads: int | None = None
    """Key/value heads (grouped-query attention: fewer than ``heads``); None: ``heads``."""
    ffn_hidden: int | None = None
    """MLP inner width f; None: 4h (GPT)."""
    gated_mlp: bool = False
    """A gated MLP (SwiGLU: gate and up projections h→f, down f→h; three matrices)."""
    fused_attention: bool = False
    """The model calls ``scaled_dot_product_attention``: a flash kernel keeps no s×s tensor
    (``PlannerOptions.fused_attention`` forces it for any shape)."""
    tied_head: bool = True
    """The LM head shares the token embedding's table (Llama-3-70B's does not)."""
    position_table: bool = True
    """A learned s×h position table (GPT); rotary models have none."""
    linears: tuple[tuple[int, int], ...] | None = None
    """One layer's weight matrices as (in, out) features, read off the captured graph
    (``captured.py``); None: GPT's (h, 3h), (h, h), (h, 4h), (4h, h)."""
    layer_vector_params: int | None = None
    """One layer's parameters beyond its matrices (biases, norms); None: GPT's 13h."""

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
    def kv_dim(self) -> int:
        """Width of the key (and of the value) projection."""
        return (self.kv_heads or self.heads) * self.head_dim

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 4 * self.hidden

    @property
    def layer_linears(self) -> tuple[tuple[int, int], ...]:
        """(in, out) of each weight matrix of one layer."""
        if self.linears is not None:
            return self.linears
        h, f, kv = self.hidden, self.ffn, self.kv_dim
        mlp = ((h, f), (h, f), (f, h)) if self.gated_mlp else ((h, f), (f, h))
        return ((h, h + 2 * kv), (h, h)) + mlp

    @cached_property  # read for every layout the search prices
    def layer_matrix_params(self) -> int:
        return sum(i * o for i, o in self.layer_linears)

    @property
    def layer_vectors(self) -> int:
        return 13 * self.hidden if self.layer_vector_params is None else self.layer_vector_params

    @property
    def num_params(self) -> int:
        """l(12h² + 13h) + Vh + sh + 2h for a GPT (Narayanan et al. SC21, appendix; LM head tied
        to the embedding); in general the layers' matrices and vectors, the table(s), the
        position table if learned and the final norm."""
        h, l = self.hidden, self.layers
        tables = self.vocab * h * (1 if self.tied_head else 2) + (self.seq * h if self.position_table else 0)
        return l * (self.layer_matrix_params + self.layer_vectors) + tables + 2 * h

    def layer_flops_per_token(self) -> float:
        """Forward matmul FLOPs of one layer per token: 2 per weight, and the attention core's
        QKᵀ and P·V over the full s×s (the paper's counting; 24h² + 4sh for a GPT)."""
        return 2.0 * self.layer_matrix_params + 4.0 * self.seq * self.hidden

    def padded_vocab(self, tp: int) -> int:
        """Megatron pads V to a multiple of 128·t so every TP rank owns an equal slice."""
        unit = 128 * tp
        return -(-self.vocab // unit) * unit

    def layer_params_per_gpu(self, tp: int) -> float:
        """One layer's parameters on one TP rank: the QKV and first MLP weights and biases
        and the output-projection and second MLP weights are split (12h²/t + 7h/t); the two
        row-parallel biases and two LayerNorms are replicated (6h)."""
        h = self.hidden
        if self.linears is None and self.layer_vector_params is None and self.ffn_hidden is None \
                and not self.gated_mlp and self.kv_heads is None:
            return 12 * h * h / tp + 7 * h / tp + 6 * h
        # every matrix split over t; vectors (norms, row-parallel biases) replicated — an upper bound
        return self.layer_matrix_params / tp + self.layer_vectors


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
    if shape.linears is None and shape.ffn_hidden is None and not shape.gated_mlp and shape.kv_heads is None:
        return model_flops_formula(global_batch, shape.seq, shape.layers, shape.hidden, shape.vocab, recompute)
    # Any other stack, counted the same way from its own matrices (3 passes, +1 forward with full
    # recompute, +the attention core's forward with selective); the logits 2hV per token and pass.
    s, l, h = shape.seq, shape.layers, shape.hidden
    layer, core = shape.layer_flops_per_token(), 4.0 * s * h
    passes = {RecomputeMode.FULL: 4 * layer, RecomputeMode.SELECTIVE: 3 * layer + core}.get(recompute, 3 * layer)
    return float(global_batch) * s * (l * passes + 3 * 2.0 * h * shape.vocab)


def model_flops_formula(B: int, s: int, l: int, h: int, V: int,  # noqa: E741 (the paper's symbols)
                        recompute: RecomputeMode = RecomputeMode.NONE) -> float:
    """``model_flops`` from the five numbers alone: batch B, sequence s, layers l, hidden h,
    vocabulary V (the one copy of the formula; the cost pass's totals are tested against it)."""
    if recompute is RecomputeMode.FULL:
        return 96.0 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
    if recompute is RecomputeMode.SELECTIVE:
        return 72.0 * B * s * l * h * h * (1 + 2 * s / (9 * h) + V / (12 * l * h))
    return 72.0 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))

"""Memory per GPU: training state and activations (Korthikanti et al. 2022).

Activation bytes per transformer layer and microbatch (fp16 activations, 1-byte
dropout masks; Korthikanti et al. 2022, Tables 2 and 4):

| setting | bytes |
|---|---|
| TP (t = 1: no parallelism) | sbh(10 + 24/t + 5as/(ht)) |
| TP + SP | sbh(34/t + 5as/(ht)) |
| TP + selective recompute | sbh(10 + 24/t) |
| TP + SP + selective | 34·sbh/t |
| full recompute | 2sbh (layer input; /t with SP, whose input is sharded) |

34 = attention 11 + MLP 19 + two norms 4; 5as/h = softmax 2 + dropout mask 1 +
dropout output 2 per score. A fused (flash) attention kernel keeps no s×s tensor:
its 5as/h term is dropped (it keeps only a per-row logsumexp, left out). For other
activation dtypes every term is scaled by dtype/2 (masks included — an
approximation).
"""
from __future__ import annotations

from dataclasses import dataclass

from fxpipe.base.recompute_mode import RecomputeMode
from fxpipe.planner.shapes import TransformerShape


def layer_activation_bytes(*, seq: int, micro_batch: int, hidden: int, heads: int, tp: int = 1,
                           sequence_parallel: bool = False,
                           recompute: RecomputeMode = RecomputeMode.NONE,
                           fused_attention: bool = False, kv_dim: int | None = None,
                           ffn: int | None = None, gated: bool = False, dropout: bool = True) -> float:
    """Bytes one layer keeps for backward per microbatch (Korthikanti et al. 2022, §4),
    generalised term by term to grouped queries, any MLP width and a gated MLP (defaults:
    the paper's GPT, where it reduces to the table above):

    - sharded over t: the queries 2sbh, keys and values 2·2sb·kv, the projection's input
      2sbh; the MLP's inner tensors 2·2sbf (up output and GeLU output) or, gated, 3·2sbf
      (gate, up, their product);
    - replicated (÷t with SP): the QKV and MLP inputs 2·2sbh, two norms' inputs 4sbh, two
      1-byte dropout masks 2sbh (none without dropout);
    - scores (unfused attention only): 5as²b/t with dropout, 2as²b/t (the softmax) without."""
    s, b, h, a, t = seq, micro_batch, hidden, heads, tp
    sbh = s * b * h
    if recompute is RecomputeMode.FULL:
        return 2.0 * sbh / (t if sequence_parallel else 1)
    kv, f = kv_dim or h, ffn or 4 * h
    sharded = 2 * sbh + 4 * s * b * kv + 2 * sbh + (6 if gated else 4) * s * b * f
    replicated = 8 * sbh + (2 * sbh if dropout else 0)
    base = (sharded + replicated) / t if sequence_parallel else replicated + sharded / t
    per_score = 5 if dropout else 2
    scores = 0.0 if (recompute is RecomputeMode.SELECTIVE or fused_attention) else per_score * a * s * s * b / t
    return base + scores


def recompute_working_bytes(*, seq: int, micro_batch: int, hidden: int, heads: int, tp: int,
                            sequence_parallel: bool, recompute: RecomputeMode,
                            fused_attention: bool, **layer: object) -> float:
    """What backward rematerialises at once: one layer's full activations (full recompute)
    or one attention core's s×s tensors (selective), for one microbatch."""
    if recompute is RecomputeMode.FULL:
        return layer_activation_bytes(seq=seq, micro_batch=micro_batch, hidden=hidden, heads=heads,
                                      tp=tp, sequence_parallel=sequence_parallel,
                                      fused_attention=fused_attention, **layer)
    if recompute is RecomputeMode.SELECTIVE and not fused_attention:
        return 5.0 * heads * seq * seq * micro_batch / tp
    return 0.0


def embedding_activation_bytes(shape: TransformerShape, micro_batch: int, tp: int, sp: bool) -> float:
    """First stage, beyond its layers: the embedding dropout's 1-byte mask (Korthikanti §4.3)."""
    if not shape.dropout:
        return 0.0
    return shape.seq * micro_batch * shape.hidden / (tp if sp else 1)


def head_activation_bytes(shape: TransformerShape, micro_batch: int, tp: int, sp: bool) -> float:
    """Last stage, beyond its layers (Korthikanti §4.3): the final LayerNorm's and the output
    projection's inputs (2sbh each, sharded with SP) and the fp32 logits cross-entropy keeps
    (4sbV/t)."""
    s, b, h = shape.seq, micro_batch, shape.hidden
    return 4.0 * s * b * h / (tp if sp else 1) + 4.0 * s * b * shape.padded_vocab(tp) / tp


def final_norm_activation_bytes(shape: TransformerShape, micro_batch: int, tp: int, sp: bool) -> float:
    """Last stage under vocabulary passes: only the final LayerNorm's input (2sbh, sharded
    with SP); the projection's input and the logits live in the vocabulary blocks."""
    return 2.0 * shape.seq * micro_batch * shape.hidden / (tp if sp else 1)


def vocab_block_activation_bytes(shape: TransformerShape, micro_batch: int, tp: int, pp: int) -> float:
    """Every rank, per microbatch between its S and its T (``runtime/head_blocks.py``): its
    copy of the head's input (2sbh, whole: broadcast after the SP gather) and its block's
    fp32 logits, V/(t·p) columns (4sb·V/(tp))."""
    s, b = shape.seq, micro_batch
    return 2.0 * s * b * shape.hidden + 4.0 * s * b * shape.padded_vocab(tp) / (tp * pp)


def lookup_activation_bytes(shape: TransformerShape, micro_batch: int, parts: int) -> float:
    """Every rank under vocabulary passes: its ``parts`` partial embedding lookups in
    flight (b·s·h each; ``runtime/lookup_exchange.py`` holds a part from its send,
    ``LOOKUP_PARTS_AHEAD`` microbatches ahead of the first stage's forward, until that
    stage's backward)."""
    return 2.0 * parts * shape.seq * micro_batch * shape.hidden


@dataclass(frozen=True, kw_only=True)
class RankMemory:
    """Predicted peak memory of one pipeline rank (any of its t·d copies), bytes."""

    rank: int
    """Pipeline rank."""
    params: float
    """Parameters this GPU holds (count, not bytes)."""
    weight_bytes: float
    """The weights in the compute dtype."""
    gradient_bytes: float
    """The gradients as reduced (fp32 with Megatron's mixed precision)."""
    optimizer_bytes: float
    """fp32 master weights and Adam moments (1/d of them with ZeRO-1)."""
    activation_bytes: float
    """Activations of the microbatches in flight at the peak."""
    working_bytes: float
    """Recomputation's rematerialised layer during one backward."""

    @property
    def state_bytes(self) -> float:
        """Weights, gradients and optimizer state."""
        return self.weight_bytes + self.gradient_bytes + self.optimizer_bytes

    @property
    def total(self) -> float:
        return self.state_bytes + self.activation_bytes + self.working_bytes

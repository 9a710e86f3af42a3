"""Seconds per microbatch for a transformer layer, the embedding, the LM head and a
stage boundary, on one GPU of a tensor-parallel group.

Per layer (Megatron, Shoeybi et al. 2019 §3; SC21 §3.2), tokens n = b·s, per GPU:

- GEMMs: QKV (n × 3h/t × h), output projection (n × h × h/t), MLP up (n × 4h/t × h),
  MLP down (n × h × 4h/t); attention QKᵀ and ·V as b·a/t batched (s × s × h/a) products.
  Backward runs two GEMMs per forward GEMM (input and weight gradient) — the latter
  are zero bubble's W. Each GEMM is priced by the hardware's roofline.
- element-wise traffic, forward, in elements of the activation dtype (Megatron's fused
  kernels: bias-GeLU, bias-dropout-add, scale-mask-softmax): two LayerNorms 2·2sbh and
  two (bias-)dropout-adds 2·3sbh, replicated on every TP rank (sharded by t with SP);
  GeLU 8sbh/t and the context permute 2sbh/t; softmax 2·as²b/t and attention dropout
  2·as²b/t; 1-byte masks sbh per dropout and as²b/t for attention's. Backward moves
  twice the forward's bytes (it reads the saved input and the output gradient and
  writes the input gradient). A fused attention kernel has no s×s traffic: it is priced
  as a compute-bound kernel of 4·b·s²·h/t FLOPs forward and 2.5× that backward (the
  backward recomputes the scores) at ``attention_efficiency`` × the GEMM rate.
- TP: two all-reduces of sbh forward and two backward (f and g, Megatron §3); with
  SP each becomes an all-gather plus a reduce-scatter — the same bytes.
- recompute: full reruns the layer's forward (its all-reduces included) in backward;
  selective reruns the attention core (its bmm's, softmax and dropout). With a split
  backward (zero bubble) fxpipe's I and W are two autograd passes and each reruns the
  checkpointed region (docs/recompute.md), so the rerun is paid twice, once in W.
"""
from __future__ import annotations

from functools import lru_cache

from fxpipe.base.hardware import Collective, Hardware
from fxpipe.base.recompute_mode import RecomputeMode
from fxpipe.planner.options import PlannerOptions
from fxpipe.planner.shapes import TransformerShape
from fxpipe.planner.work import Component as C, Work

AR, AG, RS = Collective.ALL_REDUCE, Collective.ALL_GATHER, Collective.REDUCE_SCATTER
ELEMENTWISE_KERNELS = 8
"""Memory-bound kernels per layer forward (2 norms, 2 dropout-adds, GeLU, permute,
softmax, attention dropout); backward launches twice as many."""
FLASH_BACKWARD_FACTOR = 2.5
"""Fused attention backward FLOPs / forward FLOPs (two gradient matmuls per forward
matmul, plus recomputing QKᵀ)."""
CE_FORWARD_BYTES = 12
"""Cross-entropy forward bytes per logit beyond reading it: an fp32 copy, its max and
exp-sum passes (Megatron's vocab-parallel cross-entropy)."""
CE_BACKWARD_BYTES = 4
"""Cross-entropy backward bytes per logit beyond writing the gradient: the fp32 softmax."""


class CostModel:
    """Per-microbatch ``Work`` of every piece, cached per (t, b, ...) so the planner prices
    thousands of layouts from a few dozen distinct layer costs."""

    def __init__(self, shape: TransformerShape, options: PlannerOptions) -> None:
        self.shape, self.options = shape, options
        self.hw: Hardware = options.hardware
        self.dtype = options.dtype_bytes

    def _tp_per_node(self, tp: int) -> int:
        return self.hw.members_per_node(tp, 1)

    def _tp(self, kind: Collective, nbytes: float, tp: int) -> float:
        return self.hw.collective_s(kind, nbytes, tp, self._tp_per_node(tp))

    def _attention_core(self, tp: int, b: int) -> tuple[float, float, float]:
        """(forward GEMM-side seconds, backward GEMM-side seconds, forward element-wise bytes)."""
        sh, hw, d = self.shape, self.hw, self.dtype
        s, h, a = sh.seq, sh.hidden, sh.heads
        heads = b * a / tp
        if self._fused():
            flops = 4.0 * b * s * s * h / tp
            traffic = d * 2.0 * s * b * (h + sh.kv_dim) / tp  # read q, k, v; write the output
            rate = hw.matmul_flops * hw.attention_efficiency
            fwd = max(flops / rate, traffic / hw.memory_bw) + hw.op_overhead_s
            bwd = max(FLASH_BACKWARD_FACTOR * flops / rate, 2 * traffic / hw.memory_bw) \
                + 2 * hw.op_overhead_s
            return fwd, bwd, 0.0
        dh = sh.head_dim
        scores = hw.gemm_s(s, s, dh, batch=heads, dtype_bytes=d)    # Q·Kᵀ
        context = hw.gemm_s(s, dh, s, batch=heads, dtype_bytes=d)   # P·V
        # Backward: dP = dC·Vᵀ (s×s×dh), dV = Pᵀ·dC, dQ = dS·K, dK = dSᵀ·Q (s×dh×s each).
        bwd = hw.gemm_s(s, s, dh, batch=heads, dtype_bytes=d) + 3 * context
        elems = 2 if not sh.dropout else 4  # softmax read+write (+ dropout read+write)
        ew = (elems * d + (1 if sh.dropout else 0)) * a * s * s * b / tp
        return scores + context, bwd, ew

    def _fused(self) -> bool:
        return self.options.fused_attention or self.shape.fused_attention

    def _linears(self, tp: int, n: int) -> list[tuple[int, int, int]]:
        """(M, N, K) of one layer's GEMMs on one TP rank: a matrix whose output is the hidden
        width is row-parallel (its input split: the attention and MLP output projections),
        every other one column-parallel (its output split: QKV, MLP up and gate) —
        Megatron's pairing (Shoeybi et al. §3), read off the matrices' shapes."""
        h = self.shape.hidden
        return [(n, o, i // tp) if o == h else (n, o // tp, i) for i, o in self.shape.layer_linears]

    @lru_cache(maxsize=None)
    def layer(self, tp: int, b: int, recompute: RecomputeMode, sp: bool,
              split_backward: bool = False) -> Work:
        sh, hw, d = self.shape, self.hw, self.dtype
        s, h = sh.seq, sh.hidden
        n, sbh = b * s, s * b * h
        linears = self._linears(tp, n)
        gemm_f = sum(hw.gemm_s(M, N, K, dtype_bytes=d) for M, N, K in linears)
        gemm_dx = sum(hw.gemm_s(M, K, N, dtype_bytes=d) for M, N, K in linears)
        gemm_dw = sum(hw.gemm_s(K, N, M, dtype_bytes=d) for M, N, K in linears)
        attn_f, attn_b, attn_ew = self._attention_core(tp, b)
        sp = sp and tp > 1
        masks = 2 * sbh if sh.dropout else 0
        replicated = (10 * d * sbh + masks) / (tp if sp else 1)
        # The activation reads f and writes f (GeLU: 8sbh for f = 4h); SwiGLU reads gate and
        # up and writes their product; the context permute moves the queries' width twice.
        f = sh.ffn
        activation = (3 if sh.gated_mlp else 2) * d * n * f
        sharded = (activation + 2 * d * sbh) / tp
        ew_f = hw.memory_s(replicated + sharded + attn_ew, ELEMENTWISE_KERNELS)
        ew_b = hw.memory_s(2 * (replicated + sharded + attn_ew), 2 * ELEMENTWISE_KERNELS)
        if tp > 1:
            each = self._tp(AG, d * sbh, tp) + self._tp(RS, d * sbh, tp) if sp else self._tp(AR, d * sbh, tp)
            comm_f = comm_b = 2 * each
            if self.options.tp_overlap:
                # Megatron-Core's --tp-comm-overlap pipelines each collective with the GEMM it
                # feeds or drains: only what outlasts the pass's GEMMs stays on the critical path.
                comm_f = max(0.0, comm_f - gemm_f)
                comm_b = max(0.0, comm_b - gemm_dx - gemm_dw)
        else:
            comm_f = comm_b = 0.0
        forward = {C.GEMM: gemm_f + attn_f, C.ELEMENTWISE: ew_f, C.TP_COMM: comm_f}
        if recompute is RecomputeMode.FULL:
            rerun = gemm_f + attn_f + ew_f + comm_f
        elif recompute is RecomputeMode.SELECTIVE:
            rerun = attn_f + hw.memory_s(attn_ew, 2 if attn_ew else 0)
        else:
            rerun = 0.0
        reruns = 2 if split_backward else 1
        backward = {C.GEMM: gemm_dx + gemm_dw + attn_b, C.ELEMENTWISE: ew_b, C.TP_COMM: comm_b,
                    C.RECOMPUTE: reruns * rerun}
        return Work.make(forward, backward, gemm_dw + (reruns - 1) * rerun)

    @lru_cache(maxsize=None)
    def embedding(self, tp: int, b: int, sp: bool) -> Work:
        """Word + position embedding and its dropout (first stage). Vocab-parallel with t > 1:
        an all-reduce forward (a reduce-scatter with SP, whose backward all-gathers)."""
        sh, hw, d = self.shape, self.hw, self.dtype
        sbh = sh.seq * b * sh.hidden
        sp = sp and tp > 1
        traffic = 7 * d * sbh + (sbh if sh.dropout else 0)  # gather 2, + position 3, dropout 2
        fwd_comm = (self._tp(RS, d * sbh, tp) if sp else self._tp(AR, d * sbh, tp)) if tp > 1 else 0.0
        bwd_comm = self._tp(AG, d * sbh, tp) if sp else 0.0
        return Work.make({C.ELEMENTWISE: hw.memory_s(traffic, 3), C.TP_COMM: fwd_comm},
                         {C.ELEMENTWISE: hw.memory_s(2 * traffic, 3), C.TP_COMM: bwd_comm})

    @lru_cache(maxsize=None)
    def head(self, tp: int, b: int, sp: bool) -> Work:
        """Final LayerNorm, the vocab-parallel logits GEMM and cross-entropy (last stage)."""
        return self.final_norm(tp, b, sp) + self.output_layer(tp, b) + self.softmax_stats(tp, b)

    @lru_cache(maxsize=None)
    def final_norm(self, tp: int, b: int, sp: bool) -> Work:
        """The head's part that stays on the last stage under vocabulary passes: the final
        LayerNorm, and with t > 1 Megatron's f before the logits (its backward all-reduce;
        with SP the all-gather of the sequence and its reduce-scatter)."""
        sh, hw, d = self.shape, self.hw, self.dtype
        sbh = sh.seq * b * sh.hidden
        sp = sp and tp > 1
        norm = 2 * d * sbh / (tp if sp else 1)
        fwd_comm = bwd_comm = 0.0
        if tp > 1:
            fwd_comm = self._tp(AG, d * sbh, tp) if sp else 0.0
            bwd_comm = self._tp(RS, d * sbh, tp) if sp else self._tp(AR, d * sbh, tp)  # f's backward
        return Work.make({C.ELEMENTWISE: hw.memory_s(norm, 1), C.TP_COMM: fwd_comm},
                         {C.ELEMENTWISE: hw.memory_s(2 * norm, 1), C.TP_COMM: bwd_comm})

    @lru_cache(maxsize=None)
    def output_layer(self, tp: int, b: int) -> Work:
        """The logits GEMM n × V/t × h and the cross-entropy's element-wise passes: the part
        vocabulary passes spread over the pipeline ranks (``split_output_layer``: 1/p each).
        The softmax statistics' reduction is priced apart (``softmax_stats``)."""
        sh, hw, d = self.shape, self.hw, self.dtype
        h, n = sh.hidden, b * sh.seq
        v = sh.padded_vocab(tp) // tp
        logits = n * v
        return Work.make(
            {C.GEMM: hw.gemm_s(n, v, h, dtype_bytes=d), C.ELEMENTWISE: hw.memory_s(logits * (d + CE_FORWARD_BYTES), 3)},
            {C.GEMM: hw.gemm_s(n, h, v, dtype_bytes=d) + hw.gemm_s(h, v, n, dtype_bytes=d),
             C.ELEMENTWISE: hw.memory_s(logits * (d + CE_BACKWARD_BYTES), 2)},
            hw.gemm_s(h, v, n, dtype_bytes=d))

    @lru_cache(maxsize=None)
    def softmax_stats(self, tp: int, b: int) -> Work:
        """Vocab-parallel cross-entropy over t ranks: max, target logit and exp-sum all-reduced
        (fp32 per token) in the forward."""
        n = b * self.shape.seq
        return Work.make({C.TP_COMM: 3 * self._tp(AR, 4 * n, tp) if tp > 1 else 0.0})

    @lru_cache(maxsize=None)
    def vocab_collectives(self, tp: int, pp: int, dp: int, b: int) -> tuple[float, float, float]:
        """Seconds of the vocabulary passes' collectives per microbatch, as
        ``runtime/head_blocks.py`` issues them over the pp group (ranks tp·dp apart):
        BCAST_H one broadcast of the head's input (b·s·h) and the int64 targets packed
        (``base/packing.py``); ALLREDUCE_S one all-gather of every block's statistics
        (3 × fp32 per token), over pp and then TP; REDUCE_G the input gradient (b·s·h)
        onto the last stage."""
        sh, hw, d = self.shape, self.hw, self.dtype
        n = b * sh.seq
        per_node = hw.members_per_node(pp, tp * dp)
        bcast = hw.collective_s(Collective.BROADCAST, d * n * sh.hidden + 8 * n, pp, per_node)
        stats = hw.collective_s(AG, pp * 12 * n, pp, per_node)  # 3 fp32 statistics per token
        if tp > 1:
            stats += self._tp(AG, tp * 12 * n, tp)
        reduce = hw.collective_s(Collective.REDUCE, d * n * sh.hidden, pp, per_node)
        return bcast, stats, reduce

    @lru_cache(maxsize=None)
    def boundary(self, tp: int, b: int, sp: bool, intra_node: bool) -> tuple[float, float]:
        """(send, receive-side all-gather) seconds for one stage-boundary tensor (sbh).

        Without SP the boundary is replicated on the t ranks; scatter-gather (SC21 §4.1)
        sends 1/t from each and all-gathers on the receiver over NVLink. With SP it is
        already sharded. The send blocks the sender (fxpipe waits on each send batch
        before its next compute action; Megatron's 2021 p2p did too)."""
        d = self.dtype
        full = d * self.shape.seq * b * self.shape.hidden
        if tp > 1 and sp:
            nbytes, gather = full / tp, 0.0
        elif tp > 1 and self.options.scatter_gather:
            nbytes, gather = full / tp, self._tp(AG, full, tp)
        else:
            nbytes, gather = full, 0.0
        return self.hw.p2p_s(nbytes, intra_node=intra_node), gather

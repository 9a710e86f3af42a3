"""Deal layers to pipeline stages and price each stage for one microbatch.

Stage c of p·v lives on rank c mod p (SC21 §2.2, fxpipe's loop placement). The
embedding is on stage 0 and the LM head on the last stage; with p > 1 the last rank
keeps its own copy of the tied embedding (Megatron's embedding group). With vocabulary
passes (Yeung et al. 2025) the last stage keeps only the final norm: the output layer
(logits and cross-entropy) runs as each rank's S and T, 1/p of it each, and every rank
holds V/(t·p) rows of the tied table, as ``passes/vocab_rows.py`` splits them. Stage times
are numpy arrays (the search prices thousands of layouts); the by-component
``Work`` of a stage is built only when asked (``StagePlan.work``).
"""
from __future__ import annotations

import heapq
import math
from functools import lru_cache
from dataclasses import dataclass

import numpy as np

from fxpipe.planner.layer_cost import CostModel
from fxpipe.planner.options import CandidateLayout, LayerBalance, ScheduleKind
from fxpipe.planner.work import ZERO, Component, Work
from fxpipe.schedules.simulate import StageDurations
from fxpipe.schedules.vocab_actions import split_output_layer


BULK_LAYERS = 4096
"""Above this many layers to deal beyond one per stage, ``split_layers`` fills in bulk."""


@lru_cache(maxsize=4096)  # layouts differing only in d, m or ZeRO share their split
def split_layers(layers: int, num_stages: int, balance: LayerBalance,
                 stage_cost: tuple[float, ...], layer_cost: float) -> tuple[int, ...]:
    """Layers per stage. MEGATRON: l/(p·v) each; FXPIPE: each layer to the stage with the
    least time so far, counting the embedding/head in ``stage_cost`` (optimal min-max for
    identical layers, by an exchange argument)."""
    if num_stages > layers:
        raise ValueError(f"{num_stages} pipeline stages for {layers} layers: every stage needs at "
                         f"least one layer; use fewer stages (p·v <= {layers})")
    if balance is LayerBalance.MEGATRON:
        if layers % num_stages:
            raise ValueError(f"Megatron's layer split needs l % (p·v) == 0, but {layers} % "
                             f"{num_stages} = {layers % num_stages}; use LayerBalance.FXPIPE or "
                             f"p·v dividing {layers}")
        return (layers // num_stages,) * num_stages
    counts = [1] * num_stages
    left = layers - num_stages
    if left > BULK_LAYERS and layer_cost > 0:
        # The greedy takes the smallest "next layer" times first: stage k's j-th extra layer ends
        # at stage_cost[k] + (j + 1)·layer_cost. Take every such slot below a level found by
        # bisection in one step, and leave the last few to the heap: O(S log) instead of O(l),
        # so a 10^6-layer model prices as fast as a 100-layer one.
        def slots(level: float) -> list[int]:
            return [max(0, math.ceil((level - stage_cost[k]) / layer_cost) - 2) for k in range(num_stages)]
        lo, hi = 0.0, max(stage_cost) + (left + 2) * layer_cost
        for _ in range(100):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if sum(slots(mid)) <= left else (lo, mid)
        taken = slots(lo)
        counts = [1 + n for n in taken]
        left -= sum(taken)
    heap = [(stage_cost[k] + counts[k] * layer_cost, k) for k in range(num_stages)]
    heapq.heapify(heap)
    for _ in range(left):
        t, k = heapq.heappop(heap)
        counts[k] += 1
        heapq.heappush(heap, (t + layer_cost, k))
    return tuple(counts)


@dataclass(frozen=True, eq=False)
class StagePlan:
    """Every stage of one layout, priced for one microbatch."""

    config: CandidateLayout
    layers: tuple[int, ...]
    """Layers per stage."""
    forward: np.ndarray
    """Per stage: forward seconds (p2p included)."""
    backward: np.ndarray
    """Per stage: full backward seconds (recompute and p2p included)."""
    weight: np.ndarray
    """Per stage: the weight-gradient part of ``backward``."""
    params: np.ndarray
    """Per stage: parameters per GPU."""
    parts: tuple[Work, Work, Work]
    """(one layer, embedding, head on the last stage) Work, to rebuild a stage's breakdown;
    with vocabulary passes the head part is the final norm alone."""
    p2p: tuple[float, float]
    """(send, receive-side all-gather) seconds per stage boundary and microbatch."""
    accumulate: np.ndarray | None = None
    """Per stage: the element-wise pass that adds each microbatch's weight gradients to the
    accumulator (``GradAccumulation.SEPARATE``), inside ``backward`` and ``weight``; None: fused."""
    output: Work | None = None
    """Vocabulary passes: the output layer (logits GEMM and cross-entropy) that every rank
    runs 1/p of as its S and T; not in the stage arrays. None: the head is on the last stage."""

    def ranks(self, values: np.ndarray) -> np.ndarray:
        """Sum a per-stage array over each rank's v stages -> per rank."""
        p = self.config.pp
        return values.reshape(self.config.chunks, p).sum(axis=0)

    def durations(self) -> StageDurations:
        """The simulator's durations. With vocabulary passes: the stages as the partition
        sees them (the output layer on the last) through ``split_output_layer``, which
        takes it off the last stage and gives every rank 1/p of it as its S and T."""
        if self.output is None:
            return StageDurations(forward=tuple(self.forward.tolist()), backward=tuple(self.backward.tolist()),
                                  weight=tuple(self.weight.tolist()))
        out = self.output
        f, b, w = self.forward.copy(), self.backward.copy(), self.weight.copy()
        f[-1], b[-1], w[-1] = f[-1] + out.forward_s, b[-1] + out.backward_s, w[-1] + out.weight
        whole = StageDurations(forward=tuple(f.tolist()), backward=tuple(b.tolist()), weight=tuple(w.tolist()))
        return split_output_layer(whole, self.config.pp, forward=out.forward_s, backward=out.backward_s,
                                  weight=out.weight)

    def rank_busy(self) -> np.ndarray:
        """Per rank: compute seconds per microbatch (its stages' F + B, and its S + T)."""
        busy = self.ranks(self.forward + self.backward)
        if self.output is not None:
            busy = busy + (self.output.forward_s + self.output.backward_s) / self.config.pp
        return busy

    def rank_work(self, r: int) -> Work:
        """Rank r's work per microbatch by component: its stages' and its vocabulary block's."""
        w = ZERO
        for k in range(r, len(self.layers), self.config.pp):
            w = w + self.work(k)
        return w if self.output is None else w + self.output.scaled(1 / self.config.pp)

    def work(self, k: int) -> Work:
        """Stage k's forward/backward by component."""
        layer, emb, head = self.parts
        send, gather = self.p2p
        S = len(self.layers)
        w = layer.scaled(self.layers[k])
        if k == 0:
            w = w + emb
        if k == S - 1:
            w = w + head
        f = (send if k < S - 1 else 0.0) + (gather if k > 0 else 0.0)
        b = (send if k > 0 else 0.0) + (gather if k < S - 1 else 0.0)
        acc = float(self.accumulate[k]) if self.accumulate is not None else 0.0
        return w + Work.make({Component.P2P: f}, {Component.P2P: b, Component.ELEMENTWISE: acc}, acc)


def plan_stages(model: CostModel, cfg: CandidateLayout) -> StagePlan:
    shape, opts, hw = model.shape, model.options, model.hw
    t, b, S = cfg.tp, cfg.micro_batch, cfg.num_stages
    sp = cfg.sequence_parallel and t > 1
    layer = model.layer(t, b, cfg.recompute, sp, cfg.schedule is ScheduleKind.ZB_H1)
    emb = model.embedding(t, b, sp)
    # Vocabulary passes: the last stage keeps the final norm; the output layer is every
    # rank's alike, so the layers are balanced without it (PartitionConfig.elsewhere).
    output = model.output_layer(t, b) if cfg.vocab_passes else None
    head = model.final_norm(t, b, sp) if cfg.vocab_passes else model.head(t, b, sp)
    extra = [0.0] * S
    extra[0] += emb.forward_s + emb.backward_s
    extra[-1] += head.forward_s + head.backward_s
    counts = split_layers(shape.layers, S, opts.balance, tuple(extra),
                          layer.forward_s + layer.backward_s)
    intra = cfg.tp * cfg.dp * cfg.pp <= hw.gpus_per_node
    send, gather = model.boundary(t, b, sp, intra) if S > 1 else (0.0, 0.0)
    n = np.asarray(counts, dtype=np.float64)
    fwd = n * layer.forward_s
    bwd = n * layer.backward_s
    wgt = n * layer.weight
    params = n * shape.layer_params_per_gpu(t)
    vocab_params = shape.padded_vocab(t) * shape.hidden / t
    fwd[0] += emb.forward_s
    bwd[0] += emb.backward_s
    fwd[-1] += head.forward_s
    bwd[-1] += head.backward_s
    wgt[-1] += head.weight
    params[0] += shape.seq * shape.hidden if shape.position_table else 0.0  # learned positions (replicated)
    params[-1] += 2 * shape.hidden  # final norm
    if cfg.vocab_passes:
        params[:cfg.pp] += vocab_params / cfg.pp  # stage r < p is on rank r: its rows of the tied table
    else:
        params[0] += vocab_params  # the word table (split over TP)
        # the last rank's copy of a tied table (p > 1), or an untied head's own weights
        params[-1] += vocab_params if cfg.pp > 1 or not shape.tied_head else 0.0
    accumulate = None
    if opts.accumulation_bytes_per_param:
        # Every microbatch's backward ends with one pass over the stage's gradients (SEPARATE):
        # the weight-gradient side of the backward, so zero bubble's W carries it.
        accumulate = params * opts.accumulation_bytes_per_param / hw.memory_bw
        bwd += accumulate
        wgt += accumulate
    if S > 1:
        fwd[:-1] += send
        fwd[1:] += gather
        bwd[1:] += send
        bwd[:-1] += gather
    return StagePlan(config=cfg, layers=counts, forward=fwd, backward=bwd, weight=np.minimum(wgt, bwd),
                     params=params, parts=(layer, emb, head), p2p=(send, gather), accumulate=accumulate,
                     output=output)

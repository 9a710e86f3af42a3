"""Activation recomputation, the bytes saved for backward per layer against Korthikanti
et al. 2022 (§4.1's terms, adjusted term by term for fxpipe's fp32 CPU graph), in one
process and on every rank of an emulated tensor-parallel group (with and without
sequence parallelism); the order none > selective > full; and the saved-tensor counter.
The regions are checked in test_recompute_regions.py; the rewrite's loss and
gradients, test_recompute_rewrite.py.

Run: .venv/bin/python -m pytest tests/passes/test_recompute_memory.py -q
"""
from __future__ import annotations

import dataclasses
import enum
import weakref
from dataclasses import dataclass
from functools import lru_cache

import pytest
import torch

from fxpipe.costs.saved_activations import SavedTensorCounter, measure_saved, saved_bytes_by_layer
from fxpipe.models import build_workload
from fxpipe.passes.recompute import RecomputeMode, apply_recompute
from tests.passes._recompute_programs import CASES, case_program, fresh_args, program, two_stage_plan
from tests.passes._recompute_tp import saved_bytes_per_rank, tp_program

NONE, SELECTIVE, FULL = RecomputeMode.NONE, RecomputeMode.SELECTIVE, RecomputeMode.FULL


# ---- (a) saved bytes per layer against Korthikanti et al. 2022 ------------------------------------
class Unit(enum.Enum):
    SBH = "sbh"
    AS2B = "as²b"


class Kind(enum.Enum):
    ACTIVATION = "activation"  # 2 bytes in the paper (fp16)
    MASK = "mask"              # 1 byte in the paper (dropout mask)


@dataclass(frozen=True)
class Term:
    """One tensor a transformer layer saves for backward, in elements (§4.1 of the paper)."""
    name: str
    count: int
    unit: Unit
    kind: Kind
    tp_sharded: bool
    """Divided by t under tensor parallelism (the rest only under sequence parallelism)."""
    attention_core: bool = False
    """Recomputed by selective recompute (§4.1), never stored."""


# Korthikanti et al. 2022 §4.1, one layer: attention 11sbh + 5as²b, MLP 19sbh, norms 4sbh.
PAPER_TERMS = (
    Term("layernorm inputs (2 norms)", 2, Unit.SBH, Kind.ACTIVATION, tp_sharded=False),
    Term("QKV projection input", 1, Unit.SBH, Kind.ACTIVATION, tp_sharded=False),
    Term("Q and K (QKᵀ inputs)", 2, Unit.SBH, Kind.ACTIVATION, tp_sharded=True),
    Term("softmax output", 1, Unit.AS2B, Kind.ACTIVATION, tp_sharded=True, attention_core=True),
    Term("softmax dropout mask", 1, Unit.AS2B, Kind.MASK, tp_sharded=True, attention_core=True),
    Term("softmax dropout output (·V input)", 1, Unit.AS2B, Kind.ACTIVATION, tp_sharded=True,
         attention_core=True),
    Term("V", 1, Unit.SBH, Kind.ACTIVATION, tp_sharded=True),
    Term("output projection input", 1, Unit.SBH, Kind.ACTIVATION, tp_sharded=True),
    Term("attention dropout mask", 1, Unit.SBH, Kind.MASK, tp_sharded=False),
    Term("MLP input", 1, Unit.SBH, Kind.ACTIVATION, tp_sharded=False),
    Term("GeLU input", 4, Unit.SBH, Kind.ACTIVATION, tp_sharded=True),
    Term("second MLP linear input", 4, Unit.SBH, Kind.ACTIVATION, tp_sharded=True),
    Term("MLP dropout mask", 1, Unit.SBH, Kind.MASK, tp_sharded=False),
)


@dataclass(frozen=True)
class Dims:
    s: int
    b: int
    h: int
    a: int


def layer_bytes(terms, d: Dims, mode: RecomputeMode, *, t: int = 1, sp: bool = False,
                act_bytes: int = 2, mask_bytes: int = 1) -> float:
    """Bytes one layer saves: the sum of ``terms`` (FULL: the layer input only)."""
    if mode is FULL:
        return act_bytes * d.s * d.b * d.h / (t if sp else 1)
    total = 0.0
    for term in terms:
        if mode is SELECTIVE and term.attention_core:
            continue
        n = term.count * (d.s * d.b * d.h if term.unit is Unit.SBH else d.a * d.s * d.s * d.b)
        if term.tp_sharded or sp:
            n /= t
        total += n * (act_bytes if term.kind is Kind.ACTIVATION else mask_bytes)
    return total


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_term_table_is_the_reference_formulas(t):
    """The table reproduces every closed form of Korthikanti et al. 2022, so the adjusted numbers
    below are the paper's derivation with only the stated terms changed."""
    d = Dims(s=2048, b=1, h=12288, a=96)
    sbh, q = d.s * d.b * d.h, 5 * d.a * d.s / (d.h * t)
    assert layer_bytes(PAPER_TERMS, d, NONE) == pytest.approx(sbh * (34 + 5 * d.a * d.s / d.h))
    assert layer_bytes(PAPER_TERMS, d, NONE, t=t) == pytest.approx(sbh * (10 + 24 / t + q))
    assert layer_bytes(PAPER_TERMS, d, NONE, t=t, sp=True) == pytest.approx(sbh * (34 / t + q))
    assert layer_bytes(PAPER_TERMS, d, SELECTIVE, t=t) == pytest.approx(sbh * (10 + 24 / t))
    assert layer_bytes(PAPER_TERMS, d, SELECTIVE, t=t, sp=True) == pytest.approx(34 * sbh / t)
    assert layer_bytes(PAPER_TERMS, d, FULL) == 2 * sbh


def expected_fp32_cpu(d: Dims, mode: RecomputeMode, dropout: float, *, t: int = 1, sp: bool = False) -> float:
    """The paper's terms for what our captured graph saves (fxpipe's GPT, fp32, CPU kernels).

    What differs from the paper, and why:
    - fp32 capture: every activation is 4 bytes, not 2.
    - dropout p > 0 on CPU: ``aten.dropout`` computes ``x * noise`` and keeps the noise,
      a tensor of x's dtype (ATen Dropout.cpp ``_dropout``): masks are 4 bytes, not 1
      (CUDA's fused ``native_dropout`` keeps a 1-byte bool mask as the paper assumes).
    - dropout p = 0: dropout returns its input, so there is no mask and no separate
      dropout output; CPU SDPA then runs the fused flash kernel, which keeps q, k, v, its
      output and the row logsumexp (a·s·b fp32) instead of the s×s softmax: the
      5as/h term becomes 4·a·s·b bytes (selective recomputes it too).
    - p > 0: CPU SDPA has no fused kernel with dropout and runs the math path, which
      keeps softmax, mask and dropout output (s×s each): the paper's 5as/h chain.
      It keeps copies of Q, K, V (scaled, reshaped for bmm): still 3sbh.
    - LayerNorm also keeps its per-row mean and rstd: 2·s·b fp32 per norm, a 1/(4h)
      share of its input the paper leaves out; counted here (not for FULL).
    - q, k, v are views of one fused QKV output and counted once as one 3sbh storage.
    """
    terms = list(PAPER_TERMS)
    extra = 0.0
    if dropout == 0:
        terms = [x for x in terms if x.kind is not Kind.MASK and x.unit is not Unit.AS2B]
        if mode is NONE:
            extra += 4 * d.a * d.s * d.b / t  # logsumexp of the fused kernel
    if mode is not FULL:
        extra += 2 * 2 * d.s * d.b * 4 / (t if sp else 1)  # two norms' mean and rstd
    return layer_bytes(terms, d, mode, t=t, sp=sp, act_bytes=4, mask_bytes=4) + extra


FORMULA_SHAPES = [("gpt-tiny", 64), ("gpt-small", 128)]


@pytest.mark.parametrize("mode", list(RecomputeMode), ids=lambda m: m.value)
@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("name,seq", FORMULA_SHAPES)
def test_saved_bytes_per_layer_match_formula(name, seq, dropout, mode):
    prog, batch = program(name, dropout, seq=seq)
    cfg = build_workload(name, device="meta").config
    d = Dims(s=seq, b=batch[0].shape[0], h=cfg.n_embd, a=cfg.n_head)
    gm = apply_recompute(prog.graph_module, prog.layers, mode)
    _, args = fresh_args(prog, batch)
    torch.manual_seed(0)
    measured = saved_bytes_by_layer(gm, args, prog.layers)
    expected = expected_fp32_cpu(d, mode, dropout)
    for layer in sorted(set(prog.layers.values())):
        assert measured[layer] == pytest.approx(expected, rel=0.10), \
            f"layer {layer}: measured {measured[layer]} B, formula (adjusted) {expected:.0f} B"


# ---- (b) the order none > selective > full ----------------------------------------------------------
@pytest.mark.parametrize("name,dropout", CASES)
def test_recompute_reduces_saved_bytes_in_order(name, dropout):
    prog, batch = case_program(name, dropout)
    _, args = fresh_args(prog, batch)
    by_mode = {}
    for mode in RecomputeMode:
        torch.manual_seed(0)
        gm = apply_recompute(prog.graph_module, prog.layers, mode)
        by_mode[mode] = measure_saved(gm, args, prog.layers)
    for layer in set(prog.layers.values()):
        none, sel, full = (by_mode[m].by_layer[layer] for m in RecomputeMode)
        assert none > sel > full, f"layer {layer}: {none} > {sel} > {full}"
    outside = {m: r.by_layer.get(None, 0) for m, r in by_mode.items()}
    assert len(set(outside.values())) == 1, "embeddings, head and loss are never recomputed"


# ---- (c) tensor parallelism: the same check on every TP rank ----------------------------------------
# The TP pass rewrites the captured graph; recompute is applied to the TP program's graph and
# every rank of an emulated group (threads, tests/passes/_recompute_tp.py) is measured.
TP = 2
# h, heads and s divide by t = 2 for both shapes: gpt-tiny (s=64, h=64, a=4) and
# gpt-small (s=128, h=256, a=8); sp splits the sequence, so s must divide too.
TP_SHAPES = FORMULA_SHAPES
SP_GATHERED = ("QKV projection input", "MLP input")
"""The inputs of the column-parallel projections, which fxpipe keeps unsharded under sp."""


def expected_fp32_cpu_tp(d: Dims, mode: RecomputeMode, dropout: float, *, t: int, sp: bool,
                         norm_affine: int) -> float:
    """``expected_fp32_cpu`` at (t, sp), plus what fxpipe's TP collectives really save, per rank.

    Everything of ``expected_fp32_cpu`` holds (fp32, 4-byte masks, fused SDPA at p = 0 with
    its logsumexp of the local a/t heads, LayerNorm mean/rstd on the rows it normalizes).
    The TP graph adds, per collective (fxpipe/tp/ops.py):

    - f (``copy_to_tp``) and g (``reduce_from_tp``) save nothing: their ``setup_context``
      stores only the group (Megatron's f/g likewise). f's output is a copy of the norm
      output, and the column-parallel linear saves that copy instead of the norm output:
      it *is* the paper's "QKV projection input"/"MLP input" term, sbh, no extra term.
    - A row-parallel bias is added after g: an add saves nothing.
    - ``fxpipe_tp.dropout`` is ``x * dropout_mask(x)``: the mul keeps the mask, in x's dtype
      (4 bytes), exactly as CPU ``aten.dropout`` does at t = 1. Without sp it runs on the
      replicated sbh activation after g (the paper's unsharded mask terms); with sp on the
      sequence shard, sbh/t. Attention dropout stays inside SDPA (math path, a/t heads).
    - sp: ``gather_seq`` (all-gather forward, reduce-scatter backward) saves nothing itself,
      but its output, the *full-sequence* tensor, is what the next column-parallel linear
      saves: the two terms of ``SP_GATHERED`` cost sbh, not sbh/t. The paper's 34/t assumes
      Megatron's linear, which saves only the local shard and all-gathers it again in
      backward (megatron/core/tensor_parallel/layers.py,
      LinearWithGradAccumulationAndAsyncCommunication: ``ctx.save_for_backward(input,
      weight)`` with ``input`` the shard; backward re-gathers ``total_input``).
    - sp: ``reduce_scatter_seq`` saves nothing; the norm weight and bias enter the sequence
      shards through f so their gradient is all-reduced (docs/tensor_parallel.md), and f's
      forward is a copy (custom ops may not alias their input): the norm saves that copy,
      a storage that is not a parameter. 2 norms x ``norm_affine`` vectors x h x 4 bytes.
    - FULL: only the region input is kept, the replicated layer input (sbh) or with sp its
      sequence shard (sbh/t), as ``layer_bytes`` says; the collectives, f copies and gathers
      inside the region are rerun in backward, not stored.
    """
    expected = expected_fp32_cpu(d, mode, dropout, t=t, sp=sp)
    if sp and mode is not FULL:
        gathered = sum(x.count for x in PAPER_TERMS if x.name in SP_GATHERED)
        assert gathered == len(SP_GATHERED) == 2, "the table names both projection inputs"
        expected += 4 * gathered * d.s * d.b * d.h * (1 - 1 / t)  # full, not 1/t, per rank
        expected += 2 * norm_affine * d.h * 4  # f copies of the two norms' weight (and bias)
    return expected


@lru_cache(maxsize=None)
def _tp_saved(name: str, seq: int, dropout: float, sp: bool, mode: RecomputeMode):
    """(per-rank layer -> bytes, model config, layer indices): one emulated TP forward."""
    prog, batch, cfg = tp_program(name, seq, dropout, tp=TP, sp=sp)
    return tuple(saved_bytes_per_rank(prog, batch, mode)), cfg, sorted(set(prog.layers.values()))


@pytest.mark.parametrize("mode", list(RecomputeMode), ids=lambda m: m.value)
@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("name,seq", TP_SHAPES)
def test_tp_saved_bytes_per_layer_match_formula_on_every_rank(name, seq, dropout, sp, mode):
    per_rank, cfg, layers = _tp_saved(name, seq, dropout, sp, mode)
    d = Dims(s=seq, b=2, h=cfg.n_embd, a=cfg.n_head)
    expected = expected_fp32_cpu_tp(d, mode, dropout, t=TP, sp=sp, norm_affine=2 if cfg.bias else 1)
    assert len(per_rank) == TP and layers == [0, 1]
    for rank, measured in enumerate(per_rank):
        # SPMD: every rank holds the same shapes, so it saves the same bytes.
        assert measured == per_rank[0], f"rank {rank} saves {measured}, rank 0 {per_rank[0]}"
        for layer in layers:
            assert measured[layer] == pytest.approx(expected, rel=0.10), \
                f"rank {rank} layer {layer}: measured {measured[layer]} B, formula (adjusted) {expected:.0f} B"


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("name,seq", TP_SHAPES)
def test_tp_selective_and_sequence_parallel_reduce_saved_bytes(name, seq, dropout):
    saved = {(sp, mode): _tp_saved(name, seq, dropout, sp, mode)[0]
             for sp in (False, True) for mode in RecomputeMode}
    layers = _tp_saved(name, seq, dropout, False, NONE)[2]
    for rank in range(TP):
        for layer in layers:
            at = {key: per_rank[rank][layer] for key, per_rank in saved.items()}
            for sp in (False, True):
                assert at[sp, NONE] > at[sp, SELECTIVE] > at[sp, FULL], f"sp={sp} layer {layer}: {at}"
            for mode in RecomputeMode:
                assert at[True, mode] < at[False, mode], f"{mode.value}: TP+SP < TP, layer {layer}: {at}"
        for sp in (False, True):  # embeddings, head and loss are never recomputed
            assert len({saved[sp, mode][rank][None] for mode in RecomputeMode}) == 1


# ---- the counter ---------------------------------------------------------------------------------
def test_counter_measures_a_stage_forward_as_the_runtime_would():
    prog, batch = program("gpt-tiny")
    plan = two_stage_plan(prog, cut_after=[n for n, k in prog.layers.items() if k == 0][-1])
    state = dict(plan.program.state)
    per_stage = []
    for st in plan.stages:
        gm = apply_recompute(st.graph_module, plan.program.layers, FULL)
        st = dataclasses.replace(st, graph_module=gm)
        received = {n: torch.randn(v.spec.shape, requires_grad=True)
                    for n, v in plan.values.items() if n in st.inputs}
        with SavedTensorCounter(exclude=state.values()) as saved:
            st.call(state, plan.canonical, batch, received)
        per_stage.append(saved.total)
    whole = measure_saved(apply_recompute(prog.graph_module, prog.layers, FULL), fresh_args(prog, batch)[1],
                          prog.layers)
    # Cut between layers 0 and 1: stage 1 keeps its received copy of the layer-1 input,
    # exactly what the whole graph keeps for layer 1; nothing is counted twice or lost.
    assert sum(per_stage) == whole.total


def test_counter_counts_a_storage_once_and_leaves_no_reference_cycle():
    x = torch.randn(64, requires_grad=True)
    with SavedTensorCounter() as saved:
        y = x.exp()  # exp saves its output, sin saves its input: one storage
        z = y.sin()
    assert saved.total == 64 * 4
    alive = weakref.ref(y)
    del y, z  # no gc.collect(): a cycle through autograd's C++ nodes would never be freed
    assert alive() is None

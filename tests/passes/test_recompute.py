"""Activation recomputation: same loss and gradients as the unmodified graph, and the
bytes saved for backward per layer against Korthikanti et al. 2022.

Run: .venv/bin/python -m pytest tests/passes/test_recompute.py -q
"""
from __future__ import annotations

import dataclasses
import enum
import weakref
from dataclasses import dataclass
from functools import lru_cache

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpipe
from fxpipe.models.losses import causal_lm_loss
from fxpipe.costs.saved_activations import SavedTensorCounter, measure_saved, saved_bytes_by_layer
from fxpipe.models import build_workload
from fxpipe.models.gpt import GPT
from fxpipe.compiler.driver import run_passes
from fxpipe.ir.compile_context import CompileContext
from fxpipe.ir.parallel_config import ParallelConfig
from fxpipe.passes.lint import lint_plan
from fxpipe.passes.recompute import RecomputeMode, RecomputeWarning, apply_recompute, recompute_pass, regions_of
from fxpipe.passes.split import split_program
from fxpipe.runtime.stage_runner import StageRunner
from tests.passes._recompute_tp import loss_and_grads_per_rank, saved_bytes_per_rank, tp_program

NONE, SELECTIVE, FULL = RecomputeMode.NONE, RecomputeMode.SELECTIVE, RecomputeMode.FULL
aten = torch.ops.aten


# ---- programs under test -------------------------------------------------------------------
@lru_cache(maxsize=None)
def _program(name: str, dropout: float = 0.0, batch: int = 2, seq: int = 32, layers: int = 2):
    """(Program, batch) for fxpipe's GPT at a named shape with ``dropout``, or an HF model."""
    w = build_workload(name, batch=batch, seq=seq, layers=layers)
    model = w.model
    if w.config is not None and dropout:
        torch.manual_seed(0)
        model = GPT(dataclasses.replace(w.config, dropout=dropout))
    prog, _ = run_passes(fxpipe.capture(model, w.example_inputs, w.loss_fn))
    return prog, tuple(w.example_inputs)


@lru_cache(maxsize=None)
def _hf_gpt2_eager():
    """HF GPT-2 with its unfused attention (matmul -> softmax -> dropout -> matmul)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.1, bos_token_id=0,
                                  eos_token_id=0, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 128, (2, 32))
    prog, _ = run_passes(fxpipe.capture(model, (ids, ids.clone()), causal_lm_loss))
    return prog, (ids, ids.clone())


def _args(prog, batch):
    """Fresh leaf copies of the state (so gradients do not mix between runs) + the batch."""
    state = {k: t.detach().clone().requires_grad_(t.requires_grad) for k, t in prog.state.items()}
    return state, [state[p.canonical] for p in prog.params] + list(batch)


def _loss_and_grads(prog, batch, gm, seed=123):
    state, args = _args(prog, batch)
    torch.manual_seed(seed)
    out = gm(*args)
    loss = out[prog.loss_output] if isinstance(out, (tuple, list)) else out
    loss.backward()
    return loss.detach(), {k: t.grad for k, t in state.items() if t.grad is not None}


# ---- (a) same loss and every gradient -----------------------------------------------------------
CASES = [("gpt-tiny", 0.0), ("gpt-tiny", 0.1), ("gpt-small", 0.1), ("hf:llama", 0.0), ("hf:gpt2-eager", 0.1)]


def _case(name, dropout):
    return _hf_gpt2_eager() if name == "hf:gpt2-eager" else _program(name, dropout)


@pytest.mark.parametrize("mode", [SELECTIVE, FULL], ids=lambda m: m.value)
@pytest.mark.parametrize("name,dropout", CASES)
def test_loss_and_gradients_equal_unmodified_graph(name, dropout, mode):
    prog, batch = _case(name, dropout)
    gm = apply_recompute(prog.graph_module, prog.layers, mode)
    assert regions_of(gm), "something was outlined"
    ref_loss, ref_grads = _loss_and_grads(prog, batch, prog.graph_module)
    loss, grads = _loss_and_grads(prog, batch, gm)
    if dropout:  # the comparison is only meaningful if the masks are really random
        other, _ = _loss_and_grads(prog, batch, prog.graph_module, seed=7)
        assert other != ref_loss
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    assert grads.keys() == ref_grads.keys() and len(grads) == len(prog.trainable())
    for k in ref_grads:  # recomputation reruns the same kernels: equal up to fp32 rounding
        torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-5, atol=1e-7, msg=k)


def test_full_regions_are_whole_layers_keeping_only_the_layer_input():
    prog, _ = _program("gpt-tiny")
    gm = apply_recompute(prog.graph_module, prog.layers, FULL)
    regions = regions_of(gm)
    assert [r.layer for r in regions] == [0, 1]
    params = {p.node for p in prog.params}
    for r in regions:
        assert set(r.nodes) == {n for n, k in prog.layers.items() if k == r.layer}
        activations = [i for i in r.inputs if i not in params]
        assert len(activations) == 1, f"only the layer input is kept, got {activations}"
    assert [n.name for n in gm.graph.nodes if n.op == "placeholder"] == \
        [n.name for n in prog.graph.nodes if n.op == "placeholder"]


@pytest.mark.parametrize("name,dropout", CASES)
def test_selective_region_is_the_attention_core_only(name, dropout):
    """Between the QKV projections' outputs and the output projection's input: an
    SDPA kernel or the unfused softmax chain, no parameter, no projection."""
    prog, _ = _case(name, dropout)
    gm = apply_recompute(prog.graph_module, prog.layers, SELECTIVE)
    regions = regions_of(gm)
    assert sorted(r.layer for r in regions) == sorted(set(prog.layers.values()))
    params = {p.node for p in prog.params}
    nodes = {n.name: n for n in prog.graph.nodes}
    kernels = {aten.scaled_dot_product_attention.default, aten.softmax.int, aten._softmax.default}
    for r in regions:
        targets = {nodes[n].target for n in r.nodes}
        assert targets & kernels
        assert not targets & {aten.linear.default, aten.addmm.default, aten.layer_norm.default}
        assert not set(r.inputs) & params
        assert all(nodes[i].target in (aten.linear.default, aten.addmm.default)
                   for i in r.inputs if prog.layers.get(i) == r.layer), "inputs: projection outputs"


# ---- (b) saved bytes per layer against Korthikanti et al. 2022 ------------------------------------
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
    prog, batch = _program(name, dropout, seq=seq)
    cfg = build_workload(name, device="meta").config
    d = Dims(s=seq, b=batch[0].shape[0], h=cfg.n_embd, a=cfg.n_head)
    gm = apply_recompute(prog.graph_module, prog.layers, mode)
    _, args = _args(prog, batch)
    torch.manual_seed(0)
    measured = saved_bytes_by_layer(gm, args, prog.layers)
    expected = expected_fp32_cpu(d, mode, dropout)
    for layer in sorted(set(prog.layers.values())):
        assert measured[layer] == pytest.approx(expected, rel=0.10), \
            f"layer {layer}: measured {measured[layer]} B, formula (adjusted) {expected:.0f} B"


# ---- (c) the order none > selective > full ----------------------------------------------------------
@pytest.mark.parametrize("name,dropout", CASES)
def test_recompute_reduces_saved_bytes_in_order(name, dropout):
    prog, batch = _case(name, dropout)
    _, args = _args(prog, batch)
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


# ---- (d) tensor parallelism: the same check on every TP rank ----------------------------------------
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


@pytest.mark.parametrize("mode", [SELECTIVE, FULL], ids=lambda m: m.value)
@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_tp_recompute_keeps_loss_and_gradients_with_tp_dropout(sp, mode):
    """Residual-branch dropout p = 0.1 (``fxpipe_tp.dropout``), attention dropout off: the
    emulated ranks share torch's global generator, so SDPA's own dropout is not replayable
    across threads; the TP streams are per rank and must be."""
    prog, batch, _ = tp_program("gpt-tiny", 64, 0.1, tp=TP, sp=sp, attn_dropout=False)
    ref = loss_and_grads_per_rank(prog, batch, prog.graph_module)
    out = loss_and_grads_per_rank(prog, batch, apply_recompute(prog.graph_module, prog.layers, mode))
    for rank, ((loss, grads), (ref_loss, ref_grads)) in enumerate(zip(out, ref)):
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
        assert grads.keys() == ref_grads.keys()
        for k in ref_grads:
            torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-5, atol=1e-7, msg=f"rank {rank}: {k}")


# ---- pipeline stages: a layer cut across two stages, run by the StageRunner ----------------------
def _two_stage_plan(prog, cut_after: str):
    order = [n.name for n in prog.graph.nodes if n.op == "call_function"]
    cut = order.index(cut_after) + 1
    return split_program(prog, {n: int(i >= cut) for i, n in enumerate(order)}, num_stages=2)


def _run_stages(plan, batch, split_backward: bool):
    state = {k: t.detach().clone().requires_grad_(t.requires_grad) for k, t in plan.program.state.items()}
    runners = [StageRunner(plan, st, state) for st in plan.stages]
    torch.manual_seed(5)
    sent = {}
    for r in runners:
        sent.update(r.forward(0, batch, sent))
    grads = {}
    for r in reversed(runners):
        if split_backward:  # zero-bubble I then W: two autograd passes over a retained graph
            grads.update(r.backward_input(0, grads))
            r.backward_weight(0)
        else:
            grads.update(r.backward(0, grads))
    return runners[-1].losses[0], {k: t.grad for k, t in state.items() if t.grad is not None}


@pytest.mark.parametrize("split_backward", [False, True], ids=["B", "I+W"])
@pytest.mark.parametrize("mode", [SELECTIVE, FULL], ids=lambda m: m.value)
def test_per_stage_recompute_with_a_layer_cut_across_stages(mode, split_backward):
    prog, batch = _program("gpt-tiny", 0.1)
    sdpa = [n.name for n in prog.graph.nodes if n.target == aten.scaled_dot_product_attention.default]
    plan = _two_stage_plan(prog, cut_after=sdpa[1])  # layer 1 is cut right after its attention core
    rewritten = dataclasses.replace(plan, stages=tuple(
        dataclasses.replace(st, graph_module=apply_recompute(st.graph_module, plan.program.layers, mode))
        for st in plan.stages))
    layers_per_stage = [[r.layer for r in regions_of(st.graph_module)] for st in rewritten.stages]
    assert layers_per_stage == ([[0, 1], [1]] if mode is FULL else [[0, 1], []])
    ref_loss, ref_grads = _run_stages(plan, batch, split_backward)
    loss, grads = _run_stages(rewritten, batch, split_backward)
    assert loss == ref_loss
    assert grads.keys() == ref_grads.keys()
    for k in ref_grads:
        torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-5, atol=1e-7, msg=k)


def test_counter_measures_a_stage_forward_as_the_runtime_would():
    prog, batch = _program("gpt-tiny")
    plan = _two_stage_plan(prog, cut_after=[n for n, k in prog.layers.items() if k == 0][-1])
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
    whole = measure_saved(apply_recompute(prog.graph_module, prog.layers, FULL), _args(prog, batch)[1],
                          prog.layers)
    # Cut between layers 0 and 1: stage 1 keeps its received copy of the layer-1 input,
    # exactly what the whole graph keeps for layer 1; nothing is counted twice or lost.
    assert sum(per_stage) == whole.total


# ---- the pipeline's pass and model-agnostic edges ---------------------------------------------
def test_recompute_pass_outlines_every_stage_and_keeps_the_loss():
    prog, batch = _program("gpt-tiny")
    plan = split_program(prog, {n.name: 0 for n in prog.graph.nodes if n.op == "call_function"}, num_stages=1)
    out = recompute_pass(plan, CompileContext.of(ParallelConfig(recompute="full")))
    lint_plan(out, after="recompute")
    (before,), (after,) = plan.stages, out.stages
    assert len(regions_of(after.graph_module)) == 2
    state, _ = _args(prog, batch)
    assert after.call(state, plan.canonical, batch, {}) == before.call(state, plan.canonical, batch, {})
    assert recompute_pass(plan, CompileContext.of(ParallelConfig())) is plan


def test_graph_without_layers_is_left_unchanged_with_a_note():
    lin = torch.nn.Linear(8, 8)
    prog = fxpipe.capture(lin, (torch.randn(4, 8), torch.randn(4, 8)),
                          loss_fn=lambda o, t: ((o - t) ** 2).mean())
    assert not prog.layers
    with pytest.warns(RecomputeWarning, match="no repeated layers"):
        assert apply_recompute(prog.graph_module, prog.layers, FULL) is prog.graph_module


def test_mode_names_and_errors():
    assert RecomputeMode.parse("Selective") is SELECTIVE
    with pytest.raises(ValueError, match="none, selective, full"):
        RecomputeMode.parse("partial")
    with pytest.raises(TypeError, match="RecomputeMode.parse"):
        apply_recompute(_program("gpt-tiny")[0].graph_module, {}, "full")


class _TwistedBlock(nn.Module):
    """Attention where a projection reads the core before its kernel, and one takes a
    core value back into the core (as MLA's up-projection): the region must stay a
    single call, so the first is moved after it and the second's source left out."""

    def __init__(self, h: int = 32, n_head: int = 4) -> None:
        super().__init__()
        self.n_head = n_head
        self.q, self.k, self.o, self.side, self.kv_up = (nn.Linear(h, h) for _ in range(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        heads = lambda t: t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        merge = lambda t: t.transpose(1, 2).reshape(B, T, C)  # (B, T, C)
        q = heads(self.q(x))
        side = self.side(merge(q))
        k = heads(self.k(x))
        v = heads(self.kv_up(merge(k * 0.5)))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(merge(y)) + side


class _Twisted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_TwistedBlock() for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_selective_region_stays_one_call_when_projections_interleave_the_core():
    batch = (torch.randn(2, 8, 32), torch.randn(2, 8, 32))
    prog = fxpipe.capture(_Twisted(), batch, loss_fn=lambda o, t: ((o - t) ** 2).mean())
    gm = apply_recompute(prog.graph_module, prog.layers, SELECTIVE)
    regions = regions_of(gm)
    assert [r.layer for r in regions] == [0, 1]
    nodes = {n.name: n for n in prog.graph.nodes}
    for r in regions:
        # k's chain feeds kv_up, whose output re-enters the core: it stays outside.
        assert not any(nodes[n].target == aten.mul.Tensor for n in r.nodes)
        assert any(nodes[n].target == aten.scaled_dot_product_attention.default for n in r.nodes)
    ref_loss, ref_grads = _loss_and_grads(prog, batch, prog.graph_module)
    loss, grads = _loss_and_grads(prog, batch, gm)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    for k in ref_grads:
        torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-5, atol=1e-7, msg=k)


def test_counter_counts_a_storage_once_and_leaves_no_reference_cycle():
    x = torch.randn(64, requires_grad=True)
    with SavedTensorCounter() as saved:
        y = x.exp()  # exp saves its output, sin saves its input: one storage
        z = y.sin()
    assert saved.total == 64 * 4
    alive = weakref.ref(y)
    del y, z  # no gc.collect(): a cycle through autograd's C++ nodes would never be freed
    assert alive() is None

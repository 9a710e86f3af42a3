"""``inductor=True``: stages compiled by AOTAutograd + Inductor train exactly like eager ones.

Tolerance: fp32 losses within 1e-5 relative and gradients within rtol 1e-4 / atol 1e-5
of the same run without compile. Inductor fuses and reorders fp32 reductions (layer
norm, softmax, matmul epilogues), so results are not bitwise equal; the observed
differences are ~1e-7. One spawned 2-process world runs every case, since spawning and
Inductor's first compile dominate on a 2-core machine.
"""
import os
import warnings

import pytest
import torch
import torch.fx as fx

from fxpipe.passes.recompute import RecomputeMode, apply_recompute, regions_of
from fxpipe.runtime.compiled import (CompileFallbackWarning, compile_stage, compile_stages,
                                     inline_recompute_regions)
from tests.runtime._compile_cases import compiled_vs_eager, reference
from tests.runtime._dist import run_world

# Three cases keep CI's cost near the floor of any Inductor test (spawn, import, ISA probe,
# precompiled header, one cold stage compile per process: ~45 s on 2 cores for the first
# case). Together they cover tp=2 (collectives in the compiled forward and backward,
# inside recompute regions), both zero-bubble schedules with the compiled backward split
# into I and W graphs (runtime/compiled_split.py; zb-v at pp=1 hands activations over
# locally and, at tp=2, splits a backward with collectives), both recompute modes, two
# model families. FXPIPE_COMPILE_MATRIX=1 adds every model of the equivalence matrix at
# both tp=2 (1f1b: one compiled backward) and pp=2 (~2 min more with a cold Inductor cache).
CASES = [dict(model="gpt-tiny", tp=2, schedule="zb-v", chunks=2, recompute="full"),
         dict(model="hf:llama", pp=2, schedule="zb-h1", recompute="selective"),
         dict(model="gpt-tiny", pp=2, schedule="zb-v", chunks=2, layers=4)]
if os.environ.get("FXPIPE_COMPILE_MATRIX") == "1":
    CASES += [dict(model=m, tp=2) for m in ("gpt-tiny", "hf:gpt2", "hf:llama")]
    CASES += [dict(model=m, pp=2, schedule="zb-h1") for m in ("gpt-tiny", "hf:gpt2", "hf:llama")]


def _id(c):
    return f"{c['model']}-tp{c.get('tp', 1)}-pp{c.get('pp', 1)}-{c.get('schedule', '1f1b')}" + \
        (f"-{c['recompute']}" if "recompute" in c else "")


@pytest.fixture(scope="module")
def world2():
    return run_world(2, compiled_vs_eager, CASES)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(CASES)), ids=[_id(c) for c in CASES])
def test_compiled_equals_eager(world2, index):
    ref_losses, ref_grads = reference(CASES[index])
    for rank_results in world2:
        r = rank_results[index]
        assert r["fallbacks"] == [], r["fallbacks"]
        assert r["compiled"]["compiled"] and all(ok for _, ok, _ in r["compiled"]["compiled"])
        assert r["compiled"]["losses"] == pytest.approx(r["eager"]["losses"], rel=1e-5)
        # ... and the single-process model's (the eager runs are checked against it in
        # test_equivalence.py; the compiled zero-bubble ones are checked here).
        assert r["compiled"]["losses"] == pytest.approx(ref_losses, rel=1e-5)
        assert set(r["compiled"]["grads"]) == set(r["eager"]["grads"])
        for name, g in r["compiled"]["grads"].items():
            torch.testing.assert_close(g, r["eager"]["grads"][name], rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"{name}: {m}")
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"{name} (single process): {m}")
    if CASES[index].get("schedule", "1f1b").startswith("zb"):
        # Stages receiving activations run I and W as separate compiled graphs; the first
        # stage has no input gradient, so its W is its whole backward (compiled once).
        split = {s: ok for rank_results in world2 for s, ok in rank_results[index]["compiled"]["split"].items()}
        assert split == {s: s > 0 for s in split}, split


@pytest.mark.slow
def test_split_backward_keeps_collectives_once_and_in_one_order(world2):
    """tp=2: each collective of the backward lands in exactly one of I and W, in the
    whole graph's order, and both TP ranks cut their graphs identically."""
    (index,) = [i for i, c in enumerate(CASES) if c.get("tp") == 2 and c.get("schedule") == "zb-v"]
    per_rank = [rank_results[index]["compiled"]["collectives"] for rank_results in world2]
    assert per_rank[0] and per_rank[0] == per_rank[1]
    for ops in per_rank[0].values():
        assert ops["I"], "the input-gradient path of a TP layer all-reduces"
        assert sorted(ops["I"] + ops["W"]) == sorted(ops["B"])
        assert _in_order(ops["I"], ops["B"]) and _in_order(ops["W"], ops["B"])


def _in_order(part: list, whole: list) -> bool:
    """``part`` is a subsequence of ``whole``."""
    rest = iter(whole)
    return all(any(p == w for w in rest) for p in part)


# ---- fallback ------------------------------------------------------------------------------
@torch.library.custom_op("fxpipe_test::no_fake_kernel", mutates_args=())
def _no_fake_kernel(x: torch.Tensor) -> torch.Tensor:
    """An op without a fake (meta) kernel: AOTAutograd cannot trace it."""
    return x * 2.0


_no_fake_kernel.register_autograd(lambda ctx, g: g * 2.0)


def _stage_with_untraceable_op() -> fx.GraphModule:
    g = fx.Graph()
    w, x = g.placeholder("w"), g.placeholder("x")
    y = g.call_function(torch.ops.aten.mm.default, (x, w))
    z = g.call_function(torch.ops.fxpipe_test.no_fake_kernel.default, (y,))
    g.output((g.call_function(torch.ops.aten.sum.default, (z,)),))
    return fx.GraphModule(torch.nn.Module(), g)


def test_stage_that_cannot_compile_runs_eagerly_with_a_warning():
    gm = _stage_with_untraceable_op()
    w = torch.randn(3, 2, requires_grad=True)
    x = torch.randn(4, 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fns, records = compile_stages({5: (gm, [w, x])}, context=lambda: warnings.catch_warnings(), log=None)
    assert fns[5] is gm and not records[0].compiled
    (warning,) = [c for c in caught if issubclass(c.category, CompileFallbackWarning)]
    message = str(warning.message)
    assert "stage 5: eager (" in message and "running it eagerly" in message and "\n" not in message
    assert "no_fake_kernel" in message or "fake" in message.lower(), message
    (loss,) = fns[5](w, x)
    loss.backward()
    expected = (2.0 * x.sum(0))[:, None].expand(3, 2)  # d sum(2·xw) / dw
    torch.testing.assert_close(w.grad, expected)


def test_a_stage_failing_on_another_rank_runs_eagerly_everywhere():
    """Compiled and eager code may order independent collectives differently, so the
    ranks of one TP group agree: one failure sends them all to eager."""
    gm = _stage_with_untraceable_op()
    ok = compile_stage(gm, [torch.randn(3, 2), torch.randn(4, 3)], compiler=lambda g, a: g)
    assert ok[1] is None
    with pytest.warns(CompileFallbackWarning, match="another rank"):
        fns, records = compile_stages({0: (gm, [torch.randn(3, 2), torch.randn(4, 3)])},
                                      context=lambda: warnings.catch_warnings(),
                                      agree=lambda mine: {0: False}, log=None, compiler=lambda g, a: g)
    assert fns[0] is gm and records[0].reason.startswith("another rank")


def test_recompute_regions_are_inlined_with_partitioner_tags():
    from torch.utils.checkpoint import CheckpointPolicy

    from fxpipe.compiler.capture import capture
    from fxpipe.models import build_workload

    w = build_workload("gpt-tiny", batch=2, seq=8, layers=2)
    program = capture(w.model, w.example_inputs, w.loss_fn)
    gm = apply_recompute(program.graph_module, program.layers, RecomputeMode.FULL)
    assert len(regions_of(gm)) == 2
    flat = inline_recompute_regions(gm)
    assert not any(n.op == "call_module" for n in flat.graph.nodes)
    tags = {n.meta["ac_graph_id"] for n in flat.graph.nodes if "ac_graph_id" in n.meta}
    assert tags == {0, 1}
    policies = {n.meta["recompute"] for n in flat.graph.nodes if "recompute" in n.meta}
    assert CheckpointPolicy.MUST_RECOMPUTE in policies
    # Dropout (random) is kept, never replayed: the compiled backward has no RNG rewind.
    for n in flat.graph.nodes:
        if "dropout" in str(n.target) and "ac_graph_id" in n.meta:
            assert n.meta["recompute"] is CheckpointPolicy.MUST_SAVE
    # Same values as the outlined graph.
    args = [program.state[p.canonical] for p in program.params] + list(w.example_inputs)
    torch.testing.assert_close(flat(*args), gm(*args))


# ---- the zero-bubble split of a compiled backward ---------------------------------------
@pytest.mark.slow
def test_split_backward_computes_nothing_twice(monkeypatch):
    """The last stage of a 2-stage GPT, compiled for a zero-bubble schedule: the I and W
    graphs Inductor compiles share no matmul and together hold the whole backward's;
    run through the StageRunner, I leaves ``.grad`` alone, I + W does exactly eager B's
    FLOPs (the compiled kernels' matmuls are counted) and gives B's gradients."""
    import torch._inductor.config as inductor_config
    from torch._inductor.compile_fx import compile_fx_inner
    from torch.utils.flop_counter import FlopCounterMode

    from fxpipe.runtime.compiled import example_args
    from fxpipe.runtime.compiled_split import count_ops
    from fxpipe.runtime.stage_runner import StageRunner
    from tests.runtime._stage_plans import stage_plan

    monkeypatch.setattr(inductor_config.cpp, "vec_isa_ok", False)  # as _compile_cases
    w, plan = stage_plan("gpt-tiny")
    state = {n: t.detach().clone().requires_grad_(t.requires_grad) for n, t in plan.program.state.items()}
    stage = plan.stages[1]
    backwards = []

    def inner(gm, inputs, **kw):  # what Inductor is given, before its own passes
        if kw.get("is_backward"):
            mms = {n.name for n in gm.graph.nodes if n.op == "call_function" and "mm" in str(n.target)}
            backwards.append((count_ops(gm), mms))
        return compile_fx_inner(gm, inputs, **kw)

    fn, reason = compile_stage(stage.graph_module, example_args(plan, stage, state, torch.device("cpu")),
                               split_inputs=len(stage.inputs), inner=inner)
    assert reason is None and fn.weights is not None, fn.split_reason
    (i_count, i_mms), (w_count, w_mms) = backwards
    assert i_count > 0 and w_count > 0 and not i_mms & w_mms
    assert i_count + w_count == count_ops(fn.split.backward)

    trained = [n for n in plan.stage_params(1) if state[n].requires_grad]
    sent = StageRunner(plan, plan.stages[0], state).forward(0, w.example_inputs, {})
    flops, grads = {}, {}
    for mode in ("B", "I", "W"):
        runner = StageRunner(plan, stage, state, compiled=None if mode == "B" else fn)
        if mode != "W":
            for n in trained:
                state[n].grad = None
            runner.forward(0, w.example_inputs, sent)
            last = runner
        with FlopCounterMode(display=False) as counter:
            if mode == "B":
                back = last.backward(0, {})
            elif mode == "I":
                split_back = last.backward_input(0, {})
                assert all(state[n].grad is None for n in trained), "I accumulated a weight gradient"
            else:
                last.backward_weight(0)
        flops[mode] = counter.get_total_flops()
        grads[mode] = {n: state[n].grad.clone() for n in trained if state[n].grad is not None}
    assert flops["I"] > 0 and flops["W"] > 0 and flops["I"] + flops["W"] == flops["B"]
    assert back.keys() == split_back.keys() and grads["W"].keys() == grads["B"].keys() == set(trained)
    for n in back:
        torch.testing.assert_close(split_back[n], back[n], rtol=1e-4, atol=1e-5)
    for n in trained:
        torch.testing.assert_close(grads["W"][n], grads["B"][n], rtol=1e-4, atol=1e-5, msg=n)

"""``compile=True``: stages compiled by AOTAutograd + Inductor train exactly like eager ones.

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
from tests.runtime._compile_cases import compiled_vs_eager
from tests.runtime._dist import run_world

# Two cases keep CI's cost near the floor of any Inductor test (spawn, import, ISA probe,
# precompiled header, one cold stage compile per process: ~45 s on 2 cores). Together
# they cover tp=2 (collectives in the compiled forward and backward, inside recompute
# regions) and pp=2 with zero-bubble I/W on compiled outputs, both recompute modes, two
# model families. FXPIPE_COMPILE_MATRIX=1 adds every model of the equivalence matrix at
# both tp=2 and pp=2 (~2 min more with a cold Inductor cache).
CASES = [dict(model="gpt-tiny", tp=2, recompute="full"),
         dict(model="hf:llama", pp=2, schedule="zb-h1", recompute="selective")]
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
    for rank_results in world2:
        r = rank_results[index]
        assert r["fallbacks"] == [], r["fallbacks"]
        assert r["compiled"]["compiled"] and all(ok for _, ok, _ in r["compiled"]["compiled"])
        assert r["compiled"]["losses"] == pytest.approx(r["eager"]["losses"], rel=1e-5)
        assert set(r["compiled"]["grads"]) == set(r["eager"]["grads"])
        for name, g in r["compiled"]["grads"].items():
            torch.testing.assert_close(g, r["eager"]["grads"][name], rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"{name}: {m}")


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

    from fxpipe.capture import capture
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

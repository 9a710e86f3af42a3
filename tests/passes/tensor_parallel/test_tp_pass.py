"""The pass as the driver runs it: lint-clean, priced by the cost pass, input untouched."""
import pytest

from fxpipe.compiler.driver import run_passes

from fxpipe.compiler.pass_list import DEFAULT_PASSES
from fxpipe.passes.cost import total_cost
from fxpipe.passes.tensor_parallel import TPConfig, TPResult, tensor_parallel_pass
from fxpipe.tp.ops import OPS
from tests.passes.tensor_parallel._tp_helpers import captured, reference

PASSES = DEFAULT_PASSES  # canonicalize -> causal_mask -> tensor_parallel -> grouped_attention -> cost
assert [p.name for p in PASSES] == ["canonicalize", "causal_mask", "tensor_parallel", "grouped_attention", "cost"]


def test_in_the_driver_with_lint():
    base, batch = captured("gpt-tiny")
    out, timings = run_passes(base, TPConfig(tp=2), passes=PASSES, debug=True)
    assert "tensor_parallel" in [t.name for t in timings]
    assert isinstance(out.tensor_parallel, TPResult)
    full, _ = run_passes(base, None, debug=True)
    # Sharded matmuls: the block and LM-head FLOPs halve; attention cores too (heads split).
    assert total_cost(out).fwd_flops == pytest.approx(total_cost(full).fwd_flops / 2, rel=1e-6)
    assert any(n.target is OPS.copy_to_tp.default for n in out.graph.nodes)


def test_driver_config_carries_a_tp_config():
    from fxpipe.ir.parallel_config import ParallelConfig

    class Cfg:  # tp/sp attributes alone are not a config: the layout is typed once, in ParallelConfig
        tp, sp = 2, False

    base, _ = captured("gpt-tiny")
    layout = ParallelConfig(tp=2, costs="model")
    assert tensor_parallel_pass(base, layout).tensor_parallel.config == TPConfig(tp=2, scatter_gather=True)
    with pytest.raises(TypeError, match="TPConfig"):
        tensor_parallel_pass(base, Cfg())


def test_tp1_is_the_identity_and_the_input_is_untouched():
    base, batch = captured("hf:gpt2")
    assert tensor_parallel_pass(base, TPConfig(tp=1)) is base
    before = reference(base, batch)[0]
    tensor_parallel_pass(base, TPConfig(tp=2))
    assert reference(base, batch)[0].item() == before.item()
    assert base.tensor_parallel is None

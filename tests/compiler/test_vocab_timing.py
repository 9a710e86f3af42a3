"""What one microbatch's vocabulary-pass communication costs in the price
(``compiler/vocab_placement.vocab_timing``), as the runtime runs it (``runtime/head_blocks.py``):
BCAST_H is one broadcast of the values the last stage hands the head (its input and the
targets) packed in one buffer, ALLREDUCE_S one all-gather of the softmax statistics over
the pipeline ranks (max, sum-exp and target logit), REDUCE_G one reduce of the input's
gradient — ring collectives on the hardware's links, not transfers. Under measured stage
times S and T are the passes timed as the runtime runs them, what the search prices."""
import math

import pytest

from fxpipe.base.hardware import Collective, get_hardware
from fxpipe.compiler.pipeline import capture_for, compile_program
from fxpipe.costs.local import vocab_passes_here
from fxpipe.ir.compile_context import CompileHooks
from fxpipe.ir.parallel_config import ParallelConfig
from fxpipe.passes.vocab_head import head_nodes
from tests.runtime import _wide_vocab

M = 2


@pytest.fixture(scope="module")
def compiled():
    model, batch, loss_fn = _wide_vocab.workload_tied()
    config = ParallelConfig(pp=2, microbatches=M, costs="model", vocab_passes=True).with_world(2)
    return compile_program(capture_for(model, tuple(t[:len(t) // M] for t in batch), config, loss_fn), config)


def test_the_vocabulary_collectives_are_priced_as_the_runtime_runs_them(compiled):
    timing, plan = compiled.vocab_timing, compiled.plan
    hw = get_hardware(compiled.config.hardware)
    hidden = plan.values[plan.vocab_head.hidden].spec
    tokens = math.prod(hidden.shape[:-1])
    send = hw.p2p_latency + tokens * hidden.shape[-1] * hidden.dtype.itemsize / hw.p2p_bw
    # pp = 2: a broadcast or reduce of n bytes is one step of latency + n / bw, and so is
    # a ring all-gather of n bytes per rank (each rank receives the other's n).
    step = lambda n: hw.intra_node.collective_latency + n / hw.intra_node.collective_bw  # noqa: E731
    assert hw.collective_s(Collective.ALL_GATHER, 2 * 12 * tokens, 2, 2) == pytest.approx(step(12 * tokens), rel=1e-9)
    values = [plan.values[n].spec for n in plan.vocab_head.outputs]
    assert len(values) == 2  # the head's input and the targets
    # One broadcast of both, each padded to 8 bytes in the buffer (runtime/head_blocks.py).
    packed = sum(-(-math.prod(v.shape) * v.dtype.itemsize // 8) * 8 for v in values)
    hidden_bytes = tokens * hidden.shape[-1] * hidden.dtype.itemsize
    # ALLREDUCE_S: one all-gather of 3 fp32 statistics per token from each of the 2 ranks.
    assert timing.collective_latency == pytest.approx((step(packed), step(12 * tokens), step(hidden_bytes)),
                                                      rel=1e-9)
    assert timing.p2p_latency == pytest.approx(send, rel=1e-9)


def test_under_measured_stage_times_the_passes_are_placed_on_s_and_t_timed_as_they_run():
    model, batch, loss_fn = _wide_vocab.workload_tied()
    config = ParallelConfig(pp=2, microbatches=M, costs="model", vocab_passes=True).with_world(2)
    program = capture_for(model, tuple(t[:len(t) // M] for t in batch), config, loss_fn)
    hw = get_hardware(config.hardware)
    seen = {}

    def measured(prog, pconfig, ctx):  # the model's own times, handed in as if measured
        seen["head"] = head_nodes(prog)
        return {n: (hw.forward_s(c), hw.backward_s(c)) for n, c in prog.costs.items()}

    compiled = compile_program(program, config, hooks=CompileHooks(node_times=measured))
    plan, d = compiled.plan, compiled.vocab_timing.durations
    spec = plan.values[plan.vocab_head.hidden].spec
    timed = vocab_passes_here(math.prod(spec.shape[:-1]), spec.shape[-1],
                              max(b - a for a, b in plan.vocab_head.blocks), spec.dtype)
    assert d.vocab_forward == (timed[0],) * 2 and d.vocab_backward == (timed[1],) * 2
    # not the head's nodes split over the ranks, as under the cost model
    head_f = sum(hw.forward_s(compiled.program.costs[n]) for n in seen["head"] if n in compiled.program.costs)
    assert d.vocab_forward[0] != pytest.approx(head_f / 2, rel=1e-6)

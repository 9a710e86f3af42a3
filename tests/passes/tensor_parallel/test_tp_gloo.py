"""Two processes, a real gloo ProcessGroup: the TP graph's loss and gradients equal
one process's (the emulation is not what makes the other tests pass)."""
import pytest

from fxpipe.passes.tensor_parallel import TPConfig, shard_state, tensor_parallel_pass, unshard_state
from fxpipe.tp import ProcessGroupTP, tp_group_context
from tests.runtime._dist import run_world
from tests.passes.tensor_parallel._tp_helpers import captured, leaves, reference

TP = 2
pytestmark = pytest.mark.slow


def _worker(rank: int, world: int) -> dict:
    base, batch = captured("gpt-tiny")
    program = tensor_parallel_pass(base, TPConfig(tp=world))
    group = ProcessGroupTP()
    state = leaves(shard_state(base.state, program.tensor_parallel.specs, group.rank))
    with tp_group_context(group):
        loss = program.run(state, *batch)
    loss.backward()
    return {"loss": loss.detach(), "grads": {k: v.grad for k, v in state.items() if v.grad is not None}}


def test_gloo_tp2_equals_one_process():
    results = run_world(TP, _worker)
    base, batch = captured("gpt-tiny")
    ref_loss, ref_grads = reference(base, batch)
    specs = tensor_parallel_pass(base, TPConfig(tp=TP)).tensor_parallel.specs
    grads = unshard_state([r["grads"] for r in results], specs)
    for r in results:
        assert abs(r["loss"].item() - ref_loss.item()) < 1e-5
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        assert (grads[name] - g).abs().max().item() < 1e-5, name

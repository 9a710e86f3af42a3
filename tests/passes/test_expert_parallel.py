"""The expert-parallel pass on a grouped MoE, in process (emulated expert groups): at
ep=2 and ep=4 every rank runs its rows of the batch with E/ep experts, and the loss
and every gradient equal the eager model on the whole batch. MoEs written otherwise
are left alone with the reason; experts that do not split over ep are refused."""
import pytest
import torch

import fxpipe
from fxpipe.ep import expert_group_context
from fxpipe.passes import canonicalize_pass
from fxpipe.passes.expert_parallel import EPConfig, expert_parallel_pass, shard_experts
from fxpipe.ir.shard_spec import ShardKind, shard_state
from fxpipe.tp import run_emulated

pytest.importorskip("transformers.integrations.moe")
from tests.passes.tensor_parallel._tp_models import T, V, StackedExperts  # noqa: E402

ROWS = 4


def _capture(form):
    torch.manual_seed(0)
    ids = torch.randint(0, V, (ROWS, T))
    batch = (ids, ids.roll(-1, 1))
    torch.manual_seed(1)
    model = StackedExperts(form)
    return model, canonicalize_pass(fxpipe.capture(model, tuple(t[:1] for t in batch))), batch


@pytest.fixture(scope="module")
def grouped():
    return _capture("grouped")


@pytest.mark.parametrize("ep", [2, 4])
def test_grouped_moe_equals_eager(grouped, ep):
    model, base, batch = grouped
    program = shard_experts(base, EPConfig(ep=ep, dp=ep))
    result = program.expert_parallel
    assert [layer.params for layer in result.layers] == [("down_w", "gate_up")] and not result.skipped
    assert {n: (s.kind, s.local_shape[0]) for n, s in result.specs.items()} == \
        {"gate_up": (ShardKind.EXPERTS, 4 // ep), "down_w": (ShardKind.EXPERTS, 4 // ep)}
    batch = tuple(t[:ep] for t in batch)  # one row per rank, as captured
    model.zero_grad()
    ref = model(*batch)
    ref.backward()

    def step(group):
        state = {n: t.detach().clone().requires_grad_(t.requires_grad)
                 for n, t in shard_state(base.state, result.specs, group.rank).items()}
        with expert_group_context(group):
            loss = program.run(state, *(t[group.rank:group.rank + 1] for t in batch))
        loss.backward()
        return loss.detach(), {n: t.grad for n, t in state.items() if t.grad is not None}

    out = run_emulated(ep, step)
    assert sum(loss for loss, _ in out) / ep == pytest.approx(ref.item(), rel=1e-6)
    for name, p in model.named_parameters():
        if name in result.specs:  # each rank's experts, their gradient from every rank's tokens
            grad = torch.cat([g[name] for _, g in out]) / ep
        else:  # dense: the data-parallel mean
            grad = sum(g[name] for _, g in out) / ep
        torch.testing.assert_close(grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_other_moe_forms_left_alone_and_refusals(grouped):
    from fxpipe.compiler.context import CompileContext
    from fxpipe.ir.parallel_config import ParallelConfig

    _, select, _ = _capture("select")  # one expert's matrix picked from the stack: no grouped matmul
    program = shard_experts(select, EPConfig(ep=2, dp=2))
    assert program.expert_parallel.layers == ()
    config = ParallelConfig(ep=2, dp=2)
    ctx = CompileContext.of(config)
    with pytest.raises(ValueError, match=r"ep=2 but no MoE in the model can be expert-parallel .* use ep=1"):
        expert_parallel_pass(select, ctx)
    with pytest.raises(ValueError, match=r"4 experts do not split over ep=3 ranks \(down_w, gate_up\): "
                                         r"choose ep among \[1, 2\]"):
        shard_experts(grouped[1], EPConfig(ep=3, dp=6))

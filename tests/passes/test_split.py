"""Stage construction: chaining the stage modules reproduces the full model exactly."""
import functools

import pytest
import torch

import fxpipe
from fxpipe.models import build_workload
from fxpipe.compiler.driver import run_passes
from fxpipe.passes.assign_stages import PartitionConfig, assign_stages
from fxpipe.schedules.inflight import stage_inflight
from fxpipe.passes.split import side_values, split_program
from fxpipe.runtime.stage_runner import StageRunner
from fxpipe.schedules.registry import generate
from tests._shared import FIVE_MODELS
from tests.passes._inplace_models import LOCAL_MODELS

M = 2  # microbatches


def _workload(name):
    if name in LOCAL_MODELS:
        return LOCAL_MODELS[name]()
    return build_workload(name, batch=4, seq=16, layers=4)


@functools.lru_cache(maxsize=None)
def _captured(name):
    """One capture per model for all the layouts below (cases copy the state they train)."""
    w = _workload(name)
    mbs = [tuple(t[i * 2:(i + 1) * 2] for t in w.example_inputs) for i in range(M)]
    prog, _ = run_passes(fxpipe.capture(w.model, mbs[0], w.loss_fn))
    return w, mbs, prog


@functools.lru_cache(maxsize=None)
def _eager(name):
    """The eager model's loss and gradients on the whole batch: one run per model for all
    the layouts (no case writes the model's parameters; the stages train copies)."""
    w, _, _ = _captured(name)
    w.model.zero_grad()
    ref = w.loss_fn(w.model(*w.example_inputs[:-1]), w.example_inputs[-1]) if w.loss_fn \
        else w.model(*w.example_inputs)
    ref.backward()
    return ref.item(), {n: param.grad.clone() for n, param in w.model.named_parameters()}


def _plan(name, p, v, method="ilp"):
    w, mbs, prog = _captured(name)
    sched = generate("interleaved" if v > 1 else "1f1b", p, M, v)
    cfg = PartitionConfig(num_stages=p * v, stage_to_rank=sched.stage_ranks,
                          inflight=stage_inflight(sched), method=method)
    return w, mbs, split_program(assign_stages(prog, cfg), num_stages=p * v)


def _fresh(state):
    return {k: t.detach().clone().requires_grad_(t.requires_grad) for k, t in state.items()}


# The zoo written outside transformers (fxpipe/models/zoo) and the local models with
# in-place masks, a dropless MoE and a buffer the forward writes.
ZOO = ["zoo:swa-gpt", "zoo:moe", "zoo:autocast", "zoo:complex-rope", "zoo:llama3"]


@pytest.mark.parametrize("name", FIVE_MODELS + ZOO + sorted(LOCAL_MODELS))
@pytest.mark.parametrize("p,v", [(1, 1), (2, 1), (4, 1), (2, 2)])
def test_chained_stages_equal_the_program_bit_for_bit(name, p, v):
    """Running the stage graphs in order on one process is the Program, exactly: same
    losses, same gradients, same buffer writes (fp32) — nothing a stage drops or adds."""
    w, mbs, plan = _plan(name, p, v)
    assert plan.num_stages == p * v
    assert all(s.num_nodes > 0 for s in plan.stages), "every stage computes something"
    state = _fresh(plan.program.state)
    runners = [StageRunner(plan, st, state, loss_scale=1 / M) for st in plan.stages]
    ref_state = _fresh(plan.program.state)
    losses, total = [], {}
    for mb in range(M):
        # Compared microbatch by microbatch: summing a tied weight's partial gradients
        # across microbatches in another order is rounding, not a difference of graphs.
        for t in (*state.values(), *ref_state.values()):
            t.grad = None
        sent = {}
        for r in runners:  # forward, stage by stage, through detached hand-offs
            sent.update(r.forward(mb, mbs[mb], sent))
        grads = {}
        for r in reversed(runners):
            for n, g in r.backward(mb, grads).items():
                grads[n] = grads[n] + g if n in grads else g
        losses.append(runners[-1].losses[mb])
        ref = plan.program.run(ref_state, *mbs[mb])
        (ref * (1 / M)).backward()
        assert losses[-1] == ref.item()
        for k, t in ref_state.items():
            if t.grad is not None:
                assert torch.equal(state[k].grad, t.grad), k
                total[k] = total[k] + t.grad if k in total else t.grad
            elif not t.requires_grad:
                assert torch.equal(state[k], t), f"buffer {k} written differently"
    # And the Program is the eager model (to rounding: the batch is cut into microbatches).
    eager_loss, eager_grads = _eager(name)
    assert sum(losses) / M == pytest.approx(eager_loss, rel=1e-6)
    for n, grad in eager_grads.items():
        torch.testing.assert_close(total[plan.canonical[n]], grad, rtol=1e-5, atol=1e-6)


def test_side_values_are_recomputed_not_sent():
    _, _, plan = _plan("hf:llama", 2, 1)
    side = side_values(plan.program)
    assert not set(plan.values) & side, "masks/positions/rotary never cross stages"
    # Rotary tables and the causal mask are rebuilt in both stages.
    for stage in plan.stages:
        assert any(n.name in side for n in stage.graph_module.graph.nodes if n.op == "call_function")


def test_tied_embedding_group_lists_both_ends():
    _, _, plan = _plan("gpt-tiny", 4, 1)
    assert plan.tied_stages == {"transformer.wte.weight": (0, 3)}
    first, last = plan.stages[0], plan.stages[-1]
    assert "transformer.wte.weight" in plan.stage_params(0)
    assert "transformer.wte.weight" in plan.stage_params(3)
    assert last.is_last and not first.is_last


def test_parameter_reused_across_stages_is_synced():
    """One Linear applied in the first and the last stage: both copies' gradients must be
    summed, like a tied embedding (regression: HF hrm_text reuses its blocks)."""
    _, _, plan = _plan("tests.runtime._shared_weights:workload", 2, 1)
    assert plan.tied_stages["shared.weight"] == (0, 1)
    assert plan.tied_stages["shared.bias"] == (0, 1)
    assert not any(n.startswith("layers.") for n in plan.tied_stages), "one-stage params stay local"


def test_loss_on_last_stage_only():
    _, _, plan = _plan("gpt-tiny", 2, 2)
    assert [s.is_last for s in plan.stages] == [False, False, False, True]


def test_unordered_assignment_is_rejected():
    w, mbs, plan = _plan("gpt-tiny", 2, 1)
    bad = {n: 1 - s for n, s in plan.program.stages.items()}
    with pytest.raises(ValueError, match="not ordered|loss must be"):
        split_program(plan.program, bad, 2)


@pytest.mark.parametrize("name", ["gpt-tiny", "hf:llama"])
def test_every_cut_inside_a_layer_runs_through_the_transport(name):
    """A cut may fall anywhere (measured costs move it inside attention). Received
    values arrive as fresh row-major buffers; the transport restores the producer's
    strides, because the consumer's graph may ``view`` an attention output whose
    layout follows its (sliced, transposed) inputs."""
    from datetime import timedelta

    from fxpipe.runtime.transport import Transport

    w = build_workload(name, batch=2, seq=16, layers=1)
    prog, _ = run_passes(fxpipe.capture(w.model, w.example_inputs, w.loss_fn))
    with torch.no_grad():
        expected = float(prog.run(prog.state, *w.example_inputs))
    side = side_values(prog)
    compute = [n.name for n in prog.graph.nodes if n.op == "call_function" and n.name not in side]
    transport = Transport(device=torch.device("cpu"), timeout=timedelta(seconds=1), value_ids={}, num_values=1)
    state = dict(prog.state)
    tried = 0
    for cut in range(1, len(compute), 1 if name == "gpt-tiny" else 3):  # every cut of one, a third of the other
        try:
            plan = split_program(prog, {n: int(i >= cut) for i, n in enumerate(compute)}, num_stages=2)
        except ValueError:
            continue  # e.g. a cut that would put the loss's inputs after it
        first, last = (StageRunner(plan, s, state) for s in plan.stages)
        sent = first.forward(0, w.example_inputs, {})
        arrived = {n: transport.finish(plan.values[n], t.contiguous()) for n, t in sent.items()}
        last.forward(0, w.example_inputs, arrived)
        assert last.losses[0] == pytest.approx(expected, rel=1e-6), f"cut before {compute[cut]}"
        tried += 1
    assert tried > 15

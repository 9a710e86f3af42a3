"""Coalescing after partitioning: neighbouring blocks on one stage become one slice,
matmul and loss share; blocks on other stages (or spread over two) stay; exact."""
import torch

from fxpipe.passes.coalesce_blocks import coalesce_blocks_pass
from fxpipe.passes.split import side_values, split_program
from fxpipe.passes.split_loss import blockwise_loss
import fxpipe.passes.split_matmul as split_matmul_module
from fxpipe.passes import lint_program
from fxpipe.passes.split_matmul import split_matmuls
from tests.passes._split_loss_cases import H, LOSSES, _batch, _loss_and_grads, _program

aten = torch.ops.aten
# Blocks 0-3 on stage 0, 5-7 and 9-11 on stage 1; blocks 4 and 8 have their matmul on
# stage 0 and their loss share on stage 1 (the running lse/pick only moves forward).
STAGE1 = {5, 6, 7, 9, 10, 11}
SPREAD = {4, 8}


def _assigned(monkeypatch):
    monkeypatch.setattr(split_matmul_module, "MAX_BLOCKS", 12)  # the layout below has 12 blocks
    program = _program(LOSSES["mean"][0])
    blocked = blockwise_loss(split_matmuls(program, 2))
    (split,), (loss,) = blocked.matmul_splits, blocked.loss_splits
    assert len(split.blocks) == 12
    side = side_values(blocked)
    # Everything before the head on stage 0, the combining ops after it on stage 1.
    stages = {n.name: 1 for n in blocked.graph.nodes if n.op == "call_function" and n.name not in side}
    for n in blocked.graph.nodes:
        if n.name == split.blocks[0].nodes[0]:
            break
        stages[n.name] = 0
    for i, (mb, lb) in enumerate(zip(split.blocks, loss.blocks)):
        for name in mb.nodes:
            stages[name] = int(i in STAGE1)
        for name in lb.nodes:
            stages[name] = int(i in STAGE1 or i in SPREAD)
    return program, blocked.replace(stages={n: s for n, s in stages.items() if n not in side})


def test_same_stage_neighbours_merge_exactly(monkeypatch):
    program, blocked = _assigned(monkeypatch)
    old = blocked.matmul_splits[0].blocks
    merged = coalesce_blocks_pass(blocked)
    lint_program(merged, after="coalesce_blocks")
    (split,), (loss,) = merged.matmul_splits, merged.loss_splits
    runs = [(0, 3), (4, 4), (5, 7), (8, 8), (9, 11)]
    assert [(b.start, b.end) for b in split.blocks] == [(old[i].start, old[j].end) for i, j in runs]
    assert [merged.stages[b.output] for b in split.blocks] == [0, 0, 1, 0, 1]
    assert [lb.logits for lb in loss.blocks] == [b.output for b in split.blocks]
    assert [merged.stages[lb.acc] for lb in loss.blocks] == [0, 1, 1, 1, 1]  # spread blocks kept
    # One weight slice per run: what each stage's backward pays for the head.
    slices = [n for n in merged.graph.nodes if n.target is aten.slice.Tensor and n.args[0].op == "placeholder"
              and n.args[0].meta["val"].shape[0] == old[-1].end]
    assert len(slices) == len(runs)
    # One loss share (one log_softmax) per merged block; loss and gradients are unchanged.
    assert sum(n.target is aten._log_softmax.default for n in merged.graph.nodes) == len(runs)
    batch = _batch()
    loss0, g0 = _loss_and_grads(program, batch)
    loss1, g1 = _loss_and_grads(merged, batch)
    torch.testing.assert_close(loss1, loss0, rtol=1e-6, atol=1e-6)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-5, atol=1e-6 * float(g0[n].abs().max()), msg=n)
    plan = split_program(merged, dict(merged.stages), num_stages=2)
    assert len(plan.stages) == 2
    # Between the stages travel the hidden state and the running (2, tokens) lse and
    # pick; logits only for the block whose loss share was put on the other stage.
    wide = {v.name for v in plan.values.values() if len(v.spec.shape) and v.spec.shape[-1] > H}
    assert wide == {split.blocks[1].output, split.blocks[3].output}
    accs = {lb.acc for lb in loss.blocks}
    assert {v.name for v in plan.values.values() if v.name in accs} == {loss.blocks[0].acc}


def test_nothing_to_merge_returns_the_program():
    program = _program(LOSSES["mean"][0])
    blocked = blockwise_loss(split_matmuls(program, 2))
    side = side_values(blocked)
    split = blocked.matmul_splits[0]
    alternate = {n.name: 1 for n in blocked.graph.nodes if n.op == "call_function" and n.name not in side}
    for n in blocked.graph.nodes:
        if n.name == split.blocks[0].nodes[0]:
            break
        alternate[n.name] = 0
    for i, b in enumerate(split.blocks):
        for name in b.nodes:
            alternate[name] = i % 2
    # (every loss share on stage 1: the running lse/pick only moves forward)
    out = blocked.replace(stages=alternate)
    assert coalesce_blocks_pass(out) is out


def test_measured_costs_time_a_splits_blocks_together():
    """A measured profile times all blocks of a split in one probe group, coalesced as
    they will run (one weight-slice backward, not one per block)."""
    from fxpipe.costs import measured_profile, probe_groups
    from fxpipe.passes.assign_stages import PartitionConfig

    program = _program(LOSSES["mean"][0])
    blocked = blockwise_loss(split_matmuls(program, 2))
    config = PartitionConfig(num_stages=2, stage_to_rank=(0, 1), inflight=(2, 1))
    _, probe = probe_groups(blocked, config)
    split, loss = blocked.matmul_splits[0], blocked.loss_splits[0]
    block_nodes = [n for b in split.blocks for n in b.nodes] + [n for b in loss.blocks for n in b.nodes]
    assert len({probe.group_of[n] for n in block_nodes if n in probe.group_of}) == 1
    state = {n: t.detach().clone().requires_grad_(t.requires_grad) for n, t in blocked.state.items()}
    profile, _, _ = measured_profile(blocked, config, "measure", device=torch.device("cpu"),
                                     state_for=lambda names: {n: state[n] for n in names},
                                     batch=_batch(), repeats=1, use_cache=False)
    assert len(profile.groups) == len(probe.members)


def test_blocks_joined_by_a_cat_merge_exactly():
    """A loss the blockwise rewrite leaves alone (label smoothing): the cat of the blocks
    takes the merged pieces."""
    import torch.nn.functional as F

    from tests.passes._split_loss_cases import V, _shifted

    program = _program(lambda out, y: F.cross_entropy(*_shifted(out, y), label_smoothing=0.1))
    split = split_matmuls(program, 2)
    (s,) = split.matmul_splits
    side = side_values(split)
    stages = {n.name: 1 for n in split.graph.nodes if n.op == "call_function" and n.name not in side}
    for n in split.graph.nodes:
        if n.name == s.blocks[0].nodes[0]:
            break
        stages[n.name] = 0
    for i, b in enumerate(s.blocks):
        stages.update((name, int(i >= len(s.blocks) // 2)) for name in b.nodes)
    merged = coalesce_blocks_pass(split.replace(stages={n: k for n, k in stages.items() if n not in side}))
    (m,) = merged.matmul_splits
    assert [(b.start, b.end, merged.stages[b.output]) for b in m.blocks] == \
        [(0, s.blocks[len(s.blocks) // 2].start, 0), (s.blocks[len(s.blocks) // 2].start, V, 1)]
    (cat,) = [n for n in merged.graph.nodes if n.target is aten.cat.default]
    assert [a.name for a in cat.args[0]] == [b.output for b in m.blocks]
    batch = _batch()
    loss0, g0 = _loss_and_grads(program, batch)
    loss1, g1 = _loss_and_grads(merged, batch)
    torch.testing.assert_close(loss1, loss0, rtol=1e-6, atol=1e-6)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-5, atol=1e-6 * float(g0[n].abs().max()), msg=n)

"""The LM head cut off the last stage for the vocabulary passes (passes/vocab_head.py).

In process: the compiled plan of the tied wide-vocabulary model at pp=2, and the
one-line refusals. Loss and gradients equal to one process are checked in the
equivalence worlds (tests/runtime/test_equivalence.py), the checkpoint of the blocks in
tests/checkpoint/test_checkpoint.py.
"""
import math

import pytest
import torch
import torch.nn as nn

from fxpipe.compiler.pipeline import compile_pipeline
from fxpipe.ir.parallel_config import ParallelConfig
from fxpipe.ir.program import ParamKind
from fxpipe.schedules.actions import ActionKind
from tests.runtime import _wide_vocab

aten = torch.ops.aten


@pytest.fixture(scope="module")
def compiled():
    model, batch, loss_fn = _wide_vocab.workload_tied()
    config = ParallelConfig(pp=2, microbatches=2, costs="model", vocab_passes=True).with_world(2)
    return compile_pipeline(model, tuple(t[:2] for t in batch), config, loss_fn=loss_fn)


def test_head_is_cut_off_the_last_stage(compiled):
    plan = compiled.plan
    head = plan.vocab_head
    v = _wide_vocab.VOCAB
    assert head.weight == "transformer.wte.weight" and head.blocks == ((0, v // 2), (v // 2, v))
    last = plan.stages[-1]
    # No stage computes logits or a cross-entropy any more; the last stage returns the
    # head's input and the class indices, which no stage consumes.
    for st in plan.stages:
        targets = {n.target for n in st.graph_module.graph.nodes}
        assert not targets & {aten.linear.default, aten.cross_entropy_loss.default}, st.index
    assert last.outputs[-2:] == (head.hidden, head.target)
    assert plan.values[head.hidden].spec.shape[-1] == _wide_vocab.WIDTH
    assert plan.values[head.target].spec.dtype == torch.int64
    assert not plan.values[head.hidden].consumers
    # The partition balanced the stages without the head (PartitionConfig.elsewhere): the
    # last stage runs layers too, not only the head as without vocabulary passes.
    assert last.params and head.weight not in {plan.canonical[p] for p in last.params}
    # Rank r owns block r of the tied table; the first stage reads the owners' lookup.
    assert plan.row_shards[head.weight].ranks == (((0, v // 2),), ((v // 2, v),))
    assert [lk.table for lk in plan.lookups] == [head.weight]
    assert head.weight not in plan.tied_stages
    for r in range(2):
        assert head.weight in plan.rank_params(r, compiled.schedule.stages_of_rank(r))
    # The schedule lists the five vocabulary actions per microbatch on every rank.
    kinds = (ActionKind.BCAST_H, ActionKind.S, ActionKind.ALLREDUCE_S, ActionKind.T, ActionKind.REDUCE_G)
    for actions in compiled.actions.actions:
        assert sorted((a.kind.value, a.microbatch) for a in actions if a.kind in kinds) == \
            sorted((k.value, j) for k in kinds for j in range(2))


def test_head_under_tensor_parallelism_is_cut_into_blocks_of_each_tp_shard():
    """tp=2 × pp=2, a vocabulary tp does not divide: the vocabulary-parallel cross-entropy
    and lookup leave the stages, rank r owns block r of each TP rank's padded rows, and
    the class count (for the padding rows' mask) is the model's."""
    from fxpipe.passes.logit_chain import match_loss
    from fxpipe.tp.ops import OPS

    from tests.runtime._reuse_capture import captures_reused

    model, batch, loss_fn = _wide_vocab.workload_tied_odd()
    config = ParallelConfig(pp=2, tp=2, microbatches=2, costs="model", vocab_passes=True).with_world(4)
    with captures_reused():  # both compiles capture this one model: the second copies the first's graph
        compiled = compile_pipeline(model, tuple(t[:2] for t in batch), config, loss_fn=loss_fn)
        # The blockwise loss (split_loss) does not take the TP loss: only the passes opt in.
        tp_program = compile_pipeline(model, tuple(t[:2] for t in batch), config, loss_fn=loss_fn,
                                      until="tensor_parallel").program
    plan, v = compiled.plan, _wide_vocab.VOCAB - 3
    local = -(-v // 2)  # each TP rank's rows, padding included
    head = plan.vocab_head
    assert head.vocab_size == v and head.blocks == ((0, local // 2), (local // 2, local))
    assert plan.row_shards[head.weight].ranks == tuple(((a, b),) for a, b in head.blocks)
    assert [(lk.table, lk.vocab_parallel) for lk in plan.lookups] == [(head.weight, True)]
    gone = {OPS.vocab_parallel_cross_entropy.default, OPS.vocab_parallel_embedding.default, aten.linear.default}
    for st in plan.stages:
        assert not {n.target for n in st.graph_module.graph.nodes} & gone, st.index
    logits = next(n for n in tp_program.graph.nodes if n.target is OPS.vocab_parallel_cross_entropy.default)
    head_linear = [n for n in tp_program.graph.nodes if n.target is aten.linear.default][-1]
    assert match_loss(head_linear) is None and match_loss(head_linear, vocab_parallel=True).loss is logits


@pytest.mark.parametrize("layout, message", [
    (dict(pp=1), "pp=1"),
    (dict(pp=2, split_loss=True), "split_loss=True"),
])
def test_config_refuses_what_it_cannot_run(layout, message):
    with pytest.raises(ValueError, match=f"vocab_passes=True with {message}"):
        ParallelConfig(microbatches=2, vocab_passes=True, **layout)


class _Regression(nn.Module):
    """No vocabulary: a linear layer under a mean-squared error."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 1, bias=False)

    def forward(self, x, y):
        return nn.functional.mse_loss(self.b(torch.relu(self.a(x))).squeeze(-1), y)


def test_model_without_a_head_is_refused():
    torch.manual_seed(0)
    config = ParallelConfig(pp=2, microbatches=2, costs="model", vocab_passes=True).with_world(2)
    with pytest.raises(ValueError, match="vocab_passes=True: no LM head found on the last stage"):
        compile_pipeline(_Regression(), (torch.randn(4, 8), torch.randn(4)), config)


def test_partition_memory_counts_the_rows_each_rank_holds(compiled):
    # Under vocabulary passes every rank holds one block of the tied table's rows, so the
    # partition's per-rank parameter state (rank memory less its in-flight activations)
    # is 4 x the bytes of the tensors the rank really holds, at their local shapes; it
    # used to charge the whole table to the stage of the lookup and none to the others.
    plan, result = compiled.plan, compiled.plan.program.partition
    program = plan.program
    trainable = {p.canonical: p for p in program.params if p.kind is ParamKind.PARAMETER and p.requires_grad}
    for r in range(2):
        specs = compiled.rank_specs(r)
        held = [n for n in plan.rank_params(r, compiled.schedule.stages_of_rank(r)) if n in trainable]
        real = sum(math.prod(specs[n].local_shape if n in specs else trainable[n].shape) *
                   trainable[n].dtype.itemsize for n in held)
        acts = sum(c.inflight * c.act_bytes for c in result.stages if c.rank == r)
        assert result.rank_memory_bytes[r] - acts == 4 * real, r

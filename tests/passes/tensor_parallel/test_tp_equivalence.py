"""All TP ranks' graphs, run in threads with emulated collectives, reproduce the
unsharded graph's loss and gradients (fp32, dropout 0): the independent reference
is the captured, unsharded program itself."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpipe
from fxpipe.models.gpt import GPT, GPTConfig
from fxpipe.passes import canonicalize_pass
from fxpipe.passes.tensor_parallel import ShardKind, TPConfig, shard_state, tensor_parallel_pass
from fxpipe.tp import DropoutRNG, run_emulated, tp_group_context
from fxpipe.tp.ops import OPS
from tests._shared import FIVE_MODELS
from tests.passes.tensor_parallel._tp_helpers import compile_tp
from tests.passes.tensor_parallel._tp_helpers import check_tp
from tests.passes.tensor_parallel._tp_models import _GQAAttention


CASES = [(m, tp, False) for m in FIVE_MODELS for tp in (2, 4)] + [
    ("gpt-tiny", 2, True), ("hf:llama", 2, True)]


@pytest.mark.parametrize("name,tp,sp", CASES, ids=[f"{m}-tp{t}{'-sp' if s else ''}" for m, t, s in CASES])
def test_tp_matches_unsharded(name, tp, sp):
    base, program, batch = compile_tp(name, tp, sp)
    result = program.tensor_parallel
    assert result.sharded(), "something must be sharded"
    check_tp(base, program, batch, tp)


def _program(model: nn.Module, batch, loss_fn=None):
    return canonicalize_pass(fxpipe.capture(model, batch, loss_fn))


def test_padded_vocabulary_never_wins():
    """V=250 over tp=4: padded to 252, the tied embedding/head stays one spec."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=250, block_size=16, n_layer=1, n_head=4, n_embd=32))
    x = torch.randint(0, 250, (2, 17))
    base = _program(model, (x[:, :-1], x[:, 1:]))
    program = tensor_parallel_pass(base, TPConfig(tp=4))
    result = program.tensor_parallel
    assert (result.vocab_size, result.padded_vocab) == (250, 252)
    (spec,) = [s for s in result.specs.values() if s.kind is ShardKind.VOCAB]
    assert set(spec.members) == {"transformer.wte.weight", "lm_head.weight"}
    assert spec.local_shape == (63, 32) and spec.padding(3) == 2
    check_tp(base, program, (x[:, :-1], x[:, 1:]), 4)


def test_gqa_inside_the_kernel_splits_kv_heads():
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (2, 8))
    base = _program(_GQAAttention(), (ids, ids), lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten()))
    program = tensor_parallel_pass(base, TPConfig(tp=2))
    result = program.tensor_parallel
    assert result.kind_of("kv_proj.weight") is ShardKind.COLUMN
    # k and v of one head group are rows (0:8) and (16:24) of the fused kv projection.
    assert result.specs["kv_proj.weight"].ranges[0] == ((0, 8), (16, 24))
    check_tp(base, program, (ids, ids), 2)


@pytest.mark.parametrize("sp", [False, True])
def test_dropout_replicas_stay_identical(sp):
    """Replicated activations draw the same mask on every rank; sequence shards
    (sp) draw their own (Megatron's RNG tracker)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16, dropout=0.5))
    for m in model.modules():  # attention dropout runs inside the fused kernel: keep it off
        if isinstance(getattr(m, "dropout", None), float):
            m.dropout = 0.0
    x = torch.randint(0, 64, (2, 17))
    batch = (x[:, :-1], x[:, 1:])
    program = tensor_parallel_pass(_program(model, batch), TPConfig(tp=2, sp=sp))
    specs = program.tensor_parallel.specs
    drops = [n for n in program.graph.nodes if n.target is OPS.dropout.default]
    assert len(drops) == 3 and all(n.args[2] is sp for n in drops)

    class Record(torch.fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if n in drops:
                self.seen[n.name] = out.detach()
            return out

    def step(group):
        rec = Record(program.graph_module)
        rec.seen = {}
        state = shard_state(program.state, specs, group.rank)
        with tp_group_context(group, DropoutRNG(seed=7, tp_rank=group.rank)):
            rec.run(*[state[p.canonical] for p in program.params], *batch)
        return rec.seen

    r0, r1 = run_emulated(2, step)
    for name in r0:
        assert 0.3 < (r0[name] == 0).float().mean() < 0.7, "the mask is applied"
        assert torch.equal(r0[name], r1[name]) is (not sp), name

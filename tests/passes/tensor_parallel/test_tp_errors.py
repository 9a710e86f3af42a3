"""Bad input: numbers that do not divide are user errors naming the layer, the
numbers and a fix; a projection whose role is unclear stays replicated and is listed."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpipe
from fxpipe.passes import canonicalize_pass
from fxpipe.passes.tensor_parallel import ShardKind, TPConfig, tensor_parallel_pass
from fxpipe.tp import run_emulated, tp_group_context
from fxpipe.tp.ops import OPS
from tests.passes.tensor_parallel._tp_helpers import captured
from tests.passes.tensor_parallel._tp_models import _GQAAttention


def _loss(out, target):
    return F.cross_entropy(out.flatten(0, 1), target.flatten())


class _Block(nn.Module):
    def __init__(self, h: int, ffn: int, softmax: bool) -> None:
        super().__init__()
        self.up = nn.Linear(h, ffn)
        self.down = nn.Linear(ffn, h)
        self.mix = nn.Linear(h, h)  # feeds a norm (or a softmax): no row-parallel partner
        self.norm = nn.LayerNorm(h)
        self.softmax = softmax

    def forward(self, x):
        x = x + self.down(F.gelu(self.up(x)))
        return self.norm(self.mix(x).softmax(-1) if self.softmax else self.mix(x))


class _MLPModel(nn.Module):
    def __init__(self, h: int = 8, ffn: int = 6, softmax: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, h)
        self.blocks = nn.ModuleList([_Block(h, ffn, softmax)])
        self.head = nn.Linear(h, 16)

    def forward(self, ids):
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _program(model, ids):
    return canonicalize_pass(fxpipe.capture(model, (ids, ids), _loss))


def test_heads_not_divisible():
    base, _ = captured("gpt-tiny")
    with pytest.raises(ValueError, match=r"layer 0 \(transformer\.h\.0\.attn\.c_proj\).*4 attention "
                                         r"heads.*tp=3.*choose tp dividing 4: \[1, 2, 4\]"):
        tensor_parallel_pass(base, TPConfig(tp=3))


def test_ffn_not_divisible():
    ids = torch.randint(0, 16, (2, 4))
    with pytest.raises(ValueError, match=r"layer 0 \(blocks\.0\.down\).*FFN of size 6.*tp=4.*"
                                         r"choose tp dividing 6"):
        tensor_parallel_pass(_program(_MLPModel(), ids), TPConfig(tp=4))


def test_kv_heads_that_must_be_split():
    ids = torch.randint(0, 64, (2, 8))
    base = canonicalize_pass(fxpipe.capture(_GQAAttention(), (ids, ids), _loss))
    with pytest.raises(ValueError, match=r"2 key/value heads must be split over tp=4"):
        tensor_parallel_pass(base, TPConfig(tp=4))


def test_sequence_not_divisible():
    base, _ = captured("gpt-tiny", seq=15)
    with pytest.raises(ValueError, match=r"sequence length 15.*tp=2"):
        tensor_parallel_pass(base, TPConfig(tp=2, sp=True))


def test_unclear_projection_stays_replicated_with_reason():
    ids = torch.randint(0, 16, (2, 4))
    program = tensor_parallel_pass(_program(_MLPModel(ffn=8, softmax=True), ids), TPConfig(tp=2))
    result = program.tensor_parallel
    assert result.kind_of("blocks.0.up.weight") is ShardKind.COLUMN
    spec = result.specs["blocks.0.mix.weight"]
    assert spec.kind is ShardKind.REPLICATED
    assert "blocks.0.mix" in spec.reason and "softmax" in spec.reason


def test_projection_only_a_norm_reads_is_split_with_its_output_gathered():
    ids = torch.randint(0, 16, (2, 4))
    result = tensor_parallel_pass(_program(_MLPModel(ffn=8), ids), TPConfig(tp=2)).tensor_parallel
    assert result.kind_of("blocks.0.mix.weight") is ShardKind.COLUMN
    assert result.specs["blocks.0.mix.weight"].local_shape == (4, 8)


@pytest.mark.parametrize("kwargs", [dict(tp=0), dict(tp=1, sp=True), dict(tp=2.0)])
def test_config_checked(kwargs):
    with pytest.raises(ValueError):
        TPConfig(**kwargs)


def test_graph_outside_a_group_context():
    _, batch = captured("gpt-tiny")
    program = tensor_parallel_pass(captured("gpt-tiny")[0], TPConfig(tp=2))
    with pytest.raises(RuntimeError, match="tp_group_context"):
        from fxpipe.passes.tensor_parallel import shard_state
        program.run(shard_state(program.state, program.tensor_parallel.specs, 0), *batch)


def test_group_of_the_wrong_size():
    def step(group):
        with tp_group_context(group):
            return OPS.scatter(torch.ones(4), 0, 2)

    with pytest.raises(RuntimeError, match="compiled for tp=2.*size 4"):
        run_emulated(4, step)

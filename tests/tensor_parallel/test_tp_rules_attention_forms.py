"""Attention whose heads share a dim with something else (fxpipe/passes/tensor_parallel/
attention_forms.py): heads merged with the batch for ``baddbmm`` with a per-head ALiBi
bias (Bloom), fused QKV rows picked by a constant index (Falcon), a multi-query fused
QKV (GPT-BigCode). Each sharded, every rank's loss and gradients equal to one process
at tp=2 and 4 (fp32, emulated collectives: the unsharded captured program is the
reference)."""
import math

import pytest
import torch
import torch.nn as nn

import fxpipe
from fxpipe.passes import canonicalize_pass
from fxpipe.passes.tensor_parallel import ShardKind, TPConfig, tensor_parallel_pass
from tests.tensor_parallel.test_tp_equivalence import _check
from tests.tensor_parallel.test_tp_rules import _LM, D, H, HEADS, T, V

_CAUSAL = torch.full((T, T), float("-inf")).triu(1)


class AlibiBatchMergedHeads(_LM):
    """Bloom's attention: fused QKV in a (B, T, nh, 3, hd) layout, q/k/v viewed as
    (B·nh, T, hd), scores by ``baddbmm`` onto an ALiBi bias built per head from slopes
    and repeated over the batch, probabilities times v by ``bmm``."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(H, 3 * H)

    def attend(self, x):
        B = x.shape[0]
        fused = self.qkv(x).view(B, T, HEADS, 3, D)
        q, k, v = (fused.select(3, i).transpose(1, 2).reshape(B * HEADS, T, D) for i in range(3))
        slopes = 2.0 ** (-8.0 * torch.arange(1, HEADS + 1) / HEADS)  # one per head
        alibi = (slopes[:, None, None] * torch.arange(T)).repeat(B, 1, 1)  # (B·nh, 1, T)
        scores = torch.baddbmm(alibi, q, k.transpose(1, 2), beta=1.0, alpha=1 / math.sqrt(D))
        probs = (scores.view(B, HEADS, T, T) + _CAUSAL).softmax(-1)
        return torch.bmm(probs.view(B * HEADS, T, T), v).view(B, HEADS, T, D)


MODELS = {"alibi-batch-merged-heads": AlibiBatchMergedHeads}
CASES = [(m, tp) for m in MODELS for tp in (2, 4)]


@pytest.fixture(scope="module")
def programs():
    torch.manual_seed(0)
    ids = torch.randint(0, V, (2, T))
    batch = (ids, ids.roll(-1, 1))
    return {name: (canonicalize_pass(fxpipe.capture(cls(), batch)), batch) for name, cls in MODELS.items()}


@pytest.mark.parametrize("name,tp", CASES, ids=[f"{m}-tp{t}" for m, t in CASES])
def test_attention_forms_shard_and_match(programs, name, tp):
    base, batch = programs[name]
    program = tensor_parallel_pass(base, TPConfig(tp=tp))
    result = program.tensor_parallel
    assert not result.coverage.whole, result.coverage.describe()
    assert result.kind_of("o.weight") is ShardKind.ROW and result.kind_of("down.weight") is ShardKind.ROW
    _check(base, program, batch, tp)

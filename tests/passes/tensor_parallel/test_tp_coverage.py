"""Never silent: the pass measures what it left whole and this rank's parameter share;
``strict_tp`` turns weight matrices left whole into an error naming the same facts."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpipe
from fxpipe.compiler.pipeline import compile_pipeline
from fxpipe.passes import canonicalize_pass
from fxpipe.passes.tensor_parallel import TPConfig, tensor_parallel_pass
from tests.passes.tensor_parallel._tp_helpers import compile_tp


class _Cumsum(nn.Module):
    """An MLP whose hidden channels are mixed by an op the pass has no rule for."""

    def __init__(self, h=16, f=32, v=64):
        super().__init__()
        self.emb, self.up, self.down, self.head = nn.Embedding(v, h), nn.Linear(h, f), nn.Linear(f, h), \
            nn.Linear(h, v)

    def forward(self, ids, targets):
        x = self.emb(ids)
        x = x + self.down(torch.cumsum(self.up(x), dim=-1))
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def _batch():
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (2, 8))
    return ids, ids.roll(1, 1)


def test_a_full_shard_holds_about_one_over_tp():
    _, program, _ = compile_tp("hf:llama", 2)
    coverage = program.tensor_parallel.coverage
    assert coverage.complete
    # Only norms (replicated by design) lift the share above 1/2.
    assert 0.5 <= coverage.share < 0.51


def test_whole_matrices_are_counted_and_named():
    program = canonicalize_pass(fxpipe.capture(_Cumsum(), _batch()))
    coverage = tensor_parallel_pass(program, TPConfig(tp=2)).tensor_parallel.coverage
    # down/head still pair up (column/row) behind the cumsum; up and its bias stay whole.
    assert [(name, n) for name, n, _ in coverage.whole] == [("up.weight", 16 * 32)]
    total = sum(p.numel for p in program.trainable())
    halved = 64 * 16 + 16 * 32 + 16 + 64 * 16  # emb (vocab), down + bias (column), head (row)
    assert coverage.parameters == total and coverage.local_parameters == total - halved // 2
    line = coverage.describe()
    assert "left 1 weight matrix (512 parameters) whole" in line, line
    assert f"holds {coverage.share:.2f}" in line and "ideal 0.50" in line and "cumsum" in line


def test_strict_tp_refuses_with_the_same_facts():
    with pytest.raises(ValueError, match=r"strict_tp: .*left 1 weight matrix.*cumsum"):
        compile_pipeline(_Cumsum(), _batch(), fxpipe.ParallelConfig(tp=2, strict_tp=True, costs="model"))

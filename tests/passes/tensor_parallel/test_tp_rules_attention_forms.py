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

from fxpipe.passes.tensor_parallel import ShardKind, TPConfig, tensor_parallel_pass
from tests.passes.tensor_parallel._tp_helpers import capture_models
from tests.passes.tensor_parallel._tp_helpers import check_tp
from tests.passes.tensor_parallel._tp_models import _LM, D, H, HEADS, T, V

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


class MultiQueryIndexPick(_LM):
    """Falcon's multi-query attention: one fused weight used as ``x @ W.T`` and viewed as
    (B, T, nh + 2, hd); the query heads by a slice, the one key and one value row by
    constant indices (``[-2]``, ``[-1]``: lifted index tensors), SDPA broadcasting them
    over the heads."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Parameter(torch.randn(H + 2 * D, H) / math.sqrt(H))

    def attend(self, x):
        B = x.shape[0]
        fused = (x @ self.qkv.T).view(B, T, HEADS + 2, D)
        q, k, v = fused[:, :, :-2], fused[:, :, [-2]], fused[:, :, [-1]]
        return nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)


class InterleavedIndexPick(_LM):
    """Per-head interleaved fused QKV rows [q0 k0 v0 q1 k1 v1 ...] picked by constant
    index lists (every third row): each rank's picked rows are its own heads', evenly
    spaced in its shard, read as one strided local slice."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(H, 3 * H)

    def attend(self, x):
        B = x.shape[0]
        fused = self.qkv(x).view(B, T, 3 * HEADS, D)
        q, k, v = (fused[:, :, [3 * h + j for h in range(HEADS)]].transpose(1, 2) for j in range(3))
        return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


class MultiQuerySplit(_LM):
    """GPT-BigCode's multi-query attention: ``c_attn`` gives [q of every head | k | v] with
    one key/value head shared by all; the query part is split by heads, the shared part
    computed a block per rank and all-gathered; k/v expanded to every head."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(H, H + 2 * D)

    def attend(self, x):
        B = x.shape[0]
        q, k, v = self.qkv(x).split([H, D, D], dim=-1)
        q = q.view(B, T, HEADS, D).transpose(1, 2)
        k, v = (t.unsqueeze(1).expand(B, HEADS, T, D) for t in (k, v))
        return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


class NormedProjections(MultiQuerySplit):
    """ELECTRA's and RemBERT's shape: a small embedding, normed, projected up to the
    hidden size (the projection writes the residual stream: a LayerNorm reads all its
    channels), and a BERT head transform (dense, gelu, LayerNorm) before the LM head.
    Both split by output rows, their outputs all-gathered."""

    E = 16

    def __init__(self):
        super().__init__()
        self.emb, self.emb_norm = nn.Embedding(V, self.E), nn.LayerNorm(self.E)
        self.project = nn.Linear(self.E, H)
        self.transform, self.head_norm = nn.Linear(H, self.E), nn.LayerNorm(self.E)
        self.head = nn.Linear(self.E, V, bias=False)

    def forward(self, ids, targets):
        x = self.project(self.emb_norm(self.emb(ids)))
        B = x.shape[0]
        x = x + self.o(self.attend(self.ln1(x)).transpose(1, 2).reshape(B, T, H))
        x = x + self.down(nn.functional.gelu(self.up(self.ln2(x))))
        x = self.head_norm(nn.functional.gelu(self.transform(x)))
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


MODELS = {"alibi-batch-merged-heads": AlibiBatchMergedHeads, "multi-query-index-pick": MultiQueryIndexPick,
          "interleaved-index-pick": InterleavedIndexPick, "multi-query-split": MultiQuerySplit,
          "normed-projections": NormedProjections}
CASES = [(m, tp, False) for m in MODELS for tp in (2, 4)] + [
    (m, 2, True) for m in ("multi-query-split", "normed-projections")]


@pytest.fixture(scope="module")
def programs():
    return capture_models(MODELS, V, T)


@pytest.mark.parametrize("name,tp,sp", CASES, ids=[f"{m}-tp{t}{'-sp' if s else ''}" for m, t, s in CASES])
def test_attention_forms_shard_and_match(programs, name, tp, sp):
    base, batch = programs[name]
    program = tensor_parallel_pass(base, TPConfig(tp=tp, sp=sp))
    result = program.tensor_parallel
    assert not result.coverage.whole, result.coverage.describe()
    assert result.kind_of("o.weight") is ShardKind.ROW and result.kind_of("down.weight") is ShardKind.ROW
    check_tp(base, program, batch, tp)


@pytest.mark.parametrize("name", ["multi-query-index-pick", "multi-query-split"])
def test_multi_query_shared_rows_a_block_per_rank(programs, name):
    """The fused weight holds this rank's query heads and 1/tp of the shared k/v rows
    (disjoint over ranks: each row's gradient whole on its one holder); one all-gather
    of those (B, T, 2·hd/tp) channels per layer makes k and v whole."""
    base, _ = programs[name]
    program = tensor_parallel_pass(base, TPConfig(tp=2))
    spec = program.tensor_parallel.specs["qkv.weight" if name == "multi-query-split" else "qkv"]
    assert spec.kind is ShardKind.COLUMN and spec.local_shape == (H // 2 + D, H)
    assert spec.indices(0) == [*range(H // 2), *range(H, H + D)]
    assert spec.indices(1) == [*range(H // 2, H), *range(H + D, H + 2 * D)]
    gathers = [s for s in program.tensor_parallel.collectives if s.purpose.startswith("channels every rank")]
    assert len(gathers) == 1


def test_projections_a_norm_reads_whole_gather_their_output(programs):
    """Each rank holds E/tp (H/tp) rows of the projection, and one all-gather per
    projection makes its output whole (ColumnParallelLinear with gather_output)."""
    base, _ = programs["normed-projections"]
    result = tensor_parallel_pass(base, TPConfig(tp=2)).tensor_parallel
    E = NormedProjections.E
    assert result.specs["project.weight"].local_shape == (H // 2, E)
    assert result.specs["transform.weight"].local_shape == (E // 2, H)
    gathered = {s.purpose for s in result.collectives if s.purpose.startswith("channels every rank")}
    assert len(gathered) == 3  # project, transform, and the shared k/v of c_attn

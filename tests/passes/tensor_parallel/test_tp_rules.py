"""Attention and projections written the many ways real models write them: each rule
class sharded, and every rank's loss and gradients equal to one process at tp=2 and 4
(fp32, emulated collectives: the unsharded captured program is the reference)."""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpipe
from fxpipe.passes import canonicalize_pass
from fxpipe.passes.tensor_parallel import ShardKind, TPConfig, tensor_parallel_pass
from tests.passes.tensor_parallel._tp_helpers import capture_models
from tests.passes.tensor_parallel._tp_helpers import check_tp
from tests.passes.tensor_parallel._tp_models import D, ExpertModules, H, HEADS, T, V, _LM, _RMSNorm


def _interleaved_rotary(x):  # (B, nh, T, hd): GPT-J's rotate_every_two, pairs (0,1), (2,3), ...
    pos = torch.arange(x.shape[-2], dtype=x.dtype)[:, None]
    freq = 1.0 / 10000 ** (torch.arange(0, x.shape[-1], 2, dtype=x.dtype) / x.shape[-1])
    sin = torch.repeat_interleave(torch.sin(pos * freq), 2, dim=-1)
    cos = torch.repeat_interleave(torch.cos(pos * freq), 2, dim=-1)
    rotated = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    return x * cos + rotated * sin


class EinsumAttention(_LM):
    """Separate q/k/v, interleaved (stack) rotary, attention as einsum (bmm in ATen)."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(H, H), nn.Linear(H, H), nn.Linear(H, H)

    def attend(self, x):
        B = x.shape[0]
        q, k, v = (p(x).view(B, T, HEADS, D).transpose(1, 2) for p in (self.q, self.k, self.v))
        q, k = _interleaved_rotary(q), _interleaved_rotary(k)
        scores = torch.einsum("bhtd,bhsd->bhts", q, k) / math.sqrt(D)
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        return torch.einsum("bhts,bhsd->bhtd", scores.softmax(-1), v)


class FusedSelectMatmul(_LM):
    """Fused QKV weight used as ``x @ W.T`` (Falcon), q/k/v picked by ``select`` from a
    (B, T, nh, 3, hd) layout (Persimmon), attention as matmul with a tanh softcap (Gemma 2)."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Parameter(torch.randn(3 * H, H) / math.sqrt(H))

    def attend(self, x):
        B = x.shape[0]
        fused = (x @ self.qkv.T).view(B, T, HEADS, 3, D)
        q, k, v = (fused.select(3, i).transpose(1, 2) for i in range(3))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(D)
        scores = 5.0 * torch.tanh(scores / 5.0)
        scores = scores + torch.full((T, T), float("-inf")).triu(1)
        return torch.matmul(scores.softmax(-1).type_as(v), v)


class QKNormAllHeads(_LM):
    """OLMo 2: RMSNorm over the queries (and keys) of all heads at once, before the
    head split; grouped-query attention (2 kv heads), SDPA."""

    def __init__(self):
        super().__init__()
        self.q, self.kv = nn.Linear(H, H), nn.Linear(H, 2 * 2 * D)
        self.q_norm, self.k_norm = _RMSNorm(H), _RMSNorm(2 * D)

    def attend(self, x):
        B = x.shape[0]
        k, v = self.kv(x).split(2 * D, dim=-1)
        q, k = self.q_norm(self.q(x)), self.k_norm(k)
        q = q.view(B, T, HEADS, D).transpose(1, 2)
        k, v = (t.view(B, T, 2, D).transpose(1, 2)[:, :, None].expand(B, 2, 2, T, D).reshape(B, HEADS, T, D)
                for t in (k, v))  # Hugging Face's repeat_kv
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


MODELS = {"einsum-attention": EinsumAttention, "fused-select-matmul": FusedSelectMatmul,
          "qk-norm-all-heads": QKNormAllHeads}
CASES = [(m, tp, False) for m in MODELS for tp in (2, 4)] + [(m, 2, True) for m in MODELS]


@pytest.fixture(scope="module")
def programs():
    return capture_models(MODELS, V, T)


@pytest.mark.parametrize("name,tp,sp", CASES, ids=[f"{m}-tp{t}{'-sp' if s else ''}" for m, t, s in CASES])
def test_attention_forms_shard_and_match(programs, name, tp, sp):
    base, batch = programs[name]
    program = tensor_parallel_pass(base, TPConfig(tp=tp, sp=sp))
    result = program.tensor_parallel
    # 2 kv heads over tp=4: k/v replicated by design (each rank scatters its heads' k/v),
    # so the k-norm statistic is whole on every rank while the q-norm's is split.
    gqa_replicated = {"kv.weight"} if (name, tp) == ("qk-norm-all-heads", 4) else set()
    assert {n for n, _, _ in result.coverage.whole} == gqa_replicated, result.coverage.describe()
    assert result.kind_of("o.weight") is ShardKind.ROW and result.kind_of("down.weight") is ShardKind.ROW
    check_tp(base, program, batch, tp)


def test_a_norm_over_split_heads_all_reduces_its_statistic_only(programs):
    base, _ = programs["qk-norm-all-heads"]
    program = tensor_parallel_pass(base, TPConfig(tp=2))
    result = program.tensor_parallel
    assert result.kind_of("q.weight") is ShardKind.COLUMN and result.kind_of("kv.weight") is ShardKind.COLUMN
    # Megatron's 2 g per layer (attention, MLP), the head's, plus one per QK-norm statistic,
    # each of a (B, T, 1) statistic, never of a (B, T, channels) activation.
    stats = [s for s in result.collectives if s.purpose.startswith("statistic")]
    assert len(stats) == 2
    shapes = {n.name: tuple(n.meta["val"].shape) for n in program.graph.nodes
              if isinstance(n.meta.get("val"), torch.Tensor)}
    assert all(shapes[s.node][-1] == 1 for s in stats)


@pytest.mark.parametrize("tp", [2, 4])
def test_dropless_moe_with_expert_modules(tp):
    """Router replicated (Megatron keeps it whole: top-k needs every expert's logit);
    every expert's FFN column/row-parallel like a dense MLP (expert tensor parallelism)."""
    torch.manual_seed(0)
    ids = torch.randint(0, V, (2, T))
    batch = (ids, ids.roll(-1, 1))
    base = canonicalize_pass(fxpipe.capture(ExpertModules(), batch))
    program = tensor_parallel_pass(base, TPConfig(tp=tp))
    result = program.tensor_parallel
    assert [n for n, _, _ in result.coverage.whole] == ["router.weight"]
    for e in range(4):
        assert result.kind_of(f"experts.{e}.up.weight") is ShardKind.COLUMN
        assert result.kind_of(f"experts.{e}.down.weight") is ShardKind.ROW
    check_tp(base, program, batch, tp)


class MatmulGQA(_LM):
    """Matmul attention over 2 key/value heads repeated for 4 query heads."""

    def __init__(self):
        super().__init__()
        self.q, self.kv = nn.Linear(H, H), nn.Linear(H, 2 * 2 * D)

    def attend(self, x):
        B = x.shape[0]
        q = self.q(x).view(B, T, HEADS, D).transpose(1, 2)
        k, v = (t.view(B, T, 2, D).transpose(1, 2)[:, :, None].expand(B, 2, 2, T, D).reshape(B, HEADS, T, D)
                for t in self.kv(x).split(2 * D, dim=-1))
        scores = torch.matmul(q, k.transpose(-1, -2)) + torch.full((T, T), float("-inf")).triu(1)
        return torch.matmul(scores.softmax(-1), v)


@pytest.mark.parametrize("tp", [2, 4])
def test_matmul_attention_heads_tp_cannot_cut_stay_replicated(tp):
    """2 kv groups split at tp=2; at tp=4 they cannot be cut into 4 equal blocks: the
    attention stays replicated and reported (never a wrong result, never an error); its
    output projection, which a LayerNorm then reads whole, is split with its output
    all-gathered (test_tp_rules_attention_forms.py)."""
    torch.manual_seed(0)
    ids = torch.randint(0, V, (2, T))
    batch = (ids, ids.roll(-1, 1))
    base = canonicalize_pass(fxpipe.capture(MatmulGQA(), batch))
    program = tensor_parallel_pass(base, TPConfig(tp=tp))
    whole = {n for n, _, _ in program.tensor_parallel.coverage.whole}
    assert whole == (set() if tp == 2 else {"q.weight", "kv.weight"})
    check_tp(base, program, batch, tp)

"""Constructs people write that used to leave matrices whole: rotary written
with complex numbers (``polar``/``complex`` tables, ``view_as_complex`` → multiply →
``view_as_real``), a fused projection of queries, one shared key/value head and the MLP
whose parts feed ``einsum`` (multi-query attention), and RMSNorm written with
``torch.norm``/``torch.linalg.norm`` (or ``rsqrt(mean(x²))``) over channels split by heads,
exact where the normalised rows are zero. Every rank's loss and gradients equal one
process at tp=2 and 4 (fp32, emulated collectives), and the named matrices hold 1/tp."""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fxpipe.passes.tensor_parallel import ShardKind, TPConfig, tensor_parallel_pass
from tests.passes.tensor_parallel._tp_helpers import capture_models, compile_tp
from tests.passes.tensor_parallel._tp_helpers import check_tp

V, T, H, HEADS, FFN = 64, 8, 32, 4, 64
D = H // HEADS


def _complex_table(kind: str) -> torch.Tensor:
    """(T, D/2) complex e^{i·t·θ_j}, built in the graph as the model runs."""
    angles = torch.outer(torch.arange(T).float(), 10000.0 ** (-torch.arange(0, D, 2).float() / D))
    if kind == "polar":
        return torch.polar(torch.ones_like(angles), angles)
    return torch.complex(angles.cos(), angles.sin())


class ComplexRopeLM(nn.Module):
    """Llama reference attention: q/k pairs rotated as complex numbers; ``kind="complex"``
    takes the rotated pairs back through ``.real``/``.imag`` instead of ``view_as_real``;
    ``kind="shared-key"`` rotates one key head that every query head reads (expanded, as
    latent attention's rotary key): replicated through the complex ops, so its gradient
    must be summed over the ranks' heads (complex values carry gradients)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.emb, self.ln1, self.ln2 = nn.Embedding(V, H), nn.LayerNorm(H), nn.LayerNorm(H)
        self.wq, self.wv, self.wo = (nn.Linear(H, H, bias=False) for _ in range(3))
        self.wk = nn.Linear(H, D if kind == "shared-key" else H, bias=False)
        self.up, self.down = nn.Linear(H, FFN), nn.Linear(FFN, H)
        self.head = nn.Linear(H, V, bias=False)

    def rotate(self, x):  # (B, T, nh, hs)
        pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))  # (B, T, nh, hs/2) complex
        rotated = pairs * _complex_table(self.kind).view(1, T, 1, -1)
        if self.kind != "complex":
            return torch.view_as_real(rotated).flatten(3)
        return torch.stack((rotated.real, rotated.imag), dim=-1).flatten(3)

    def forward(self, ids, targets):
        x = self.emb(ids)
        B = x.shape[0]
        h = self.ln1(x)
        q, k, v = (w(h).view(B, T, -1, D) for w in (self.wq, self.wk, self.wv))
        q, k = self.rotate(q), self.rotate(k).expand(B, T, HEADS, D)
        y = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
        x = x + self.wo(y.transpose(1, 2).reshape(B, T, H))
        x = x + self.down(F.gelu(self.up(self.ln2(x))))
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


class FusedMQALM(nn.Module):
    """``q, kv, ff = fused(x).split(...)``: all query heads, one key/value head, SwiGLU."""

    def __init__(self):
        super().__init__()
        self.emb, self.ln = nn.Embedding(V, H), nn.LayerNorm(H)
        self.fused = nn.Linear(H, H + 2 * D + 2 * FFN, bias=False)
        self.attn_out, self.ff_out = nn.Linear(H, H, bias=False), nn.Linear(FFN, H, bias=False)
        self.head = nn.Linear(H, V, bias=False)

    def forward(self, ids, targets):
        x = self.emb(ids)
        B = x.shape[0]
        q, kv, ff = self.fused(self.ln(x)).split([H, 2 * D, 2 * FFN], dim=-1)
        q = q.view(B, T, HEADS, D).transpose(1, 2)  # (B, nh, T, hs)
        k, v = kv.chunk(2, dim=-1)  # (B, T, hs): one head, every query head reads it
        mask = torch.ones(T, T, dtype=torch.bool).triu(1)
        scores = torch.einsum("bhqd,bkd->bhqk", q, k) / math.sqrt(D)
        attn = scores.masked_fill(mask, float("-inf")).softmax(-1)
        y = torch.einsum("bhqk,bkd->bhqd", attn, v).transpose(1, 2).reshape(B, T, H)
        gate, up = ff.chunk(2, dim=-1)
        x = x + self.attn_out(y) + self.ff_out(F.silu(gate) * up)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def _rms(x, kind: str, g, eps=1e-8):
    if kind == "norm":  # Tensor.norm: aten.linalg_vector_norm
        return x / (x.norm(2, dim=-1, keepdim=True) * x.shape[-1] ** -0.5 + eps) * g
    if kind == "linalg":  # torch.linalg.norm over one dim: canonicalized to the same op
        return x / (torch.linalg.norm(x, dim=-1, keepdim=True) * x.shape[-1] ** -0.5 + eps) * g
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * g


class NormQKLM(nn.Module):
    """QK-norm over all heads (OLMo 2) and a sub-norm over the FFN's channels, written as
    ``kind``. Some token rows and the last quarter of the query channels are zeroed
    before their norms: a norm of zeros (and a rank whose part is all zeros) must keep
    autograd's zero gradient, never ∞·0."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.emb, self.ln1, self.ln2 = nn.Embedding(V, H), nn.LayerNorm(H), nn.LayerNorm(H)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(H, H, bias=False) for _ in range(4))
        self.gq, self.gk, self.gf = nn.Parameter(torch.ones(H)), nn.Parameter(torch.ones(H)), \
            nn.Parameter(torch.ones(FFN))
        self.up, self.down = nn.Linear(H, FFN), nn.Linear(FFN, H)
        self.head = nn.Linear(H, V, bias=False)
        self.register_buffer("channels", (torch.arange(H) < 3 * H // 4).float())

    def forward(self, ids, targets):
        x = self.emb(ids)
        B = x.shape[0]
        h = self.ln1(x)
        rows = (ids % 5 != 0).float()[..., None]  # (B, T, 1): zero rows
        q = _rms(self.wq(h) * rows * self.channels, self.kind, self.gq)
        k = _rms(self.wk(h) * rows, self.kind, self.gk)
        q, k, v = (t.view(B, T, HEADS, D).transpose(1, 2) for t in (q, k, self.wv(h)))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(y.transpose(1, 2).reshape(B, T, H))
        x = x + self.down(_rms(F.gelu(self.up(self.ln2(x))), self.kind, self.gf))
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


MODELS = {"complex-polar": lambda: ComplexRopeLM("polar"), "complex-real-imag": lambda: ComplexRopeLM("complex"),
          "complex-shared-key": lambda: ComplexRopeLM("shared-key"), "fused-mqa-einsum": FusedMQALM, "norm": lambda: NormQKLM("norm"),
          "linalg-norm": lambda: NormQKLM("linalg"), "rsqrt-mean": lambda: NormQKLM("rsqrt")}
# Which matrices each construct must split (every one 1/tp of its full size).
SPLIT = {"complex-polar": ("wq", "wk", "wv", "wo"), "complex-real-imag": ("wq", "wk", "wv", "wo"),
         "complex-shared-key": ("wq", "wv", "wo"),
         "fused-mqa-einsum": ("fused", "attn_out", "ff_out"),
         **{m: ("wq", "wk", "wv", "wo", "up", "down") for m in ("norm", "linalg-norm", "rsqrt-mean")}}
# What stays whole, by design: the one key head every query head reads.
WHOLE = {"complex-shared-key": {"wk.weight"}}
CASES = [(m, tp) for m in MODELS for tp in (2, 4)]


@pytest.fixture(scope="module")
def programs():
    return capture_models(MODELS, V, T, model_seed=0)


@pytest.mark.parametrize("name,tp", CASES, ids=[f"{m}-tp{t}" for m, t in CASES])
def test_a_construct_is_split_exactly(programs, name, tp):
    base, batch = programs[name]
    program = tensor_parallel_pass(base, TPConfig(tp=tp))
    result = program.tensor_parallel
    assert {n for n, _, _ in result.coverage.whole} == WHOLE.get(name, set()), result.coverage.describe()
    full = {p.canonical: p.shape for p in base.params}
    for module in SPLIT[name]:
        spec = result.specs[f"{module}.weight"]
        assert spec.kind in (ShardKind.COLUMN, ShardKind.ROW), module
        assert math.prod(spec.local_shape) * tp == math.prod(full[f"{module}.weight"]), module
    check_tp(base, program, batch, tp)


def test_a_norm_over_split_channels_is_one_gather_of_norms(programs):
    """The QK-norms and the FFN sub-norm: each rank's norm, gathered, normed again."""
    base, _ = programs["norm"]
    sites = tensor_parallel_pass(base, TPConfig(tp=2)).tensor_parallel.collectives
    assert sum("norm over split channels" in s.purpose for s in sites) == 3


@pytest.mark.parametrize("name", ["complex-rope", "fused-mqa", "norm-rms"])
def test_zoo_models_in_these_styles_are_sharded(name):
    _, program, _ = compile_tp(f"zoo:{name}", 2)
    assert program.tensor_parallel.coverage.share <= 0.53, program.tensor_parallel.coverage.describe()

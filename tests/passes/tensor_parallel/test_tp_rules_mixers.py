"""Rule classes for state-space and linear-attention mixers: a Mamba-1 selective scan
(depthwise conv1d, a per-channel recurrence, x_proj/dt_proj), a Mamba-2 chunked scan
(cumsum over the sequence, per head, a gated RMSNorm over the split inner channels) and
a gated delta net (fused q|k|v conv, key heads repeated to value heads, a low-rank
gate, the delta rule stepped in place); each sharded, and
every rank's loss and gradients equal to one process at tp=2 and 4 (fp32, emulated
collectives; the unsharded captured program is the reference)."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fxpipe.passes.tensor_parallel import ShardKind, TPConfig, tensor_parallel_pass
from tests.passes.tensor_parallel._tp_helpers import capture_models
from tests.passes.tensor_parallel._tp_helpers import check_tp
from tests.passes.tensor_parallel._tp_models import _RMSNorm

V, T, H = 64, 8, 32
DI, N, R, K = 64, 8, 4, 4  # inner channels, state size, dt rank, conv kernel


class _Stack(nn.Module):
    """Embedding, two residual mixer blocks, a final norm and a head."""

    def __init__(self, mixer):
        super().__init__()
        self.emb, self.head = nn.Embedding(V, H), nn.Linear(H, V, bias=False)
        self.norms = nn.ModuleList(_RMSNorm(H) for _ in range(2))
        self.mixers = nn.ModuleList(mixer() for _ in range(2))
        self.final = _RMSNorm(H)

    def forward(self, ids, targets):
        x = self.emb(ids)
        for norm, mixer in zip(self.norms, self.mixers):
            x = x + mixer(norm(x))
        return F.cross_entropy(self.head(self.final(x)).flatten(0, 1), targets.flatten())


class Mamba1(nn.Module):
    """Hugging Face's slow path of Mamba: in_proj -> x, z; a depthwise causal conv1d on x
    (its kernel read through squeeze/unsqueeze); x_proj -> dt, B, C; dt_proj as
    ``W @ dt`` plus a bias; a per-channel selective scan stepped over the sequence, the
    state's rows (channels) times the replicated C of each step."""

    def __init__(self):
        super().__init__()
        self.in_proj = nn.Linear(H, 2 * DI, bias=False)
        self.conv = nn.Conv1d(DI, DI, K, groups=DI, padding=K - 1)
        self.x_proj = nn.Linear(DI, R + 2 * N, bias=False)
        self.dt_proj = nn.Linear(R, DI)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, N + 1, dtype=torch.float32)).repeat(DI, 1))
        self.D = nn.Parameter(torch.ones(DI))
        self.out_proj = nn.Linear(DI, H, bias=False)

    def forward(self, h):
        B = h.shape[0]
        x, z = self.in_proj(h).transpose(1, 2).chunk(2, dim=1)  # (B, DI, T) each
        w = self.conv.weight.squeeze(1).unsqueeze(1)
        x = F.silu(F.conv1d(x, w, self.conv.bias, padding=K - 1, groups=DI)[..., :T])
        dt, b, c = self.x_proj(x.transpose(1, 2)).split([R, N, N], dim=-1)
        dt = F.softplus(self.dt_proj.weight @ dt.transpose(1, 2) + self.dt_proj.bias.float()[:, None])
        A = -torch.exp(self.A_log.float())
        dA = torch.exp(A[None, :, None, :] * dt[..., None])  # (B, DI, T, N)
        dBx = dt[..., None] * b[:, None] * x[..., None]
        state, ys = torch.zeros(B, DI, N), torch.zeros(B, DI, T)
        for t in range(T):  # each step's output written in place (select_scatter once captured)
            state = dA[:, :, t] * state + dBx[:, :, t]
            ys[:, :, t] = (state @ c[:, t, :, None])[..., 0]
        y = ys + x * self.D[None, :, None]
        return self.out_proj((y * F.silu(z)).transpose(1, 2))


def _segsum(x):
    """(..., L) -> (..., L, L): the sum of x over (j, i] below the diagonal, -inf above."""
    n = x.shape[-1]
    x = x[..., None].expand(*x.shape, n).masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(-1), 0)
    return x.cumsum(dim=-2).masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(0), -torch.inf)


class Mamba2(nn.Module):
    """Hugging Face's torch path of Mamba-2 (SSD): one fused in_proj -> z | x, B, C | dt; a
    depthwise conv1d over x|B|C (each rank's channels of each part: not a block); B and C
    per group, repeated to the heads; the chunked scan (cumsum over each chunk, segment
    sums under triangular masks, einsums per head, the chunks' states carried by a
    second segment sum); D per head; a gated RMSNorm over all inner channels."""

    HEADS, P, G, L = 8, 8, 4, 4  # heads, head dim, groups of B/C, chunk length

    def __init__(self):
        super().__init__()
        self.di, self.bc = self.HEADS * self.P, self.G * N
        self.in_proj = nn.Linear(H, 2 * self.di + 2 * self.bc + self.HEADS, bias=False)
        conv = self.di + 2 * self.bc
        self.conv = nn.Conv1d(conv, conv, K, groups=conv, padding=K - 1)
        self.dt_bias = nn.Parameter(0.1 * torch.randn(self.HEADS))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, self.HEADS + 1, dtype=torch.float32)))
        self.D = nn.Parameter(torch.ones(self.HEADS))
        self.norm = _RMSNorm(self.di)
        self.out_proj = nn.Linear(self.di, H, bias=False)

    def forward(self, h):
        B, nh, P, nc, L = h.shape[0], self.HEADS, self.P, T // self.L, self.L
        z, xbc, dt = self.in_proj(h).split([self.di, self.di + 2 * self.bc, nh], dim=-1)
        xbc = F.silu(self.conv(xbc.transpose(1, 2))[..., :T].transpose(1, 2))
        x, b, c = xbc.split([self.di, self.bc, self.bc], dim=-1)
        x = x.reshape(B, T, nh, P)
        b, c = (t.reshape(B, T, self.G, N).repeat_interleave(nh // self.G, dim=2) for t in (b, c))
        dt = F.softplus(dt + self.dt_bias)
        A = -torch.exp(self.A_log.float())
        xs, b, c = (t.reshape(B, nc, L, nh, -1) for t in (x * dt[..., None], b, c))
        a = (A * dt).reshape(B, nc, L, nh).permute(0, 3, 1, 2)  # (B, heads, chunks, L)
        a_cum = torch.cumsum(a, dim=-1)
        scores = torch.einsum("bclhn,bcshn->bclsh", c, b) * torch.exp(_segsum(a)).permute(0, 2, 3, 4, 1)
        y_diag = torch.einsum("bclsh,bcshp->bclhp", scores, xs)
        decay = torch.exp(a_cum[..., -1:] - a_cum).permute(0, 2, 3, 1)[..., None]
        states = torch.einsum("bclhn,bclhp->bchpn", b * decay, xs)
        states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)
        carry = torch.exp(_segsum(F.pad(a_cum[..., -1], (1, 0)))).transpose(1, 3)  # (B, z, c, heads)
        states = torch.einsum("bzch,bchpn->bzhpn", carry, states)[:, :-1]
        y_off = torch.einsum("bclhn,bchpn->bclhp", c, states) * torch.exp(a_cum).permute(0, 2, 3, 1)[..., None]
        y = (y_diag + y_off).reshape(B, T, nh, P) + x * self.D[:, None]
        return self.out_proj(self.norm(y.reshape(B, T, self.di) * F.silu(z)))


class GatedDeltaNet(nn.Module):
    """Qwen3-Next / Kimi Linear style linear attention: one fused q|k|v projection and a
    depthwise conv over it, key heads repeated to value heads, a low-rank forget gate
    (x -> a -> b, b split by heads: the bottleneck a stays whole), the delta rule's
    state stepped over the sequence with each output row written in place, a norm per
    head gated by z."""

    KH, VH, DK, DV, RANK = 4, 8, 8, 8, 16

    def __init__(self):
        super().__init__()
        width = 2 * self.KH * self.DK + self.VH * self.DV
        self.qkv = nn.Linear(H, width, bias=False)
        self.conv = nn.Conv1d(width, width, K, groups=width, padding=K - 1, bias=False)
        self.f_a, self.f_b = nn.Linear(H, self.RANK, bias=False), nn.Linear(self.RANK, self.VH, bias=False)
        self.beta, self.z = nn.Linear(H, self.VH, bias=False), nn.Linear(H, self.VH * self.DV, bias=False)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, self.VH + 1, dtype=torch.float32)))
        self.norm, self.out = _RMSNorm(self.DV), nn.Linear(self.VH * self.DV, H, bias=False)

    def forward(self, h):
        B, kh, vh, dk, dv = h.shape[0], self.KH, self.VH, self.DK, self.DV
        qkv = F.silu(self.conv(self.qkv(h).transpose(1, 2))[..., :T]).transpose(1, 2)
        q, k, v = qkv.split([kh * dk, kh * dk, vh * dv], dim=-1)
        q, k = (t.reshape(B, T, kh, dk).repeat_interleave(vh // kh, dim=2) for t in (q, k))
        q, k = (t * torch.rsqrt(t.pow(2).sum(-1, keepdim=True) + 1e-6) for t in (q, k))
        v = v.reshape(B, T, vh, dv)
        decay = torch.exp(-torch.exp(self.A_log) * F.softplus(self.f_b(self.f_a(h))))  # (B, T, heads)
        beta = torch.sigmoid(self.beta(h))
        state, out = torch.zeros(B, vh, dk, dv), torch.zeros(B, T, vh, dv)
        for t in range(T):
            state = state * decay[:, t, :, None, None]
            delta = (v[:, t] - (state * k[:, t, :, :, None]).sum(-2)) * beta[:, t, :, None]
            state = state + k[:, t, :, :, None] * delta[:, :, None, :]
            out[:, t] = (state * q[:, t, :, :, None]).sum(-2)
        y = self.norm(out) * F.silu(self.z(h).view(B, T, vh, dv))
        return self.out(y.reshape(B, T, vh * dv))


class EvenGatedDeltaNet(GatedDeltaNet):
    """q, k and v of one width: each rank's part of the fused conv kernel is a strided
    block (the dim viewed as 3 equal parts, block r of each), which the kernel's own
    split must follow (Bailing's hybrid attention)."""

    KH, VH = 4, 4


MODELS = {"mamba1": lambda: _Stack(Mamba1), "mamba2": lambda: _Stack(Mamba2),
          "gated-delta": lambda: _Stack(GatedDeltaNet), "gated-delta-even": lambda: _Stack(EvenGatedDeltaNet)}
# What stays whole, by design: the gate's low-rank bottleneck (a in x -> a -> b).
WHOLE = {"mamba1": set(), "mamba2": set(), "gated-delta": {f"mixers.{i}.f_a.weight" for i in range(2)},
         "gated-delta-even": {f"mixers.{i}.f_a.weight" for i in range(2)}}
CASES = [(m, tp) for m in MODELS for tp in (2, 4)]


@pytest.fixture(scope="module")
def programs():
    return capture_models(MODELS, V, T, model_seed=1)


@pytest.mark.parametrize("name,tp", CASES, ids=[f"{m}-tp{t}" for m, t in CASES])
def test_mixers_shard_and_match(programs, name, tp):
    base, batch = programs[name]
    program = tensor_parallel_pass(base, TPConfig(tp=tp))
    result = program.tensor_parallel
    assert {n for n, _, _ in result.coverage.whole} == WHOLE[name], result.coverage.describe()
    column, row = ("qkv", "out") if name.startswith("gated-delta") else ("in_proj", "out_proj")
    for i in range(2):
        assert result.kind_of(f"mixers.{i}.{column}.weight") is ShardKind.COLUMN
        assert result.kind_of(f"mixers.{i}.{row}.weight") is ShardKind.ROW
    if name != "mamba1":  # the kernel over x|B|C or q|k|v: each rank's part of each
        spec = result.specs["mixers.0.conv.weight"]
        assert spec.kind is ShardKind.COLUMN and len(spec.ranges[0]) == 3, spec
    if name == "mamba2":  # the gated norms over all inner channels: one all-reduced statistic each
        assert sum(s.purpose.startswith("statistic") for s in result.collectives) == 2
    if name == "mamba1":  # x_proj reads every inner channel: row-parallel, its output all-reduced
        assert result.kind_of("mixers.0.x_proj.weight") is ShardKind.ROW
        # dt_proj (W @ dt) column-parallel from the replicated dt; the depthwise kernel, its
        # bias, D, A_log and dt's bias split with the channels they are applied to
        for n in ("dt_proj.weight", "conv.weight", "conv.bias", "D", "A_log", "dt_proj.bias"):
            spec = result.specs[f"mixers.0.{n}"]
            assert (spec.kind, spec.dim, spec.local_shape[0]) == (ShardKind.COLUMN, 0, DI // tp), n
    check_tp(base, program, batch, tp)

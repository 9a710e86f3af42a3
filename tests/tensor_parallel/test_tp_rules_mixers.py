"""Rule classes for state-space mixers: a Mamba-1 selective scan (depthwise conv1d, a
per-channel recurrence, x_proj/dt_proj) and a Mamba-2 chunked scan (cumsum over the
sequence, per head, a gated RMSNorm over the split inner channels); each sharded, and
every rank's loss and gradients equal to one process at tp=2 and 4 (fp32, emulated
collectives; the unsharded captured program is the reference)."""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpipe
from fxpipe.passes import canonicalize_pass
from fxpipe.passes.tensor_parallel import ShardKind, TPConfig, tensor_parallel_pass
from tests.tensor_parallel.test_tp_equivalence import _check

V, T, H = 64, 8, 32
DI, N, R, K = 64, 8, 4, 4  # inner channels, state size, dt rank, conv kernel


class _RMSNorm(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(n))

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


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
    ``W @ dt`` plus a bias; a per-channel selective scan stepped over the sequence."""

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
        state, ys = torch.zeros(B, DI, N), []
        for t in range(T):
            state = dA[:, :, t] * state + dBx[:, :, t]
            ys.append((state @ c[:, t, :, None])[..., 0])
        y = torch.stack(ys, dim=-1) + x * self.D[None, :, None]
        return self.out_proj((y * F.silu(z)).transpose(1, 2))


MODELS = {"mamba1": lambda: _Stack(Mamba1)}
# What stays whole, by design: dt_proj (W @ dt of the replicated x_proj output; each rank
# takes its block of the product) and A_log, applied to that replicated dt.
WHOLE = {"mamba1": {f"mixers.{i}.{n}" for i in range(2) for n in ("dt_proj.weight", "A_log")}}
CASES = [(m, tp) for m in MODELS for tp in (2, 4)]


@pytest.fixture(scope="module")
def programs():
    torch.manual_seed(0)
    ids = torch.randint(0, V, (2, T))
    batch = (ids, ids.roll(-1, 1))
    out = {}
    for name, make in MODELS.items():
        torch.manual_seed(1)
        out[name] = (canonicalize_pass(fxpipe.capture(make(), batch)), batch)
    return out


@pytest.mark.parametrize("name,tp", CASES, ids=[f"{m}-tp{t}" for m, t in CASES])
def test_mixers_shard_and_match(programs, name, tp):
    base, batch = programs[name]
    program = tensor_parallel_pass(base, TPConfig(tp=tp))
    result = program.tensor_parallel
    assert {n for n, _, _ in result.coverage.whole} == WHOLE[name], result.coverage.describe()
    for i in range(2):
        assert result.kind_of(f"mixers.{i}.in_proj.weight") is ShardKind.COLUMN
        assert result.kind_of(f"mixers.{i}.out_proj.weight") is ShardKind.ROW
    if name == "mamba1":  # x_proj reads every inner channel: row-parallel, its output all-reduced
        assert result.kind_of("mixers.0.x_proj.weight") is ShardKind.ROW
        # the depthwise kernel, its bias and D: split with the channels they are applied to
        for n in ("conv.weight", "conv.bias", "D"):
            spec = result.specs[f"mixers.0.{n}"]
            assert (spec.kind, spec.dim, spec.local_shape[0]) == (ShardKind.COLUMN, 0, DI // tp), n
    _check(base, program, batch, tp)

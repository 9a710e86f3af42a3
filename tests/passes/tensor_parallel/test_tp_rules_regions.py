"""Blocks of another grad mode or precision inside forward (torch.export's
``wrap_with_set_grad_enabled`` / ``wrap_with_autocast`` regions) seen through by the TP
pass: the projections around and inside them split, and every rank's loss and gradients
equal one process at tp=2 and 4 (emulated collectives; the captured program is the reference)."""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpipe
from fxpipe.passes import canonicalize_pass
from fxpipe.passes.tensor_parallel import ShardKind, TPConfig, tensor_parallel_pass
from fxpipe.passes.tensor_parallel.regions import AUTOCAST, SET_GRAD
from fxpipe.tp.ops import OPS
from tests.passes.tensor_parallel._tp_helpers import reference, run_tp
from tests.passes.tensor_parallel._tp_helpers import check_tp
from tests.passes.tensor_parallel._tp_models import _LM, D, HEADS, H, T, V


class RegionAttention(_LM):
    """A stop-gradient per-head temperature from a weight of its own, under no_grad (with
    an autocast block inside, which torch.export nests); scores and values under bf16
    autocast with the softmax in fp32."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(H, H), nn.Linear(H, H), nn.Linear(H, H)
        self.temp = nn.Linear(H, H, bias=False)

    def attend(self, x):
        B = x.shape[0]
        q, k, v = (p(x).view(B, T, HEADS, D).transpose(1, 2) for p in (self.q, self.k, self.v))
        with torch.no_grad():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                t = self.temp(x)  # (B, T, C) bf16
            t = t.float().view(B, T, HEADS, D).transpose(1, 2)
            inv = torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1.0)  # (B, nh, T, 1)
        q = q * inv
        with torch.autocast("cpu", dtype=torch.bfloat16):
            s = q @ k.transpose(-1, -2) / math.sqrt(D)  # (B, nh, T, T) bf16
            s = s.float().masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
            return (s @ v).float()


@pytest.fixture(scope="module")
def regions():
    torch.manual_seed(0)
    ids = torch.randint(0, V, (2, T))
    batch = (ids, ids.roll(-1, 1))
    return canonicalize_pass(fxpipe.capture(RegionAttention(), batch)), batch


@pytest.mark.parametrize("tp", [2, 4])
def test_grad_mode_and_autocast_regions_are_seen_through(regions, tp):
    base, batch = regions
    assert any(n.target is SET_GRAD for n in base.graph.nodes)  # the capture keeps the regions
    program = tensor_parallel_pass(base, TPConfig(tp=tp))
    result = program.tensor_parallel
    assert not result.coverage.whole, result.coverage.describe()
    for name in ("q", "k", "v", "temp"):
        assert result.kind_of(f"{name}.weight") is ShardKind.COLUMN, name
    assert result.kind_of("o.weight") is ShardKind.ROW
    # No-grad became detached values; autocast is a region again, bf16 inside.
    assert not any(n.target is SET_GRAD for n in program.graph.nodes)
    calls = [n for n in program.graph.nodes if n.target is AUTOCAST]
    assert len(calls) == 2
    bodies = [getattr(program.graph_module, c.args[4].target).graph for c in calls]
    inner = [n.meta["val"].dtype for body in bodies for n in body.nodes
             if n.target is torch.ops.aten.matmul.default or n.target is torch.ops.aten.linear.default]
    assert inner and all(d is torch.bfloat16 for d in inner)
    check_tp(base, program, batch, tp)  # temp.weight: no gradient in either



class AutocastMLP(_LM):
    """An MLP under bf16 autocast: the row-parallel projection's reduction and its bias
    are added by the rewrite inside the block."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(H, 3 * H)

    def attend(self, x):
        B = x.shape[0]
        q, k, v = (t.view(B, T, HEADS, D).transpose(1, 2) for t in self.qkv(x).split(H, dim=-1))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def forward(self, ids, targets):
        x = self.emb(ids)
        B = x.shape[0]
        x = x + self.o(self.attend(self.ln1(x)).transpose(1, 2).reshape(B, T, H))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = 2 * self.down(F.gelu(self.up(self.ln2(x))))  # (B, T, C) bf16
        return F.cross_entropy(self.head(x + h.float()).flatten(0, 1), targets.flatten())


def test_ops_the_rewrite_adds_inside_an_autocast_block_run_in_it():
    torch.manual_seed(0)
    ids = torch.randint(0, V, (2, T))
    batch = (ids, ids.roll(-1, 1))
    base = canonicalize_pass(fxpipe.capture(AutocastMLP(), batch))
    program = tensor_parallel_pass(base, TPConfig(tp=2))
    assert program.tensor_parallel.kind_of("down.weight") is ShardKind.ROW
    (call,) = [n for n in program.graph.nodes if n.target is AUTOCAST]
    body = getattr(program.graph_module, call.args[4].target).graph
    g = [n for n in body.nodes if n.target is OPS.reduce_from_tp.default]
    assert len(g) == 1 and g[0].meta["val"].dtype is torch.bfloat16
    # the bias added after the reduction in the projection's precision, as its linear did
    (bias,) = [n for n in body.nodes
               if n.name.startswith("tp_bias_") and n.target is torch.ops.aten.add.Tensor]
    assert bias.meta["val"].dtype is torch.bfloat16
    # bf16 partial sums round differently from one bf16 matmul: close, not equal
    ref_loss, _ = reference(base, batch)
    losses, _ = run_tp(program, base.state, batch, 2)
    assert all(abs(loss.item() - ref_loss.item()) < 1e-3 * ref_loss.item() for loss in losses)


class SlidingWindowWrite(_LM):
    """Matmul attention whose window mask is written in place, ``att[:, :, mask] = -inf``
    (``index_put`` once functional), as the zoo's sliding-window GPT does."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(H, 3 * H)

    def attend(self, x):
        B = x.shape[0]
        q, k, v = (t.view(B, T, HEADS, D).transpose(1, 2) for t in self.qkv(x).split(H, dim=-1))
        att = q @ k.transpose(-1, -2) / math.sqrt(D)  # (B, nh, T, T)
        mask = torch.ones(T, T, dtype=torch.bool).triu(1) | torch.ones(T, T, dtype=torch.bool).tril(-3)
        att[:, :, mask] = float("-inf")
        return att.softmax(-1) @ v


class StepwiseRecurrence(_LM):
    """RWKV-style time mixing: a per-channel recurrence over keys and values written one
    step at a time into ``zeros_like(key)`` (``select_scatter``), gated by a receptance."""

    def __init__(self):
        super().__init__()
        self.key, self.value, self.receptance = nn.Linear(H, H), nn.Linear(H, H), nn.Linear(H, H)
        self.decay = nn.Parameter(torch.full((H,), -0.5))

    def attend(self, x):
        B = x.shape[0]
        k, v = self.key(x), self.value(x)  # (B, T, C)
        out, num, den = torch.zeros_like(k), torch.zeros_like(k[:, 0]), torch.zeros_like(k[:, 0])
        for t in range(T):
            w = torch.exp(k[:, t])
            num, den = num * torch.exp(self.decay) + w * v[:, t], den * torch.exp(self.decay) + w
            out[:, t] = num / den
        y = torch.sigmoid(self.receptance(x)) * out
        return y.view(B, T, HEADS, D).transpose(1, 2)


WRITES = {"sliding-window-index-put": SlidingWindowWrite, "stepwise-select-scatter": StepwiseRecurrence}


@pytest.mark.parametrize("name,tp", [(m, tp) for m in WRITES for tp in (2, 4)])
def test_writes_along_dims_without_channels_keep_them_split(name, tp):
    torch.manual_seed(0)
    ids = torch.randint(0, V, (2, T))
    batch = (ids, ids.roll(-1, 1))
    base = canonicalize_pass(fxpipe.capture(WRITES[name](), batch))
    op = {"sliding-window-index-put": torch.ops.aten.index_put.default,
          "stepwise-select-scatter": torch.ops.aten.select_scatter.default}[name]
    assert any(n.target is op for n in base.graph.nodes)
    program = tensor_parallel_pass(base, TPConfig(tp=tp))
    result = program.tensor_parallel
    assert not result.coverage.whole, result.coverage.describe()
    columns = ("qkv",) if name.startswith("sliding") else ("key", "value", "receptance")
    for col in columns:
        assert result.kind_of(f"{col}.weight") is ShardKind.COLUMN, col
    assert result.kind_of("o.weight") is ShardKind.ROW
    check_tp(base, program, batch, tp)


class DynamicMask(_LM):
    """Doge: an additive attention mask per head computed from the values of all heads
    (a projection over every value channel, one output per kv head), given to SDPA;
    ``kv`` key/value heads repeated for the query heads."""

    def __init__(self, kv=HEADS):
        super().__init__()
        self.kv = kv
        self.q, self.k, self.v = nn.Linear(H, H), nn.Linear(H, kv * D), nn.Linear(H, kv * D)
        self.dt, self.A = nn.Linear(kv * D, kv), nn.Parameter(torch.full((kv,), 0.5))

    def attend(self, x):
        B, kv, rep = x.shape[0], self.kv, HEADS // self.kv
        q = self.q(x).view(B, T, HEADS, D).transpose(1, 2)
        k, v = (p(x).view(B, T, kv, D).transpose(1, 2) for p in (self.k, self.v))
        dt = self.dt(v.transpose(1, 2).reshape(B, T, kv * D))  # (B, T, kv)
        dt = torch.exp(self.A * F.softplus(dt)).transpose(-1, -2)  # (B, kv, T)
        mask = dt[:, :, None, :].expand(B, kv, T, T)  # (B, kv, T, T): one bias per key
        mask = mask.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        k, v, mask = (t[:, :, None].expand(B, kv, rep, *t.shape[2:]).reshape(B, HEADS, *t.shape[2:])
                      for t in (k, v, mask))  # Hugging Face's repeat_kv
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("tp,kv", [(2, HEADS), (4, HEADS), (4, 2)])
def test_a_mask_computed_from_projections_stays_whole_and_heads_split(tp, kv):
    """The mask's projection reads the values of every head: row-parallel, its result
    all-reduced, and each rank scatters its heads' part of the mask. With 2 kv heads over
    4 ranks the values cannot split by heads: the attention stays whole (Doge at tp=4)."""
    torch.manual_seed(0)
    ids = torch.randint(0, V, (2, T))
    batch = (ids, ids.roll(-1, 1))
    base = canonicalize_pass(fxpipe.capture(DynamicMask(kv), batch))
    program = tensor_parallel_pass(base, TPConfig(tp=tp))
    result = program.tensor_parallel
    if kv == HEADS:
        assert not result.coverage.whole, result.coverage.describe()
        for name in ("q", "k", "v"):
            assert result.kind_of(f"{name}.weight") is ShardKind.COLUMN, name
        assert result.kind_of("dt.weight") is ShardKind.ROW and result.kind_of("o.weight") is ShardKind.ROW
    check_tp(base, program, batch, tp)


@pytest.mark.parametrize("cls", [RegionAttention, SlidingWindowWrite, StepwiseRecurrence, DynamicMask],
                         ids=lambda c: c.__name__)
def test_sequence_parallel_through_regions_writes_and_masks(cls):
    torch.manual_seed(0)
    ids = torch.randint(0, V, (2, T))
    batch = (ids, ids.roll(-1, 1))
    base = canonicalize_pass(fxpipe.capture(cls(), batch))
    program = tensor_parallel_pass(base, TPConfig(tp=2, sp=True))
    assert not program.tensor_parallel.coverage.whole, program.tensor_parallel.coverage.describe()
    check_tp(base, program, batch, 2)

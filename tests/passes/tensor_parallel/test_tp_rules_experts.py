"""Rule classes for stacked experts, sub-norms, latent attention and unread weights:
each sharded, and every rank's loss and gradients equal to one process at tp=2 and 4
(fp32, emulated collectives; the unsharded captured program is the reference)."""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fxpipe.passes.tensor_parallel import ShardKind, TPConfig, tensor_parallel_pass
from tests.passes.tensor_parallel._tp_helpers import capture_models
from tests.passes.tensor_parallel._tp_helpers import check_tp
from tests.passes.tensor_parallel._tp_models import HEADS, D, H, T, V, _LM, _RMSNorm
from tests.passes.tensor_parallel._tp_models import StackedExperts


class SubNormMLP(_LM):
    """BitNet: an RMSNorm over the FFN's inner channels before the down projection, and
    one over the attention's heads before the output projection."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(H, H), nn.Linear(H, H), nn.Linear(H, H)
        self.gate, self.ffn_norm, self.attn_norm = nn.Linear(H, 4 * H), _RMSNorm(4 * H), _RMSNorm(H)

    def attend(self, x):
        B = x.shape[0]
        q, k, v = (p(x).view(B, T, HEADS, D).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.attn_norm(y.transpose(1, 2).reshape(B, T, H)).view(B, T, HEADS, D).transpose(1, 2)

    def forward(self, ids, targets):
        x = self.emb(ids)
        B = x.shape[0]
        x = x + self.o(self.attend(self.ln1(x)).transpose(1, 2).reshape(B, T, H))
        h = self.ln2(x)
        x = x + self.down(self.ffn_norm(F.silu(self.gate(h)) * self.up(h)))
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


class LatentAttention(_LM):
    """DeepSeek's multi-head latent attention: normed low-rank q and kv latents, a rotary
    key part shared by all heads (expanded to each), the key assembled in a new tensor;
    and a weight no forward reads (a decoder's cross-attention without an encoder)."""

    R, L = 4, 16  # rotary dims per head, kv latent size

    def __init__(self):
        super().__init__()
        self.q_a, self.q_norm, self.q_b = nn.Linear(H, 16, bias=False), _RMSNorm(16), \
            nn.Linear(16, HEADS * (D + self.R), bias=False)
        self.kv_a, self.kv_norm = nn.Linear(H, self.L + self.R, bias=False), _RMSNorm(self.L)
        self.kv_b = nn.Linear(self.L, HEADS * 2 * D, bias=False)
        self.unread = nn.Linear(H, H)

    def attend(self, x):
        B = x.shape[0]
        q = self.q_b(self.q_norm(self.q_a(x))).view(B, T, HEADS, D + self.R).transpose(1, 2)
        latent, k_rope = self.kv_a(x).split([self.L, self.R], dim=-1)
        k_nope, v = self.kv_b(self.kv_norm(latent)).view(B, T, HEADS, 2 * D).transpose(1, 2).split(D, -1)
        k_rope = torch.tanh(k_rope).view(B, 1, T, self.R)  # stands in for the shared rotary
        k = k_nope.new_empty(B, HEADS, T, D + self.R)
        k[..., :D] = k_nope
        k[..., D:] = k_rope.expand(-1, HEADS, -1, -1)
        return F.scaled_dot_product_attention(q, k, F.pad(v, (0, self.R)), is_causal=True)[..., :D]


class SinkAttention(_LM):
    """Attention with per-head sinks through logsumexp (gpt-oss, Granite), the output
    reshaped by view_as, a sub-norm that casts back with type_as over all heads (nGPT-style
    Dory), and logits scaled per vocabulary entry."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(H, 3 * H)
        self.sinks = nn.Parameter(torch.randn(HEADS))
        self.norm_w = nn.Parameter(1 + 0.1 * torch.randn(H))
        self.logit_scale = nn.Parameter(1 + 0.1 * torch.randn(V))

    def attend(self, x):
        B = x.shape[0]
        q, k, v = self.qkv(x).view(B, T, 3, HEADS, D).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(D) + torch.full((T, T), float("-inf")).triu(1)
        sinks = self.sinks.view(1, HEADS, 1, 1).expand(B, HEADS, T, 1)
        lse = torch.logsumexp(torch.cat([scores, sinks], -1), dim=-1, keepdim=True)
        y = (scores - lse).exp() @ v  # softmax with a sink column, dropped
        flat = y.transpose(1, 2).reshape(B, T, H)
        h = flat.float()
        normed = (h * torch.rsqrt(h.pow(2).sum(-1, keepdim=True) / H + 1e-6)).type_as(h)
        return (self.norm_w * normed).view_as(flat).view(B, T, HEADS, D).transpose(1, 2)

    def forward(self, ids, targets):
        x = self.emb(ids)
        B = x.shape[0]
        x = x + self.o(self.attend(self.ln1(x)).transpose(1, 2).reshape(B, T, H))
        x = x + self.down(F.gelu(self.up(self.ln2(x))))
        logits = self.head(x) * self.logit_scale
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


MODELS = {"grouped": lambda: StackedExperts("grouped"), "bmm": lambda: StackedExperts("bmm"),
          "select": lambda: StackedExperts("select"), "sub-norm": SubNormMLP, "latent": LatentAttention,
          "sinks": SinkAttention}
# What stays whole, by design: the router (top-k needs every logit); MLA's latents.
WHOLE = {"grouped": {"router.weight"}, "bmm": {"router.weight"}, "select": {"router.weight"},
         "sub-norm": set(), "latent": {"q_a.weight", "kv_a.weight"}, "sinks": set()}
CASES = [(m, tp) for m in MODELS for tp in (2, 4)]


@pytest.fixture(scope="module")
def programs():
    pytest.importorskip("transformers.integrations.moe")  # registers transformers::grouped_mm_fallback
    return capture_models(MODELS, V, T, model_seed=1)


@pytest.mark.parametrize("name,tp", CASES, ids=[f"{m}-tp{t}" for m, t in CASES])
def test_rule_classes_shard_and_match(programs, name, tp):
    base, batch = programs[name]
    program = tensor_parallel_pass(base, TPConfig(tp=tp))
    result = program.tensor_parallel
    assert {n for n, _, _ in result.coverage.whole} == WHOLE[name], result.coverage.describe()
    if name in ("grouped", "bmm", "select"):  # every expert's FFN split like a dense MLP
        assert result.specs["gate_up"].dim == 1 and result.specs["down_w"].dim == 2
    if name == "sub-norm":
        assert result.kind_of("gate.weight") is ShardKind.COLUMN and result.kind_of("down.weight") is ShardKind.ROW
        assert sum(s.purpose.startswith("statistic") for s in result.collectives) == 2
    if name == "latent":
        assert result.kind_of("kv_b.weight") is ShardKind.COLUMN and result.kind_of("q_b.weight") is ShardKind.COLUMN
        assert result.specs["unread.weight"].local_shape == (H // tp, H)
    check_tp(base, program, batch, tp)


@pytest.mark.parametrize("name", ["grouped", "latent"])
def test_values_marked_replicated_are_identical_on_every_rank(programs, name):
    """Scatter-gather between pipeline stages sends 1/tp of a value (and of its gradient)
    marked replicated: every such value and gradient must be the same on every rank —
    views of a sharded weight (a transposed expert stack) and views after an f (the
    latent before a column-parallel projection) are not."""
    import torch.fx as fx

    from fxpipe.passes.tensor_parallel import shard_state
    from fxpipe.passes.tensor_parallel.rewrite import REPLICATED
    from fxpipe.tp import run_emulated, tp_group_context
    from tests.passes.tensor_parallel._tp_helpers import leaves

    base, batch = programs[name]
    program = tensor_parallel_pass(base, TPConfig(tp=2))
    specs, gm = program.tensor_parallel.specs, program.graph_module
    marked = {n.name for n in gm.graph.nodes if n.meta.get(REPLICATED) and n.op == "call_function"}

    def step(group):
        state, seen = leaves(shard_state(base.state, specs, group.rank)), {}

        class Record(fx.Interpreter):
            def run_node(self, n):
                out = super().run_node(n)
                if n.name in marked and isinstance(out, torch.Tensor):
                    if out.requires_grad:
                        out.retain_grad()
                    seen[n.name] = out
                return out

        with tp_group_context(group):
            out = Record(gm).run(*[state[p.canonical] for p in program.params], *batch)
        (out[program.loss_output] if isinstance(out, (tuple, list)) else out).backward()
        return {k: (v.detach(), v.grad) for k, v in seen.items()}

    ranks = run_emulated(2, step)
    assert len(ranks[0]) > 10
    for k, (value, grad) in ranks[0].items():
        other, other_grad = ranks[1][k]
        assert torch.equal(value, other), f"{k}: marked replicated, values differ"
        assert (grad is None) == (other_grad is None), k
        assert grad is None or torch.allclose(grad, other_grad, atol=1e-6), f"{k}: gradients differ"

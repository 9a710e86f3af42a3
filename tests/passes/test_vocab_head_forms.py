"""The LM heads people write, taken by the vocabulary passes (passes/vocab_head.py).

Each form between the head and its cross-entropy (a softcap, a temperature or scale, a
bias on the head, a sequence slice with -100 targets, a reshaped / flattened / viewed
loss, an identity autograd wrapper, per-token losses reduced with Megatron's loss mask
or a mean, a bias and a per-class scale as parameters of their own) is compiled at pp=2 with ``vocab_passes=True`` and
run in one process: the stage graphs in order, then every pipeline rank's block of the
head through the runtime's own block math (``loss_chain.replay``,
``head_blocks.block_statistics`` / ``block_gradient``) with the all-reduces done here.
Loss and every gradient must equal the model's own (fp32). The runtime's collectives
on these heads are checked in the equivalence world of 2 (``zoo:biased-head``).
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fxpipe.compiler.pipeline import compile_pipeline
from fxpipe.ir.loss_chain import ChainKind, Reduction, replay
from fxpipe.ir.parallel_config import ParallelConfig
from fxpipe.runtime.head_blocks import block_gradient, block_statistics

V, H, M = 96, 16, 2  # vocabulary, width, microbatches


class _Wrap(torch.autograd.Function):
    """A model-parallel helper at size 1 (Megatron's copy_to_tensor_model_parallel_region):
    identity forward and backward, exported as ``x.view_as(x)``."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class HeadForms(nn.Module):
    """Embedding, two residual MLP layers and a head; ``forms`` picks what sits between
    the head and ``F.cross_entropy`` (the loss is computed inside, as nanoGPT's)."""

    def __init__(self, forms: str):
        super().__init__()
        self.forms = set(forms.split("+"))
        self.emb = nn.Embedding(V, H)
        self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(H), nn.Linear(H, H), nn.GELU()) for _ in range(2))
        self.head = nn.Linear(H, V, bias="bias" in self.forms)
        if "vocab_params" in self.forms:  # a bias added after the head, a learnable per-class scale
            self.out_bias, self.class_scale = nn.Parameter(torch.randn(V) * 0.1), nn.Parameter(1 + torch.rand(V))

    def forward(self, tokens):  # (B, T)
        x = self.emb(tokens)
        for layer in self.layers:
            x = x + layer(x)
        f = self.forms
        if "cast" in f:  # the weight read through a dtype cast, as speedrun-style training scripts write it
            logits = F.linear(x, self.head.weight.to(x.dtype), self.head.bias.type_as(x) if self.head.bias is not None
                              else None)
        elif "alias" in f:  # the parameters through identity wrappers that export as aten.alias
            alias = torch.ops.aten.alias
            logits = F.linear(x, alias(self.head.weight), alias(self.head.bias) if self.head.bias is not None else None)
        else:
            logits = self.head(_Wrap.apply(x) if "wrap" in f else x)  # (B, T, V)
        if "wrap" in f:
            logits = _Wrap.apply(logits)
        if "vocab_params" in f:  # the parameter first in one op, second in the other
            logits = self.out_bias + logits * (self.class_scale.float() * 0.5)
        if "softcap" in f:  # Gemma 2: c·tanh(l / c)
            logits = torch.tanh(logits / 30.0) * 30.0
        if "temperature" in f:
            logits = logits / 0.7
        if "scale" in f:
            logits = logits * 1.5
        if "loss_mask" in f:  # Megatron: per-token losses, masked, summed, over the mask's count
            losses = F.cross_entropy(logits.reshape(-1, V).float(), tokens.reshape(-1), reduction="none")
            loss_mask = (tokens % 3 != 0).float()  # (B, T)
            return torch.sum(losses.view(-1) * loss_mask.view(-1)) / loss_mask.sum()
        if "token_mean" in f:
            return F.cross_entropy(logits.reshape(-1, V), tokens.reshape(-1), reduction="none").mean() * 2.0
        if "slice" not in f:
            return F.cross_entropy(logits.reshape(-1, V), tokens.reshape(-1))
        logits, target = logits[:, :-1], tokens[:, 1:]  # position t predicts token t+1
        if "mask" in f:  # the first two targets of every row ignored (a prompt), -100 as HF
            target = torch.where(torch.arange(target.shape[1]) < 2, -100, target)
        if "flatten" in f:
            return F.cross_entropy(logits.flatten(0, 1), target.flatten(0, 1))
        if "view" in f:
            return F.cross_entropy(logits.contiguous().view(-1, V), target.contiguous().view(-1))
        return F.cross_entropy(logits.reshape(-1, V), target.reshape(-1))


FORMS = ["softcap", "temperature", "scale", "bias", "slice+mask", "slice+flatten", "slice+view", "wrap", "alias+bias",
         "softcap+bias+wrap+slice+mask+view", "loss_mask", "token_mean", "softcap+bias+loss_mask",
         "vocab_params+softcap+slice", "cast+softcap", "cast+bias+slice+mask"]


def _batch():
    return (torch.randint(0, V, (4, 12), generator=torch.Generator().manual_seed(0)),)


def _compile(forms):
    torch.manual_seed(0)
    model = HeadForms(forms)
    config = ParallelConfig(pp=2, microbatches=M, costs="model", vocab_passes=True).with_world(2)
    return model, compile_pipeline(model, tuple(t[:4 // M] for t in _batch()), config)


def _head_loss(head, state, hidden, target, token_weight, scale):
    """The vocabulary passes' loss of one microbatch, every rank's block in turn (the
    runtime's S), the all-reduces of ALLREDUCE_S done here; T's gradients sent back
    through autograd (``scale``: 1/m; ``token_weight``: each token's weight, or None)."""
    blocks = []
    for a, b in head.blocks:
        bias = state[head.bias][a:b] if head.bias is not None else None
        operands = {p: state[p][a:b] for p in head.params}
        logits = replay(head.chain, F.linear(hidden, state[head.weight][a:b], bias), b - a, operands)
        blocks.append((logits, block_statistics(logits, target, a, 0)))
    top = torch.stack([s[0] for _, s in blocks]).max(0).values
    total = sum(s[1] * torch.exp(s[0] - top) for _, s in blocks)
    pick = sum(s[2] for _, s in blocks)
    valid = target != head.ignore_index
    per = torch.where(valid, top + torch.log(total) - pick, 0.0)
    if token_weight is not None:
        assert head.reduction == Reduction.NONE
        loss, weight = (per * token_weight).sum(), valid.float() * token_weight * scale
    else:
        assert head.reduction == Reduction.MEAN
        loss, weight = per.sum() / valid.sum(), valid.float() * scale / valid.sum()
    stats = torch.stack([top, total, pick])
    grads = [block_gradient(logits, stats, target, a, 0, weight) for (logits, _), (a, _b) in zip(blocks, head.blocks)]
    torch.autograd.backward([logits for logits, _ in blocks], grads)
    return loss.detach()


def _run_in_process(compiled):
    """Loss and gradients of the compiled pipeline, each stage with its rank's rows."""
    plan = compiled.plan
    state = {k: v.detach().clone().requires_grad_(v.requires_grad) for k, v in plan.program.state.items()}
    losses = []
    for mb in zip(*(t.chunk(M) for t in _batch())):
        values = {}
        for st in plan.stages:
            rank = compiled.schedule.stage_to_rank(st.index)
            local = {n: t[plan.row_shards[n].positions(rank)] if n in plan.row_shards else t for n, t in state.items()}
            received = {n: values[n] for n in st.inputs}
            for lk in plan.lookups:  # the owners' summed lookup is the whole table's
                if lk.stage == st.index:
                    received[lk.name] = F.embedding(lk.ids(mb[lk.batch_input]), state[lk.table])
            values.update(zip(st.outputs, st.call(local, plan.canonical, mb, received)))
        head = plan.vocab_head
        hidden, target, *token_weight = (values[n] for n in head.outputs)
        losses.append(_head_loss(head, state, hidden, target, token_weight[0] if token_weight else None, 1 / M))
    return sum(losses) / M, {n: t.grad for n, t in state.items() if t.grad is not None}


@pytest.mark.parametrize("forms", FORMS)
def test_vocab_passes_take_the_head_and_equal_one_process(forms):
    model, compiled = _compile(forms)
    head = compiled.plan.vocab_head
    assert head.weight == "head.weight" and head.blocks == ((0, V // 2), (V // 2, V))
    kinds = {c.kind for c in head.chain}
    assert (ChainKind.POINTWISE in kinds) == bool({"softcap", "temperature", "scale", "vocab_params"} &
                                                  set(forms.split("+")))
    assert (ChainKind.SLICE in kinds) == ("slice" in forms)
    assert (head.token_weight is not None) == ("loss_mask" in forms or "token_mean" in forms)
    if "bias" in forms:  # split with the rows: rank r holds block r of the bias, no stage reads it
        assert head.bias == "head.bias"
        assert compiled.plan.row_shards["head.bias"].ranks == tuple(((a, b),) for a, b in head.blocks)
        assert all("head.bias" not in compiled.plan.stage_params(s) for s in range(2))
    if "vocab_params" in forms:  # the parameters [V] of the element-wise ops too
        assert head.params == ("head.weight", "class_scale", "out_bias")  # in the order the ops apply
        for name in head.params:
            assert compiled.plan.row_shards[name].ranks == tuple(((a, b),) for a, b in head.blocks)
    loss, grads = _run_in_process(compiled)
    ref = sum(model(*mb) for mb in zip(*(t.chunk(M) for t in _batch()))) / M
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-6, atol=1e-6)
    expected = {n: p.grad for n, p in model.named_parameters()}
    assert grads.keys() == expected.keys()
    for n, g in expected.items():
        torch.testing.assert_close(grads[n], g, rtol=1e-5, atol=1e-6 * float(g.abs().max()), msg=n)


class _Untakeable(nn.Module):
    """Heads no block can run alone: logits centred over the whole vocabulary, or
    per-token losses squared (not linear in them)."""

    def __init__(self, form):
        super().__init__()
        self.form = form
        self.emb, self.body, self.head = nn.Embedding(V, H), nn.Linear(H, H), nn.Linear(H, V, bias=False)

    def forward(self, tokens):
        logits = self.head(torch.relu(self.body(self.emb(tokens))))
        if self.form == "centred":
            logits = logits - logits.mean(-1, keepdim=True)  # reads the whole vocabulary
            return F.cross_entropy(logits.reshape(-1, V), tokens.reshape(-1))
        return F.cross_entropy(logits.reshape(-1, V), tokens.reshape(-1), reduction="none").square().mean()


@pytest.mark.parametrize("form, message", [
    ("centred", r"the logits \(aten.linear.*\) are read by 2 ops \(aten.mean.dim, aten.sub.Tensor\)"),
    ("squared", r"its per-token losses \(reduction='none'\) reach aten.square.default, which is no view"),
])
def test_a_head_the_passes_cannot_take_names_the_op(form, message):
    config = ParallelConfig(pp=2, microbatches=M, costs="model", vocab_passes=True).with_world(2)
    with pytest.raises(ValueError, match=r"no LM head found on the last stage \(stage 1\): " + message):
        compile_pipeline(_Untakeable(form), tuple(t[:2] for t in _batch()), config)

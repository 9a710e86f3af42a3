"""The TP graph ops in an emulated group: each against its single-process definition."""
import threading

import pytest
import torch
import torch.nn.functional as F

from fxpipe.tp import (DropoutRNG, EmulatedGroup, ReduceOp, gather_chunks, inter_stage_bytes,
                       run_emulated, scatter_chunk, tp_group_context)
from fxpipe.tp.ops import OPS


def _emulate(tp, fn):
    def step(group):
        with tp_group_context(group, DropoutRNG(3, group.rank)):
            return fn(group)
    return run_emulated(tp, step)


def test_f_and_g_are_transposes():
    x = torch.randn(3, 4)

    def fn(g):
        a = x.clone().requires_grad_()
        f = OPS.copy_to_tp(a)                       # identity forward
        y = OPS.reduce_from_tp(f * (g.rank + 1))    # sum over ranks forward
        y.sum().backward()
        return f.detach(), y.detach(), a.grad

    out = _emulate(3, fn)
    for f, y, grad in out:
        assert torch.equal(f, x) and torch.allclose(y, 6 * x)
        assert torch.allclose(grad, torch.full_like(x, 6.0))  # f's backward all-reduced 1+2+3


@pytest.mark.parametrize("dim", [0, 1])
def test_sequence_ops(dim):
    x = torch.randn(4, 6)

    def fn(g):
        part = x.chunk(2, dim)[g.rank].clone().requires_grad_()
        full = OPS.gather_seq(part, dim, 2)
        back = OPS.reduce_scatter_seq(full * 2, dim, 2)
        back.sum().backward()
        return full.detach(), back.detach(), part.grad

    (f0, b0, g0), (f1, b1, g1) = _emulate(2, fn)
    assert torch.equal(f0, x) and torch.equal(f1, x)
    assert torch.allclose(torch.cat([b0, b1], dim), 4 * x)
    assert torch.allclose(g0, torch.full_like(g0, 4.0))


def test_scatter_and_gather():
    x = torch.arange(8.0)

    def fn(g):
        a = x.clone().requires_grad_()
        mine = OPS.scatter(a, 0, 2)
        (mine * (g.rank + 1)).sum().backward()
        b = mine.detach().clone().requires_grad_()
        whole = OPS.gather(b, 0, 2)
        (whole * torch.arange(8.0)).sum().backward()
        return mine.detach(), a.grad, whole.detach(), b.grad

    (m0, a0, w0, b0), (m1, a1, w1, b1) = _emulate(2, fn)
    assert torch.equal(m0, x[:4]) and torch.equal(m1, x[4:])
    assert torch.equal(a0, torch.tensor([1.0] * 4 + [2.0] * 4))  # all-gathered per-rank grads
    assert torch.equal(w0, x) and torch.equal(b1, torch.arange(4.0, 8.0))


@pytest.mark.parametrize("vocab,tp,reduction", [(10, 2, 1), (9, 2, 1), (7, 4, 2), (8, 4, 0)])
def test_vocab_parallel_cross_entropy(vocab, tp, reduction):
    torch.manual_seed(0)
    logits = torch.randn(6, vocab) * 3
    target = torch.randint(0, vocab, (6,))
    target[2] = -100
    ref_logits = logits.clone().requires_grad_()
    ref = F.cross_entropy(ref_logits, target, reduction=["none", "mean", "sum"][reduction])
    ref.sum().backward()
    block = -(-vocab // tp)
    padded = torch.cat([logits, torch.full((6, block * tp - vocab), 123.0)], 1)  # huge padding

    def fn(g):
        mine = padded[:, g.rank * block:(g.rank + 1) * block].clone().requires_grad_()
        loss = OPS.vocab_parallel_cross_entropy(mine, target, vocab, -100, reduction)
        loss.sum().backward()
        return loss.detach(), mine.grad

    out = _emulate(tp, fn)
    for loss, _ in out:
        assert torch.allclose(loss, ref.detach(), atol=1e-6)
    grad = torch.cat([g for _, g in out], 1)
    assert torch.allclose(grad[:, :vocab], ref_logits.grad, atol=1e-6)
    assert torch.all(grad[:, vocab:] == 0), "padded logits never win and get no gradient"


def test_vocab_parallel_embedding_with_padding_idx():
    torch.manual_seed(0)
    weight = torch.randn(6, 3)
    ids = torch.tensor([[0, 1, 5], [4, 0, 2]])
    ref_w = weight.clone().requires_grad_()
    ref = F.embedding(ids, ref_w, padding_idx=0)
    (ref * torch.arange(3.0)).sum().backward()

    def fn(g):
        w = weight[g.rank * 3:(g.rank + 1) * 3].clone().requires_grad_()
        out = OPS.reduce_from_tp(OPS.vocab_parallel_embedding(w, ids, 0))
        (out * torch.arange(3.0)).sum().backward()
        return out.detach(), w.grad

    out = _emulate(2, fn)
    assert all(torch.equal(o, ref.detach()) for o, _ in out)
    assert torch.equal(torch.cat([g for _, g in out]), ref_w.grad)


def test_dropout_streams():
    x = torch.ones(64, 64)

    def fn(g):
        return (OPS.dropout(x, 0.5, False), OPS.dropout(x, 0.5, True))

    (r0, s0), (r1, s1) = _emulate(2, fn)
    assert torch.equal(r0, r1), "replicated regions: one mask on every rank"
    assert not torch.equal(s0, s1), "sharded regions: a mask per rank"
    assert set(r0.unique().tolist()) == {0.0, 2.0}
    (r0_again, _), _ = _emulate(2, fn)
    assert torch.equal(r0, r0_again), "seeded: reproducible"


@pytest.mark.parametrize("shape,tp", [((2, 16, 64), 4), ((3, 5, 7), 2), ((1,), 3)])
def test_scatter_gather_between_stages(shape, tp):
    x = torch.randn(shape)
    chunks = [scatter_chunk(x, r, tp) for r in range(tp)]
    assert all(c.dim() == 1 and c.numel() == -(-x.numel() // tp) for c in chunks)
    out = run_emulated(tp, lambda g: gather_chunks(chunks[g.rank], g, x.shape))
    assert all(torch.equal(o, x) for o in out)


def test_inter_stage_bytes():
    # SC21 §4.1: b·s·h per rank drops to b·s·h/t.
    assert inter_stage_bytes((2, 16, 64), torch.float32, 4, scatter_gather=False) == 2 * 16 * 64 * 4
    assert inter_stage_bytes((2, 16, 64), torch.float32, 4, scatter_gather=True) == 2 * 16 * 64
    assert inter_stage_bytes((3,), torch.float16, 2, scatter_gather=True) == 4


def test_emulated_group_collectives_and_errors():
    out = run_emulated(3, lambda g: (g.all_reduce(torch.tensor([g.rank]), ReduceOp.MAX),
                                     g.reduce_scatter(torch.arange(6.0), 0)))
    assert [int(m) for m, _ in out] == [2, 2, 2]
    assert torch.equal(out[1][1], torch.tensor([6.0, 9.0]))

    def bad(g):
        if g.rank == 1:
            raise KeyError("rank 1 failed")
        return g.all_reduce(torch.ones(1))  # would wait forever without the abort

    with pytest.raises(KeyError, match="rank 1 failed"):
        run_emulated(2, bad)
    assert threading.active_count() < 10
    assert len(EmulatedGroup.create(4)) == 4


def test_backward_needs_no_context():
    """Autograd may run backward on another thread (GPU): the group saved on ctx
    in forward is used, not the context."""
    x = torch.randn(4)

    def step(group):
        a = x.clone().requires_grad_()
        with tp_group_context(group):
            y = OPS.reduce_from_tp(OPS.scatter(OPS.copy_to_tp(a), 0, 2) * (group.rank + 1))
        worker = threading.Thread(target=lambda: y.sum().backward())
        worker.start()
        worker.join()
        return a.grad

    g0, g1 = run_emulated(2, step)
    # scatter gathers [1, 1, 2, 2] (rank r scaled its half by r+1); f sums it over both ranks.
    assert torch.equal(g0, torch.tensor([2.0, 2.0, 4.0, 4.0])) and torch.equal(g0, g1)

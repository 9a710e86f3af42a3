"""runtime/grad_buckets.py: the buckets are not zeroed before a step; a tensor's first
gradient of the step is copied into its range, a tensor no gradient reached is zeroed
when its bucket launches (the collective is faked, as in test_grad_buckets.py)."""
from datetime import timedelta

import torch

from fxpipe.runtime import grad_buckets
from fxpipe.runtime.grad_buckets import OverlappedReduction, plan_buckets


class _Done:
    def wait(self, *_):
        return True


def _reduction(monkeypatch, launched):
    monkeypatch.setattr(grad_buckets.dist, "all_reduce",
                        lambda t, group, async_op: launched.append(t.clone()) or _Done())
    w1, w2, unused = (torch.ones(n, requires_grad=True) for n in (3, 2, 4))
    like = {"w1": w1, "w2": w2, "unused": unused}
    plan = plan_buckets({"w1": 3, "w2": 3, "unused": 3}, {"w1": 0, "w2": -1, "unused": 1},
                        {n: t.numel() for n, t in like.items()}, dict.fromkeys(like, torch.float32), bucket_bytes=1e6)
    return OverlappedReduction(plan, like, like, None, 2, 0, timedelta(seconds=5), lambda d: d), like


def _step(red, w1, w2):
    red.start_step()
    for index, scale in ((1, 1.0), (3, 2.0)):  # two microbatches' backwards, the second final
        red.before_action(index)
        ((w1 * scale).sum() + (w2 * w2 * scale).sum()).backward()
        red.after_action(index)
    red.finish()


def test_start_step_leaves_the_bucket_unwritten_and_the_first_gradient_is_copied_in(monkeypatch):
    launched = []
    red, like = _reduction(monkeypatch, launched)
    w1, w2 = like["w1"], like["w2"]
    _step(red, w1, w2)
    (buf,) = red._buffers
    buf.fill_(float("nan"))  # what the last step left, as garbage
    red.start_step()
    assert torch.isnan(buf).all()  # not zeroed
    assert all(t.grad is None for t in like.values())
    red.before_action(1)
    ((w1 * 1.0).sum() + (w2 * w2).sum()).backward()
    red.after_action(1)
    lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel() * buf.element_size()
    for t, expected in ((w1, torch.ones(3)), (w2, torch.full((2,), 2.0))):
        assert lo <= t.grad.data_ptr() < hi  # its range of the bucket, holding the first gradient
        assert torch.equal(t.grad, expected)
    assert like["unused"].grad is None


def test_every_range_is_exact_after_a_step_over_a_dirty_bucket(monkeypatch):
    launched = []
    red, like = _reduction(monkeypatch, launched)
    w1, w2, unused = like["w1"], like["w2"], like["unused"]
    for _ in range(2):
        launched.clear()
        if red._buffers:
            red._buffers[0].fill_(7.0)
        _step(red, w1, w2)
        # One bucket: w2 (read last, finished first), w1, then the tensor nothing reached.
        (reduced,) = launched
        assert torch.equal(reduced, torch.cat([torch.full((2,), 6.0), torch.full((3,), 3.0), torch.zeros(4)]))
        assert torch.equal(w2.grad, torch.full((2,), 3.0)) and torch.equal(w1.grad, torch.full((3,), 1.5))
        assert torch.equal(unused.grad, torch.zeros(4))

"""runtime/grad_buckets.py in process: when gradients are final, the buckets' layout, and
that a bucket's collective starts inside the backward that finishes it (the collective
itself is faked here; tests/runtime/test_zero.py runs the real ones on gloo)."""
from datetime import timedelta

import pytest
import torch

from fxpipe.runtime import grad_buckets
from fxpipe.runtime.grad_buckets import OverlappedReduction, final_actions, plan_buckets
from fxpipe.schedules.actions import Action, ActionKind

K = ActionKind


def test_a_gradient_is_final_after_the_last_backward_of_every_stage_reading_it():
    # Two stages on one rank (a V), zero-bubble: B split into I and W; "w" read by both.
    actions = [Action(0, K.F, 0), Action(1, K.F, 0), Action(1, K.I, 0), Action(0, K.I, 0),
               Action(1, K.W, 0), Action(0, K.F, 1), Action(1, K.F, 1), Action(1, K.I, 1),
               Action(1, K.W, 1), Action(0, K.I, 1), Action(0, K.W, 0), Action(0, K.W, 1)]
    final_at, order = final_actions(actions, {0: ["emb", "w"], 1: ["w", "head"]})
    assert final_at == {"head": 8, "emb": 11, "w": 11}  # I never accumulates; W does
    assert order["head"] < 0 and order["w"] < order["emb"]  # later-read first within a stage


def test_buckets_follow_the_finishing_order_and_the_cap():
    final_at = {"a": 3, "b": 3, "c": 1, "d": 1}
    order = {"a": -1, "b": 0, "c": 0, "d": -1}
    numel = {"a": 1000, "b": 1000, "c": 3000, "d": 100}
    dtype = dict.fromkeys(final_at, torch.float32)
    plan = plan_buckets(final_at, order, numel, dtype, bucket_bytes=4 * 2000)
    # d then c finish at action 1 (c alone exceeds the cap: its own bucket), a then b at 3.
    assert [b.names for b in plan.buckets] == [("d",), ("c",), ("a", "b")]
    assert [b.numel for b in plan.buckets] == [100, 3000, 2000]
    # ZeRO-1: one contiguous run per owner inside a bucket.
    plan = plan_buckets(final_at, order, numel, dtype, bucket_bytes=1e9, owner={"a": 1, "b": 0, "c": 1, "d": 0})
    (bucket,) = plan.buckets
    assert bucket.names == ("d", "b", "c", "a")
    assert bucket.runs == ((0, 0, 1100), (1, 1100, 4000))


class _Done:
    def wait(self, *_):
        return True


def test_a_bucket_starts_inside_the_backward_that_finishes_it(monkeypatch):
    launched = []
    monkeypatch.setattr(grad_buckets.dist, "all_reduce",
                        lambda t, group, async_op: launched.append((phase[0], t.clone())) or _Done())
    phase = ["idle"]
    w1, w2 = torch.ones(3, requires_grad=True), torch.ones(2, requires_grad=True)
    like = {"w1": w1, "w2": w2}
    # w2 is read last (finished first by backward); both final in action 3 (microbatch 1's B).
    plan = plan_buckets({"w1": 3, "w2": 3}, {"w1": 0, "w2": -1}, {"w1": 3, "w2": 2},
                        dict.fromkeys(like, torch.float32), bucket_bytes=8)
    red = OverlappedReduction(plan, like, like, None, 2, 0, timedelta(seconds=5), lambda d: d)
    for _ in range(2):  # two steps: the buckets zeroed and re-viewed each time
        launched.clear()
        red.start_step()

        def backward(index, scale):
            red.before_action(index)
            phase[0] = f"in backward {index}"
            ((w1 * scale).sum() + (w2 * w2 * scale).sum()).backward()
            phase[0] = "after"
            red.after_action(index)

        backward(1, 1.0)  # microbatch 0: not final, nothing starts
        assert launched == []
        backward(3, 2.0)
        assert [p for p, _ in launched] == ["in backward 3", "in backward 3"], launched
        # Each bucket reduced the sum of both microbatches' gradients, in place.
        assert torch.equal(launched[0][1], torch.full((2,), 6.0)) and torch.equal(launched[1][1], torch.full((3,), 3.0))
        red.finish()
        assert torch.equal(w2.grad, torch.full((2,), 3.0)) and torch.equal(w1.grad, torch.full((3,), 1.5))


def test_a_gradient_the_last_action_did_not_reach_is_final_when_it_returns(monkeypatch):
    launched = []
    monkeypatch.setattr(grad_buckets.dist, "all_reduce", lambda t, group, async_op: launched.append(1) or _Done())
    w = torch.ones(2, requires_grad=True)
    plan = plan_buckets({"w": 0}, {"w": 0}, {"w": 2}, {"w": torch.float32}, bucket_bytes=1e6)
    red = OverlappedReduction(plan, {"w": w}, {"w": w}, None, 2, 0, timedelta(seconds=5), lambda d: d)
    red.start_step()
    red.before_action(0)
    assert launched == []
    red.after_action(0)
    assert launched == [1]
    red.finish()
    assert torch.equal(w.grad, torch.zeros(2))


@pytest.mark.parametrize("onto_owner", [True, False], ids=["nccl-reduce", "gloo-all-reduce"])
def test_zero1_bucket_reduced_onto_owners_or_all_reduced_whole(monkeypatch, onto_owner):
    """ZeRO-1: each owner's run of a bucket is reduced onto it (NCCL's reduce-scatter bytes);
    on gloo, whose reduce is slower than its all-reduce, the bucket is all-reduced whole in
    one call and the runs others own are dropped. Either way the owner's gradient is the
    mean over the replicas (here: this replica's own, the collective faked)."""
    calls = []
    monkeypatch.setattr(grad_buckets.dist, "all_reduce",
                        lambda t, group, async_op: calls.append(("all_reduce", t.numel())) or _Done())
    monkeypatch.setattr(grad_buckets.dist, "reduce",
                        lambda t, dst, group, async_op: calls.append(("reduce", t.numel(), dst)) or _Done())
    w = {n: torch.ones(k, requires_grad=True) for n, k in (("a", 3), ("b", 2), ("c", 4))}
    plan = plan_buckets(dict.fromkeys(w, 0), dict.fromkeys(w, 0), {n: t.numel() for n, t in w.items()},
                        dict.fromkeys(w, torch.float32), bucket_bytes=1e6, owner={"a": 0, "b": 1, "c": 0})
    red = OverlappedReduction(plan, w, w, None, 2, 0, timedelta(seconds=5), lambda d: 10 + d,
                              owner={"a": 0, "b": 1, "c": 0}, reduce_onto_owner=onto_owner)
    red.start_step()
    red.before_action(0)
    sum((t * (i + 1)).sum() for i, t in enumerate(w.values())).backward()
    red.after_action(0)
    red.finish()
    if onto_owner:
        assert sorted(calls) == [("reduce", 2, 11), ("reduce", 7, 10)]
    else:
        assert calls == [("all_reduce", 9)]
    assert torch.equal(w["a"].grad, torch.full((3,), 0.5)) and torch.equal(w["c"].grad, torch.full((4,), 1.5))
    assert w["b"].grad is None  # owned by replica 1


@pytest.mark.parametrize("bad", [-1.0, "25"])
def test_bucket_mb_must_be_a_size(bad):
    from fxpipe.ir.parallel_config import ParallelConfig

    with pytest.raises(ValueError, match="bucket_mb must be a number of MB >= 0"):
        ParallelConfig(bucket_mb=bad)

"""ZeRO-1 cases, run inside one spawned world of 4 (importable by the children)."""
from __future__ import annotations

from pathlib import Path


from tests.checkpoint._ckpt_cases import SAVE_AT, STEPS, build, no_gather, train
from tests.runtime._clip_cases import clip_check
from tests.runtime._reuse_capture import reusing_captures

STEP_RANGE = range(STEPS)


def _run(zero: int, *, pp: int, dp: int, tp: int = 1, precision: str = "fp32", bucket_mb: float = 25.0) -> dict:
    pm, w, opt, sched = build("gpt-tiny", pp=pp, dp=dp, tp=tp, zero=zero, precision=precision, bucket_mb=bucket_mb)
    waits = _record_param_waits(pm) if zero else None
    losses = train(pm, w, opt, sched, STEP_RANGE)
    waits = list(waits) if zero else None  # the last step's (sync_parameters below broadcasts again)
    forwards = [(e[1], e[2]) for e in pm.last_stats.events if e[0].kind.name == "F"]
    overlap = pm.grad_sync.overlap
    last = max((e for e in pm.last_stats.events if e[0].kind.name in ("B", "W")), key=lambda e: e[2])
    buckets = dict(launched=list(overlap.launched_at), last_backward=(last[1], last[2]),
                   onto_owner=overlap.reduce_onto_owner)
    pm.sync_parameters()
    params = pm.full_state_dict() if pm.master is None else None
    masters = {n: t.detach().clone() for n, t in pm.named_parameters()}
    state_elems = sum(t.numel() for s in opt.state.values() for t in s.values() if t.dim() > 0)
    # --grad-clip on the trained model: one more step's gradients (no optimizer step).
    clip = clip_check(pm, w, STEPS) if precision == "fp32" else None
    return dict(losses=losses, params=params, masters=masters, state_elems=state_elems, clip=clip,
                replicas=(pm.groups.pp_rank, pm.groups.tp_rank),
                owned=sorted(n for n, _ in pm.named_parameters()),
                trainable=sorted(n for n, t in pm.state.items() if t.requires_grad), buckets=buckets,
                waits=waits, forwards=forwards)


def _record_param_waits(pm) -> list:
    """Each ``wait_for`` of the ZeRO-1 broadcast during the last step: (name, its
    collective's index or None on the owner, collectives not yet waited for, time)."""
    import time

    calls: list = []
    start = pm.zero.start_broadcast

    def recording(*args, **kwargs):
        pending = start(*args, **kwargs)
        calls.clear()
        wait_for = pending.wait_for

        def recorded(name):
            calls.append((name, pending.by_name.get(name), sum(e is not None for e in pending.pending),
                          time.perf_counter()))
            wait_for(name)
        pending.wait_for = recorded
        return pending
    pm.zero.start_broadcast = recording
    return calls


@reusing_captures
def world_zero(rank: int, world: int, root: str) -> dict:
    """dp=2 × pp=2 and tp=2 × dp=2: ZeRO-1 against plain data parallel, fp32 and bf16; a
    ZeRO-1 checkpoint resumed without ZeRO and in another layout; gradient clipping over
    the shards of those layouts and of tp=2 × pp=2 (tests/runtime/_clip_cases.py)."""
    from fxpipe.checkpoint.dcp import load_checkpoint, save_checkpoint

    out = {}
    # dp2pp2 in buckets of ~10 KB (each a few tensors: some of one owner, some of both).
    for key, kwargs in (("dp2pp2", dict(pp=2, dp=2, bucket_mb=0.01)), ("tp2dp2", dict(pp=1, dp=2, tp=2))):
        out[(key, 0)] = _run(0, **kwargs)
        out[(key, 1)] = _run(1, **kwargs)
    pm, w, _, _ = build("gpt-tiny", pp=2, tp=2)
    out["clip_tp2pp2"] = clip_check(pm, w, 0)
    out[("bf16", 0)] = _run(0, pp=2, dp=2, precision="bf16", bucket_mb=0.01)
    out[("bf16", 1)] = _run(1, pp=2, dp=2, precision="bf16", bucket_mb=0.01)

    # Save under ZeRO-1 at SAVE_AT; resume into plain dp=2 × pp=2 and into ZeRO-1 at dp=4.
    directory = Path(root) / "zero"
    pm, w, opt, sched = build("gpt-tiny", pp=2, dp=2, zero=1)
    train(pm, w, opt, sched, range(SAVE_AT))
    with no_gather():
        save_checkpoint(pm, opt, SAVE_AT, directory, extra={"lr_scheduler": sched.state_dict()})
    for key, kwargs in (("resume_plain", dict(pp=2, dp=2, zero=0)), ("resume_tp2dp2", dict(pp=1, dp=2, tp=2, zero=1))):
        pm, w, opt, sched = build("gpt-tiny", seed=1, **kwargs)
        step, extra = load_checkpoint(pm, opt, directory)
        sched.load_state_dict(extra["lr_scheduler"])
        out[key] = dict(step=step, losses=train(pm, w, opt, sched, range(step, STEPS)))
    return out


def launched_in_last_backward(buckets: dict) -> None:
    """Every bucket's collective started after the rank's last backward began (its
    gradients were final) and before it returned (overlapped, not issued after it)."""
    start, end = buckets["last_backward"]
    assert buckets["launched"], "no bucket was launched"
    assert start <= buckets["launched"][0], "a bucket was reduced before its gradients were final"
    assert buckets["launched"][-1] <= end, (f"the reduction was issued {1e3 * (buckets['launched'][-1] - end):.2f} ms "
                                            f"after the last backward returned")

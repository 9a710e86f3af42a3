"""Deferred-initialisation cases, run inside a spawned world (importable by the children)."""
from __future__ import annotations

import torch
from tests.runtime._reuse_capture import reusing_captures

BATCH, SEQ, MICRO = 8, 16, 4
# HF GPT-2 (built on meta too) comes in through weights=, at tp=2 × pp=2.
CASES = [dict(model="gpt-tiny", tp=2, pp=2), dict(model="hf:llama", tp=1, pp=2, dp=2)]


def batch(name: str):
    from fxpipe.models import build_workload
    return build_workload(name, batch=BATCH, seq=SEQ).example_inputs


@reusing_captures
def world_meta(rank: int, world: int, weights_dir: str) -> list[dict]:
    """Each case: the model built on the meta device, parallelized, 2 AdamW steps. Last:
    an HF GPT-2 directory (save_pretrained) read into tp=2 × pp=2 — its first loss — and
    into a model it does not fit — the error."""
    import fxpipe
    from fxpipe.models import build_workload

    out = []
    w = build_workload("hf:gpt2", batch=BATCH, seq=SEQ, device="meta")
    pm = fxpipe.parallelize(w.model, tp=2, pp=2, microbatches=MICRO, example_inputs=batch("hf:gpt2"),
                            loss_fn=w.loss_fn, weights=weights_dir, partition="uniform")
    hf = dict(loss=pm.train_step(batch("hf:gpt2")))
    try:
        w = build_workload("hf:gpt2", batch=BATCH, seq=SEQ, device="meta", layers=3)
        fxpipe.parallelize(w.model, tp=2, pp=2, microbatches=MICRO, example_inputs=batch("hf:gpt2"),
                           loss_fn=w.loss_fn, weights=weights_dir, partition="uniform")
    except ValueError as exc:
        hf["mismatch"] = str(exc)
    for case in CASES:
        w = build_workload(case["model"], batch=BATCH, seq=SEQ, device="meta")
        pm = fxpipe.parallelize(w.model, tp=case["tp"], pp=case["pp"], dp=case.get("dp"), microbatches=MICRO,
                                example_inputs=batch(case["model"]), loss_fn=w.loss_fn, seed=3,
                                partition="uniform")
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
        losses = []
        for _ in range(2):
            losses.append(pm.train_step(batch(case["model"])))
            opt.step()
        out.append(dict(losses=losses, local=sum(t.numel() for t in pm.state.values()),
                        meta_left=sum(t.numel() for t in pm.plan.program.state.values() if not t.is_meta)))
    return out + [hf]


def reference(name: str) -> list[float]:
    """One process: the meta model made real by the public function, trained eagerly."""
    from fxpipe.params.deferred_init import materialize_
    from fxpipe.models import build_workload

    w = build_workload(name, batch=BATCH, seq=SEQ, device="meta")
    model = materialize_(w.model, seed=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data, losses = batch(name), []
    for _ in range(2):
        opt.zero_grad()
        total = 0.0
        for part in zip(*(t.chunk(MICRO) for t in data)):
            loss = w.loss_fn(model(*part[:-1]), part[-1]) if w.loss_fn else model(*part)
            (loss / MICRO).backward()
            total += float(loss.detach()) / MICRO
        opt.step()
        losses.append(total)
    return losses

"""Gradient-norm clipping over shards, run inside one spawned world of 4 (importable by
the children): each layout's global norm and clipped gradients against
torch.nn.utils.clip_grad_norm_ on the unsharded model in the same process."""
from __future__ import annotations

import torch
import torch.distributed as dist

from tests.runtime._ckpt_cases import batch, build, workload
from tests.runtime._reuse_capture import reusing_captures

LAYOUTS = {"tp2pp2": dict(tp=2, pp=2), "dp2pp2_zero1": dict(pp=2, dp=2, zero=1),
           "tp2dp2": dict(tp=2, pp=1, dp=2), "tp2dp2_zero1": dict(tp=2, pp=1, dp=2, zero=1)}


def reference(max_norm_share: float) -> tuple[float, float, dict[str, torch.Tensor]]:
    """(norm, max_norm, clipped gradients) of one process on step 0's batch."""
    w = workload()
    loss = w.model(*batch(w, 0))  # fxpipe's GPT returns the loss given targets
    loss.backward()
    params = dict(w.model.named_parameters())  # a tied pair appears once
    norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params.values()])))
    max_norm = norm * max_norm_share
    returned = float(torch.nn.utils.clip_grad_norm_(params.values(), max_norm))
    return returned, max_norm, {n: p.grad.clone() for n, p in params.items()}


def gathered_grads(pm) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, from all shards, replicas and stages."""
    local = {n: t.grad.detach().clone() for n, t in pm.named_parameters() if t.grad is not None}
    if pm.zero is not None:  # each replica holds the gradients it owns
        parts: list = [None] * pm.groups.mesh.dp
        dist.all_gather_object(parts, local, group=pm.groups.dp_group)
        local = {n: g for part in parts for n, g in part.items()}
    local = pm.unshard_tp(local)
    parts = [None] * pm.groups.mesh.pp
    dist.all_gather_object(parts, local, group=pm.groups.pp_group)
    full: dict[str, torch.Tensor] = {}
    for part in parts:
        for n, g in part.items():
            full.setdefault(n, g)
    return full


@reusing_captures
def world_clip(rank: int, world: int) -> dict:
    from fxpipe.runtime.grad_norm import clip_grad_norm

    out = {}
    for share in (0.5, 2.0):  # clipped, and a max_norm above the norm (unchanged)
        ref_norm, max_norm, ref_grads = reference(share)
        for key, kwargs in LAYOUTS.items():
            if share == 2.0 and key != "tp2pp2":
                continue
            pm, w, _, _ = build("gpt-tiny", **kwargs)
            pm.train_step(batch(w, 0))
            norm = clip_grad_norm(pm, max_norm)
            out[(key, share)] = dict(norm=norm, ref_norm=ref_norm, grads=gathered_grads(pm), ref=ref_grads)
            pm.close()
    return out

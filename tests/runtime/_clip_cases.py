"""Gradient-norm clipping over shards (importable by the children of test_zero's world
of 4): a layout's global norm and clipped gradients against
torch.nn.utils.clip_grad_norm_ on the unsharded model, in the same process."""
from __future__ import annotations

import torch
import torch.distributed as dist

from tests.checkpoint._ckpt_cases import batch, workload

SHARE = 0.5
"""max_norm as a share of the reference norm: the clip acts."""


def reference(params: dict[str, torch.Tensor], step: int) -> tuple[float, float, dict[str, torch.Tensor]]:
    """(norm, max_norm, clipped gradients) of one process holding ``params``, on ``step``'s batch."""
    w = workload()
    w.model.load_state_dict(params, strict=False)  # a tied pair is stored once
    loss = w.model(*batch(w, step))  # fxpipe's GPT returns the loss given targets
    loss.backward()
    named = dict(w.model.named_parameters())  # a tied pair appears once
    norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in named.values()])))
    returned = float(torch.nn.utils.clip_grad_norm_(named.values(), norm * SHARE))
    assert abs(returned - norm) <= 1e-6 * norm
    return returned, norm * SHARE, {n: p.grad.clone() for n, p in named.items()}


def gathered_grads(pm, params: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter's gradient (or value: every replica holds every value after
    ``sync_parameters``), from all shards, replicas and stages."""
    if params:
        local = {n: t.detach().clone() for n, t in pm.state.items() if t.requires_grad}
    else:
        local = {n: t.grad.detach().clone() for n, t in pm.named_parameters() if t.grad is not None}
    if pm.zero is not None and not params:  # each replica holds the gradients it owns
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


def clip_check(pm, w, step: int) -> dict:
    """One more step's gradients on ``pm`` clipped by fxpipe, and the reference's."""
    from fxpipe.runtime.grad_norm import clip_grad_norm

    pm.sync_parameters()
    ref_norm, max_norm, ref_grads = reference(gathered_grads(pm, params=True), step)
    pm.train_step(batch(w, step))
    norm = clip_grad_norm(pm, max_norm)
    return dict(norm=norm, ref_norm=ref_norm, grads=gathered_grads(pm), ref=ref_grads)

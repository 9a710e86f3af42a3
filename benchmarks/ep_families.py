"""Expert parallelism on the Hugging Face MoE families: the expert-parallel pass at ep=2
on each family's tiny model (``compat_families.py``), two emulated ranks each running
half the batch with half the experts, against the eager model on the whole batch.

    .venv/bin/python benchmarks/ep_families.py                    # every family with experts
    .venv/bin/python benchmarks/ep_families.py mixtral gpt_oss    # some

Prints one row per family: the MoE layers made expert-parallel (of those with experts),
the loss difference, the worst gradient error relative to the largest entry of that
gradient over every parameter, and what the pass left alone and why.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import fxpipe  # noqa: E402
from compat_families import NotBuildable, build, family_names, tiny_config  # noqa: E402
from fxpipe.ep import expert_group_context  # noqa: E402
from fxpipe.models.losses import causal_lm_loss  # noqa: E402
from fxpipe.passes import canonicalize_pass  # noqa: E402
from fxpipe.passes.expert_parallel import EPConfig, shard_experts  # noqa: E402
from fxpipe.ir.shard_spec import shard_state  # noqa: E402
from fxpipe.tp import run_emulated  # noqa: E402

EP = 2
EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def has_experts(model_type: str) -> bool:
    try:
        fields = tiny_config(model_type).to_dict()
    except Exception:  # a config that cannot be made or read is reported by compat.py
        return False
    return any(fields.get(f) for f in EXPERT_FIELDS)


def check(model_type: str) -> tuple[str, int]:
    fam = build(model_type)
    model, (ids, targets) = fam.model, fam.batch
    rows = ids.shape[0] // EP
    base = canonicalize_pass(fxpipe.capture(model, (ids[:rows], targets[:rows]), causal_lm_loss))
    program = shard_experts(base, EPConfig(ep=EP, dp=EP))
    result = program.expert_parallel
    left = "; ".join(result.skipped) or "-"
    if not result.layers:
        return f"{model_type:16s} 0 layers   left alone: {left}", 0
    model.zero_grad()
    ref = causal_lm_loss(model(ids), targets)
    ref.backward()

    def step(group):
        state = {n: t.detach().clone().requires_grad_(t.requires_grad)
                 for n, t in shard_state(base.state, result.specs, group.rank).items()}
        with expert_group_context(group):
            sl = slice(group.rank * rows, (group.rank + 1) * rows)
            loss = program.run(state, ids[sl], targets[sl])
        loss.backward()
        return loss.detach(), {n: t.grad for n, t in state.items() if t.grad is not None}

    out = run_emulated(EP, step)
    canonical = {p.name: p.canonical for p in base.params}
    worst = 0.0
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        c = canonical[name]
        parts = [g[c] for _, g in out]
        grad = torch.cat(parts) / EP if c in result.specs else sum(parts) / EP
        worst = max(worst, ((grad - p.grad).abs().max() / p.grad.abs().max().clamp_min(1e-12)).item())
    loss = sum(loss for loss, _ in out).item() / EP
    return (f"{model_type:16s} {len(result.layers)} layers   |loss diff| {abs(loss - ref.item()):.1e}   "
            f"worst grad rel err {worst:.1e}   left alone: {left}"), len(result.layers)


def main() -> None:
    names = sys.argv[1:] or [f for f in family_names() if has_experts(f)]
    tally = {"expert-parallel": 0, "left alone": 0, "not built or captured": 0}
    for name in names:
        try:
            line, layers = check(name)
            tally["expert-parallel" if layers else "left alone"] += 1
            print(line, flush=True)
        except NotBuildable as exc:
            tally["not built or captured"] += 1
            print(f"{name:16s} not buildable: {exc}", flush=True)
        except Exception as exc:  # a family the capture or the pass cannot take: say which
            tally["not built or captured"] += 1
            print(f"{name:16s} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}", flush=True)
    print(f"{len(names)} families with experts: " + ", ".join(f"{v} {k}" for k, v in tally.items()))


if __name__ == "__main__":
    main()
